"""A bench run's records written out: the environment every record carries (command, revision, device,
versions), the markdown table (with each profiled step's breakdown), the JSON, and their copies to $OUT."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git(*args) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def revision() -> tuple[str | None, bool | None]:
    """(the code's git revision, whether the files differ from it). JAXINFER_GIT_REVISION, where set, names the
    revision and the difference is unknown (None): a copy of the tree whose .git is missing or older than its files
    (the device machine's keeps the first call's) cannot tell its own (experiments/device/suites.sh says how to
    set it)."""
    named = os.environ.get("JAXINFER_GIT_REVISION")
    if named:
        return named, None
    head = git("rev-parse", "HEAD")
    return head, (bool(git("status", "--porcelain")) if head else None)


def short_revision() -> str:
    """`revision()` in one short word: 7 hex digits, '+dirty' where the files differ, '+named' where
    JAXINFER_GIT_REVISION named it ('?' without either)."""
    head, dirty = revision()
    return (head or "?")[:7] + {True: "+dirty", None: "+named" if head else ""}.get(dirty, "")


def revision_label(env: dict) -> str:
    """A record's revision as its markdown header gives it: 'git REV', '(dirty)' where the files differed from it,
    '(named)' where JAXINFER_GIT_REVISION named it."""
    note = {True: " (dirty)", None: " (named)"}.get(env.get("git_dirty"), "")
    return f"git {env.get('git_revision')}{note}"


def environment(command: str) -> dict:
    import flax
    import jax

    dev = jax.devices()[0]
    rev, dirty = revision()
    return {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": command,
            "git_revision": rev, "git_dirty": dirty,
            "backend": jax.default_backend(), "device": getattr(dev, "device_kind", str(dev)),
            "device_count": jax.device_count(), "jax": jax.__version__, "flax": flax.__version__,
            "python": sys.version.split()[0], "xla_flags": os.environ.get("XLA_FLAGS"),
            "compile_cache_dir": jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache
            else None}


def command_line(argv, module: str = "experiments.bench") -> str:
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", "-m", module, *args])


def markdown(env: dict, recs: list[dict], title: str = "bench") -> str:
    out = [f"# {title} {env['date_utc']}", "",
           f"`{env['command']}` — {revision_label(env)}, "
           f"{env['device']} x{env['device_count']} ({env['backend']}), jax {env['jax']}, flax {env['flax']}.", "",
           "Step time: median of the timed steps (wall clock, `jax.block_until_ready` per step) after warm-up; "
           "compile excluded (compile s: (reused) = compiled for another point, (hit) = loaded from the "
           "persistent compilation cache). Roofline: experiments/roofline.py floor per device (H200 best measured ceilings: "
           "HBM 4.4 TB/s, bf16 790, FP8 1525 TFLOP/s; the datasheet's in the records); "
           "% roofline = floor / median. deepinfer tokens/s = requests x 3.25 / step; realistic = requests x "
           "measured (1 + accepted) / step; prefill = new tokens / step.", "",
           "| phase | mode | step | model | dtype | impl (attn/moe) | mesh | batch | context | rows/seq | median ms "
           "| p10-p90 ms | compile s | tokens/s | tok/s/dev | accept len | floor ms | % roofline | MFU | "
           "warm-up/repeats | status |",
           "|" + "---|" * 21]
    for r in recs:
        mesh = "x".join(str(r["mesh"][a]) for a in ("dp", "ep", "tp"))
        dtype = weight_label(r)
        invariant = " batch-invariant" if r.get("batch_invariant") else ""
        head = (f"| {r['phase']} | {r['mode']} | {r['step']} | {r['config']} | {dtype} | "
                f"{r['attention_impl']}/{r['moe_impl']}{invariant} | {mesh} | {r['batch']} | {r['context']} | "
                f"{r['new_tokens']} |")
        if r["status"] != "ok":
            out.append(head + f" — | | | | | | | | | | {r['status']}: {r.get('reason', '')[:160]} |")
            continue
        s = r["step_ms"]
        comp = sum(r.get("compile_s", {}).values())
        cached = sorted(set(r.get("compile_cache", {}).values()) - {"miss", "off"})
        acc = r.get("acceptance", {}).get("mean_accepted_length")
        acc_s = f"{acc:.2f}" if acc is not None else (f"{r['accepted_per_step_assumed']:.2f} (assumed)"
                                                       if "accepted_per_step_assumed" in r else "")
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else ""
        out.append(head + f" {s['median']:.3f} | {s['p10']:.3f}-{s['p90']:.3f} | {comp:.1f}"
                   f"{' (' + '/'.join(cached) + ')' if cached else ''} | "
                   f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_device']:,.0f} | {acc_s} | "
                   f"{r['roofline']['floor_ms']:.3f} | {100 * r['roofline_fraction']:.1f}% | {mfu} | "
                   f"{r['warmup']}/{r['repeats']} | ok |")
    looped = [r for r in recs if r.get("status") == "ok" and "looped" in r]
    if looped:
        out += ["", "Verify steps in one device loop (`--loop-steps`), ms a step: " + "; ".join(
            f"batch {r['batch']}: {r['looped']['step_ms']:.3f} ({r['looped']['steps_per_call']} a call) against "
            f"{r['step_ms']['median']:.3f} synchronous"
            + (f" and {r['profile']['pipelined_ms']:.3f} back to back" if "pipelined_ms" in r.get("profile", {}) else "")
            for r in looped)]
    for r in recs:
        if r.get("status") == "ok" and "components" in r.get("profile", {}):
            out += [""] + breakdown_table(r)
    notes = sorted({n for r in recs for n in r.get("notes", [])})
    if notes:
        out += [""] + [f"Note: {n}." for n in notes]
    return "\n".join(out) + "\n"


# "cache write": older records' name for "in-place update"
GLUE_KINDS = ("transpose", "concatenate", "convert", "sort", "copy", "in-place update", "cache write",
              "scatter / gather", "reduce", "elementwise / other")


def breakdown_table(r: dict) -> list[str]:
    """A profiled record (`--kernel-times`) as markdown: each component's kernel time against its floor at both
    ceilings, its glue (XLA's own non-GEMM kernels), the host / launch gap, and the largest glue kernels."""
    prof, roof = r["profile"], r["roofline"]
    wall = r["step_ms"]["median"]
    floors, sheet = roof.get("by_component_ms", {}), roof.get("datasheet", {}).get("by_component_ms", {})
    out = [f"Where the time goes: {r['phase']} B{r['batch']} x {r['new_tokens']} at {r['context']} "
           f"({r['config']}, {weight_label(r)}), CUPTI over {prof['steps']} steps; floors per component at the "
           "best measured / datasheet ceilings:", "",
           "| component | ms | % of step | floor ms | x floor | datasheet floor ms | glue ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, c in prof["components"].items():
        fl, ds = floors.get(name), sheet.get(name)
        glue = sum(v for k, v in c["by_kind"].items() if k in GLUE_KINDS)
        ratio = f"{c['ms'] / fl:.2f}" if fl else ""
        out.append(f"| {name} | {c['ms']:.3f} | {100 * c['ms'] / wall:.1f}% | {fl if fl is not None else ''} | "
                   f"{ratio} | {ds if ds is not None else ''} | {glue:.3f} |")
    out.append(f"| host / launch gap | {prof['gap_ms']:.3f} | {100 * prof['gap_ms'] / wall:.1f}% | 0 | | 0 | |")
    if "pipelined_ms" in prof:   # the gap split by steps issued back to back
        for key, name in (("host_gap_ms", "of it: the host's (dispatch and wait)"),
                          ("dispatch_ms", "a synchronous call's return (dispatch; the device works meanwhile)"),
                          ("device_idle_ms", "of it: the device idle between kernels")):
            if key not in prof:   # records made before the dispatch was timed
                continue
            out.append(f"| {name} | {prof[key]:.3f} | {100 * prof[key] / wall:.1f}% | 0 | | 0 | |")
    out.append(f"| **step** | **{wall:.3f}** | 100% | **{roof['floor_ms']:.3f}** | **{wall / roof['floor_ms']:.2f}** | "
               f"{roof.get('datasheet', {}).get('floor_ms', 0):.3f} | |")
    glue = [t for t in prof["top"] if t[2] in GLUE_KINDS][:8]
    if glue:
        out += ["", "Largest glue kernels (ms per step, % of step): " + "; ".join(
            f"{k} [{comp}, {kind}] {ms:.3f} ({100 * ms / wall:.1f}%)" for k, comp, kind, ms, *_ in glue)]
    return out


def weight_label(r: dict) -> str:
    return r["dtype"] + (" + fp8 dense" if r.get("dense_weights") == "fp8" else "") + (
        " (kernels)" if r.get("dense_impl") == "pallas" else "") + (" + quant_sim" if r.get("quant_sim") else "") + (
        " + fp4 experts" if r.get("expert_weights") == "fp4" else "") + (
        " + bf16 head" if r.get("head_dtype") == "bfloat16" else "") + (
        " + fp4 index keys" if r.get("index_key_format") == "fp4" else "") + (
        " + mhc kernels" if r.get("mhc_impl") == "pallas" else "")


def write_results(env: dict, recs: list[dict], stem: str, out_dir: Path | None = None, title: str = "bench"
                  ) -> list[Path]:
    """experiments/results/<stem>.json (a list of self-contained records) and .md; copies to $OUT."""
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    full = [{**r, "env": env} for r in recs]
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    tmp = paths[0].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(full, indent=1, default=json_default))
    tmp.replace(paths[0])
    paths[1].write_text(markdown(env, recs, title))
    copy_to_out(paths)
    return paths


def copy_to_out(paths) -> None:
    dest = os.environ.get("OUT")
    if not dest:
        return
    d = Path(dest)
    d.mkdir(parents=True, exist_ok=True)
    for p in paths:
        p = Path(p)
        if p.exists() and p.resolve().parent != d.resolve():
            shutil.copy2(p, d / p.name)


def json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)
