"""experiments/bench_kernels.py --quick and experiments/bench_moe.py --smoke on the CPU (interpret mode): every
benchmark family runs end to end, writes its records, and our kernels agree with the references there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(module: str, *args: str, out: Path) -> dict:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-m", module, *args, "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("*.json")
    assert path.with_suffix(".md").exists()
    return json.loads(path.read_text())


def test_bench_kernels_quick(tmp_path):
    """Two of its families (the others share the harness; CI time): the attention and indexer decode cases."""
    only = "attention_decode,indexer_decode"
    recs = _run("experiments.bench_kernels", "--quick", "--only", only, out=tmp_path)["records"]
    assert {r["family"] for r in recs} == {"attention_decode", "indexer_decode"}
    ours = [r for r in recs if r["variant"] in ("triton", "pallas")]   # attention's kernel, the indexer's
    assert {r["family"] for r in ours} == {"attention_decode", "indexer_decode"}
    assert ours and not any(r.get("error") for r in ours)
    for r in ours:
        if r["family"].startswith("attention"):
            assert r["rel_err"] < 1e-2, r
        else:
            assert r["topk_overlap"] == 1.0, r


@pytest.mark.slow
def test_bench_moe_smoke(tmp_path):
    recs = _run("experiments.bench_moe", "--smoke", out=tmp_path)["records"]
    assert not any(r.get("error") for r in recs)
    assert {r["fmt"] for r in recs} == {"bf16", "fp8", "fp4"} and {r["regime"] for r in recs} == {"prefill", "decode"}
    for r in recs:
        if r["impl"] == "triton":
            assert r["rel_err_vs_xla"] < 1e-2, r
    layers = [r for r in recs if r["impl"] == "layer"]   # the model's whole MoE layer: bf16 and FP4 experts
    assert {r["fmt"] for r in layers} == {"bf16", "fp4"} and all(r["finite_output"] for r in layers)
    for r in layers:
        parts = r["floor_experts_ms"] + r["floor_router_ms"] + r["floor_shared_ms"]
        assert r["roofline_ms"] == parts and r["floor_router_ms"] > 0 and r["floor_shared_ms"] > 0


def test_bench_moe_sweeps_start_with_the_default_tiling():
    """bench_moe's sweeps list the tiling `moe_experts` would pick first, so a --quick run times the default."""
    import pytest

    from experiments.bench_moe import configs
    from pallas_kernels.moe import default_config
    e = 256
    for backend, regime, fmt, rows in (("mgpu", "decode", "fp4", 384), ("mgpu", "decode", "fp4", 6144),
                                       ("mgpu", "prefill", "fp4", 49152), ("triton", "prefill", "bf16", 49152),
                                       ("mgpu", "prefill", "bf16", 49152), ("mgpu", "prefill", "fp8", 49152),
                                       ("mgpu", "decode", "fp8", 384), ("mgpu", "decode", "bf16", 384)):
        assert configs(backend, regime, fmt, False, None, rows / e)[0] == \
            default_config(backend, rows, e, "dense" if fmt == "bf16" else fmt), (backend, regime, fmt, rows)
    # FP8 prefill with act_quant'd activations (--act-block 128): the FP8 x FP8 row tiles
    assert configs("mgpu", "prefill", "fp8", False, None, 192, act=128)[0] == \
        default_config("mgpu", 49152, e, "fp8", fp8_acts=True)
    # forced balance at 8K tokens: the 192-row tiles, then the rest of the sweep without a repeat
    for fmt, act in (("bf16", 0), ("fp4", 0), ("fp8", 128)):
        sweep = configs("mgpu", "prefill", fmt, False, None, 192, act=act, balanced=True)
        assert sweep[0] == default_config("mgpu", 49152, e, "dense" if fmt == "bf16" else fmt,
                                          fp8_acts=bool(act), balanced=True), fmt
        assert sweep[0].block_m == 192 and len(set(sweep)) == len(sweep), fmt
    with pytest.raises(SystemExit, match="block_m, block_n"):
        configs("mgpu", "decode", "fp4", False, '[{"blockm": 16}]')
