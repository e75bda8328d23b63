"""Benchmark the routed-expert block (gate/up GEMM, clamped SwiGLU, routing weight, down GEMM, dispatch and
combine) at V4-Flash expert shapes (256 experts, 4096 -> 2048 -> 4096, top-6) on one GPU.

  python -m experiments.bench_moe --quick                 # a few minutes: one config per implementation
  python -m experiments.bench_moe                         # small config sweeps (best of each is reported)
  python -m experiments.bench_moe --regime decode --formats bf16,fp4
  python -m experiments.bench_moe --roofline-only         # print the predictions only (runs on a CPU)
  python -m experiments.bench_moe --regime decode --formats fp8 --act-block 128    # FP8 x FP8 MMA (Triton)

Cases: prefill 8192 tokens (49152 routed rows; --prefill-tokens) and decode/verify 64..256 tokens x 6 rows,
with forced-balance routing (DeepInfer's benchmark mode) and random top-6 routing. Weights bf16, FP8 (E4M3 +
UE8M0 128x128 block scales) and FP4 (E2M1 packed + UE8M0 per 32). Implementations:
  xla        reference.moe_experts: jax.lax.ragged_dot (quantised weights: dequantised to bf16 by XLA each call)
  jax_mgpu   jax's in-tree Mosaic GPU ragged_dot_mgpu in the same block (gate|up fused as one [E, D, 2I]
             GEMM, weights pre-transposed to its [G, K, N] layout outside the timing), best of a small sweep
  triton     pallas_kernels.moe, Pallas-Triton kernels (all formats)
  mgpu       pallas_kernels.moe, Mosaic GPU kernels (bf16; FP8 through the swap_ab kernels)
  layer      the model's whole MoE layer (model.moe.MoE: router, routed experts through the Pallas kernels at
             their default tiles, shared expert, combine; bf16 and FP4 experts, its own random weights),
             balanced = the model's forced balance, random = its router's own top-6; the floor is the sum
             of the router's, the routed experts' and the shared expert's GEMM floors (the target: <= 1.25x)
Timing: CUPTI kernel time (jax.experimental.mosaic.gpu.profiler), median of --iters (>= 10; 10 for calls
slower than 50 ms) iterations after warm-up calls (compile timed separately); the wall clock per call
(median of 10) is recorded too.
Inputs are random (never zeros). Each implementation's output is compared with the XLA path's.
Roofline: prefill = 6*R*D*I FLOPs at the measured GEMM ceiling of the format (bf16 816, fp8 1116 TFLOP/s,
BENCHMARKS.md); decode = distinct experts touched x expert bytes at 3.40 TB/s (measured HBM read).
Results: experiments/results/bench_moe_<date>.json (one record per configuration) and .md, also copied to
$OUT when that is set; the JSON is rewritten after every record, so a timeout keeps what was measured.
Device time (estimate, unmeasured): --quick ~3 min; the full sweep ~8-10 min, so on a 10-minute command
limit run `--regime prefill` and `--regime decode` separately. Registered in bench_kernels.py, bench_moe()
also takes its Opts (see normalise_args).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback

import numpy as np

E, D, I, K_TOP = 256, 4096, 2048, 6
LIMIT = 10.0
CEIL = {"hbm_TBps": 3.40, "bf16_TFLOPs": 816.0, "fp8_TFLOPs": 1116.0}   # BENCHMARKS.md, measured on our H200


# ----------------------------------------------------------------------------------------------- args


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--quick", action="store_true", help="one config per implementation, fewer cases")
    p.add_argument("--regime", default="prefill,decode", help="comma list: prefill, decode")
    p.add_argument("--formats", default="bf16,fp8,fp4", help="comma list: bf16, fp8, fp4")
    p.add_argument("--impls", default="xla,jax_mgpu,triton,mgpu,layer", help="comma list of implementations")
    p.add_argument("--decode-tokens", default="64,256", help="comma list of decode batch sizes (x6 rows)")
    p.add_argument("--prefill-tokens", default="8192",
                   help="comma list of prefill token counts (x6 rows; 4096: the one-sequence step, 96 rows per expert)")
    p.add_argument("--routing", default="balanced,random", help="comma list: balanced, random")
    p.add_argument("--iters", type=int, default=20, help="timed iterations (median), >= 10")
    p.add_argument("--mgpu-configs", help="JSON list of MgpuConfig fields replacing the built-in Mosaic GPU tilings, "
                                         "e.g. '[{\"block_m\": 16, \"block_k\": 256, \"swap_ab\": true}]'")
    p.add_argument("--act-block", type=int, default=0,
                   help="FP8 act_quant block of the GEMM inputs (0: off; 128: the V4 model's numerics). With FP8 "
                        "weights of the same block the Triton decode / verify kernels multiply FP8 x FP8")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="results directory (default experiments/results, --smoke: "
                                  "$TMPDIR/bench_moe_smoke); $OUT also gets a copy of a measurement")
    p.add_argument("--roofline-only", action="store_true", help="print the predicted floors and exit")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of this script: tiny shapes (E=16, D=256, I=128, prefill 256 tokens), kernels "
                        "in interpret mode, 1 config each; timings meaningless")
    return p


def _csv(s):
    return [t.strip() for t in str(s).split(",") if t.strip()]


# ------------------------------------------------------------------------------------------ roofline


def expert_bytes(fmt: str) -> int:
    from pallas_kernels.moe import expert_bytes as eb
    return eb(D, I, "dense" if fmt == "bf16" else fmt, fp8_block=128)


def roofline(regime: str, fmt: str, rows: int, touched: int) -> dict:
    """Predicted floor of one expert block: max(compute at the format's GEMM ceiling, weight bytes at HBM)."""
    flops = 6.0 * rows * D * I
    ceiling = CEIL["bf16_TFLOPs"] if fmt == "bf16" else CEIL["fp8_TFLOPs"]
    wbytes = touched * expert_bytes(fmt)
    compute_ms = flops / (ceiling * 1e12) * 1e3
    memory_ms = wbytes / (CEIL["hbm_TBps"] * 1e12) * 1e3
    return {"flops": flops, "weight_bytes": wbytes, "ceiling_TFLOPs": ceiling,
            "roofline_compute_ms": compute_ms, "roofline_memory_ms": memory_ms,
            "roofline_ms": max(compute_ms, memory_ms),
            "roofline_bound": "compute" if compute_ms >= memory_ms else "memory",
            # what our kernels can reach today: they run the MMA in bf16 for every weight format
            "roofline_bf16_mma_ms": max(flops / (CEIL["bf16_TFLOPs"] * 1e12) * 1e3, memory_ms)}


def layer_roofline(regime: str, fmt: str, tokens: int, touched: int) -> dict:
    """The whole MoE layer's floor: the sum of its GEMM floors, each max(FLOPs at the bf16 ceiling, weight bytes
    at HBM) -- the router (D x E, bf16 weight), the routed experts (`roofline`), the shared expert (3 x D x I
    bf16) -- over `tokens` rows."""
    experts = roofline(regime, fmt, tokens * K_TOP, touched)
    floors, flops, wbytes = {"experts": experts["roofline_ms"]}, experts["flops"], experts["weight_bytes"]
    for name, params in (("router", D * E), ("shared", 3 * D * I)):
        f, b = 2.0 * tokens * params, 2.0 * params
        floors[name] = max(f / (CEIL["bf16_TFLOPs"] * 1e12), b / (CEIL["hbm_TBps"] * 1e12)) * 1e3
        flops, wbytes = flops + f, wbytes + b
    return dict(experts, flops=flops, weight_bytes=wbytes, roofline_ms=sum(floors.values()),
                roofline_bf16_mma_ms=experts["roofline_bf16_mma_ms"] + floors["router"] + floors["shared"],
                **{f"floor_{k}_ms": v for k, v in floors.items()})


# ------------------------------------------------------------------------------------------- inputs


def make_routing(kind: str, tokens: int, rng):
    import jax.numpy as jnp

    from pallas_kernels.moe import forced_balance
    w = rng.uniform(0.05, 0.4, (tokens, K_TOP)).astype(np.float32)
    if kind == "balanced":
        ids = np.asarray(forced_balance(tokens, E, K_TOP, offset=int(rng.integers(E))))
    elif kind == "random":          # top-6 of random scores: the realistic spread, some experts idle
        ids = np.argsort(-rng.gumbel(size=(tokens, E)), axis=1)[:, :K_TOP]
    else:
        raise ValueError(f"unknown routing {kind!r}")
    ids = ids.astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(w), int(len(np.unique(ids))), int(np.bincount(ids.ravel(), minlength=E).max())


def make_weights(fmt: str, seed: int):
    """Random expert weights in storage format, generated on the device (never zeros); FP4 scales held as
    the model holds them (pallas_kernels.moe.fp4_kernel_scales)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import moe as PK
    ks = jax.random.split(jax.random.key(seed), 6)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def dense(key, shape, fan_in):
        return (jax.random.normal(key, shape, jnp.float32) * fan_in ** -0.5).astype(jnp.bfloat16)

    if fmt == "bf16":
        return dense(ks[0], (E, I, D), D), dense(ks[1], (E, D, I), I), dense(ks[2], (E, I, D), D), None
    if fmt == "fp8":
        @functools.partial(jax.jit, static_argnums=(1,))
        def q(key, shape):      # E4M3 values up to ~+-4, block scales 2^-9 .. 2^-6 (weights of ~1e-2)
            kv, ks_ = jax.random.split(key)
            v = jax.random.normal(kv, shape, jnp.float32).astype(jnp.float8_e4m3fn)
            s = jax.random.randint(ks_, (shape[0], shape[1] // 128, shape[2] // 128), 118, 122).astype(jnp.uint8)
            return v, s
    else:
        @functools.partial(jax.jit, static_argnums=(1,))
        def q(key, shape):      # random E2M1 codes (all 16), per-32 scales 2^-8 .. 2^-5
            kv, ks_ = jax.random.split(key)
            v = jax.random.randint(kv, (shape[0], shape[1], shape[2] // 2), -128, 128).astype(jnp.int8)
            s = jax.random.randint(ks_, (shape[0], shape[1], shape[2] // 32), 119, 123).astype(jnp.uint8)
            return v, s
    (w1, s1), (w2, s2), (w3, s3) = q(ks[0], (E, I, D)), q(ks[1], (E, D, I)), q(ks[2], (E, I, D))
    if fmt == "fp4":    # as the model holds them (the weight bytes reported stay the checkpoint's: 1 per scale)
        s1, s2, s3 = (PK.fp4_kernel_scales(s) for s in (s1, s2, s3))
    return w1, w2, w3, (s1, s2, s3)


# ----------------------------------------------------------------------------------- implementations


def _xla_fn(fmt, act_block=0):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import moe as PK
    from pallas_kernels import reference as R

    def f(x, ids, w, w1, w2, w3, scales):
        if scales is not None:       # the XLA path with quantised weights: dequantise to bf16 every call
            w1, w2, w3 = (R.dequant_experts(a, PK.fp4_scale_bytes(s)).astype(jnp.bfloat16)
                          for a, s in zip((w1, w2, w3), scales))
        return R.moe_experts(x, ids, w, w1, w2, w3, LIMIT, act_block)
    return jax.jit(f)


def _jax_mgpu_fn(cfg):
    """The same block around jax's in-tree ragged_dot_mgpu: gate|up as one GEMM, then the down GEMM."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rdm

    from pallas_kernels import reference as R

    def f(x, ids, w, w13kn, w2kn):
        m, k = ids.shape
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token_of = order // k
        xs = jnp.take(x, token_of, axis=0)
        gs = jnp.bincount(flat, length=E).astype(jnp.int32)
        h = rdm.ragged_dot(xs, w13kn, group_sizes=gs, **cfg)                        # [R, 2I]
        z = R.clamped_swiglu(h[:, :I], h[:, I:], LIMIT) * jnp.take(w.reshape(-1), order)[:, None]
        y = rdm.ragged_dot(z.astype(x.dtype), w2kn, group_sizes=gs, **cfg)           # [R, D]
        return jnp.zeros((m, D), jnp.float32).at[token_of].add(y.astype(jnp.float32))
    return jax.jit(f)


def _ours_fn(backend, cfg, interpret=False, act_block=0):
    import jax

    from pallas_kernels import moe as PK

    def f(x, ids, w, w1, w2, w3, scales):
        return PK.moe_experts(x, ids, w, w1, w2, w3, LIMIT, scales=scales, backend=backend, config=cfg,
                              interpret=interpret, act_block=act_block)
    return jax.jit(f)


def _layer_fn(fmt: str, seed: int):
    """model.moe.MoE at this script's widths (a score-routed V4-Flash layer, bf16 or FP4 experts, Pallas kernels,
    random weights) -> (f(state, h [1, M, D], tokens [1, M], forced) -> [1, M, D], its state, a router
    function h, tokens -> expert ids). `forced` (static) imposes the model's forced balance, as bench.py's
    deepinfer mode does."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from model import ModelConfig
    from model.moe import LocalExperts, MoE
    from sharding.placement import ForcedBalance

    cfg = ModelConfig.preset("v4-flash").replace(hidden_size=D, moe_intermediate_size=I, n_routed_experts=E,
                                                  expert_weights="fp4" if fmt == "fp4" else "dense",
                                                  moe_impl="pallas")
    spec = cfg.layer_spec(cfg.num_hash_layers)
    layer = MoE(cfg, spec, rngs=nnx.Rngs(seed), dtype=jnp.bfloat16)
    forced_layer = nnx.eval_shape(lambda: MoE(cfg, spec, rngs=nnx.Rngs(seed), dtype=jnp.bfloat16,
                                              experts=ForcedBalance(LocalExperts(cfg.moe_impl))))
    graphs = {False: nnx.graphdef(layer), True: nnx.graphdef(forced_layer)}
    state = nnx.state(layer)

    @functools.partial(jax.jit, static_argnums=3)
    def f(state, h, tokens, forced):
        return nnx.merge(graphs[forced], state)(h, tokens)

    route = jax.jit(lambda state, h, tokens: nnx.merge(graphs[False], state).route(h, tokens)[0])
    return f, state, route


def configs(impl: str, regime: str, fmt: str, quick: bool, mgpu_json: str | None = None,
            rows_per_expert: float = 0.0, act: int = 0, balanced: bool = False):
    """Small sweeps; the first entry is the default tiling where default_config has one for the regime (and
    the only entry with --quick): for the Mosaic GPU kernels default_config itself, given the routing
    (`balanced`: forced balance, which takes 192-row tiles at 8K tokens). FP4 decode tiles hold 16 tokens, 32
    past 16 rows per expert (one pass over the weights). `mgpu_json`: a JSON list of MgpuConfig fields that
    replaces the Mosaic GPU sweep of every case. act: the --act-block (FP8 prefill adds the FP8 x FP8 row
    tiles)."""
    from pallas_kernels.moe import MgpuConfig, TritonConfig, default_config
    if impl == "mgpu" and mgpu_json:
        try:
            return [MgpuConfig(**c) for c in json.loads(mgpu_json)]
        except (TypeError, ValueError) as e:
            raise SystemExit(f"bench_moe: --mgpu-configs must be a JSON list of MgpuConfig fields "
                             f"({', '.join(MgpuConfig.__dataclass_fields__)}): {e}") from None
    if impl == "jax_mgpu":
        c = lambda bm, bn, bk, s, g: dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=s,  # noqa
                                          grid_block_n=g)
        if regime == "prefill":   # PALLAS_H200.md: best (128,128,64,4,8) = 306 TFLOP/s on one GEMM
            out = [c(128, 128, 64, 4, 8), c(64, 256, 64, 4, 4), c(128, 128, 64, 4, 16)]
        else:                     # decode best (64,256,64,4,1)
            out = [c(64, 256, 64, 4, 1), c(64, 128, 64, 6, 2)]
    elif impl == "mgpu":
        swap = functools.partial(MgpuConfig, swap_ab=True)
        persist = functools.partial(swap, persistent=True)        # prefill: a persistent CTA per SM
        plain = functools.partial(swap, warp_specialized=False)   # decode: one warpgroup issues its own copies
        if fmt == "fp4":                # swap_ab only; a step is a whole number of 32-column scale groups
            out = [persist(block_m=128, block_n=128, block_k=64, block_n_down=128, block_k_down=64, compute_wgs=2),
                   persist(block_m=128, block_n=64, block_k=64, block_n_down=64, block_k_down=64),
                   persist(block_m=64, block_n=128, block_k=64, block_n_down=128, block_k_down=64,
                        compute_wgs=2)] if regime == "prefill" else [
                plain(block_m=16, block_n=64, block_k=256, block_n_down=64, block_k_down=256, max_concurrent_steps=4),
                plain(block_m=16, block_n=64, block_k=256, block_n_down=64, block_k_down=256, max_concurrent_steps=3),
                plain(block_m=16, block_n=128, block_k=128, block_n_down=128, block_k_down=128, max_concurrent_steps=4),
                plain(block_m=16, block_n=128, block_k=64, block_n_down=128, block_k_down=64, max_concurrent_steps=6)]
            if regime == "decode" and rows_per_expert > 16:   # the same tiles at 32 tokens, after the default
                out = [dataclasses.replace(out[0], block_m=32, max_concurrent_steps=3),
                       dataclasses.replace(out[0], block_m=32, max_concurrent_steps=2),
                       dataclasses.replace(out[2], block_m=32, max_concurrent_steps=3),
                       dataclasses.replace(out[3], block_m=32, max_concurrent_steps=5)]
        elif regime == "prefill" and fmt == "bf16":   # warp-specialised row tiles first (2 or 3 compute WGs)
            ws = functools.partial(MgpuConfig, block_n=128, block_k=64, block_k_down=64)
            out = [ws(block_m=128, compute_wgs=2, block_n_down=256, max_concurrent_steps=4),
                   ws(block_m=128, compute_wgs=2, block_n_down=128, max_concurrent_steps=4),
                   ws(block_m=192, compute_wgs=3, block_n_down=128, max_concurrent_steps=3, persistent=True),
                   MgpuConfig(), MgpuConfig(max_concurrent_steps=3), MgpuConfig(block_n_down=128),
                   swap(block_m=128, block_n=64, block_k=64, block_n_down=128, block_k_down=64),
                   swap(block_m=64, block_n=128, block_k=64, block_n_down=128, block_k_down=64),
                   swap(block_m=192, block_n=64, block_k=64, block_n_down=64, block_k_down=64)]
        elif regime == "prefill":       # fp8: weights dequantised in registers (swap_ab)
            out = [persist(block_m=128, block_n=128, block_k=128, block_n_down=128, block_k_down=128, compute_wgs=2),
                   persist(block_m=128, block_n=64, block_k=128, block_n_down=128, block_k_down=128),
                   persist(block_m=128, block_n=128, block_k=64, block_n_down=128, block_k_down=64)]
            if act:   # FP8 x FP8 row tiles (act_quant'd activations, the default): a K step is one scale block
                rows = functools.partial(MgpuConfig, block_m=128, compute_wgs=2, block_k=128, block_k_down=128,
                                         persistent=True)
                out = [rows(block_n=64, block_n_down=128, max_concurrent_steps=6),
                       rows(block_n=128, block_n_down=128, max_concurrent_steps=4)] + out
        elif fmt == "bf16":
            out = [plain(block_m=16, block_n=128, block_k=64, block_n_down=256, block_k_down=64,
                        max_concurrent_steps=6),
                   plain(block_m=16, block_n=64, block_k=128, block_n_down=64, block_k_down=128,
                        max_concurrent_steps=5),
                   MgpuConfig(block_n=64, block_n_down=128, max_concurrent_steps=6)]
        else:
            out = [plain(block_m=16, block_n=128, block_k=128, block_n_down=128, block_k_down=128,
                        max_concurrent_steps=5),
                   plain(block_m=16, block_n=64, block_k=128, block_n_down=128, block_k_down=128,
                        max_concurrent_steps=8)]
    elif impl == "triton":
        if regime == "prefill":
            out = [TritonConfig(128, 128, 64, 128, 64, num_warps=8, num_stages=3),
                   TritonConfig(64, 128, 64, 128, 64, num_warps=4, num_stages=3),
                   TritonConfig(64, 64, 128, 128, 128, num_warps=4, num_stages=3),
                   TritonConfig(128, 128, 64, 128, 64, num_warps=8, num_stages=4),
                   TritonConfig(128, 256, 64, 256, 64, num_warps=8, num_stages=3)]
        else:
            out = [TritonConfig(16, 64, 128, 64, 128, num_warps=4, num_stages=4),
                   TritonConfig(16, 128, 128, 128, 128, num_warps=4, num_stages=3),
                   TritonConfig(16, 64, 256, 64, 256, num_warps=4, num_stages=3),
                   TritonConfig(16, 32, 256, 32, 256, num_warps=2, num_stages=4)]
            if fmt == "fp8":          # FP8 tiles must sit inside one 128x128 scale block
                out = [c for c in out if c.block_k <= 128 and c.block_k_down <= 128] or out[:1]
    else:
        out = [None]
    if impl == "mgpu":   # what moe_experts picks for this load comes first
        default = default_config("mgpu", round(rows_per_expert * E), E, "dense" if fmt == "bf16" else fmt,
                                 fp8_acts=bool(act) and fmt == "fp8", balanced=balanced)
        out = [default] + [c for c in out if c != default]
    return out[:1] if quick else out


# ------------------------------------------------------------------------------------------- timing


def time_fn(f, args, iters: int):
    """(compile_s, cupti_ms_median, wall_ms_median, per-kernel cupti medians, iterations, output).

    The first call compiles (timed separately). Calls slower than 50 ms (the XLA prefill path) are timed over
    10 iterations instead of `iters`; the wall clock (dispatch included) is the median of 10 calls."""
    import jax
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    if time.perf_counter() - t0 > 0.05:
        iters = 10
    cupti, kernels = None, None
    try:
        from jax.experimental.mosaic.gpu import profiler
        _, per_iter = profiler.measure(f, aggregate=False, iterations=iters)(*args)
        if per_iter:
            cupti = statistics.median(sum(t for _, t in it) for it in per_iter)
            names = [n for n, _ in per_iter[0]]
            kernels = [(n[:60], round(statistics.median(it[j][1] for it in per_iter), 4))
                       for j, n in enumerate(names)]
    except Exception as e:  # noqa: BLE001  (no CUPTI: fall back to the wall clock)
        kernels = [("cupti_error", str(e)[:120])]
    walls = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        walls.append((time.perf_counter() - t0) * 1e3)
    return compile_s, cupti, statistics.median(walls), kernels, iters, out


# ---------------------------------------------------------------------------------------------- main


def _env():
    import jax

    from experiments.bench_report import short_revision

    d = jax.devices()[0]
    return {"git": short_revision(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(d, "device_kind", str(d)), "cc": str(getattr(d, "compute_capability", "")),
            "python": platform.python_version(), "command": " ".join(sys.argv)}


def cases(args):
    out = []
    regimes, routings = _csv(args.regime), _csv(args.routing)
    if args.quick:
        routings = routings[:1]
    if "prefill" in regimes:
        out += [("prefill", int(t), r) for t in _csv(args.prefill_tokens) for r in routings]
    if "decode" in regimes:
        toks = [int(t) for t in _csv(args.decode_tokens)]
        out += [("decode", t, r) for t in toks for r in routings]
    return out


def normalise_args(args) -> argparse.Namespace:
    """This script's namespace, or experiments/bench_kernels.py's Opts (quick, sweep, repeats, interpret,
    roofline_only) for when the benchmark is registered there: missing fields take this CLI's defaults."""
    if hasattr(args, "regime"):
        return args
    ns = add_args(argparse.ArgumentParser()).parse_args([])
    ns.quick = bool(getattr(args, "quick", False))
    ns.one_config = not getattr(args, "sweep", True)   # bench_kernels sweeps tiles only with --sweep
    ns.iters = max(10, int(getattr(args, "repeats", 0) or 20))
    ns.smoke = bool(getattr(args, "interpret", False))
    ns.roofline_only = bool(getattr(args, "roofline_only", False))
    ns.out = None                       # the caller writes the results
    return ns


def bench_moe(args) -> list[dict]:
    """Run the MoE expert-block benchmark; returns one record per (case, format, implementation, config).

    `args`: this script's argparse namespace (see add_args) or bench_kernels' Opts (see normalise_args).
    Records carry this script's fields plus bench_kernels' (family, case, variant, roofline, timing, ...)."""
    args = normalise_args(args)
    if args.iters < 10:
        raise ValueError("--iters must be >= 10 (medians of at least 10)")
    import jax
    import jax.numpy as jnp

    from experiments.bench_kernels import rel_err
    from pallas_kernels import moe as PK

    global E, D, I
    smoke = getattr(args, "smoke", False)
    if smoke:       # exercise every code path of this script on a CPU (interpret mode), not a measurement
        E, D, I = 16, 256, 128
        args.prefill_tokens = "256"
        args.quick, args.iters = True, 10
        args.decode_tokens = "8"
        if args.impls == "xla,jax_mgpu,triton,mgpu,layer":
            args.impls = "xla,triton,layer"

    records: list[dict] = []
    env = _env()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    # args.out None: the caller (bench_kernels) writes the records
    out_dirs = ([args.out] if args.out else []) + ([os.environ["OUT"]] if os.environ.get("OUT") and args.out
                                                   and not smoke else [])
    formats, impls = _csv(args.formats), _csv(args.impls)
    rng = np.random.default_rng(args.seed)
    case_list = cases(args)

    # routing first (host), so that the predictions can be printed before anything heavy runs
    routed = {}
    print(f"{'case':28s} {'fmt':5s} {'experts':>7s} {'GFLOP':>8s} {'GB':>6s} {'floor ms':>9s} bound", flush=True)
    for regime, tokens, kind in case_list:
        ids, w, touched, max_rows = make_routing(kind, tokens, rng)
        routed[(regime, tokens, kind)] = (ids, w, touched, max_rows)
        for fmt in formats:
            rf = roofline(regime, fmt, tokens * K_TOP, touched)
            print(f"{regime} {tokens:5d} tok {kind:9s} {fmt:5s} {touched:7d} {rf['flops'] / 1e9:8.0f} "
                  f"{rf['weight_bytes'] / 1e9:6.2f} {rf['roofline_ms']:9.3f} {rf['roofline_bound']}"
                  f" (bf16-MMA floor {rf['roofline_bf16_mma_ms']:.3f})", flush=True)
    if args.roofline_only:
        return records

    def save():
        for d in out_dirs:
            try:
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, f"bench_moe_{stamp}.json"), "w") as fh:
                    json.dump({"env": env, "ceilings": CEIL, "records": records}, fh, indent=1, default=str)
                with open(os.path.join(d, f"bench_moe_{stamp}.md"), "w") as fh:
                    fh.write(markdown(records, env))
            except OSError as e:
                print(f"could not write results to {d}: {e}", flush=True)

    x_cache = {}
    block_impls = any(impl != "layer" for impl in impls)   # "layer" alone uses the model's own weights
    for fmt in formats:
        try:
            w1, w2, w3, scales = make_weights(fmt, args.seed + 1) if block_impls else (None,) * 4
            # FP4: the Mosaic GPU kernels take the weights as the model holds them, the rest the checkpoint's bytes
            held_w = tuple(PK.fp4_kernel_weights(b) for b in (w1, w2, w3)) if fmt == "fp4" and block_impls \
                else (w1, w2, w3)
            jax.block_until_ready((w1, w2, w3, held_w))
        except Exception as e:  # noqa: BLE001
            records.append({"fmt": fmt, "error": f"weights: {type(e).__name__}: {str(e)[:300]}"})
            save()
            continue
        kn = layer = None
        for regime, tokens, kind in case_list:
            ids, w, touched, max_rows = routed[(regime, tokens, kind)]
            if tokens not in x_cache:
                x_cache[tokens] = jax.random.normal(jax.random.key(args.seed + tokens), (tokens, D), jnp.bfloat16)
            x = x_cache[tokens]
            rf = roofline(regime, fmt, tokens * K_TOP, touched)
            base = {"regime": regime, "tokens": tokens, "rows": tokens * K_TOP, "routing": kind, "fmt": fmt,
                    "experts_touched": touched, "max_rows_per_expert": max_rows, "E": E, "D": D, "I": I,
                    "iters": args.iters, **{k: v for k, v in rf.items()}}
            ref_out, xla_ms = None, None
            for impl in impls:
                if (impl == "jax_mgpu" and fmt != "bf16") or (impl == "layer" and fmt == "fp8"):
                    continue
                act = 0 if impl in ("layer", "jax_mgpu") else getattr(args, "act_block", 0)
                for cfg in configs(impl, regime, fmt, args.quick or getattr(args, "one_config", False),
                                   getattr(args, "mgpu_configs", None), tokens * K_TOP / E, act,
                                   balanced=kind == "balanced"):
                    rec = dict(base, impl=impl, act_block=act, config=(cfg if isinstance(cfg, dict) or cfg is None
                                                                       else cfg.__dict__))
                    try:
                        rf_impl = rf
                        if impl == "layer":
                            if layer is None:   # the model's layer with its own weights; built once per format
                                layer = _layer_fn(fmt, args.seed + 2)
                            lf, state, route = layer
                            h, toks = x[None], jnp.arange(tokens, dtype=jnp.int32)[None] % 1000
                            n_touched = touched if kind == "balanced" else \
                                int(len(np.unique(np.asarray(route(state, h, toks)))))
                            rf_impl = layer_roofline(regime, fmt, tokens, n_touched)
                            rec.update(rf_impl, experts_touched=n_touched,
                                       routing=kind if kind == "balanced" else "router")
                            f, a = functools.partial(lf, forced=kind == "balanced"), (state, h, toks)
                        elif impl == "xla":
                            f, a = _xla_fn(fmt, act), (x, ids, w, w1, w2, w3, scales)
                        elif impl == "jax_mgpu":
                            if kn is None:     # its [G, K, N] layout, gate|up fused; built once, untimed
                                kn = jax.jit(lambda a, b, c: (jnp.concatenate([jnp.swapaxes(a, 1, 2),
                                                                               jnp.swapaxes(c, 1, 2)], axis=2),
                                                              jnp.swapaxes(b, 1, 2)))(w1, w2, w3)
                            f, a = _jax_mgpu_fn(cfg), (x, ids, w, kn[0], kn[1])
                        else:
                            f, a = _ours_fn(impl, cfg, interpret=True if smoke else False, act_block=act), \
                                (x, ids, w, *(held_w if impl == "mgpu" else (w1, w2, w3)), scales)
                        compile_s, cupti, wall, kernels, n_it, out = time_fn(f, a, args.iters)
                        ms = cupti if cupti is not None else wall
                        rec.update(compile_s=round(compile_s, 2), cupti_ms=cupti, wall_ms=round(wall, 4), ms=ms,
                                   iters=n_it,
                                   timer="cupti" if cupti is not None else "wall", kernels=kernels,
                                   TFLOPs=rf_impl["flops"] / (ms * 1e-3) / 1e12,
                                   weight_TBps=rf_impl["weight_bytes"] / (ms * 1e-3) / 1e12,
                                   frac_of_roofline=rf_impl["roofline_ms"] / ms)
                        out = np.asarray(out.astype(jnp.float32))
                        if impl == "layer":      # its own weights: not comparable with the XLA block
                            rec["finite_output"] = bool(np.all(np.isfinite(out)))
                        elif impl == "xla":
                            ref_out, xla_ms = out, ms
                        elif ref_out is not None:
                            rec["rel_err_vs_xla"] = rel_err(out, ref_out)
                            rec["speedup_vs_xla_reference"] = round(xla_ms / ms, 2)
                        del out
                    except Exception as e:  # noqa: BLE001
                        lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
                        rec["error"] = " | ".join(lines[:4])[:600]
                        rec["traceback_tail"] = traceback.format_exc()[-800:]
                        if smoke:   # the Mosaic GPU CPU interpreter must be reset after an exception
                            from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
                            gpu_callbacks.reset_gpu_interpret_mode_state()
                    records.append(compat(rec))
                    print(summary_line(rec), flush=True)
                    save()
        del w1, w2, w3, scales, kn, layer
    print(markdown(records, env), flush=True)
    return records


