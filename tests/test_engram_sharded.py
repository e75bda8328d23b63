"""[V4.1] Engram tables split over a mesh (engram_placement="sharded") or held in host memory ("host"), on 8 simulated
CPU devices (tests/sharding_worker.py "engram", started at collection by tests/conftest.py): the rows of every
exchange equal numpy gathers; the model with each placement and exchange equals the replicated placement on the
same mesh bitwise in prefill, decode and speculative decoding; its decode step holds no host callback, only the
exchange's collectives (and the host gathers of host tables); born-sharded tables equal one device's. The
slow test runs every mesh x variant x output."""

from __future__ import annotations

import pytest

import sharding_worker
from test_sharding import _worker_results


@pytest.fixture(scope="module")
def engram_results(tmp_path_factory):
    return _worker_results(tmp_path_factory, "engram", timeout=1200)


def _check_cases(cases: list, expected: dict) -> None:
    """Every case ran with the outputs `expected` names for its (placement, exchange) and equals the replicated run;
    the tables lie split in 8 row ranges (358 rows padded to 360) in device or host memory."""
    assert {(c["placement"], c["exchange"]) for c in cases} == set(expected)
    for c in cases:
        assert set(c["equal"]) == set(expected[c["placement"], c["exchange"]]) and all(c["equal"].values()), c
        assert (c["table_rows"], c["table_shard_rows"]) == (360, 45), c
        assert c["table_memory"] == ("pinned_host" if c["placement"] == "host" else "device"), c


def test_row_lookup_equals_numpy_gathers(engram_results):
    lookups = engram_results["lookups"]
    assert {c["exchange"] for c in lookups} == {"all_to_all", "all_gather"} and {c["host"] for c in lookups} == {
        False, True} and {c["batch"] for c in lookups} == {3, 8}
    assert all(c["equal"] for c in lookups), [c for c in lookups if not c["equal"]]


def test_split_and_host_tables_equal_replicated(engram_results):
    _check_cases(engram_results["cases"], {(p, e): which for p, e, which in sharding_worker.ENGRAM_CASES})
    assert {c["built"] for c in engram_results["cases"]} == {"shard_model", "load_checkpoint(mesh)"}


def test_decode_step_on_a_mesh_has_no_host_callback(engram_results):
    """The decode step with split or host tables: no callback, one exchange (its collective), host gathers exactly
    with host tables."""
    for c in engram_results["cases"]:
        assert not c["decode_callback"], c
        assert c["exchange"] in c["decode_ops"] and ("compute_on" in c["decode_ops"]) == (c["placement"] == "host"), c


def test_born_sharded_tables_equal_one_device(engram_results):
    born = engram_results["born_sharded"]
    assert {b["placement"] for b in born} == {"sharded", "host"}
    for b in born:
        assert b["tables_equal"] and b["table_memory"] == ("pinned_host" if b["placement"] == "host" else "device"), b


@pytest.mark.slow
def test_every_mesh_variant_and_output(tmp_path_factory):
    """sharding_worker.ENGRAM_MESHES (dp x ep, dp x ep x tp, ep only, dp only) x every placement and exchange x
    prefill, decode, speculative and greedy; born-sharded models' prefill against born-sharded replicated tables."""
    results = _worker_results(tmp_path_factory, "engram-full", timeout=5400)
    for shape in sharding_worker.ENGRAM_MESHES:
        cases = [c for c in results["cases"] if tuple(c["mesh"]) == shape]
        _check_cases(cases, {(p, e): sharding_worker.ENGRAM_OUTPUTS for p, e, _ in sharding_worker.ENGRAM_CASES})
    assert all(b["tables_equal"] and b["prefill_equal_born_device"] for b in results["born_sharded"])
