"""Tool: what a batch-invariant step repeats, counted from its traced program at any size (abstract weights and
caches: no device, no weights, the real V4-Flash widths on a CPU). Under ModelConfig.batch_invariant every
reduction runs on fixed blocks in loops (pallas_kernels/invariant.py); on a GPU each loop trip costs a few kernel
launches and a loop-condition check, and each row block's product streams its weight again. Per step this
counts the loop trips (nested trips multiplied out) and the matrix products executed with the bytes their
operands read, by the model code that made the loop.

    python -m experiments.probes.invariant_loops --preset v4-flash-4l --expert-weights fp4 --dense-weights fp8 \\
        --steps verify,prefill --decode-batch 8,64 --context 32768
    python -m experiments.probes.invariant_loops --moe-impl pallas            # the experts on the MoE kernels
    python -m experiments.probes.invariant_loops --moe-impl pallas --dense-impl pallas   # and the FP8 projections
    python -m experiments.probes.invariant_loops --moe-impl pallas --dense-impl pallas --mhc-impl pallas \
        --attention-impl pallas                                   # and the mHC and attention kernels
    python -m experiments.probes.invariant_loops --blocks 8,16,16             # other block sizes

With `--moe-impl pallas` the routed experts run on the MoE kernels (their calls counted, not their bytes). The
routed experts' reference tile loop has a data-dependent trip count (the live tiles); it is counted at forced
balance (every expert gets rows x k / E rows, as bench.py's deepinfer mode), the other loops at their static
lengths. A product's operand that is an upcast of a narrower value (XLA:CPU multiplies bf16 as float32,
`reference.f32_dot_operands`) counts at the narrower size, as a GPU reads it.
Writes experiments/results/invariant_loops_<stamp>_<backend>.{json,md} and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import warnings
from pathlib import Path

from jax._src import source_info_util

from experiments import records as records_io
from experiments.bench_report import short_revision

ROOT = Path(__file__).resolve().parents[2]


def _jaxprs(params: dict):
    """The sub-programs in an equation's params (pjit, custom calls, remat, shard_map, cond branches, ...)."""
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            inner = getattr(x, "jaxpr", x)
            if hasattr(inner, "eqns"):
                yield inner


def _frame_text(frame) -> str:
    path = Path(frame.file_name)
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return f"{name}:{frame.start_line} ({frame.function_name})"


def _where(eqn) -> str:
    """The model code (file:line (function)) that made an equation; for the loop of `invariant.row_blocks`, the
    code that called it."""
    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    if not frames:
        return "?"
    if frames[0].function_name == "row_blocks" and len(frames) > 1:
        return f"{_frame_text(frames[1])} via row_blocks"
    return _frame_text(frames[0])


def _nbytes(aval) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize if hasattr(aval, "shape") else 0


class Count:
    """Loop trips and products of a traced step, nested trips multiplied out."""

    def __init__(self, expert_tiles: int):
        self.expert_tiles = expert_tiles
        self.trips = collections.Counter()        # where -> trips per step
        self.read = collections.Counter()         # where -> bytes the products there read per step
        self.dots = 0
        self.kernels = 0                          # Pallas kernel calls executed
        self.looped_dot_bytes = 0
        self.upcast: dict = {}                    # a float32 upcast of a bf16 value -> the bf16 bytes

    def walk(self, jaxpr, times: int, in_loop: bool) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "convert_element_type":
                source, result = eqn.invars[0].aval, eqn.outvars[0].aval
                if source.dtype.itemsize < result.dtype.itemsize:
                    self.upcast[eqn.outvars[0]] = _nbytes(source)
            if name == "pallas_call":
                self.kernels += times
                continue
            if name == "dot_general":
                self.dots += times
                read = sum(self.upcast.get(v, _nbytes(v.aval)) for v in eqn.invars) * times
                self.read[_where(eqn)] += read
                self.looped_dot_bytes += read if in_loop else 0
            if name == "scan":
                n = int(eqn.params["length"])
                self.trips[_where(eqn)] += times * n
                self.walk(eqn.params["jaxpr"].jaxpr, times * n, True)
            elif name == "while":
                n = self.expert_tiles if "experts" in str(eqn.source_info.name_stack) else 1
                self.trips[_where(eqn)] += times * n
                self.walk(eqn.params["body_jaxpr"].jaxpr, times * n, True)
            else:
                for sub in _jaxprs(eqn.params):
                    self.walk(sub, times, in_loop)