def compat(r: dict) -> dict:
    """Add experiments/bench_kernels.py's record fields (family, case, variant, roofline, timing, GBps, ...)."""
    floor_us = r["roofline_ms"] * 1e3
    r.update(family="moe", case=f"{r['regime']} {r['tokens']}tok {r['routing']} {r['fmt']}",
             variant=f"{r['impl']} {json.dumps(r['config'])}" if r.get("config") else r["impl"],
             shape={"E": r["E"], "D": r["D"], "I": r["I"], "rows": r["rows"], "k": K_TOP},
             roofline={"bytes": int(r["weight_bytes"]), "flops": int(r["flops"]),
                       "intensity_flop_per_byte": round(r["flops"] / max(r["weight_bytes"], 1), 1),
                       "floor_us": round(floor_us, 2), "bound": r["roofline_bound"]},
             note=f"{r['experts_touched']} experts touched; bytes = their weights ({r['fmt']})")
    if "ms" in r:
        us = r["ms"] * 1e3
        r["timing"] = {"compile_and_first_s": r["compile_s"], "repeats": r["iters"], "warmup": 2,
                       "wall_us": round(r["wall_ms"] * 1e3, 2), "timer": r["timer"]}
        if r["cupti_ms"] is not None:
            r["timing"]["cupti_us"] = round(r["cupti_ms"] * 1e3, 2)
        r.update(GBps=round(r["weight_bytes"] / (us * 1e-6) / 1e9, 1), TFLOPps=round(r["TFLOPs"], 1),
                 frac_hbm_read=round(r["weight_bytes"] / (us * 1e-6) / (CEIL["hbm_TBps"] * 1e12), 3),
                 frac_bf16_peak=round(r["TFLOPs"] / CEIL["bf16_TFLOPs"], 3),
                 frac_of_floor=round(floor_us / us, 3))
        if "rel_err_vs_xla" in r:
            r["rel_err"] = r["rel_err_vs_xla"]
    return r


