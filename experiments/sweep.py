"""Sweeps of experiments/bench.py over meshes, batch sizes, context lengths, draft counts and bounded replay,
resumable, with one results file and plots.

    python -m experiments.sweep --spec experiments/sweeps/h200_decode.yaml
    python -m experiments.sweep --preset tiny-v4 --phase decode --mode deepinfer,realistic \\
        --mesh 1,1,1 --batch 2,4 --context 64 --num-draft 1,3 --replay off --name smoke

The grid is the product of: mesh x phase x mode x context x batch x num_draft (decode) / new_tokens
(prefill) x replay. Values come from a small YAML (or JSON) spec file; every list given on the command
line replaces the spec's. Spec keys (all optional):

    name: h200-decode                 # results: experiments/results/sweep_<name>.jsonl / .md / .png
    preset: v4-flash-4l               # plus layers, dtype, moe_impl, attention_impl, mhc_impl, expert_weights,
                                      # dense_weights, seed, checkpoint, scan_layers
    phase: [decode]                   # prefill | decode
    mode: [deepinfer, realistic]
    step: verify                      # decode step for deepinfer mode (realistic always times spec)
    mesh: ["1,1,1", "1,2,1"]          # dp,ep,tp; meshes needing more devices than visible are left out
    batch: [8, 64, 256]               # decode batch (global sequences)
    prefill_batch: [1, 4]             # prefill batch (default: batch)
    context: [4096, 32768]
    num_draft: [3]
    new_tokens: [4096]
    replay: [false, true]             # [V4.1] bounded replay in prefill; V4 points are recorded as skipped
    warmup: 3
    repeats: {prefill: 10, decode: 60}   # or one number
    real_prefill: false
    quick: false

Resumable: every finished point is appended to the results file (JSON lines) at once; a later run with
the same file skips every point already there with status ok / refused / skipped (points that failed with
an error run again). The model is built once per mesh, and only if that mesh has points left to run.
Programs are shared: points whose step is the same program (the same step function, routing, shapes and
mesh: e.g. contexts whose caches round to the same length) compile it once, and the persistent compilation
cache (experiments/compile_cache.py, on by default) loads what an earlier run compiled (a resumed or
repeated sweep, another sweep with common points). Each point's record says how its programs came (`compile_cache`: reused / hit / miss / off) and
the summary gives the compile seconds per point and in total. At
the end the markdown table and the plot (<name>.png: tokens/s per GPU and % of the floor against the swept
axis, one line per combination of the other swept values, one column per phase; experiments/plots.py) are
rewritten from the whole file; plotting needs matplotlib and is skipped with a message where it is not
installed. Everything written is also copied to $OUT when set.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from pathlib import Path

from . import bench, bench_cli, bench_report, compile_cache
from .progress import Progress

# what makes two records the same point (besides bench.Point.key()); warm-up / repeat counts do not
KEY_FIELDS = ("preset", "config", "layers", "dtype", "moe_impl", "attention_impl", "mhc_impl", "expert_weights",
              "dense_weights", "real_prefill", "checkpoint", "scan_layers")


# ----------------------------------------------------------------------------------------------- spec

def load_spec(path: str | None) -> dict:
    if not path:
        return {}
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise SystemExit(f"{path}: reading YAML needs pyyaml (pip install pyyaml), or use a JSON spec") from e
        spec = yaml.safe_load(text) or {}
    else:
        spec = json.loads(text)
    if not isinstance(spec, dict):
        raise SystemExit(f"{path}: a sweep spec is a mapping of keys to values or lists")
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise SystemExit(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(SPEC_KEYS)}")
    return spec


SPEC_KEYS = {"name", "preset", "layers", "dtype", "moe_impl", "attention_impl", "mhc_impl", "expert_weights",
             "dense_weights", "seed", "checkpoint", "phase", "mode", "step", "mesh", "batch", "prefill_batch", "context", "num_draft",
             "new_tokens", "replay", "warmup", "repeats", "real_prefill", "quick", "results", "scan_layers"}


def as_list(v) -> list:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return list(v)
    return [v]


def as_bool(v) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("on", "true", "yes", "1"):
        return True
    if s in ("off", "false", "no", "0"):
        return False
    raise SystemExit(f"on/off values (true/false) expected (replay, scan_layers), got {v!r}")


def as_mesh(v) -> tuple[int, int, int]:
    if isinstance(v, (list, tuple)):
        v = ",".join(str(x) for x in v)
    try:
        return bench_cli.parse_mesh(str(v))
    except argparse.ArgumentTypeError as e:
        raise SystemExit(str(e))


def str_list(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def mesh_list(s: str) -> list[str]:
    """'1,1,1;1,2,1' or '1,1,1 1,2,1' -> ['1,1,1', '1,2,1']."""
    return [x for x in s.replace(";", " ").split() if x]


# ----------------------------------------------------------------------------------------------- grid

def grid(spec: dict, backend: str) -> tuple[dict, list[bench.Point]]:
    quick = bool(spec.get("quick", False))
    d = bench_cli.defaults(backend, quick)
    run = {
        "preset": spec.get("preset") or d["preset"], "layers": spec.get("layers"),
        "dtype": spec.get("dtype") or d["dtype"], "moe_impl": spec.get("moe_impl") or d["impl"],
        "attention_impl": spec.get("attention_impl") or d["impl"], "mhc_impl": spec.get("mhc_impl") or d["impl"],
        "seed": int(spec.get("seed", 0)),
        "expert_weights": spec.get("expert_weights") or "dense", "dense_weights": spec.get("dense_weights") or "model",
        "checkpoint": spec.get("checkpoint"), "real_prefill": bool(spec.get("real_prefill", False)),
        "scan_layers": as_bool(spec.get("scan_layers", False)),
        "warmup": int(spec["warmup"]) if spec.get("warmup") is not None else d["warmup"],
    }
    reps = spec.get("repeats")
    if isinstance(reps, dict):
        run["repeats"] = {ph: int(reps.get(ph, d[f"repeats_{ph}"])) for ph in bench_cli.PHASES}
    else:
        run["repeats"] = {ph: int(reps) if reps else d[f"repeats_{ph}"] for ph in bench_cli.PHASES}
    phases = [str(x) for x in as_list(spec.get("phase")) or ["decode"]]
    modes = [str(x) for x in as_list(spec.get("mode")) or ["deepinfer"]]
    meshes = [as_mesh(m) for m in as_list(spec.get("mesh")) or ["1,1,1"]]
    batches = [int(x) for x in as_list(spec.get("batch")) or d["batch"]]
    pbatches = [int(x) for x in as_list(spec.get("prefill_batch")) or batches]
    contexts = [int(x) for x in as_list(spec.get("context")) or [d["context"]]]
    drafts = [int(x) for x in as_list(spec.get("num_draft")) or [3]]
    news = [int(x) for x in as_list(spec.get("new_tokens")) or [d["new_tokens"]]]
    replays = [as_bool(x) for x in as_list(spec.get("replay")) or [False]]
    step = str(spec.get("step") or "")
    for ph in phases:
        if ph not in bench_cli.PHASES:
            raise SystemExit(f"phase must be one of {bench_cli.PHASES}, got {ph!r}")
    for m in modes:
        if m not in bench_cli.MODES:
            raise SystemExit(f"mode must be one of {bench_cli.MODES}, got {m!r}")
    points = []
    for mesh, phase, mode, ctx, rep in itertools.product(meshes, phases, modes, contexts, replays):
        if phase == "prefill":
            for b, n in itertools.product(pbatches, news):
                points.append(bench.Point(phase, mode, b, ctx, n, 0, "", rep, mesh))
        else:
            s = step if mode == "deepinfer" else ""
            for b, k in itertools.product(batches, drafts):
                points.append(bench.Point(phase, mode, b, ctx, 4096, k, s, rep, mesh))
    seen, unique = set(), []
    for p in points:  # the same point twice (e.g. prefill x num_draft) runs once
        k = json.dumps(p.key(), sort_keys=True)
        if k not in seen:
            seen.add(k)
            unique.append(p)
    return run, unique


def run_key(run: dict, cfg, p: bench.Point) -> str:
    fields = {"preset": run["preset"], "config": cfg.name, "layers": cfg.num_layers, "dtype": run["dtype"],
              "moe_impl": cfg.moe_impl, "attention_impl": cfg.attention_impl, "mhc_impl": cfg.mhc_impl,
              "expert_weights": cfg.expert_weights,
              "dense_weights": cfg.dense_weights, "real_prefill": run["real_prefill"],
              "checkpoint": run["checkpoint"], "scan_layers": cfg.scan_layers}
    return json.dumps({**fields, **p.key()}, sort_keys=True)


def record_key(rec: dict) -> str | None:
    if "key" not in rec:
        return None
    fields = {k: rec.get(k) for k in KEY_FIELDS}
    fields["expert_weights"] = fields["expert_weights"] or "dense"  # records from before the fields
    fields["dense_weights"] = fields["dense_weights"] or "model"
    fields["scan_layers"] = bool(fields["scan_layers"])  # records without the field ran every layer on its own
    fields["mhc_impl"] = fields["mhc_impl"] or "reference"
    return json.dumps({**fields, **rec["key"]}, sort_keys=True)


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    recs = []
    for i, line in enumerate(path.read_text().splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"[sweep] {path}:{i + 1}: unreadable line left out (a run cut mid-write?)", file=sys.stderr)
    return recs


DONE = ("ok", "refused", "skipped")


# ----------------------------------------------------------------------------------------------- plots

def plot(recs: list[dict], stem: Path) -> list[Path]:
    """<stem>.png: tokens/s per GPU and % of the floor against the swept axis, a column per phase
    (experiments.plots.plot_sweep); nothing where matplotlib is not installed or no point finished."""
    try:
        from .plots import plot_sweep
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("matplotlib"):
            raise
        print("[sweep] matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    if not any(r.get("status") == "ok" for r in recs):
        return []
    path = stem.with_suffix(".png")
    plot_sweep(recs, path, title=stem.name)
    return [path]


# ----------------------------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", help="YAML or JSON spec file (keys in the module docstring)")
    p.add_argument("--name", help="sweep name (results file stem; default from the spec, else 'sweep')")
    p.add_argument("--results", help="results file (JSON lines; default experiments/results/sweep_<name>.jsonl)")
    p.add_argument("--preset")
    p.add_argument("--layers", type=int)
    p.add_argument("--dtype", choices=("bfloat16", "float32"))
    p.add_argument("--moe-impl", choices=("reference", "pallas"))
    p.add_argument("--attention-impl", choices=("reference", "pallas"))
    p.add_argument("--expert-weights", choices=("dense", "fp4"))
    p.add_argument("--dense-weights", choices=("model", "fp8"))
    p.add_argument("--phase", type=str_list, help="comma list of prefill,decode")
    p.add_argument("--mode", type=str_list, help="comma list of deepinfer,realistic")
    p.add_argument("--step", choices=bench_cli.STEPS, help="deepinfer decode step (default verify)")
    p.add_argument("--mesh", type=mesh_list, help="meshes 'dp,ep,tp' separated by ';' or spaces")
    p.add_argument("--batch", type=bench_cli.int_list)
    p.add_argument("--prefill-batch", type=bench_cli.int_list)
    p.add_argument("--context", type=bench_cli.int_list)
    p.add_argument("--num-draft", type=bench_cli.int_list)
    p.add_argument("--new-tokens", type=bench_cli.int_list)
    p.add_argument("--replay", type=str_list, help="comma list of off,on")
    p.add_argument("--warmup", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--real-prefill", action="store_true", default=None)
    p.add_argument("--seed", type=int)
    p.add_argument("--checkpoint")
    p.add_argument("--quick", action="store_true", default=None)
    p.add_argument("--scan-layers", action="store_true", default=None, help="run repeated layer groups as "
                   "one scanned body each (ModelConfig.scan_layers)")
    compile_cache.add_argument(p)
    p.add_argument("--no-memory-check", action="store_true")
    p.add_argument("--plot-only", action="store_true", help="only rewrite the table and plots from the results file")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    spec = load_spec(args.spec)
    for key in SPEC_KEYS:  # every list or value given on the command line replaces the spec's
        v = getattr(args, key, None)
        if v is not None:
            spec[key] = v
    import jax

    compile_cache.enable(args.compile_cache)
    backend = jax.default_backend()
    name = str(spec.get("name") or "sweep")
    results = Path(spec.get("results") or bench_report.RESULTS_DIR / f"sweep_{name}.jsonl")
    results.parent.mkdir(parents=True, exist_ok=True)
    stem = results.with_suffix("")
    progress = Progress(quiet=args.quiet)
    run, points = grid(spec, backend)
    cfg = bench.resolve_config(run["preset"], run["layers"], run["moe_impl"], run["attention_impl"],
                               run["expert_weights"], run["dense_weights"], mhc_impl=run["mhc_impl"],
                               scan_layers=run["scan_layers"])
    env = bench_report.environment(bench_report.command_line(argv, "experiments.sweep"))
    old = read_results(results)
    done = {record_key(r) for r in old if r.get("status") in DONE}
    summary = {"results": str(results), "points": len(points), "skipped_done": 0, "ran": 0, "not_possible": 0,
               "compile_s": {}, "compile_s_total": 0.0}
    if not args.plot_only:
        ndev = jax.device_count()
        todo: dict[tuple, list[bench.Point]] = {}
        for p in points:
            if int(p.mesh[0] * p.mesh[1] * p.mesh[2]) > ndev:
                summary["not_possible"] += 1
                continue
            if run_key(run, cfg, p) in done:
                summary["skipped_done"] += 1
                continue
            todo.setdefault(tuple(p.mesh), []).append(p)
        left = sum(len(v) for v in todo.values())
        progress.log(f"sweep '{name}': {len(points)} points; {summary['skipped_done']} already in {results.name}, "
                     f"{summary['not_possible']} need more than {ndev} device(s), {left} to run")
        i = 0
        for mesh, pts in todo.items():
            setup = bench.build(cfg, run["preset"], run["dtype"], mesh, run["seed"], run["checkpoint"], progress,
                                warmup=run["warmup"], repeats_prefill=run["repeats"]["prefill"],
                                repeats_decode=run["repeats"]["decode"], real_prefill=run["real_prefill"])
            for p in pts:
                i += 1
                progress.log(f"[{i}/{left}] {p.label()}")
                t0 = time.perf_counter()
                rec = bench.run_point(setup, p, check_memory=not args.no_memory_check)
                rec.update(real_prefill=run["real_prefill"], checkpoint=run["checkpoint"], sweep=name,
                           point_wall_s=round(time.perf_counter() - t0, 2), env=env)
                with results.open("a") as f:
                    f.write(json.dumps(rec, default=bench_report.json_default) + "\n")
                summary["ran"] += 1
                compile_s = sum(rec.get("compile_s", {}).values())
                summary["compile_s"][p.label()] = round(compile_s, 3)
                summary["compile_s_total"] = round(summary["compile_s_total"] + compile_s, 3)
                if rec["status"] == "ok":
                    how = "/".join(sorted(set(rec.get("compile_cache", {}).values())))
                    progress.log(f"  {rec['step_ms']['median']:.3f} ms/step, {rec['tokens_per_s']:,.0f} tokens/s, "
                                 f"{100 * rec['roofline_fraction']:.1f}% of the roofline; compile {compile_s:.1f} s "
                                 f"({how})")
                else:
                    progress.log(f"  {rec['status']}: {rec.get('reason')}")
            del setup
            gc.collect()
    recs = read_results(results)
    md = stem.with_suffix(".md")
    md.write_text(bench_report.markdown(recs[-1]["env"] if recs and "env" in recs[-1] else env, recs, f"sweep {name}"))
    pngs = plot(recs, stem)
    bench_report.copy_to_out([results, md, *pngs])
    summary.update(markdown=str(md), plots=[str(p) for p in pngs], records=len(recs))
    progress.log(f"done: ran {summary['ran']}, skipped {summary['skipped_done']} finished; {len(recs)} records in "
                 f"{results}; table {md.name}; plots {', '.join(p.name for p in pngs) or 'none'}; compile "
                 f"{summary['compile_s_total']:.1f} s in total")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
