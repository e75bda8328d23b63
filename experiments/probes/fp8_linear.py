"""Tool: V4-Flash's (or V4.1-Flash's, `--generation v41`: 32 x 32 scale blocks) FP8 projections at decode / verify /
prefill loads, three ways of multiplying the stored FP8
bytes, all through `pallas_kernels.fp8_linear`: "dequantised" (the model's in-graph path: the weight dequantised to
bf16 in HBM, then XLA's GEMM), the Triton tiles, the Mosaic GPU swap_ab tiles (dequantised in
registers) and "invariant", the Triton tiles that batch invariance fixes whatever the rows
(`pallas_kernels.invariant_linear.TILES`; `--invariant-block-m` times other fixed row tiles beside them). For each projection and row count it prints the CUPTI kernel time of each (all kernels it launches;
median of the calls) beside the floor (the FP8 weights, their scales, the input and output once at 4.4 TB/s, or
the bf16 MMA at 790 TFLOP/s, whichever is longer), and each kernel's error against the float32 reference.

    python -m experiments.probes.fp8_linear                          # GPU: rows 32, 256, 1024
    python -m experiments.probes.fp8_linear --rows 4096 --ways dequantised,triton
    python -m experiments.probes.fp8_linear --rows 32 --ways swap --projections wq_b,wo_b
    python -m experiments.probes.fp8_linear --generation v41 --rows 32,256 --ways dequantised,swap
    python -m experiments.probes.fp8_linear --rows 256,1024 --ways dequantised,swap --swap-tile-tokens 128,256
    python -m experiments.probes.fp8_linear --rows 32,256,4096 --ways dequantised,invariant --invariant-block-m 32,128
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_kernels import cupti_ms
from pallas_kernels import reference as ref
from pallas_kernels.fp8_linear import SWAP_TILE_TOKENS, fp8_linear, fp8_linear_reference, swap_config
from pallas_kernels.invariant_linear import TILES, fp8_invariant_linear

HBM, BF16 = 4.4e12, 790e12
# generation: (scale block, {name: (groups, out, in)}) at the Flash models' widths
GENERATIONS = {
    "v4": (128, {"wq_a": (1, 1024, 4096), "wq_b": (1, 32768, 1024), "wkv": (1, 512, 4096),
                 "wo_a": (8, 1024, 4096), "wo_b": (1, 4096, 8192)}),
    "v41": (32, {"wq_a": (1, 1280, 5120), "wq_b": (1, 32768, 1280), "wkv": (1, 512, 5120),
                 "wo_a": (8, 1024, 4096), "wo_b": (1, 5120, 8192), "shared_w1": (1, 2304, 5120),
                 "shared_w2": (1, 5120, 2304), "engram_wkv": (1, 25600, 6144)}),
}
WAYS = ("dequantised", "triton", "swap", "invariant")   # fp8_linear's backends; "invariant": fp8_invariant_linear


def floor_us(g: int, n: int, k: int, m: int, block: int) -> float:
    bytes_ = g * (n * k + (n // block) * (k // block) + 2 * m * (k + n))
    return max(bytes_ / HBM, 2 * g * m * n * k / BF16) * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="32,256,1024", help="token rows per group (comma list)")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma list of {', '.join(WAYS)}")
    p.add_argument("--generation", default="v4", choices=sorted(GENERATIONS))
    p.add_argument("--projections", default=None, help="comma list of wq_a, wq_b, wkv, wo_a, wo_b (V4.1 also "
                   "shared_w1, shared_w2, engram_wkv; default: all)")
    p.add_argument("--swap-tile-tokens", default=str(SWAP_TILE_TOKENS),
                   help="comma list of the swap tiles' tokens per tile above 128 rows (128, 256): one column each")
    p.add_argument("--invariant-block-m", default=str(TILES.block_m),
                   help="comma list of the invariant tiles' rows (the model's: the first); one column each")
    p.add_argument("--iterations", type=int, default=20)
    args = p.parse_args(argv)
    block, projections = GENERATIONS[args.generation]
    tile_tokens = [int(t) for t in args.swap_tile_tokens.split(",")]
    invariant_rows = [int(r) for r in args.invariant_block_m.split(",")]
    ways = args.ways.split(",")
    names = args.projections.split(",") if args.projections else list(projections)
    if unknown := set(ways) - set(WAYS):
        raise SystemExit(f"--ways: unknown {sorted(unknown)}; choose from {list(WAYS)}")
    if unknown := set(names) - set(projections):
        raise SystemExit(f"--projections: unknown {sorted(unknown)}; choose from {list(projections)}")
    if jax.default_backend() != "gpu":
        raise SystemExit("experiments.probes.fp8_linear times CUDA kernels: it needs a GPU")
    rng = np.random.default_rng(0)
    # (label, way, its config)
    variants = {way: [(way, lambda m: None)] for way in WAYS}
    variants["swap"] = [(f"swap/{t}", lambda m, t=t: swap_config(m, t)) for t in tile_tokens]
    variants["invariant"] = [(f"invariant/{r}", lambda m, r=r: dataclasses.replace(TILES, block_m=r))
                             for r in invariant_rows]
    columns = [(label if len(variants[way]) > 1 else way, way, config)
               for way in ways for label, config in variants[way]]
    print("| projection | rows | " + " | ".join(f"{c[0]} us" for c in columns) + " | floor us | best / floor | "
          "rel. errors |")
    print("|---|---:|" + "---:|" * len(columns) + "---:|---:|---|")
    for name in names:
        g, n, k = projections[name]
        w32 = jnp.asarray(rng.standard_normal((g, n, k)), jnp.float32) * k ** -0.5
        w, s = jax.vmap(lambda a: ref.quantize_fp8_blocks(a, block))(w32)
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((g, m, k)), jnp.bfloat16)
            want = np.asarray(fp8_linear_reference(x, w, s), np.float64)
            times, errors = [], []
            for label, way, config in columns:
                if way == "invariant":
                    f = jax.jit(functools.partial(fp8_invariant_linear, out_dtype=jnp.bfloat16, tiles=config(m)))
                else:
                    f = jax.jit(functools.partial(fp8_linear, backend=way, config=config(m)))
                got = f(x, w, s)
                errors.append(f"{label} {np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want):.1e}")
                t = cupti_ms(f, x, w, s, iterations=args.iterations)
                times.append(float(np.median(t)) * 1e3)
            fl = floor_us(g, n, k, m, block)
            print(f"| {name}{f' ({g} groups)' if g > 1 else ''} | {m} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {fl:.1f} | "
                  f"{min(times) / fl:.2f} | {', '.join(errors)} |", flush=True)


if __name__ == "__main__":
    main()
