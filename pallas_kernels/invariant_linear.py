"""Linears whose tiles are fixed whatever the rows, for batch invariance (ModelConfig.batch_invariant with
dense_impl="pallas"): a row's output is one fixed sequence of block products whatever the batch, the tile the row
lands in and its tile-mates, with no K split but one the caller fixes from the weight's shape. Both run the MoE
package's Triton down GEMM with one weight over all rows at once (the tiles `TILES`), the row tiles of one weight
slice launched together, so that the slice is read from HBM once while they run (here the weights are the large
operand):

  fp8_invariant_linear   FP8 weights with UE8M0 block scales, bf16 activations (pallas_kernels.fp8_linear's
                         Triton path, grouped weights too)
  bf16_invariant_linear  bf16 weights; float32 inputs as three bf16 terms (common.split_bf16x3) whose products are
                         exact in the float32 accumulator: the float32 linear to float32 rounding (the LM head and
                         the other float32 projections of a bf16 model: the compressors', the indexer's weights)
  invariant_product      bf16_invariant_linear over any leading dims and any float input (the model's callers)

A row-blocked XLA product (pallas_kernels/invariant.py `row_blocks`) gets the same guarantee by giving every GEMM
8 rows, and streams each weight once per 8 rows; these read it about once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .common import interpret_flag, next_pow2, split_bf16x3
from .fp8_linear import fp8_linear
from .moe import triton_gemm
from .moe.configs import TritonConfig

# 32-row tiles of 64 output columns, 128-deep K steps (the MoE tuning table's Triton FP8 tiles at 32 rows per
# expert). Changing them changes a row's numbers (another K order), which stay invariant.
TILES = TritonConfig(block_m=32, block_n=64, block_k=128, block_n_down=64, block_k_down=128, num_warps=4,
                     num_stages=4)


def _fits(v: int, t: int) -> bool:
    """v multiple of the tile t, or a power of two below it of at least 16 (Triton's smallest dot)."""
    return v % t == 0 if v >= t else v >= 16 and v & (v - 1) == 0


def k_fits(k: int) -> bool:
    """Whether a weight's K tiles by TILES's K step (any N does: padded per call where it does not tile)."""
    return _fits(k, TILES.block_k_down)


def _tile_rows(n: int) -> int:
    """n weight rows padded to what TILES takes: a power of two from 16 below the tile, whole tiles above."""
    t = TILES.block_n_down
    return max(16, next_pow2(n)) if n < t else -(-n // t) * t


def fp8_invariant_linear(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype,
                         tiles: TritonConfig = TILES) -> jax.Array:
    """x [G, M, K] @ W_g^T for FP8 weights w [G, N, K] with block scales [G, N/B, K/B], bf16 (or float32)
    activations -> [G, M, N] in out_dtype, on `tiles` (the model's: TILES) whatever M."""
    return fp8_linear(x, w, scale, backend="triton", config=tiles, out_dtype=out_dtype, rows_fastest=True)


def invariant_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w[N, K].T -> [..., N] float32 by `bf16_invariant_linear` over the rows of every leading dim, a
    bf16 x as it is, any other float x as float32 (three exact bf16 terms)."""
    flat = x.reshape(-1, x.shape[-1])
    flat = flat if flat.dtype == jnp.bfloat16 else flat.astype(jnp.float32)
    return bf16_invariant_linear(flat, w).reshape(*x.shape[:-1], w.shape[0])


@functools.partial(jax.jit, static_argnames="k_split")
def bf16_invariant_linear(x: jax.Array, w: jax.Array, k_split: int = 1) -> jax.Array:
    """x [M, K] (bf16, or float32 as three bf16 terms) @ w[N, K].T for bf16 w -> [M, N] float32, on TILES
    whatever M (an N off the tiles padded with zero rows per call: small weights, at the model's real widths none);
    the terms' products added hi + mid, then + lo. k_split: K cut into that many equal chunks, each
    chunk's product on its own tiles (more programs for a narrow weight with a long K: the mHC's) and the chunks
    added in order; a property of the weight, never of M."""
    if w.dtype != jnp.bfloat16 or x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"bf16_invariant_linear: x [M, K] and a bf16 w [N, K], got x {x.shape} {x.dtype}, "
                         f"w {w.shape} {w.dtype}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"bf16_invariant_linear: x must be bf16 or float32, got {x.dtype}")
    (n, k), m = w.shape, x.shape[0]
    if k_split < 1 or k % k_split or not k_fits(k // k_split):
        raise ValueError(f"bf16_invariant_linear: w {w.shape} cut into {k_split} K chunks does not tile by "
                         f"{TILES.block_k_down} in K")
    if not _fits(n, TILES.block_n_down):   # a small or ragged N (tiny models, the mHC's columns): zero rows
        w = jnp.pad(w, ((0, _tile_rows(n) - n), (0, 0)))
    terms = (x,) if x.dtype == jnp.bfloat16 else split_bf16x3(x)
    rows = len(terms) * m
    padded = -(-rows // TILES.block_m) * TILES.block_m
    kc = k // k_split
    z = jnp.pad(jnp.concatenate(terms), ((0, padded - rows), (0, 0)))
    z = z.reshape(padded, k_split, kc).transpose(1, 0, 2).reshape(k_split * padded, kc)   # chunk-major rows
    tile_chunk = jnp.repeat(jnp.arange(k_split, dtype=jnp.int32), padded // TILES.block_m)
    np_ = w.shape[0]
    y = triton_gemm.down((z,), tile_chunk, w.reshape(np_, k_split, kc).transpose(1, 0, 2), None, fmt="dense",
                         cfg=TILES, out_dtype=jnp.float32, interpret=interpret_flag("triton", None),
                         rows_fastest=True)
    parts = y.reshape(k_split, padded, np_)[:, :rows, :n].reshape(k_split * len(terms), m, n)
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out
