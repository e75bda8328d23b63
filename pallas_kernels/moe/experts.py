"""`moe_experts`, the routed-expert SwiGLU block on the grouped-GEMM kernels (docs/model.md §9 experts, §14
FP8/FP4 weights):

    out[t] = sum_j w[t,j] * W2_e (silu(min(W1_e x_t, L)) * clip(W3_e x_t, -L, L)),  e = ids[t, j]

in three steps, the same for every regime and weight format:
1. **Dispatch** (named scope "dispatch"): the routing plan (routing.route_plan) and the routed rows gathered
   into its tile-aligned buffer by one kernel (row_kernels: `take_rows`, or `transpose` for the swap kernels).
2. **Gate/up and down kernels**: z = swiglu(x W1_e^T, x W3_e^T) * routing weight per tile, then y = z W2_e^T,
   on the backend's kernels: Triton (triton_gemm.py, every format) or Mosaic GPU (mgpu_rows.py row tiles,
   mgpu_swap.py swap_ab tiles, on the skeleton of mgpu_pipeline.py).
3. **Combine** (named scope "combine"): each token's k rows of y gathered and summed in float32
   (deterministic; no scatter-add).
`backend="auto"` and `config=None` take the tuning table's choice (tuning.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from .. import reference as ref
from ..common import interpret_flag, swiglu
from . import triton_gemm
from .configs import MgpuConfig, TritonConfig
from .layouts import (FP4_GROUP, as_e8m0_bytes, fp4_scale_bytes, fp4_weight_bytes, logical_shape,
                      weight_format)
from .mgpu_rows import row_gemm
from .mgpu_swap import swap_gemm
from .routing import route_plan
from .row_kernels import act_quant_rows, take_rows
from .tuning import TRITON_FP8_MMA_MAX_ROWS, choose_backend, default_config, invariant_tiling


# jitted so that a program lowers each distinct call once (as fp8_linear: the scanned bodies repeat it)
@functools.partial(jax.jit, static_argnames=("limit", "backend", "config", "interpret", "weight_layout",
                                             "compute_dtype", "act_block", "balanced", "per_slot"))
def moe_experts(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w1: jax.Array, w2: jax.Array,
                w3: jax.Array, limit: float, *, scales=None, backend: str = "auto", config=None,
                interpret=None, weight_layout: str = "out_in", compute_dtype=jnp.bfloat16, act_block: int = 0,
                balanced: bool = False, per_slot: bool = False) -> jax.Array:
    """Routed-expert SwiGLU block (drop-in for `reference.moe_experts`, plus quantised weights).

    x [M, D], expert_ids [M, k] int (ids outside [0, E) are dropped: they cost nothing and add 0 -- an
    expert-parallel shard passes the rows it does not own that way), weights [M, k] float32 (routing weights),
    w1/w3 [E, I, D], w2 [E, D, I] in storage format (dense; FP8 E4M3; FP4 packed [E, out, in/2]),
    scales: None or (s1, s2, s3) UE8M0 scales of w1, w2, w3 (layouts.py; FP4 ones also as
    fp4_kernel_scales, which the swap kernels take without a per-call pass),
    backend: "auto" | "triton" | "mgpu"; config: TritonConfig / MgpuConfig (None -> by regime);
    interpret: None (auto: interpret on CPU) | bool | an InterpretGPUParams for mgpu;
    weight_layout: "out_in" (the model's [E, out, in]) or "in_out" (dense, or FP8 on the mgpu row tiles, scales
    unchanged: w1/w3 [E, D, I], w2 [E, I, D],
    as ragged_dot takes them; the MGPU CPU interpreter has no transposed wgmma operand, so its tests use this).
    Activations enter the GEMMs as `compute_dtype` (bf16; dense weights use their own dtype).
    act_block > 0: both GEMMs' inputs are FP8 act_quant'd per `act_block` values first (the official model's
    numerics, `reference.moe_experts(act_block=)`). With FP8 weights of the same block on the Triton backend at
    decode / verify loads (<= TRITON_FP8_MMA_MAX_ROWS rows per expert), or on the mgpu row tiles
    (MgpuConfig(swap_ab=False), block_k = the block), the kernels then multiply FP8 x FP8 (tensor-core FP8 MMA,
    both scales on the f32 partial products); otherwise the rounded activations enter the usual kernels in
    `compute_dtype` (exact: 4 significant bits).
    balanced: the routing gives every expert the same row count (forced_balance); only the default tiling
    uses it (default_config).
    per_slot (ModelConfig.batch_invariant): each choice's output unsummed, [M, k, D] float32, for the caller to
    add in expert-id order; with backend="auto" and config=None the tiling is `invariant_tiling`'s, one per weight
    format whatever the load, and the FP8 x FP8 MMA choice does not follow the load either, so a row's numbers
    do not depend on how many rows share its expert or its tile.
    Returns [M, D] float32 = sum_k w_k * W2_e(swiglu(W1_e x, W3_e x)).
    """
    # FP4 comes in either layout (fp4_kernel_weights / fp4_kernel_scales): the swap kernels take the held operands,
    # the Triton kernels the checkpoint's bytes (converted in their branch only); the checks read shapes
    s1, s2, s3 = (None, None, None) if scales is None else tuple(scales)
    fmt = weight_format(w1, s1)
    if fmt == "fp8":
        s1, s2, s3 = (as_e8m0_bytes(s) for s in (s1, s2, s3))
    if weight_format(w2, s2) != fmt or weight_format(w3, s3) != fmt:
        raise ValueError("moe_experts: w1, w2, w3 must share one storage format")
    if weight_layout not in ("out_in", "in_out"):
        raise ValueError(f"moe_experts: weight_layout must be 'out_in' or 'in_out', got {weight_layout!r}")
    kn = weight_layout == "in_out"
    if kn and fmt == "fp4":
        raise ValueError("moe_experts: weight_layout='in_out' is for dense and FP8 weights")
    e, i_dim, d = logical_shape(w1, fmt)
    if kn:
        i_dim, d = d, i_dim
    w13_shape, w2_shape = ((e, d, i_dim), (e, i_dim, d)) if kn else ((e, i_dim, d), (e, d, i_dim))
    if logical_shape(w2, fmt) != w2_shape or logical_shape(w3, fmt) != w13_shape:
        raise ValueError(f"moe_experts: w1 {w1.shape}, w2 {w2.shape}, w3 {w3.shape} disagree ({fmt}, {weight_layout})")
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"moe_experts: x {x.shape} does not match expert input dim {d}")
    if expert_ids.shape != weights.shape or expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: expert_ids {expert_ids.shape} / weights {weights.shape} vs x {x.shape}")
    if fmt == "fp4":    # the checkpoint's shapes of either layout, traced only (no conversion runs)
        for name, w_, s_ in (("s1", w1, s1), ("s2", w2, s2), ("s3", w3, s3)):
            ref.check_fp4_scale(jax.eval_shape(fp4_weight_bytes, w_).shape, jax.eval_shape(fp4_scale_bytes, s_).shape,
                                2 * FP4_GROUP, f"moe_experts: FP4 scales {name}")
    m, k = expert_ids.shape
    if act_block < 0 or (act_block and (d % act_block or i_dim % act_block)):
        raise ValueError(f"moe_experts: act_block {act_block} must divide the expert dims D={d} and I={i_dim}")
    cdt = w1.dtype if fmt == "dense" else jnp.dtype(compute_dtype)
    # FP8 activations of the weights' own block: the FP8 x FP8 MMA kernels can take them as they are
    fp8_acts = act_block > 0 and fmt == "fp8" and act_block == ref.fp8_block_size((e, i_dim, d), s1.shape)
    if per_slot and (backend == "auto") != (config is None):
        raise ValueError("moe_experts: per_slot takes both backend and config, or neither (invariant_tiling's)")
    if per_slot and config is None:
        backend, config = invariant_tiling(fmt, cdt, fp8_acts=fp8_acts)
    if backend == "auto":
        backend = choose_backend(fmt, cdt, m * k / e, fp8_acts=fp8_acts)
    if config is None:
        config = default_config(backend, m * k, e, fmt, fp8_acts=fp8_acts, balanced=balanced)
    if kn and fmt == "fp8" and not (backend == "mgpu" and not config.swap_ab):
        raise ValueError("moe_experts: FP8 weights in the 'in_out' layout run on the mgpu row tiles only")
    interp = interpret_flag(backend, interpret)
    # FP8 x FP8 MMA: always on the mgpu row tiles (they take FP8 weights only so), in Triton at decode / verify
    # loads (tuning.TRITON_FP8_MMA_MAX_ROWS), or per slot at every load (there the choice must not follow the load)
    row_tiles = backend == "mgpu" and isinstance(config, MgpuConfig) and not config.swap_ab
    triton_fp8_mma = backend == "triton" and (per_slot or m * k <= TRITON_FP8_MMA_MAX_ROWS * e)
    fp8_mma = fp8_acts and (row_tiles or triton_fp8_mma)
    # a GEMM input in compute_dtype, act_quant-rounded first with act_block (exact in compute_dtype); the SwiGLU
    # output then leaves the gate/up kernel in float32 and is rounded from there, as the reference rounds it
    def rounded(a):
        return (ref.fp8_fake_quant(a, act_block) if act_block else a).astype(cdt)
    z_dtype = jnp.float32 if act_block else cdt

    def gemm_input(a):   # -> (a as the kernels read it, FP8 x FP8: its act_quant scales [rows, K / B])
        return ref.act_quant(a, act_block) if fp8_mma else (rounded(a), None)

    with jax.named_scope("dispatch"):
        plan = route_plan(expert_ids, weights, e, config.block_m)
        post = None
        xq, xq_scale = gemm_input(x)    # act_quant is per row: quantise the M tokens, then gather their rows
        swap = backend == "mgpu" and isinstance(config, MgpuConfig) and config.swap_ab
        # the tile-aligned rows [P, D]; the swap kernels take them transposed, gathered so in one pass
        live_rows = plan.num_tiles * config.block_m    # the live tiles' rows: the kernels skip the rest
        tiles = (plan.tile_expert, plan.tile_rows, plan.num_tiles.reshape(1))   # the Mosaic GPU kernels' plan arrays
        xs = None if swap else take_rows(xq, plan.row_token, live_rows, interpret=bool(interp))
        x_scale = None if xq_scale is None else jnp.take(xq_scale, plan.row_token, axis=0)
    if backend == "triton":
        if not isinstance(config, TritonConfig):
            raise ValueError(f"moe_experts: backend 'triton' needs a TritonConfig, got {type(config).__name__}")
        if fmt == "fp4":
            w1, w2, w3 = (fp4_weight_bytes(a) for a in (w1, w2, w3))
            s1, s2, s3 = (fp4_scale_bytes(a) for a in (s1, s2, s3))
        # FP4 bytes hold (even, odd) column pairs: feed the activations as even and odd halves
        split = (lambda a: (a[:, 0::2], a[:, 1::2])) if fmt == "fp4" else (lambda a: (a,))  # noqa: E731
        z = triton_gemm.gate_up(split(xs), plan.row_weight, plan.tile_expert, w1, w3, s1, s3, fmt=fmt,
                                limit=limit, cfg=config, interpret=interp, out_dtype=z_dtype, kn=kn,
                                x_scale=x_scale)
        z, z_scale = gemm_input(z)
        y = triton_gemm.down(split(z), plan.tile_expert, w2, s2, fmt=fmt, cfg=config, out_dtype=cdt,
                             interpret=interp, kn=kn, z_scale=z_scale)
    elif swap:
        if kn or jnp.dtype(cdt) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            raise ValueError("moe_experts: the mgpu swap_ab kernels take bf16/f16, FP8 or FP4 weights in the "
                             "[E, out, in] layout")
        if fmt != "dense" and jnp.dtype(cdt) != jnp.dtype(jnp.bfloat16):
            raise ValueError(f"moe_experts: the mgpu swap_ab {fmt.upper()} kernels compute in bfloat16, got {cdt}")
        if fmt != "dense" and interp is not None:
            raise ValueError(f"moe_experts: the mgpu swap_ab {fmt.upper()} kernels dequantise into a register "
                             "wgmma operand, which the Mosaic GPU interpreter lacks: they run compiled only (GPU)")
        zt = swap_gemm("gate/up", xq, tiles + (plan.row_weight,), (w1, w3), (s1, s3), fmt=fmt,
                       names=("block_n", "block_k"), cfg=config, epilogue=lambda accs: swiglu(*accs, limit),
                       out_dtype=z_dtype, interpret=interp, rows=(plan.row_token, live_rows))
        zt = rounded(zt.T).T if act_block else zt
        y = swap_gemm("down", zt, tiles, (w2,), (s2,), fmt=fmt, names=("block_n_down", "block_k_down"),
                      cfg=config, epilogue=lambda accs: accs[0], out_dtype=cdt, interpret=interp, out_rows=True)
    elif backend == "mgpu":
        if fmt == "fp4" or jnp.dtype(cdt) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            raise ValueError("moe_experts: the mgpu row-tile kernels take dense bf16/f16 weights, or FP8 ones "
                             "with act_block (FP8 x FP8); FP4 runs on MgpuConfig(swap_ab=True)")
        if not isinstance(config, MgpuConfig):
            raise ValueError(f"moe_experts: backend 'mgpu' needs an MgpuConfig, got {type(config).__name__}")
        if act_block and not config.route_weight_in_kernel:
            raise ValueError("moe_experts: act_block rounds the routing-weighted SwiGLU output; it needs "
                             "MgpuConfig(route_weight_in_kernel=True)")
        if fmt == "fp8" and not fp8_mma:
            raise ValueError(f"moe_experts: the mgpu FP8 row tiles multiply FP8 x FP8: act_block must be the "
                             f"weights' scale block, got {act_block}")
        z = row_gemm("gate/up", xs, tiles + ((plan.row_weight,) if config.route_weight_in_kernel else ()),
                     (w1, w3), bn=config.block_n, bk=config.block_k, cfg=config, kn=kn,
                     epilogue=lambda accs: swiglu(*accs, limit), out_dtype=z_dtype, interpret=interp,
                     x_scale_t=None if x_scale is None else x_scale.T, ss=(s1, s3))
        if fp8_mma:
            zs, z_scale_t = act_quant_rows(z, act_block, live_rows,
                                           rows=math.gcd(config.block_m, 64), interpret=interp is not None)
        else:
            zs, z_scale_t = rounded(z), None
        y = row_gemm("down", zs, tiles, (w2,), bn=config.block_n_down, bk=config.block_k_down, cfg=config,
                     kn=kn, epilogue=lambda accs: accs[0], out_dtype=cdt, interpret=interp, x_scale_t=z_scale_t,
                     ss=(s2,))
        if not config.route_weight_in_kernel:
            post = weights.astype(jnp.float32)
    else:
        raise ValueError(f"moe_experts: unknown backend {backend!r}")
    with jax.named_scope("combine"):
        rows = jnp.take(y, plan.dest.reshape(-1), axis=0, mode="fill", fill_value=0).astype(jnp.float32)
        rows = rows.reshape(m, k, d)
        if post is not None:
            rows = rows * post[:, :, None]
        return rows if per_slot else jnp.sum(rows, axis=1)
