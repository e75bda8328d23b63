"""The rack-scale terms of experiments/roofline.py: hardware profiles, bytes sent between GPUs against a hand
count, redundant experts, the floors' overlap rules, the calibrated estimate against bench records it did not
calibrate on, and the published configurations (every floor below its published time)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from experiments import hardware, roofline_estimate, roofline_mesh  # noqa: E402
from experiments import roofline as rl  # noqa: E402
from model import ModelConfig  # noqa: E402

V4 = ModelConfig.preset("v4-flash")
V4_4L = rl.scale_layers(V4, 4)
V41 = ModelConfig.preset("v41-flash")


def rel(a, b):
    return abs(a - b) / abs(b)


# ------------------------------------------------------------------ hardware profiles

def test_profiles_arithmetic():
    gb300, gb200 = hardware.profile("gb300"), hardware.profile("gb200")
    # NVL72 rack totals / 72, sparse peaks / 2, bidirectional links / 2, Gb/s / 8
    assert gb300["hbm_Bps"] == pytest.approx(8e12)
    assert gb300["fp4_flops"] == pytest.approx(15e15) and gb300["fp8_flops"] == pytest.approx(5e15)
    assert gb300["bf16_flops"] == pytest.approx(2.5e15) and gb200["fp4_flops"] == pytest.approx(10e15)
    assert gb300["nvlink_Bps"] == pytest.approx(130e12 / 72 / 2) and gb300["nvlink_domain"] == 72
    assert gb300["scaleout_Bps"] == pytest.approx(100e9) and gb200["scaleout_Bps"] == pytest.approx(50e9)
    b200, b300, h100 = hardware.profile("b200"), hardware.profile("b300"), hardware.profile("h100")
    assert b200["fp8_flops"] == pytest.approx(4.5e15) and b200["fp4_flops"] == pytest.approx(9e15)
    assert b300["fp4_flops"] == pytest.approx(13.5e15) and b300["hbm_capacity_bytes"] == 288e9
    assert b200["nvlink_Bps"] == pytest.approx(900e9) and b200["nvlink_domain"] == 8
    assert h100["bf16_flops"] == pytest.approx(989.5e12) and h100["fp8_flops"] == pytest.approx(1979e12)
    assert h100["nvlink_Bps"] == pytest.approx(450e9) and h100["fp4_flops"] == 0
    # the H200 as measured stays what every single-GPU floor used
    m = hardware.H200_MEASURED
    assert (m["hbm_Bps"], m["bf16_flops"], m["fp8_flops"], m["hbm_capacity_bytes"]) == (
        4.4e12, 790e12, 1525e12, 139 * 2 ** 30)
    for name, prof in hardware.PROFILES.items():
        assert set(prof["sources"]) == set(hardware.FIELDS), name
        assert all(prof["sources"].values()), name
        assert prof["bf16_flops"] < prof["fp8_flops"], name
        assert prof["fp4_flops"] == 0 or prof["fp4_flops"] >= prof["fp8_flops"], name
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        hardware.profile("tpu")


def test_fp4_experts_run_the_fp4_peak_where_there_is_one():
    gb300 = hardware.profile("gb300")
    assert rl.gemm_peak("expert", "fp4-experts", gb300) == gb300["fp4_flops"]
    assert rl.gemm_peak("dense", "fp4-experts", gb300) == gb300["fp8_flops"]
    assert rl.gemm_peak("expert", "fp4-experts", hardware.H200_MEASURED) == hardware.H200_MEASURED["fp8_flops"]


# ------------------------------------------------------------------ single GPU: unchanged

# floor, memory, compute seconds, bytes, FLOPs, memory per device: the model before the mesh terms existed
SINGLE_H200 = [
    ((V4, "decode", 64, 131072, 4, "fp4-experts", "bf16", False, False),
     (0.038773698565982576, 0.038773698565982576, 0.009961366014404182, 170604273690.32333, 10917085851136.0,
      219303146056.0)),
    ((V4, "decode", 256, 32768, 4, "bf16-fp4-experts", "bf16", True, False),
     (0.042511992806363634, 0.042511992806363634, 0.033594027305540106, 187052768348.0, 32948105033728.0,
      231293810248.0)),
    ((V4, "prefill", 2, 126976, 4096, "fp8-fp4-experts", "fp8", True, False),
     (0.2500399951606892, 0.035525892926363635, 0.2500399951606892, 156313928876.0, 338873138348052.0,
      156964288732.0)),
    ((V41, "decode", 64, 131072, 4, "fp4-experts", "packed", True, True),
     (0.07067390541272728, 0.07067390541272728, 0.008215012764690702, 310965183816.0, 10937866122496.0,
      517150149464.0)),
]


@pytest.mark.parametrize("case,expect", SINGLE_H200)
def test_single_h200_floor_unchanged(case, expect):
    cfg, phase, batch, ctx, rows, wd, kv, fb, drafter = case
    r = rl.roofline(cfg, phase, batch, ctx, rows, wd, kv, forced_balance=fb, drafter=drafter)
    t = r["totals"]
    got = (t["floor_s"], t["memory_s"], t["compute_s"], t["bytes"], t["flops"], r["memory"]["total_bytes"])
    for g, e in zip(got, expect):
        assert rel(g, e) < 1e-12
    assert t["comm_s"] == 0 and r["communication"]["bytes"] == 0 and t["floor_serial_s"] == t["floor_s"]
    assert t["floor_s"] == max(t["memory_s"], t["compute_s"])


# ------------------------------------------------------------------ bytes between GPUs

def test_dispatch_and_combine_bytes_by_hand():
    """V4-Flash, 4 layers, mesh dp1/ep4/tp2, 64 sequences x 4 rows: 16 sequences, 64 rows per device."""
    D, k, V = 4096, 6, 129280
    r = rl.roofline(V4_4L, "decode", 64, 4096, 4, "fp4-experts", mesh=(1, 4, 2), forced_balance=True)
    routed = 64 * k * 3 / 4                                       # choices that leave the device
    per_layer = {"ep.moe_dispatch": routed * D * (1 + 4 / 128), "ep.moe_combine": routed * D * 2,
                 "tp.attn_all_reduce": 2 * (1 / 2) * 64 * D * 2, "tp.moe_all_reduce": 2 * (1 / 2) * 64 * D * 2}
    parts = r["communication"]["parts"]
    for name, b in per_layer.items():
        assert rel(parts[name], 4 * b) < 1e-12, name
    assert rel(parts["tp.head_all_gather"], (1 / 2) * 64 * V * 2) < 1e-12
    total = 4 * sum(per_layer.values()) + (1 / 2) * 64 * V * 2
    comm = r["communication"]
    assert rel(comm["bytes"], total) < 1e-12 and comm["scaleout_bytes"] == 0     # 8 devices: one HGX domain
    assert rel(r["totals"]["comm_s"], total / hardware.H200_MEASURED["nvlink_Bps"]) < 1e-12
    # NVLink domains of 4 devices: EP peers sit tp = 2 devices apart, one of a device's 3 shares its domain
    small = dict(hardware.H200_MEASURED, nvlink_domain=4)
    s = rl.roofline(V4_4L, "decode", 64, 4096, 4, "fp4-experts", mesh=(1, 4, 2), forced_balance=True, ceilings=small)
    ep_bytes = 4 * (per_layer["ep.moe_dispatch"] + per_layer["ep.moe_combine"])
    sc = s["communication"]
    assert rel(sc["scaleout_bytes"], ep_bytes * 2 / 3) < 1e-12
    assert rel(sc["nvlink_bytes"], total - ep_bytes * 2 / 3) < 1e-12
    assert rel(sc["comm_s"], max(sc["nvlink_bytes"] / small["nvlink_Bps"],
                                 sc["scaleout_bytes"] / small["scaleout_Bps"])) < 1e-12


def test_engine_transports_by_hand():
    D, k = 4096, 6
    g = rl.roofline(V4_4L, "decode", 64, 4096, 4, "fp4-experts", mesh=(1, 4, 1), forced_balance=True,
                    transport="gather")["communication"]
    assert rel(g["parts"]["ep.moe_all_gather"], 4 * 3 * 64 * (2 * D + 8 * k)) < 1e-12
    assert rel(g["parts"]["ep.moe_reduce_scatter"], 4 * 3 * 64 * 4 * D) < 1e-12
    assert g["foreign_row_choices"] == 4 * 3 * 64 * k
    rep = rl.roofline(V4_4L, "decode", 64, 4096, 4, "fp4-experts", mesh=(1, 4, 1), forced_balance=True,
                      transport="replicate")["communication"]
    assert rel(rep["parts"]["ep.moe_all_reduce"], 4 * 2 * 3 / 4 * 4 * 64 * 4 * D) < 1e-12
    assert roofline_mesh.engine_transport(8) == "replicate" and roofline_mesh.engine_transport(9) == "gather"
    with pytest.raises(ValueError, match="transport must be one of"):
        rl.roofline(V4_4L, "decode", 64, 4096, 4, mesh=(1, 4, 1), transport="nvshmem")
    with pytest.raises(ValueError, match="no link bandwidths"):
        rl.roofline(V4_4L, "decode", 64, 4096, 4, mesh=(1, 4, 1), ceilings={
            k: v for k, v in hardware.H200_MEASURED.items() if k != "nvlink_Bps"})


def test_overlap_rules():
    r = rl.roofline(V41, "decode", 16384, 131072, 4, "fp4-experts", "packed", (1, 64, 1), True,
                    hardware.profile("gb300"), redundant_experts=64)
    t = r["totals"]
    assert t["comm_s"] > 0
    assert t["floor_s"] == max(t["memory_s"], t["compute_s"], t["comm_s"])
    assert t["floor_serial_s"] == pytest.approx(max(t["memory_s"], t["compute_s"]) + t["comm_s"])
    assert set(r["overlap"]) == {"memory/compute", "communication", "estimate"}
    rep = r["replication"]
    assert rep["replicas"] == 64 and 0 < rep["share_of_step_bytes"] < 1


# ------------------------------------------------------------------ redundant experts and balance

def test_redundant_experts_bytes_and_balance():
    gb300 = hardware.profile("gb300")
    args = (V41, "decode", 16384, 131072, 4, "fp4-experts", "packed", (1, 64, 1), True, gb300)
    plain, extra = rl.roofline(*args), rl.roofline(*args, redundant_experts=64)
    # forced balance touches every slot: 7 instead of 6 experts per device, read and held
    assert rel(extra["components"]["moe_experts"]["weight_bytes"],
               plain["components"]["moe_experts"]["weight_bytes"] * 7 / 6) < 1e-12
    assert rel(extra["memory"]["weights_by_component"]["moe_experts"],
               plain["memory"]["weights_by_component"]["moe_experts"] * 7 / 6) < 1e-12
    place = extra["placement"]["384"]
    assert (place["slots"], place["slots_per_device"], place["imbalance"]) == (448, 7, 1.0)
    assert extra["placement"]["128"]["slots_per_device"] == 3          # the drafter's 128 + 64
    assert extra["components"]["moe_experts"]["flops"] == plain["components"]["moe_experts"]["flops"]
    with pytest.raises(ValueError, match=r"ep=64 does not divide the backbone's 384 \+ 10 redundant"):
        rl.roofline(*args, redundant_experts=10)
    # uniform random routing: the busiest of ep devices, mean + sqrt(2 ln ep) sd
    rnd = roofline_mesh.expert_placement(384, 0, 64, 1e5, forced_balance=False)
    p = 1 / 64
    assert rnd["imbalance"] == pytest.approx(1 + math.sqrt(2 * math.log(64)) * math.sqrt(1e5 * p * (1 - p)) / (1e5 * p))
    # forced balance with fewer picks than slots: consecutive slots, the first devices take them
    few = roofline_mesh.expert_placement(256, 0, 8, 48, forced_balance=True)
    assert few["imbalance"] == pytest.approx(32 * 8 / 48)


# ------------------------------------------------------------------ the calibrated estimate

HELD_OUT = [("bench_20261130-231600_gpu_h200x2_full43_b256.json", 0),    # 43 layers, EP=2, FP8 dense
            ("bench_20261130-054402_gpu_h200x2_full43.json", 0),         # 43 layers, EP=2, batch 64
            ("bench_20261130-000606_gpu_h200_v41_4l.json", 5)]           # V4.1 width, 4 layers


@pytest.mark.parametrize("name,index", HELD_OUT)
def test_estimate_on_records_it_did_not_calibrate_on(name, index):
    cal = roofline_estimate.calibrate("decode", "fp4")
    used = {(r["record"], r["index"]) for r in cal["records"] + cal["mesh_records"]}
    assert (name, index) not in used
    rec = roofline_estimate.load_record(name, index)
    est = roofline_estimate.estimate(roofline_estimate.record_roofline(rec), cal)
    assert rel(est["estimate_s"] * 1e3, rec["step_ms"]["median"]) < 0.15, (est["estimate_s"] * 1e3, est["by_group_s"])


def test_estimate_reproduces_its_calibration_and_scales_with_hardware():
    cal = roofline_estimate.calibrate("decode", "fp4")
    rec = roofline_estimate.load_record(*roofline_estimate.CALIBRATION[("decode", "fp4")][0])
    res = roofline_estimate.record_roofline(rec)
    assert roofline_estimate.estimate(res, cal)["estimate_s"] * 1e3 == pytest.approx(rec["step_ms"]["median"])
    # twice the bandwidth and peaks: every kernel group halves, the host gap stays
    fast = dict(hardware.H200_MEASURED, hbm_Bps=8.8e12, bf16_flops=1580e12, fp8_flops=3050e12)
    e1 = roofline_estimate.estimate(res, cal)["by_group_s"]
    e2 = roofline_estimate.estimate(roofline_estimate.record_roofline(rec, fast), cal)["by_group_s"]
    assert e2["gap"] == e1["gap"]
    for g in ("moe_experts", "attn_core", "gemm"):
        assert e2[g] == pytest.approx(e1[g] / 2)
    with pytest.raises(ValueError, match="no calibration record for prefill steps with fp4 experts"):
        roofline_estimate.calibrate("prefill", "fp4")


def test_measured_from_program_attribution():
    """A record with profile.components (op-name attribution): components as groups, NCCL kernels apart."""
    rec = {"mesh": {"dp": 1, "ep": 2, "tp": 1}, "step_ms": {"median": 10.0},
           "profile": {"kernel_ms_per_step": 16.0, "components": {
               "moe_experts": {"ms": 8.0}, "attn_core": {"ms": 2.0}, "embed": {"ms": 0.5}, "head": {"ms": 1.5},
               "other": {"ms": 4.0}},
               "top": [["ncclDevKernel_AllGather_RING_LL", "moe_experts", "elementwise / other", 1.0, 8, ""]]}}
    m = roofline_estimate.measured(rec)
    assert m["by_component"]
    assert m["groups"] == pytest.approx({"moe_experts": 3.5e-3, "attn_core": 1e-3, "head": 1e-3})
    assert m["comm"] == pytest.approx(0.5e-3) and m["unattributed"] == pytest.approx(2e-3)
    assert m["gap"] == pytest.approx(2e-3)


# ------------------------------------------------------------------ the command line and the published table

def test_rack_scale_command_writes_floor_and_estimate(tmp_path, capsys):
    out = tmp_path / "gb300.json"
    rl.main(["--preset", "v41-flash", "--hardware", "gb300", "--mesh", "1,64,1", "--phase", "decode", "--batch",
             "16384", "--context", "131072", "--num-draft", "3", "--redundant-experts", "64", "--forced-balance",
             "--json", str(out)])
    text = capsys.readouterr().out
    assert "**Floor" in text and "**Estimate" in text and "GB300" in text
    rec = json.loads(out.read_text())
    assert 0 < rec["floor_ms"] < rec["estimate_ms"]
    assert rec["floor_ms"] == pytest.approx(rec["totals"]["floor_s"] * 1e3)
    assert rec["ceilings"]["name"].startswith("GB300") and rec["redundant_experts"] == 64


def test_published_floors_are_lower_bounds():
    from experiments import roofline_published

    tab = roofline_published.table()
    rows = [r for r in tab["rows"] + tab["scaling"] if r["published_ms"]]
    assert len(rows) >= 9
    for r in rows:
        assert r["floor_ms"] < r["published_ms"], r
    assert all(r["fits"] for r in tab["rows"])
    text = roofline_published.markdown(tab)
    assert "31.19" in text and "| 64 |" in text