def summary_line(r: dict) -> str:
    head = f"{r['regime']:7s} {r['tokens']:5d} {r['routing']:8s} {r['fmt']:4s} {r['impl']:8s}"
    if "error" in r:
        return f"{head} ERROR {r['error'][:200]}"
    err = r.get("rel_err_vs_xla")
    return (f"{head} {r['ms']:8.3f} ms ({r['timer']}) {r['TFLOPs']:7.1f} TFLOP/s {r['weight_TBps']:5.2f} TB/s "
            f"{100 * r['frac_of_roofline']:5.1f}% of floor {r['roofline_ms']:.3f} ms"
            + (f" err {err:.1e}" if err is not None else "") + f" compile {r['compile_s']}s cfg {r['config']}")


def markdown(records, env) -> str:
    lines = [f"# MoE expert block, V4-Flash shapes (E={E}, {D} -> {I} -> {D}, top-{K_TOP})", "",
             f"git {env['git']} · jax {env['jax']} · {env['device']} · `{env['command']}`", "",
             "Best configuration per (case, format, implementation); CUPTI kernel-time medians.", "",
             "| regime | tokens | routing | fmt | impl | ms | TFLOP/s | weight TB/s | floor ms | % of floor "
             "| err vs XLA | config |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    best = {}
    for r in records:
        if "ms" not in r:
            continue
        key = (r["regime"], r["tokens"], r["routing"], r["fmt"], r["impl"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    for r in best.values():
        err = r.get("rel_err_vs_xla")
        fmt = r["fmt"] + (f" act{r['act_block']}" if r.get("act_block") else "")
        lines.append(f"| {r['regime']} | {r['tokens']} | {r['routing']} | {fmt} | {r['impl']} | {r['ms']:.3f} "
                     f"| {r['TFLOPs']:.1f} | {r['weight_TBps']:.2f} | {r['roofline_ms']:.3f} "
                     f"| {100 * r['frac_of_roofline']:.1f} | {'' if err is None else f'{err:.1e}'} "
                     f"| {json.dumps(r['config'])} |")
    errs = [r for r in records if "error" in r]
    if errs:
        lines += ["", "Errors:", ""] + [f"- {r.get('regime')} {r.get('tokens')} {r.get('fmt')} {r.get('impl')} "
                                        f"{json.dumps(r.get('config'))}: {r['error'][:300]}" for r in errs]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = add_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    args = p.parse_args(argv)
    if not args.out:
        import tempfile

        here = os.path.dirname(os.path.abspath(__file__))
        args.out = os.path.join(tempfile.gettempdir() if args.smoke else here,
                                "bench_moe_smoke" if args.smoke else "results")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bench_moe(args)


if __name__ == "__main__":
    main()
