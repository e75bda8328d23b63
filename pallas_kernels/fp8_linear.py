"""FP8 linears: y = x W^T with W held as the release ships it (E4M3 [N, K] and one UE8M0 scale per B x B block,
B = 128 V4 / 32 V4.1).

A dense linear is the MoE block's down GEMM with one expert, and a grouped one (the attention's grouped output
projection: G groups, each its own [N, K] weight over its own inputs) with G experts; so the kernels are the MoE
package's single-weight grouped GEMMs over a plan whose tiles are the groups' rows in order (no routing, no
gather). Backends:
  "swap"         bf16 activations, 128- or 32-blocks: the Mosaic GPU swap_ab tiles; the weights are wgmma's M
                 operand, dequantised in registers (32-blocks by scale rows), the tokens its N (one pass over the
                 weights per tile of up to 128 tokens).
  "triton"       Triton dequantises each FP8 tile in registers by its block scale on the partial product (one pass
                 over the weights per tile of rows); with act_block == B the official FP8 GEMM: activations
                 act_quant'd per B values (reference.act_quant), FP8 x FP8 MMA with both scales on each block's
                 float32 partial up to TRITON_FP8_MMA_MAX_ROWS rows, the act_quant-rounded values on the bf16 path
                 above it (the same products).
  "mgpu"         FP8 x FP8 only: the Mosaic GPU row tiles (per-block promotion into register-carried totals).
  "dequantised"  bf16 activations: the weight dequantised to bf16 in HBM, then XLA's GEMM (which fuses the
                 dequantisation into the GEMM for small weights).
  "auto"         on a GPU with bf16 activations: "swap" for the largest weights at decode / verify loads (see
                 SWAP_MAX_ROWS, SWAP_MIN_WEIGHTS), "dequantised" elsewhere (it beat the Triton tiles at prefill:
                 V4 prefill 2 x 4096 56.80 against 81.77 ms a step); FP8 x FP8 and the CPU interpreter: "triton".
Triton and mgpu tilings are the MoE tuning table's (moe/tuning.py) at rows per group = M; under batch invariance
the model fixes the Triton tiles whatever M (pallas_kernels/invariant_linear.py).

The reference (`fp8_linear_reference`) dequantises the weight and multiplies in float32: the kernels match it to
float32 summation order (act_block == 0), or match it on act_quant-rounded inputs (act_block == B).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import reference as ref
from .common import interpret_flag, next_pow2, on_gpu, on_hopper
from .moe import triton_gemm
from .moe.configs import MgpuConfig, TritonConfig
from .moe.layouts import as_e8m0_bytes
from .moe.mgpu_pipeline import num_sms
from .moe.mgpu_rows import row_gemm
from .moe.mgpu_swap import ROW_SCALE_BLOCK, swap_gemm
from .moe.row_kernels import transpose
from .moe.tuning import TRITON_FP8_MMA_MAX_ROWS, default_config

# "auto" takes the swap_ab tiles (bf16 activations, on Hopper) up to SWAP_MAX_ROWS rows per group for
# weights of at least SWAP_MIN_WEIGHTS elements per call: V4-Flash's wq_b, grouped wo_a and wo_b (33.5M each),
# which XLA dequantises into HBM before its GEMM (at 32 / 256 rows: 13.4 / 45.1, 19.2 / 42.9, 18.8 / 44.5 us against
# XLA's 62 / 71, 66 / 72, 65 / 73). XLA fuses the dequantisation of the smaller ones into its GEMM and wins there
# (wq_a, 4.2M: 11 / 16 us against 24 / 33; wkv 2.1M), as it does at 1024 rows (wq_b: 126 against 157 us).
# `python -m experiments.probes.fp8_linear` on an H200.
SWAP_MAX_ROWS = 256
# V4.1's 32 x 32 blocks: XLA dequantises into HBM down to smaller weights (wq_a, 6.5M: 16.3 against the swap tiles'
# 16.1 us at 32 rows, 20.7 against 23.4 at 256), so its shared expert (11.8M a weight) takes the tiles too
SWAP_MIN_WEIGHTS = {128: 16 * 2 ** 20, ROW_SCALE_BLOCK: 8 * 2 ** 20}
# the swap tiles split K while a weight's tiles would not fill the GPU's SMs (`swap_k_split`), keeping at least
# SPLIT_MIN_STEPS K steps a split: wo_b (32 blocks of 128 rows) 8 ways at 32 rows, 2 at 256 (unsplit 46 / 63 us)
SPLIT_MIN_STEPS = 8
SHARED_SM_ROWS = 32   # swap tiles of up to this many rows run three slots: two CTAs share an SM
SWAP_TILE_TOKENS = 128   # tokens per swap tile above 128 rows (swap_config)
# the scale blocks the swap tiles take: V4's 128 x 128 (one scale a tile), V4.1's 32 x 32 (scale rows)
SWAP_BLOCKS = tuple(SWAP_MIN_WEIGHTS)


def swap_config(m: int, tile_tokens: int = SWAP_TILE_TOKENS) -> MgpuConfig:
    """The swap_ab tiling for m rows per group: one tile of the rows rounded up to a power of two from 16 (one
    warpgroup issuing its own copies, the MoE's FP8 decode tiling) up to 64 rows, with three slots up to
    SHARED_SM_ROWS so that two CTAs share an SM (wq_b at 32 rows: 13.4 against 18.3 us with five); above, tiles of
    128 tokens (or tile_tokens = 256 above 128 rows: one pass over the weights per 256 tokens, K steps of 64 so
    that the slots fit) over two compute warpgroups in persistent CTAs (the MoE's FP8 prefill swap tiling)."""
    if tile_tokens not in (128, 256):
        raise ValueError(f"swap_config: tile_tokens must be 128 or 256, got {tile_tokens}")
    if m <= SHARED_SM_ROWS:
        return MgpuConfig(block_m=max(16, next_pow2(m)), block_n=128, block_k=128, block_n_down=128,
                          block_k_down=128, max_concurrent_steps=3, swap_ab=True, warp_specialized=False)
    if m <= 64:
        return MgpuConfig(block_m=64, block_n=128, block_k=128, block_n_down=128,
                          block_k_down=128, max_concurrent_steps=5, swap_ab=True, warp_specialized=False)
    if m > 128 and tile_tokens == 256:
        return MgpuConfig(block_m=256, block_n=128, block_k=64, block_n_down=128, block_k_down=64,
                          max_concurrent_steps=4, swap_ab=True, compute_wgs=2, persistent=True)
    return MgpuConfig(block_m=128, block_n=128, block_k=128, block_n_down=128, block_k_down=128,
                      max_concurrent_steps=4, swap_ab=True, compute_wgs=2, persistent=True)


def swap_k_split(ctas: int, k: int, bk: int, per_sm: int = 1) -> int:
    """K splits for swap tiles over `ctas` (tiles x row blocks) of a K-column weight, `bk` columns a step, `per_sm`
    CTAs sharing an SM: doubled while the CTAs stay within per_sm CTAs an SM of the GPU and every split keeps whole
    steps, at least SPLIT_MIN_STEPS of them."""
    splits, sms = 1, num_sms(None)
    while (ctas * splits * 2 <= per_sm * sms and k % (2 * splits * bk) == 0
           and k // (2 * splits * bk) >= SPLIT_MIN_STEPS):
        splits *= 2
    return splits


def choose_backend(g: int, m: int, n: int, k: int, block: int, act_block: int, x_dtype, kn: bool = False) -> str:
    """The backend "auto" runs for G groups of m rows x [n, k] weights of `block`-blocks: on a GPU with bf16
    activations "swap" (the largest weights at decode / verify loads, Hopper) or "dequantised"; FP8 x FP8
    (act_block) and the CPU interpreter "triton"."""
    if not act_block and jnp.dtype(x_dtype) == jnp.dtype(jnp.bfloat16) and not kn and on_gpu():
        big = block in SWAP_MIN_WEIGHTS and g * n * k >= SWAP_MIN_WEIGHTS[block]
        return "swap" if big and m <= SWAP_MAX_ROWS and on_hopper() else "dequantised"
    return "triton"


def fp8_linear_reference(x: jax.Array, w: jax.Array, scale: jax.Array, act_block: int = 0) -> jax.Array:
    """x [G, M, K] (float), w float8_e4m3fn [G, N, K], scale UE8M0 [G, N/B, K/B] -> [G, M, N] float32: the weight
    dequantised, the input act_quant-rounded first when act_block > 0."""
    wd = jax.vmap(ref.dequant_fp8_blocks)(w, scale)
    if act_block:
        x = ref.fp8_fake_quant(x, act_block)
    return jnp.einsum("gmk,gnk->gmn", x.astype(jnp.float32), wd, precision=jax.lax.Precision.HIGHEST)


# jitted so that a program lowers each distinct call once: the scanned layer bodies call the same projection with the
# same shapes, and JAX lowers a jitted call once per module where it lowers an inline pallas_call at every call site
@functools.partial(jax.jit, static_argnames=("act_block", "backend", "config", "out_dtype", "interpret",
                                             "weight_layout", "rows_fastest"))
def fp8_linear(x: jax.Array, w: jax.Array, scale: jax.Array, *, act_block: int = 0, backend: str = "auto",
               config: TritonConfig | MgpuConfig | None = None, out_dtype=jnp.bfloat16, interpret=None,
               weight_layout: str = "out_in", rows_fastest: bool = False) -> jax.Array:
    """y [G, M, N] = x [G, M, K] @ W_g^T for FP8 weights w [G, N, K] (weight_layout "in_out": [G, K, N], which the
    Mosaic GPU CPU interpreter needs) with UE8M0 block scales [G, N/B, K/B] (uint8 exponent bytes or
    float8_e8m0fnu). act_block: 0 (bf16 activations) or the weights' block B (act_quant, FP8 x FP8).
    backend: "auto" | "triton" | "mgpu" (FP8 x FP8 only) | "swap" (bf16 activations, 128- or 32-blocks) |
    "dequantised" (bf16 activations only). Output in out_dtype, accumulated in float32. rows_fastest ("triton"):
    the programs of one weight slice launched together (`triton_gemm.down`), for many row tiles."""
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ValueError(f"fp8_linear: x must be bf16, f16 or float32, got {x.dtype}")
    if x.ndim != 3 or w.ndim != 3 or scale.ndim != 3:
        raise ValueError(f"fp8_linear: x [G, M, K], w [G, N, K] and scale [G, N/B, K/B], got {x.shape}, {w.shape}, "
                         f"{scale.shape}")
    if w.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_linear: w must be float8_e4m3fn, got {w.dtype}")
    if weight_layout not in ("out_in", "in_out"):
        raise ValueError(f"fp8_linear: weight_layout must be 'out_in' or 'in_out', got {weight_layout!r}")
    kn = weight_layout == "in_out"
    g, m, k = x.shape
    n = w.shape[2] if kn else w.shape[1]
    if w.shape[0] != g or (w.shape[1] if kn else w.shape[2]) != k:
        raise ValueError(f"fp8_linear: x {x.shape} does not match w {w.shape} ({weight_layout})")
    scale = as_e8m0_bytes(scale)
    block = ref.fp8_block_size((g, n, k), scale.shape)
    if n % block or k % block:
        raise ValueError(f"fp8_linear: [{n}, {k}] is not a whole number of {block} x {block} scale blocks")
    if act_block not in (0, block):
        raise ValueError(f"fp8_linear: act_block must be 0 or the weights' scale block {block}, got {act_block}")
    bf16_acts = not act_block and jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16)
    swap_ok = bf16_acts and block in SWAP_BLOCKS
    if backend == "auto":
        backend = choose_backend(g, m, n, k, block, act_block, x.dtype, kn)
    if backend not in ("triton", "mgpu", "swap", "dequantised"):
        raise ValueError(f"fp8_linear: backend must be 'auto', 'triton', 'mgpu', 'swap' or 'dequantised', got "
                         f"{backend!r}")
    if rows_fastest and backend != "triton":
        raise ValueError(f"fp8_linear: rows_fastest orders the Triton tiles only, got backend {backend!r}")
    if backend == "dequantised":
        if not bf16_acts or kn:
            raise ValueError(f"fp8_linear: the dequantised path takes bf16 activations (got {x.dtype}, act_block "
                             f"{act_block}) and the 'out_in' layout")
        wd = jax.vmap(ref.dequant_fp8_blocks)(w, scale).astype(jnp.bfloat16)
        # the GEMM accumulates in float32 and writes out_dtype itself (no float32 copy of the output)
        return jnp.einsum("gmk,gnk->gmn", x, wd, preferred_element_type=out_dtype)
    if backend == "mgpu" and not act_block:
        raise ValueError("fp8_linear: the mgpu row tiles multiply FP8 x FP8: give act_block (the scale block)")
    if backend == "swap" and not swap_ok:
        raise ValueError(f"fp8_linear: the swap tiles take bf16 activations (got {x.dtype}, act_block {act_block}) "
                         f"and scale blocks of {' or '.join(map(str, SWAP_BLOCKS))} (got {block})")
    if kn and backend != "mgpu":
        raise ValueError("fp8_linear: weight_layout 'in_out' runs on the mgpu row tiles only")
    if config is None:
        config = swap_config(m) if backend == "swap" else default_config(backend, g * m, g, "fp8",
                                                                           fp8_acts=act_block > 0)
    if backend in ("mgpu", "swap") and (not isinstance(config, MgpuConfig) or config.swap_ab != (backend == "swap")):
        raise ValueError(f"fp8_linear: backend {backend!r} takes an MgpuConfig with swap_ab={backend == 'swap'}")
    if backend == "triton" and not isinstance(config, TritonConfig):
        raise ValueError(f"fp8_linear: backend 'triton' needs a TritonConfig, got {type(config).__name__}")
    interp = interpret_flag("triton" if backend == "triton" else "mgpu", interpret)

    bm = config.block_m
    tiles_per_group = -(-m // bm)
    rows = tiles_per_group * bm
    xp = jnp.pad(x, ((0, 0), (0, rows - m), (0, 0))).reshape(g * rows, k) if rows != m else x.reshape(g * m, k)
    splits = 1
    if backend == "swap":
        splits = swap_k_split(g * tiles_per_group * (n // min(config.block_n_down, n)), k,
                              min(config.block_k_down, k), per_sm=2 if m <= SHARED_SM_ROWS else 1)
    if splits > 1:   # split s of group i is group i * splits + s, over the inputs' columns s k / splits ..
        xp = jnp.swapaxes(xp.reshape(g, rows, splits, k // splits), 1, 2).reshape(g * splits * rows, k // splits)
    groups = g * splits
    tile_expert = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), tiles_per_group)
    fp8_mma = act_block > 0 and (backend == "mgpu" or m <= TRITON_FP8_MMA_MAX_ROWS)
    if fp8_mma:
        xq, xs = ref.act_quant(xp, act_block)
    else:
        xq, xs = (ref.fp8_fake_quant(xp, act_block) if act_block else xp), None
    last = m - (tiles_per_group - 1) * bm
    tile_rows = jnp.tile(jnp.array([bm] * (tiles_per_group - 1) + [last], jnp.int32), groups)
    plan = (tile_expert, tile_rows, jnp.full((1,), groups * tiles_per_group, jnp.int32))
    if backend == "swap":
        y = swap_gemm("fp8 linear", transpose(xq, interpret=interp is not None), plan, (w,), (scale,), fmt="fp8",
                      names=("block_n_down", "block_k_down"), cfg=config, epilogue=lambda accs: accs[0],
                      out_dtype=out_dtype if splits == 1 else jnp.float32, interpret=interp, out_rows=True,
                      k_split=splits)
        if splits > 1:   # the splits' float32 products added in split order
            y = y.reshape(g, splits, rows, n).sum(axis=1).astype(out_dtype)
    elif backend == "triton":
        y = triton_gemm.down((xq,), tile_expert, w, scale, fmt="fp8", cfg=config, out_dtype=out_dtype,
                             interpret=interp, z_scale=xs, rows_fastest=rows_fastest)
    else:
        y = row_gemm("fp8 linear", xq, plan, (w,), bn=config.block_n_down, bk=config.block_k_down, cfg=config,
                     kn=kn, epilogue=lambda accs: accs[0], out_dtype=out_dtype, interpret=interp,
                     x_scale_t=xs.T, ss=(scale,))
    return y.reshape(g, rows, n)[:, :m]
