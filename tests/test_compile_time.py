"""experiments/compile_time.py: bench.py's prefill and verify programs compiled on abstract weights and
caches (nothing allocated), with trace/lower and compile times recorded."""

from __future__ import annotations

import json

import jax
import pytest

from experiments import compile_time
from pallas_kernels.common import on_gpu


def test_compiles_abstract_steps(tmp_path):
    out = compile_time.main(["--preset", "tiny-v4", "--layers", "3", "--context", "40", "--new-tokens", "8",
                             "--decode-batch", "2", "--out", str(tmp_path)])
    assert [r["step"] for r in out["records"]] == ["prefill", "verify"]
    assert [(r["batch"], r["rows"]) for r in out["records"]] == [(1, 8), (2, 4)]
    assert all(r["compile_s"] > 0 and r["trace_lower_s"] > 0 for r in out["records"])
    assert out["meta"]["layers"] == 3
    saved = json.loads(next(tmp_path.glob("compile_time_*.json")).read_text())
    assert saved["records"] == out["records"]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU-only: cross-lowering for CUDA")
def test_lowers_the_release_step_for_cuda_on_a_cpu(tmp_path):
    """--lower-for cuda: the scanned release-format step lowered for CUDA with the Hopper kernels on this CPU, not
    compiled; the kernels' backend query answers for the host again after."""
    release = ["--moe-impl", "pallas", "--attention-impl", "pallas", "--mhc-impl", "pallas", "--dense-weights", "fp8",
               "--expert-weights", "fp4", "--dense-impl", "pallas"]
    out = compile_time.main(["--preset", "v4-flash-4l", "--scan-layers", *release, "--steps", "verify",
                             "--lower-for", "cuda", "--out", str(tmp_path)])
    rec, = out["records"]
    assert rec["compile_s"] is None and rec["lowered_for"] == "cuda" and rec["trace_lower_s"] > 0
    assert not on_gpu()
    with pytest.raises(SystemExit, match="--lower-for lowers the one-device step"):
        compile_time.main(["--preset", "v4-flash-4l", *release, "--lower-for", "cuda", "--mesh", "1,2,1"])


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU-only: cross-lowering for CUDA")
def test_lowers_the_batch_invariant_release_step_for_cuda_on_a_cpu(tmp_path):
    """--batch-invariant: the release-format step with every kernel at its invariant tiling (the attention kernel's
    canonical launch, the indexer, mHC, MoE and the linears' fixed tiles) lowers for CUDA at V4-Flash widths,
    prefill and verify."""
    release = ["--moe-impl", "pallas", "--attention-impl", "pallas", "--mhc-impl", "pallas", "--dense-weights", "fp8",
               "--expert-weights", "fp4", "--dense-impl", "pallas"]
    out = compile_time.main(["--preset", "v4-flash-4l", *release, "--batch-invariant", "--context", "4096",
                             "--new-tokens", "512", "--decode-batch", "8", "--lower-for", "cuda", "--out",
                             str(tmp_path)])
    assert out["meta"]["batch_invariant"] and [r["step"] for r in out["records"]] == ["prefill", "verify"]
    assert all(r["compile_s"] is None and r["trace_lower_s"] > 0 for r in out["records"])


def test_release_format_switches_parse():
    """The device suites pass the release format's switches (FP8 dense with its kernels, FP4 experts) to both tools."""
    args = compile_time.parse_args(["--dense-weights", "fp8", "--dense-impl", "pallas", "--expert-weights", "fp4"])
    assert (args.dense_weights, args.dense_impl, args.expert_weights) == ("fp8", "pallas", "fp4")


def test_collectives_parser():
    hlo = "\n".join([
        '  %ag = f32[64,4,512]{2,1,0} all-gather(f32[32,4,512]{2,1,0} %x), dimensions={0}, '
        'metadata={op_name="jit(verify_fn)/scatter" source_file="x.py"}',
        '  %ag2 = f32[64,4,512]{2,1,0} all-gather(f32[32,4,512]{2,1,0} %y), dimensions={0}, '
        'metadata={op_name="jit(verify_fn)/scatter"}',
        '  %ar = bf16[128,4096]{1,0} all-reduce-start(bf16[128,4096]{1,0} %z), to_apply=%add',
        '  %d = f32[8]{0} add(f32[8]{0} %a, f32[8]{0} %b)',
    ])
    got = compile_time.collectives(hlo)
    assert got == [
        {"kind": "all-gather", "shape": "f32[64,4,512]{2,1,0}", "op": "scatter", "bytes": 64 * 4 * 512 * 4, "count": 2},
        {"kind": "all-reduce", "shape": "bf16[128,4096]{1,0}", "op": "", "bytes": 128 * 4096 * 2, "count": 1},
    ]


def test_mesh_collectives_subprocess(tmp_path):
    """On 2 simulated devices (dp=2) the partitioned verify step compiles and lists its collectives."""
    import subprocess
    import sys
    from pathlib import Path

    from common import simulated_devices_env

    env = simulated_devices_env(2)
    cmd = [sys.executable, "-m", "experiments.compile_time", "--preset", "tiny-v4", "--layers", "3", "--steps",
           "verify", "--context", "40", "--decode-batch", "4", "--mesh", "2,1,1", "--collectives", "--out",
           str(tmp_path)]
    subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).resolve().parents[1], timeout=600,
                   capture_output=True)
    (rec,) = json.loads(next(tmp_path.glob("compile_time_*.json")).read_text())["records"]
    assert rec["mesh"] == [2, 1, 1] and rec["collectives"]
    assert all(c["bytes"] > 0 and c["count"] > 0 for c in rec["collectives"])
