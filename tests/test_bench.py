"""CPU smoke runs of experiments/bench.py (both modes, both phases, --quick) and experiments/sweep.py (two
points, then a resumed run that skips them), plus the fast pieces (points, memory refusal, spec grids).

The CLIs run as subprocesses under `timeout`, on a 4-layer tiny-v4 (SWA, SWA, CSA, HCA + MTP) to keep
compilation short; the numbers are meaningless on CPU, the records and files are what is checked.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory) -> dict:
    """One persistent compilation cache for this module's CLI runs: the sweep's points share their programs
    (and the model's eager init ops) with the bench run, which roughly halves the sweep's time on CPU."""
    d = tmp_path_factory.mktemp("jax_cache")
    return {"JAXINFER_COMPILE_CACHE": str(d)}  # experiments/compile_cache.py: every program cached


def run_cli(args: list[str], limit_s: int, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # $OUT only where a test sets it
    env.update(env_extra or {})
    cmd = ["timeout", str(limit_s), sys.executable, "-m", *args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s + 30)
    if res.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-6000:]}")
    return res


def test_bench_quick_both_modes_both_phases(tmp_path, jax_cache):
    out = tmp_path / "results"
    copy = tmp_path / "out"
    plot = importlib.util.find_spec("matplotlib") is not None
    res = run_cli(["experiments.bench", "--quick", "--preset", "tiny-v4", "--layers", "4", "--mode", "both",
                   "--phase", "both", "--out", str(out), "--tag", "test", "--kernel-times", "1", "--trace",
                   str(tmp_path / "trace"), "--loop-steps", "2"]
                  + ["--plot"] * plot, 240, {"OUT": str(copy), **jax_cache})
    files = sorted(out.glob("bench_*_test.json"))
    assert len(files) == 1, list(out.iterdir())
    recs = json.loads(files[0].read_text())
    assert (out / files[0].name.replace(".json", ".md")).exists()
    assert (copy / files[0].name).exists(), "results are copied to $OUT"
    if plot:   # the records drawn beside them
        assert files[0].with_suffix(".png").read_bytes()[:4] == b"\x89PNG" and (copy / f"{files[0].stem}.png").exists()
    assert "[bench" in res.stderr and "/11" in res.stderr, "progress display"
    got = {(r["phase"], r["mode"]): r for r in recs}
    assert set(got) == {(ph, m) for ph in ("prefill", "decode") for m in ("deepinfer", "realistic")}
    for r in recs:
        assert r["status"] == "ok", r
        env = r["env"]
        for k in ("command", "git_revision", "device", "jax", "backend", "date_utc"):
            assert env.get(k), (k, env)
        assert "experiments.bench" in env["command"]
        assert "xla_flags" in env   # the XLA flags the step ran under (None: XLA's defaults)
        assert r["repeats"] >= 10 and r["warmup"] >= 1
        assert len(r["step_times_ms"]) == r["repeats"]
        assert r["step_ms"]["median"] > 0 and all(math.isfinite(t) and t > 0 for t in r["step_times_ms"])
        # a point whose program another point compiled reuses it (0 s)
        assert all(v > 0 or r["compile_cache"][k] == "reused" for k, v in r["compile_s"].items())
        assert r["finite_outputs"] is True
        if r["step"] in ("prefill", "verify"):   # a timeline per configuration
            assert any(Path(r["trace_dir"]).rglob("*.xplane.pb")), r["trace_dir"]
        assert r["roofline"]["floor_ms"] > 0 and 0 < r["roofline_fraction"] < 10
        assert r["tokens_per_s"] > 0
        assert r["context_fill"] == "synthetic" and r["layers"] == 4
        assert r["memory_estimate"]["fits"]
    dec, pre = got[("decode", "deepinfer")], got[("prefill", "deepinfer")]
    assert dec["step"] == "verify" and dec["routing"].startswith("forced-balance") and dec["prefix"] == "forked"
    b = dec["batch"]
    assert dec["tokens_per_s"] == pytest.approx(b * 3.25 / (dec["step_ms"]["median"] / 1e3))
    assert pre["tokens_per_s"] == pytest.approx(pre["batch"] * pre["new_tokens"] / (pre["step_ms"]["median"] / 1e3))
    assert "mfu" in pre and pre["roofline"]["forced_balance"]
    # --kernel-times: CUPTI per-kernel times on a GPU; here the reason it could not, and the timing stands
    assert "CUPTI" in dec["profile"]["error"] and "CUPTI" in pre["profile"]["error"]
    assert "profile" not in got[("decode", "realistic")]
    # --loop-steps: verify steps in one device loop, timed per step, with cache room for them
    assert dec["looped"]["steps_per_call"] == 2 and dec["looped"]["step_ms"] > 0
    assert "looped" not in pre and "looped" not in got[("decode", "realistic")]
    assert "Verify steps in one device loop" in (out / files[0].name.replace(".json", ".md")).read_text()
    from experiments.bench import extra_steps

    need = dec["context"] + (dec["warmup"] + dec["repeats"] + extra_steps(1, True, 2)) * dec["num_draft"] + 4
    assert dec["cache_max_len"] >= need
    real = got[("decode", "realistic")]
    assert real["step"] == "spec" and real["routing"].startswith("router") and real["prefix"] == "distinct"
    acc = real["acceptance"]
    assert 1.0 <= acc["mean_accepted_length"] <= 1 + real["num_draft"]
    assert len(acc["acceptance_per_position"]) == real["num_draft"]
    assert real["tokens_per_s"] == pytest.approx(
        b * acc["mean_accepted_length"] / (real["step_ms"]["median"] / 1e3))
    assert real["roofline"]["drafter"] and not real["roofline"]["forced_balance"]


def test_markdown_kernel_breakdown():
    """What --kernel-times adds to the table on a GPU: each component against its floor, the gap, the glue."""
    from experiments.bench_report import markdown

    env = {"date_utc": "now", "command": "c", "git_revision": "r", "git_dirty": False, "device": "H200",
           "device_count": 1, "backend": "gpu", "jax": "j", "flax": "f"}
    profile = {"steps": 2, "wall_ms": 38.5, "kernel_ms_per_step": 30.5, "gap_ms": 8.0, "pipelined_ms": 32.5,
               "host_gap_ms": 6.0, "device_idle_ms": 2.0,
               "components": {"moe_experts": {"ms": 20.0, "by_kind": {"pallas": 19.0, "transpose": 1.0}},
                              "head": {"ms": 10.5, "by_kind": {"gemm": 10.5}}},
               "kinds": {"pallas": 19.0, "gemm": 10.5, "transpose": 1.0},
               "top": [["moe_gate_up", "moe_experts", "pallas", 19.0, 4.0, ""],
                       ["input_transpose_fusion", "moe_experts", "transpose", 1.0, 4.0, ""]]}
    rec = {"phase": "prefill", "mode": "deepinfer", "step": "prefill", "config": "m", "dtype": "bfloat16",
           "attention_impl": "pallas", "moe_impl": "pallas", "mesh": {"dp": 1, "ep": 1, "tp": 1}, "batch": 1,
           "context": 0, "new_tokens": 4096, "status": "ok", "step_ms": {"median": 38.5, "p10": 38.0, "p90": 39.0},
           "compile_s": {"prefill": 17.0}, "tokens_per_s": 1.0, "tokens_per_s_per_device": 1.0,
           "roofline": {"floor_ms": 15.8, "by_component_ms": {"moe_experts": 10.0, "head": 0.5},
                        "datasheet": {"floor_ms": 12.0, "by_component_ms": {"moe_experts": 8.0, "head": 0.4}}},
           "roofline_fraction": 0.41, "warmup": 3, "repeats": 10, "profile": profile}
    text = markdown(env, [rec])
    assert "| moe_experts | 20.000 | 51.9% | 10.0 | 2.00 | 8.0 | 1.000 |" in text
    assert "| host / launch gap | 8.000 | 20.8% |" in text
    assert "| of it: the host's (dispatch and wait) | 6.000 | 15.6% |" in text
    assert "| of it: the device idle between kernels | 2.000 | 5.2% |" in text
    assert "input_transpose_fusion [moe_experts, transpose] 1.000 (2.6%)" in text


def test_pipelined_gap_splits_the_gap():
    """Steps issued back to back: the host's share is the synchronous wall time less the pipelined step, the
    device's idle time the pipelined step less its kernels; a synchronous call's return is timed apart."""
    from experiments.bench import pipelined_gap

    calls = []
    split = pipelined_gap(lambda: calls.append(1) or 0, {"wall_ms": 5.0, "kernel_ms_per_step": 1.0}, calls=4)
    assert len(calls) == 9   # five timed alone (each call's dispatch), then the four back to back
    assert 0 <= split["dispatch_ms"] < 5.0
    assert split["host_gap_ms"] == pytest.approx(5.0 - split["pipelined_ms"], abs=1e-3)
    assert split["device_idle_ms"] == pytest.approx(split["pipelined_ms"] - 1.0, abs=1e-3)


def test_sweep_two_points_then_resume(tmp_path, jax_cache):
    results = tmp_path / "sweep_smoke.jsonl"
    # contexts 60 and 64 with --quick's batch 2 give the same cache shapes (max_len 128) as the bench run's
    # decode point: both points reuse its compiled program from the shared cache
    args = ["experiments.sweep", "--quick", "--preset", "tiny-v4", "--layers", "4", "--phase", "decode",
            "--mode", "deepinfer", "--mesh", "1,1,1;64,1,1", "--batch", "2", "--context", "60,64", "--num-draft", "3",
            "--replay", "off", "--results", str(results), "--name", "smoke"]
    first = run_cli(args, 180, jax_cache)
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["ran"] == 2 and summary["skipped_done"] == 0
    assert summary["not_possible"] == 2, "the 64-device mesh is left out on this machine"
    recs = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["context"] for r in recs] == [60, 64] and all(r["status"] == "ok" for r in recs)
    assert all(r["sweep"] == "smoke" and r["env"]["git_revision"] for r in recs)
    assert results.with_suffix(".md").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert results.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    second = run_cli(args, 60, jax_cache)
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["ran"] == 0 and summary["skipped_done"] == 2
    assert "model ready" not in second.stderr, "a resumed sweep with nothing left builds no model"
    assert len(results.read_text().splitlines()) == 2


# ----------------------------------------------------------------------------------------------- fast pieces

def test_points_and_keys():
    from experiments.bench import Point

    d = Point("decode", "deepinfer", 8, 4096)
    assert d.kind == "verify" and d.rows == 4 and d.key()["new_tokens"] == 4
    assert Point("decode", "realistic", 8, 4096).kind == "spec"
    assert Point("decode", "deepinfer", 8, 4096, step="spec").kind == "spec"
    p = Point("prefill", "deepinfer", 2, 126976, 4096, num_draft=3)
    assert p.kind == "prefill" and p.rows == 4096 and p.key()["num_draft"] == 0
    with pytest.raises(ValueError):
        Point("decode", "benchmark", 8, 4096)


def test_invariance_variants_with_scanned_layers():
    """--scan-layers benches the fast mode; asking for the batch-invariant mode beside it is refused by name."""
    from experiments.bench import invariance_variants, resolve_config

    cfg = resolve_config("tiny-v4", scan_layers=True)
    assert invariance_variants(cfg, "off") == [cfg]
    with pytest.raises(ValueError, match="scan_layers=True with batch_invariant=True"):
        invariance_variants(cfg, "both")


def test_invariance_variants_keep_the_invariant_kernels():
    """The batch-invariant variant runs the kernels that have invariant tilings (MoE, mHC, indexer scoring, FP8
    linears without quant_sim) and the reference paths for the rest (a forced Mosaic GPU attention: "pallas")."""
    from experiments.bench import invariance_variants, resolve_config

    release = resolve_config("tiny-v4").replace(dense_weights="fp8", dense_impl="pallas", moe_impl="pallas",
                                                 attention_impl="pallas", mhc_impl="pallas")
    fast, on = invariance_variants(release, "both")
    assert fast == release and on.batch_invariant
    assert (on.dense_impl, on.moe_impl, on.attention_impl, on.mhc_impl) == ("pallas", "pallas", "pallas", "pallas")
    forced = resolve_config("v4-flash-4l").replace(attention_impl="mgpu")
    assert invariance_variants(forced, "on")[0].attention_impl == "pallas"
    assert invariance_variants(release.replace(quant_sim=True), "on")[0].dense_impl == "reference"


def test_memory_estimate_refuses_what_cannot_fit():
    from experiments.bench import Point, resolve_config
    from experiments.bench_memory import estimate_memory, memory_message

    cfg = resolve_config("v4-flash-4l", moe_impl="pallas", attention_impl="pallas")
    h200 = 139 * 2 ** 30
    ok = estimate_memory(cfg, "bfloat16", Point("decode", "deepinfer", 64, 32768), 33024, h200)
    assert ok["fits"] and 50e9 < ok["weights_bytes"] < 80e9  # ~68 GB: 4 layers + MTP at real widths
    ref = resolve_config("v4-flash-4l", attention_impl="reference")
    big = estimate_memory(ref, "bfloat16", Point("prefill", "deepinfer", 16, 126976, 4096), 131072, h200)
    assert not big["fits"]
    assert "--attention-impl pallas" in memory_message(big, "the H200")


def test_v41_widths_fit_one_gpu_with_fp4_experts_and_a_small_engram_vocabulary():
    """V4.1 widths at 4 layers: the Engram tables (16M hash vocabulary: 197 GB bf16) and bf16 experts do not
    fit an H200; FP4 experts and --engram-vocab do, with the rows read per token unchanged."""
    import pytest

    from experiments.bench import Point, resolve_config
    from experiments.bench_memory import estimate_memory

    h200 = 139 * 2 ** 30
    point = Point("decode", "deepinfer", 64, 32768)
    full = resolve_config("v41-flash", 4, "pallas", "pallas", "fp4")
    assert not estimate_memory(full, "bfloat16", point, 33024, h200)["fits"]
    small = resolve_config("v41-flash", 4, "pallas", "pallas", "fp4", engram_vocab=160000)
    assert small.engram_vocab_size == 160000 and small.engram_n_heads == full.engram_n_heads
    assert estimate_memory(small, "bfloat16", point, 33024, h200)["fits"]
    with pytest.raises(ValueError, match="no Engram layers"):
        resolve_config("v4-flash-4l", engram_vocab=1000)


def test_sweep_grid_from_spec(tmp_path):
    pytest.importorskip("yaml")
    from experiments import sweep

    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("preset: tiny-v4\nphase: [prefill, decode]\nmode: [deepinfer, realistic]\n"
                         "mesh: ['1,1,1', [1, 2, 1]]\nbatch: [2, 4]\nprefill_batch: [1]\ncontext: [64]\n"
                         "num_draft: [1, 3]\nnew_tokens: [16]\nreplay: [off]\nrepeats: {decode: 20}\n")
    spec = sweep.load_spec(str(spec_file))
    run, points = sweep.grid(spec, "cpu")
    assert run["repeats"] == {"prefill": 10, "decode": 20}
    # per mesh: prefill 2 modes x 1 batch; decode 2 modes x 2 batches x 2 drafts
    assert len(points) == 2 * (2 + 8)
    assert {p.mesh for p in points} == {(1, 1, 1), (1, 2, 1)}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"batchez": [1]}))
    with pytest.raises(SystemExit, match="unknown keys"):
        sweep.load_spec(str(bad))


def test_a_named_revision_wins(monkeypatch):
    """JAXINFER_GIT_REVISION names a record's code where the tree's own .git is older than its files (the device
    machine's copy): it wins over HEAD, and the record says the files were not compared with it."""
    from experiments.bench_report import revision, revision_label, short_revision

    monkeypatch.delenv("JAXINFER_GIT_REVISION", raising=False)
    head, dirty = revision()
    assert head and dirty in (True, False)
    monkeypatch.setenv("JAXINFER_GIT_REVISION", "0123abc")
    assert revision() == ("0123abc", None)
    assert short_revision() == "0123abc+named"
    assert revision_label({"git_revision": "0123abc", "git_dirty": None}) == "git 0123abc (named)"
    assert revision_label({"git_revision": "0123abc", "git_dirty": True}) == "git 0123abc (dirty)"
