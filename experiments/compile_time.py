"""Compile time of the prefill and decode (verify) steps for any config, the full 43-layer V4-Flash
included, with abstract weights and caches: `model.transformer.abstract_model` and `jax.eval_shape` of
the cache hold shapes only, so nothing is allocated and any backend can compile any size.

    python -m experiments.compile_time --preset v4-flash --prefill-batch 1 --decode-batch 64 \\
        --context 126976 --new-tokens 4096
    python -m experiments.compile_time --preset v4-flash-4l --moe-impl pallas --attention-impl pallas   # GPU
    python -m experiments.compile_time --preset v4-flash-4l --moe-impl pallas --attention-impl pallas \
        --mhc-impl pallas --expert-weights fp4 --dense-weights fp8 --dense-impl pallas --batch-invariant \
        --context 32768 --lower-for cuda               # the invariant release step lowers for CUDA, on any host
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m experiments.compile_time --preset v4-flash-4l \
        --steps verify --context 32768 --mesh 1,2,1 --collectives      # what a mesh step communicates

The step functions are experiments/bench.py's (`step_functions`: prefill = `new_tokens` rows per sequence
after `context` cached positions; verify = 1 + num_draft rows per sequence), so the programs are the ones
bench.py times. Reported per step: trace + lowering seconds, XLA compile seconds, and the compiled
program's temporary buffer bytes where the backend reports them. With `--mesh dp,ep,tp` the step is compiled
partitioned (weights, caches and tokens laid out by the sharding tables, the model on the mesh's runtime) and
`--collectives` lists what it communicates per device (kind, result shape and bytes, the jax op that made
it): on a CPU this shows the XLA partitioning of everything but the GPU kernels' custom calls. `--scan-layers`
compiles the model with its repeated layer groups scanned (ModelConfig.scan_layers: one traced body per group
position, `traced_layers` in the record). The persistent compilation cache (experiments/compile_cache.py) is on
as in every CLI: each record says whether its compile was a cache hit (warm) or a miss (cold: a fresh
`--compile-cache DIR`, or `--compile-cache off`). `--lower-for cuda` traces and lowers the step for CUDA on any
host, the kernels chosen as on an H100 / H200 (`pallas_kernels.common.lowering_for_hopper`), without compiling: the
GPU's trace + lower time, measured on a CPU machine. Output: JSON + markdown under
experiments/results/compile_time_<stamp>_<backend>.{json,md} (and $OUT when set).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time

from experiments import compile_cache
from experiments import records as records_io
from experiments.bench_cli import parse_mesh
from pallas_kernels.common import lowering_for_hopper


COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|all-to-all|ragged-all-to-all|reduce-scatter|"
                        r"collective-permute)(?:-start)?\(")
OP_NAME = re.compile(r'op_name="([^"]*)"')
LOWERED_FOR_CUDA = ", lowered for CUDA (Hopper kernels), not compiled"
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
            "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def collectives(hlo_text: str) -> list[dict]:
    """The collectives of a compiled (SPMD-partitioned) HLO module: kind, result shape, bytes of the result
    per device and the jax op that made it, aggregated by (kind, shape, op) with a count."""
    out: dict[tuple, dict] = {}
    for line in hlo_text.splitlines():
        m = COLLECTIVE.search(line)
        if not m:
            continue
        op = OP_NAME.search(line)
        shape, kind, op = m.group(1), m.group(2), "/".join(op.group(1).split("/")[1:]) if op else ""
        nbytes = 0
        for dt, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", shape):
            nbytes += ITEMSIZE.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
        rec = out.setdefault((kind, shape, op), {"kind": kind, "shape": shape, "op": op, "bytes": nbytes, "count": 0})
        rec["count"] += 1
    return sorted(out.values(), key=lambda r: -r["bytes"] * r["count"])


def abstract_step(cfg, dtype: str, kind: str, batch: int, context: int, rows: int, num_draft: int = 3,
                  mesh_shape: tuple = (1, 1, 1)):
    """bench.py's step function of `kind` ("prefill" or "verify") and its abstract inputs: -> (setup, jitted
    function, (state, cache, tokens) as shapes; on a mesh, with the sharding tables' placements)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from experiments.bench import Point, Setup, make_mesh, step_functions
    from model.cache import allocate
    from model.runtime import make_runtime
    from model.transformer import abstract_model

    mesh = make_mesh(mesh_shape)
    model = abstract_model(cfg, dtype, runtime=make_runtime(cfg, mesh))
    setup = Setup(cfg=cfg, preset=cfg.name, dtype=dtype, mesh_shape=tuple(mesh_shape), mesh=mesh, model=model,
                  init_s=0.0)
    point = Point("prefill" if kind == "prefill" else "decode", "deepinfer", batch, context, rows, num_draft,
                  step="" if kind == "prefill" else "verify", mesh=tuple(mesh_shape))
    state, fns, _ = step_functions(setup, point)
    max_len = min(-(-(context + rows + num_draft + 2) // 64) * 64, cfg.max_position_embeddings)
    cache = jax.eval_shape(lambda: allocate(cfg, batch, max_len, dtype, max(8, num_draft + 2)))
    tokens = jax.ShapeDtypeStruct((batch, rows), jnp.int32)
    if mesh is not None:
        from model.sharded import cache_shardings, param_shardings
        from sharding.rules import batch_sharding

        placed = lambda tree, shardings: jax.tree.map(  # noqa: E731
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
        tree = nnx.state(model)   # the step functions take the state's leaves; the rules read its paths
        state = jax.tree.leaves(placed(tree, param_shardings(tree, mesh)))
        cache = placed(cache, cache_shardings(cache, mesh))
        tokens = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=batch_sharding(mesh, 2))
    return setup, fns[kind], (state, cache, tokens)


def compile_step(cfg, dtype: str, kind: str, batch: int, context: int, rows: int, num_draft: int = 3,
                 mesh_shape: tuple = (1, 1, 1), list_collectives: bool = False, lower_for: str | None = None) -> dict:
    """Lower and compile one step (kind "prefill" or "verify") on abstract inputs -> timings (and, on a
    (dp, ep, tp) mesh of visible devices, the collectives of the partitioned program). lower_for "cuda": lowered
    for CUDA with the Hopper kernels, not compiled (compile_s None)."""
    t0 = time.perf_counter()
    setup, fn, (state, cache, tokens) = abstract_step(cfg, dtype, kind, batch, context, rows, num_draft, mesh_shape)
    t1 = time.perf_counter()
    with setup.context():
        platforms = {} if lower_for is None else {"lowering_platforms": (lower_for,)}
        lowered = fn.trace(state, cache, tokens).lower(**platforms)
        t2 = time.perf_counter()
        rec = {"step": kind, "batch": batch, "context": context, "rows": rows, "mesh": list(mesh_shape),
               "abstract_model_s": round(t1 - t0, 3), "trace_lower_s": round(t2 - t1, 3)}
        if lower_for is not None:
            return {**rec, "compile_s": None, "compile_cache": "-", "lowered_for": lower_for}
        with compile_cache.CacheEvents() as events:
            compiled = lowered.compile()
    rec.update(compile_s=round(time.perf_counter() - t2, 3), compile_cache=events.status)
    try:
        mem = compiled.memory_analysis()
        rec["temp_bytes"] = int(mem.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        pass
    if list_collectives:
        rec["collectives"] = collectives(compiled.as_text())
    return rec


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--layers", type=int, help="scale to N backbone layers keeping the layer pattern")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--steps", default="prefill,verify", help="comma list of prefill, verify")
    p.add_argument("--prefill-batch", type=int, default=1)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--context", type=int, default=126976)
    p.add_argument("--new-tokens", type=int, default=4096)
    p.add_argument("--num-draft", type=int, default=3)
    p.add_argument("--moe-impl", choices=("reference", "pallas"), default="reference")
    p.add_argument("--attention-impl", choices=("reference", "pallas"), default="reference")
    p.add_argument("--mhc-impl", choices=("reference", "pallas"), default="reference")
    p.add_argument("--expert-weights", choices=("dense", "fp4"), default="dense")
    p.add_argument("--dense-weights", choices=("model", "fp8"), default="model")
    p.add_argument("--dense-impl", choices=("reference", "pallas"), default="reference",
                   help="the FP8 projections dequantised in-graph, or through pallas_kernels.fp8_linear (with "
                   "--dense-weights fp8)")
    p.add_argument("--mesh", type=parse_mesh, default=(1, 1, 1),
                   help="dp,ep,tp over the visible devices (CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    p.add_argument("--collectives", action="store_true",
                   help="list the partitioned program's collectives (kind, shape, bytes per device, source op)")
    p.add_argument("--scan-layers", action="store_true",
                   help="scan repeated layer groups (ModelConfig.scan_layers) instead of tracing every layer")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the batch-invariant step (ModelConfig.batch_invariant: its kernels at their fixed tilings)")
    p.add_argument("--lower-for", choices=("cuda",),
                   help="trace and lower for CUDA with the Hopper kernels on any host, without compiling")
    compile_cache.add_argument(p)
    p.add_argument("--out", help="results directory (default experiments/results; $OUT also gets a copy)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax

    from experiments.layer_scaling import scale_layers
    from model import ModelConfig
    from model.groups import layer_groups, traced_layers

    cache_dir = compile_cache.enable(args.compile_cache)

    cfg = ModelConfig.preset(args.preset)
    if args.layers:
        cfg = scale_layers(cfg, args.layers)
    cfg = cfg.replace(moe_impl=args.moe_impl, attention_impl=args.attention_impl, mhc_impl=args.mhc_impl,
                      expert_weights=args.expert_weights, dense_weights=args.dense_weights,
                      dense_impl=args.dense_impl, scan_layers=args.scan_layers, batch_invariant=args.batch_invariant)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    if not steps or any(s not in ("prefill", "verify") for s in steps):
        raise SystemExit(f"--steps must list prefill and/or verify, got {args.steps!r}")
    if args.lower_for and (args.mesh != (1, 1, 1) or args.collectives):
        raise SystemExit("--lower-for lowers the one-device step: leave out --mesh and --collectives")
    backend = jax.default_backend()
    records = []
    with lowering_for_hopper() if args.lower_for else contextlib.nullcontext():
        for kind in steps:
            batch, rows = ((args.prefill_batch, args.new_tokens) if kind == "prefill"
                           else (args.decode_batch, 1 + args.num_draft))
            rec = compile_step(cfg, args.dtype, kind, batch, args.context, rows, args.num_draft, args.mesh,
                               args.collectives, args.lower_for)
            compiled = "not compiled" if rec["compile_s"] is None else f"compile {rec['compile_s']:.1f} s"
            print(f"[compile_time] {cfg.name} {kind} B{batch} x {rows} rows at {args.context}: trace+lower "
                  f"{rec['trace_lower_s']:.1f} s, {compiled} (cache {rec['compile_cache']})", flush=True)
            for c in rec.get("collectives", [])[:12]:
                print(f"    {c['count']:3d} x {c['kind']:<14} {c['shape']:<40} {c['bytes'] / 2**20:9.2f} MiB  "
                      f"{c['op']}")
            records.append(rec)
    meta = {"config": cfg.name, "layers": cfg.num_layers, "dtype": args.dtype, "backend": backend,
            "device": str(jax.devices()[0]), "jax": jax.__version__, "moe_impl": cfg.moe_impl,
            "expert_weights": cfg.expert_weights, "dense_weights": cfg.dense_weights, "dense_impl": cfg.dense_impl,
            "attention_impl": cfg.attention_impl, "mhc_impl": cfg.mhc_impl, "scan_layers": cfg.scan_layers,
            "batch_invariant": cfg.batch_invariant,
            "lowered_for": args.lower_for, "traced_layers": traced_layers(layer_groups(cfg)),
            "compile_cache_dir": None if cache_dir is None else str(cache_dir),
            "xla_flags": os.environ.get("XLA_FLAGS"),
            "command": "python -m experiments.compile_time " + " ".join(sys.argv[1:] if argv is None else argv)}
    lines = [f"# Compile time: {cfg.name} ({cfg.num_layers} layers), {args.dtype} ({cfg.dense_weights} dense, "
             f"{cfg.expert_weights} experts{', batch-invariant' * cfg.batch_invariant}), "
             f"{'scanned' if cfg.scan_layers else 'unrolled'} layers "
             f"({meta['traced_layers']} traced), "
             f"{backend} ({meta['device']}){LOWERED_FOR_CUDA * bool(args.lower_for)}, "
             f"jax {jax.__version__}", "", f"`{meta['command']}`", "",
             "| step | batch x rows | context | trace + lower s | compile s | cache | temp GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        temp = f"{r['temp_bytes'] / 2**30:.1f}" if "temp_bytes" in r else "-"
        compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        lines.append(f"| {r['step']} | {r['batch']} x {r['rows']} | {r['context']} | {r['trace_lower_s']:.1f} "
                     f"| {compile_s} | {r['compile_cache']} | {temp} |")
    out = {"meta": meta, "records": records}
    records_io.save(out, "\n".join(lines) + "\n", "compile_time", backend, args.out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