def forced_balance_tiles(cfg, tokens: int) -> int:
    """Live tiles of `invariant.expert_slots` per layer at forced balance: every expert ceil(tokens k / E / ROWS)."""
    from pallas_kernels import invariant as inv

    per_expert = -(-tokens * cfg.n_experts_per_tok // cfg.n_routed_experts)
    return cfg.n_routed_experts * -(-per_expert // inv.ROWS)


def count_step(cfg, dtype: str, kind: str, batch: int, context: int, rows: int, num_draft: int) -> dict:
    from experiments.compile_time import abstract_step
    from pallas_kernels import invariant as inv

    setup, fn, args = abstract_step(cfg, dtype, kind, batch, context, rows, num_draft)
    with setup.context():
        jaxpr = fn.trace(*args).jaxpr
    count = Count(forced_balance_tiles(cfg, batch * rows))
    count.walk(jaxpr.jaxpr, 1, False)
    return {"step": kind, "batch": batch, "rows": rows, "context": context, "row_block": inv.ROWS,
            "entry_block": inv.ENTRY_BLOCK, "index_key_block": inv.INDEX_KEY_BLOCK,
            "expert_tiles_per_layer": count.expert_tiles, "loop_trips": sum(count.trips.values()),
            "dots": count.dots, "pallas_calls": count.kernels, "dot_gb": round(sum(count.read.values()) / 1e9, 3),
            "looped_dot_gb": round(count.looped_dot_bytes / 1e9, 3),
            "trips_by_source": dict(count.trips.most_common()),
            "product_gb_by_source": {k: round(v / 1e9, 3) for k, v in count.read.most_common()}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v4-flash-4l")
    p.add_argument("--layers", type=int, help="scale to N backbone layers keeping the layer pattern")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--expert-weights", choices=("dense", "fp4"), default="fp4")
    p.add_argument("--dense-weights", choices=("model", "fp8"), default="fp8")
    p.add_argument("--moe-impl", choices=("reference", "pallas"), default="reference",
                   help="the routed experts on the reference tiles or on the MoE kernels (one tiling per format)")
    p.add_argument("--dense-impl", choices=("reference", "pallas"), default="reference",
                   help="the FP8 projections on row blocks or on the FP8 linears' fixed tiles over all rows")
    p.add_argument("--mhc-impl", choices=("reference", "pallas"), default="reference",
                   help="the mHC on row blocks or on its kernels (the coefficient GEMM on fixed tiles)")
    p.add_argument("--attention-impl", choices=("reference", "pallas"), default="reference",
                   help="the attention core and the indexer's scores on key blocks or on their kernels at one tiling")
    p.add_argument("--steps", default="verify,prefill", help="comma list of prefill, verify")
    p.add_argument("--decode-batch", default="8,64", help="comma list")
    p.add_argument("--prefill-batch", type=int, default=1)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--new-tokens", type=int, default=4096)
    p.add_argument("--num-draft", type=int, default=3)
    p.add_argument("--blocks", help="ROWS,ENTRY_BLOCK,INDEX_KEY_BLOCK to count with instead of "
                   "pallas_kernels/invariant.py's (what other block sizes would repeat)")
    p.add_argument("--top", type=int, default=6, help="loop sources listed per step")
    p.add_argument("--out", help="results directory (default experiments/results; $OUT also gets a copy)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax

    from experiments.layer_scaling import scale_layers
    from model import ModelConfig
    from pallas_kernels import invariant as inv

    try:
        asked = inv.parse_blocks(args.blocks) if args.blocks else (inv.ROWS, inv.ENTRY_BLOCK, inv.INDEX_KEY_BLOCK)
    except ValueError as e:
        raise SystemExit(f"--blocks {e}") from None

    cfg = ModelConfig.preset(args.preset)
    if args.layers:
        cfg = scale_layers(cfg, args.layers)
    cfg = cfg.replace(batch_invariant=True, expert_weights=args.expert_weights, dense_weights=args.dense_weights,
                      moe_impl=args.moe_impl, dense_impl=args.dense_impl, mhc_impl=args.mhc_impl,
                      attention_impl=args.attention_impl)
    records = []
    blocks = inv.set_blocks(asked)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*interpret mode.*")   # traced only, never run
            for kind in [s.strip() for s in args.steps.split(",") if s.strip()]:
                batches = [args.prefill_batch] if kind == "prefill" else [int(b) for b in args.decode_batch.split(",")]
                for batch in batches:
                    rows = args.new_tokens if kind == "prefill" else 1 + args.num_draft
                    records.append(count_step(cfg, args.dtype, kind, batch, args.context, rows, args.num_draft))
    finally:
        inv.set_blocks(blocks)
    command = "python -m experiments.probes.invariant_loops " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"# Loops of the batch-invariant step: {cfg.name} ({cfg.num_layers} layers), {args.dtype} "
             f"({cfg.dense_weights} dense on the {cfg.dense_impl} path, {cfg.expert_weights} experts on the "
             f"{cfg.moe_impl} path, the mHC and the attention on the {cfg.mhc_impl} and "
             f"{cfg.attention_impl} paths), "
             f"jax {jax.__version__}, git {short_revision()}", "",
             f"`{command}`", "",
             "| step | batch x rows | context | row / entry / index-key block | expert tiles per layer | loop trips "
             "| products | their operands GB (in loops) | Pallas calls |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['step']} | {r['batch']} x {r['rows']} | {r['context']} | {r['row_block']} / "
                     f"{r['entry_block']} / {r['index_key_block']} | {r['expert_tiles_per_layer']} | "
                     f"{r['loop_trips']:,} | {r['dots']:,} | {r['dot_gb']} ({r['looped_dot_gb']}) | "
                     f"{r['pallas_calls']:,} |")
    for r in records:
        lines += ["", f"{r['step']} {r['batch']} x {r['rows']}: loop trips by source", ""]
        lines += [f"- {n:,} {where}" for where, n in list(r["trips_by_source"].items())[:args.top]] or ["- none"]
        lines += ["", f"{r['step']} {r['batch']} x {r['rows']}: products' operand GB by source", ""]
        lines += [f"- {gb} {where}" for where, gb in list(r["product_gb_by_source"].items())[:args.top]] or ["- none"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = {"meta": {"config": cfg.name, "layers": cfg.num_layers, "dtype": args.dtype, "command": command,
                    "jax": jax.__version__, "git": short_revision()}, "records": records}
    records_io.save(out, text, "invariant_loops", jax.default_backend(), args.out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
