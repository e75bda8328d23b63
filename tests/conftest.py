"""Test-wide setup: CPU XLA with a cheaper backend optimisation level and XLA:CPU's classic fusion code generator
(compile time dominates the tiny models' tests; numerics are unchanged), the `gpu` marker's skip, the shared golden
data, the sharding worker started ahead of its tests, and `--invariant-blocks` (other batch-invariant blocks)."""

import os
import shutil
from pathlib import Path

# CPU only (a GPU machine keeps XLA's normal optimisation, so GPU tests measure real code). The classic fusion
# emitter (--xla_cpu_use_fusion_emitters=false) compiles a tiny model's programs in about 60% of the time of the
# MLIR fusion emitters, with bitwise the same logits (float32, bfloat16, quant_sim, Pallas interpret) and sampled
# tokens on tiny-v4 and tiny-v41; subprocesses that keep this XLA_FLAGS (the sharding workers) inherit both.
CPU_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if shutil.which("nvidia-smi") is None:
    _flags = os.environ.get("XLA_FLAGS", "").split()
    _flags += [f for f in CPU_XLA_FLAGS if f.split("=")[0] not in {g.split("=")[0] for g in _flags}]
    os.environ["XLA_FLAGS"] = " ".join(_flags)

# Tests that run a CLI in-process leave the persistent compilation cache off (experiments/compile_cache.py):
# the user's cache directory stays untouched and later tests' compiles are not written to disk.
os.environ.setdefault("JAXINFER_COMPILE_CACHE", "off")

import pytest  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"


def pytest_addoption(parser):
    parser.addoption("--invariant-blocks", default=None, metavar="ROWS,ENTRY_BLOCK,INDEX_KEY_BLOCK",
                     help="run with pallas_kernels/invariant.py's block sizes replaced (this process only, not the "
                          "sharding workers): e.g. 64,64,512 to check other blocks on a GPU")


def pytest_configure(config):
    blocks = config.getoption("--invariant-blocks")
    if blocks is None:
        return
    import pallas_kernels.invariant as invariant

    try:
        invariant.set_blocks(invariant.parse_blocks(blocks))
    except ValueError as e:
        raise pytest.UsageError(f"--invariant-blocks {e}") from None


@pytest.fixture(scope="session")
def golden_dir():
    """`../shared/golden` (read in place, never copied); tests skip cleanly where it is absent."""
    if not GOLDEN.is_dir():
        pytest.skip(f"golden data not found at {GOLDEN}")
    return GOLDEN


@pytest.fixture(autouse=True)
def _bounded_compiled_code():
    """After each test: jax's compiled programs are dropped once they hold most of the process's memory-map limit
    (common.release_compiled_code; a long run of slow tests otherwise crashes XLA:CPU's compiler)."""
    yield
    from common import release_compiled_code

    release_compiled_code()


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests run only where jax sees a GPU."""
    import jax

    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the 8-device sharding worker runs that the selected tests need (tests/sharding_worker.py "engram" for
    test_engram_sharded.py's `engram_results`, ~170 s of XLA compiles; "meshes" for test_sharding.py's
    `mesh_results`, ~240 s) now, one after the other in the order their tests come: they run on the second CPU
    core, which this process (one compile at a time) mostly leaves idle, while this process runs the tests before
    them; one at a time, they never take this process's core."""
    if session.config.option.collectonly:
        return
    first_use = {}
    for index, item in enumerate(session.items):
        for fixture, mode in (("mesh_results", "meshes"), ("engram_results", "engram")):
            if fixture in getattr(item, "fixturenames", ()):
                first_use.setdefault(mode, index)
    if first_use:
        import sharding_worker

        sharding_worker.start_early(sorted(first_use, key=first_use.get))


def pytest_sessionfinish(session):
    import sys

    if "sharding_worker" in sys.modules:
        sys.modules["sharding_worker"].stop_early()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop jax's compiled-program caches after each test module: one process runs the whole suite,
    and without this every module's executables (hundreds of tiny-model programs) stay resident."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
