"""Routed-expert SwiGLU block as grouped GEMMs in Pallas (MODEL_SPEC 2.8 experts, 3.7 FP8/FP4 weights).

    out[t] = sum_j w[t,j] * W2_e (silu(min(W1_e x_t, L)) * clip(W3_e x_t, -L, L)),  e = ids[t, j]

is computed in three steps, the same for every regime and weight format:

1. **Plan (XLA).** The M*k routed rows are sorted by expert and laid out in a *tile-aligned* buffer:
   expert e owns ceil(rows_e / block_m) consecutive tiles of block_m rows, so every tile belongs to one
   expert (`tile_expert[t]`, -1 past the last tile). Experts with no rows own no tiles and cost nothing:
   their weights are never read. Padding rows carry routing weight 0 (so z = 0 there). The buffer has a
   static worst-case size cdiv(M*k, block_m) + min(E, M*k) tiles; tiles past `num_tiles` exit at once.
2. **Gate/up kernel.** One program per (tile, block of I): both projections of the tile's rows against the
   same slice of W1_e and W3_e, then the clamped SwiGLU and the routing weight in the epilogue (the weight
   is applied *before* the down projection, as the model does), written as bf16 z [P, I].
3. **Down kernel.** One program per (tile, block of D): z_tile @ W2_e^T -> y [P, D]; the combine gathers
   each token's k rows of y and sums them in float32 (deterministic; no scatter-add).

Weights stay in their storage format in HBM and are dequantised in registers inside the kernels:
  dense  bf16/f16/f32  w [E, out, in]
  FP8    float8_e4m3fn w [E, out, in] + UE8M0 block scales [E, out/B, in/B] (B = 128 V4, 32 V4.1)
  FP4    E2M1 packed   w int8 [E, out, in/2] (low nibble = even column) + UE8M0 [E, out, in/32]
(scales as float8_e8m0fnu or their uint8 exponent bytes; see model/quant_io.py). FP4 weights and scales may also
come in the layout the Mosaic GPU swap kernels stream, which is how the model holds routed experts'
(`fp4_kernel_weights`: uint16 [E, out, in/4], each 32-bit word's bits permuted for the register decode;
`fp4_kernel_scales`: bf16 [E, in/32, out], 2^(b-1)); `fp4_weight_bytes` / `fp4_scale_bytes` give the
checkpoint's bytes back (the Triton and XLA paths read those).

Backends (Pallas lowerings):
  "triton" - every format, block_m >= 16 (tl.dot): decode / verify (weight-bandwidth-bound: a tile holds
             all of an expert's rows, so each touched expert's weights are streamed once) and prefill.
  "mgpu"   - Mosaic GPU (TMA + wgmma; Warpgroup lowering semantics, one code path for jax 0.10.2 and 0.11.x).
             One skeleton (_ws_kernel): a TMA warpgroup feeds MgpuConfig.compute_wgs compute warpgroups
             (emit_pipeline_warp_specialized), or with warp_specialized=False one warpgroup issues its own
             copies (emit_pipeline; the decode defaults). Two orientations (MgpuConfig.swap_ab):
               row tiles  - tokens are wgmma's M (64 rows per compute warpgroup), dense bf16/f16: prefill;
               swap_ab    - weights are wgmma's M and a tile's 16..256 tokens its N: decode tiles cost one
                            pass over the weights; FP8 and FP4 weights are dequantised in registers
                            (A operand).
  "auto"   - what measured fastest on the H200 (`choose_backend`): mgpu for FP4 (bf16 compute) and for bf16 /
             FP8 prefill (two compute warpgroups), triton for bf16 / FP8 decode and verify.
On a CPU both run in their interpreters (tests); `interpret=None` chooses that automatically. The MGPU
interpreter has no transposed-SMEM or register wgmma operand: row-tile kernels are interpreted with weights
given as [E, in, out] (`weight_layout="in_out"`), swap_ab kernels with bf16 weights; the rest is checked by
lowering for CUDA at V4-Flash shapes, and on the GPU.

Public: `moe_experts` (drop-in for reference.moe_experts, plus scales / backend / config),
`forced_balance` (DeepInfer's benchmark routing), `route_plan`, `quantize_experts_fp8/fp4` (numpy, for
tests and tools), `fp4_kernel_weights` / `fp4_weight_bytes`, `fp4_kernel_scales` / `fp4_scale_bytes`,
`expert_bytes`, `TritonConfig`, `MgpuConfig`,
`default_config`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from . import formats
from . import reference as ref
from .common import FP4_FOLD, e2m1_pair, e8m0, fp4_tile, interpret_flag, on_hopper

# ----------------------------------------------------------------------------------------------- routing


def forced_balance(num_tokens: int, num_experts: int, k: int, *, offset: int = 0) -> jax.Array:
    """DeepInfer's benchmark routing: every expert gets the same load (to within one row).

    Routed row r = t*k + j goes to expert (r + offset) mod E, so each token's k experts are distinct
    (k <= E) and consecutive tokens walk round the experts. Returns expert ids [num_tokens, k] int32.
    `offset` rotates the assignment (e.g. by step or by rank) without changing the balance.
    """
    if k > num_experts:
        raise ValueError(f"forced_balance: k={k} > num_experts={num_experts}")
    r = jnp.arange(num_tokens * k, dtype=jnp.int32) + jnp.int32(offset % num_experts)
    return (r % num_experts).reshape(num_tokens, k)


class RoutePlan(NamedTuple):
    """Tile-aligned layout of the routed rows (all int32 except row_weight).

    tile_expert [T]   expert of tile t, -1 for t >= num_tiles
    tile_rows   [T]   routed (non-padding) rows in tile t (its first ones), 0 for t >= num_tiles
    row_token   [P]   token feeding padded row p (0 for padding rows), P = T * block_m
    row_weight  [P]   routing weight of row p (0 for padding)
    dest        [M,k] padded row holding token t's j-th routed row
    num_tiles   []    tiles in use
    group_sizes [E]   rows per expert
    """
    tile_expert: jax.Array
    tile_rows: jax.Array
    row_token: jax.Array
    row_weight: jax.Array
    dest: jax.Array
    num_tiles: jax.Array
    group_sizes: jax.Array


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Static bound on sum_e ceil(rows_e / block_m): cdiv(R, bm) + (number of non-empty experts)."""
    return -(-num_rows // block_m) + min(num_experts, num_rows)


def route_plan(expert_ids: jax.Array, weights: jax.Array, num_experts: int, block_m: int) -> RoutePlan:
    """expert_ids [M, k] int, weights [M, k] -> RoutePlan (see the module docstring). Ids outside
    [0, num_experts) are dropped: no tile, and `dest` = P (past the buffer) so they combine to 0."""
    m, k = expert_ids.shape
    r = m * k
    t_max = max_tiles(r, num_experts, block_m)
    p = t_max * block_m
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # dropped rows sort last
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)       # sorted position -> flat row
    sorted_e = flat[order]
    kept = sorted_e < num_experts
    gs = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # the sentinel is not counted
    tiles = (gs + block_m - 1) // block_m
    tiles_end = jnp.cumsum(tiles).astype(jnp.int32)
    tile_first = tiles_end - tiles
    group_first = (jnp.cumsum(gs) - gs).astype(jnp.int32)
    e_kept = jnp.minimum(sorted_e, num_experts - 1)
    rank = jnp.arange(r, dtype=jnp.int32) - group_first[e_kept]
    dest_sorted = jnp.where(kept, tile_first[e_kept] * block_m + rank, p)
    row_token = jnp.zeros((p,), jnp.int32).at[dest_sorted].set(order // k, mode="drop")
    row_weight = jnp.zeros((p,), jnp.float32).at[dest_sorted].set(
        weights.reshape(-1).astype(jnp.float32)[order], mode="drop")
    dest = jnp.zeros((r,), jnp.int32).at[order].set(dest_sorted).reshape(m, k)
    num_tiles = tiles_end[-1]
    t = jnp.arange(t_max, dtype=jnp.int32)
    # one fused compare-and-count (T x E): the default binary search is a chain of ~2 log2(E) tiny kernels
    # on the GPU, ~20 us of a decode layer's ~100 us of glue
    tile_expert = jnp.searchsorted(tiles_end, t, side="right", method="compare_all").astype(jnp.int32)
    live = t < num_tiles
    e_t = jnp.minimum(tile_expert, num_experts - 1)
    tile_rows = jnp.where(live, jnp.clip(gs[e_t] - (t - tile_first[e_t]) * block_m, 0, block_m), 0)
    return RoutePlan(jnp.where(live, tile_expert, -1), tile_rows.astype(jnp.int32), row_token, row_weight, dest,
                     num_tiles, gs)


# ----------------------------------------------------------------------------------------------- formats


def _as_e8m0_bytes(s: jax.Array) -> jax.Array:
    if s.dtype == jnp.float8_e8m0fnu:
        return lax.bitcast_convert_type(s, jnp.uint8)
    if s.dtype != jnp.uint8:
        raise ValueError(f"expert scales must be UE8M0 (float8_e8m0fnu or uint8 exponent bytes), got {s.dtype}")
    return s


def weight_format(w: jax.Array, scale) -> str:
    """'dense' | 'fp8' | 'fp4' from the storage dtype (and whether a scale is given)."""
    if scale is None:
        if w.dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
            return "dense"
        raise ValueError(f"expert weight of dtype {w.dtype} needs its scale")
    if w.dtype == jnp.float8_e4m3fn:
        return "fp8"
    if w.dtype in (jnp.int8, jnp.uint8, jnp.uint16):    # uint16: fp4_kernel_weights
        return "fp4"
    raise ValueError(f"scaled expert weights must be float8_e4m3fn or packed FP4 (int8, or uint16 as "
                     f"fp4_kernel_weights holds it), got {w.dtype}")


def logical_shape(w: jax.Array, fmt: str) -> tuple[int, int, int]:
    """[E, out, in] of expert weights in storage format `fmt` (FP4 in either layout)."""
    return fp4_logical_shape(w) if fmt == "fp4" else w.shape


def expert_bytes(d: int, i: int, fmt: str, fp8_block: int = 128, dense_itemsize: int = 2) -> int:
    """HBM bytes of one expert's three matrices (w1, w3 [I, D], w2 [D, I]) including scales."""
    n = 3 * d * i
    if fmt == "dense":
        return n * dense_itemsize
    if fmt == "fp8":
        return n + 3 * math.ceil(i / fp8_block) * math.ceil(d / fp8_block)
    if fmt == "fp4":
        return n // 2 + n // 32
    raise ValueError(fmt)


def quantize_experts_fp8(w: np.ndarray, block: int = 128):
    """float [E, out, in] -> (float8_e4m3fn [E, out, in], uint8 UE8M0 [E, out/B, in/B]) (formats, numpy)."""
    qs = [formats.quantize_fp8_blocks(np.asarray(we, np.float32), block) for we in np.asarray(w)]
    return (jnp.asarray(np.stack([q for q, _ in qs])),
            jnp.asarray(np.stack([s for _, s in qs]).view(np.uint8)))


def quantize_experts_fp4(w: np.ndarray):
    """float [E, out, in] -> (int8 packed [E, out, in/2], uint8 UE8M0 [E, out, in/32]) (formats, numpy)."""
    qs = [formats.quantize_fp4(np.asarray(we, np.float32)) for we in np.asarray(w)]
    return (jnp.asarray(np.stack([q for q, _ in qs])),
            jnp.asarray(np.stack([s for _, s in qs]).view(np.uint8)))


# ----------------------------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Tiles of the Triton kernels. All powers of two; block_m >= 16 (tl.dot)."""
    block_m: int = 16
    block_n: int = 64        # gate/up: columns of I per program
    block_k: int = 128       # gate/up: slice of D per step
    block_n_down: int = 64   # down: columns of D per program
    block_k_down: int = 128  # down: slice of I per step
    num_warps: int = 4
    num_stages: int = 4


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiles of the Mosaic GPU kernels. Row tiles: compute_wgs compute warpgroups per CTA (plus one TMA
    warpgroup), each owning block_m / compute_wgs rows (wgmma M, a multiple of 64); swap_ab: each owning
    block_n / compute_wgs weight rows."""
    block_m: int = 64          # rows per tile (route_plan's block_m)
    block_n: int = 128         # gate/up: gate and up each [block_m, block_n] f32 accumulators
    block_k: int = 64
    block_n_down: int = 256    # down: one [block_m, block_n_down] accumulator (<= 256)
    block_k_down: int = 64
    max_concurrent_steps: int = 4
    route_weight_in_kernel: bool = True   # False: apply the routing weight in the f32 combine
    # swap_ab: weights are wgmma's M operand and tokens its N (decode/verify tiles of 16..256 rows; FP8 and FP4
    # weights dequantised in registers). Then block_m = tokens per tile (multiple of 16), block_n / block_n_down =
    # weight rows per tile (multiples of 64); FP4 steps are whole 32-column scale groups (block_k % 32 == 0).
    swap_ab: bool = False
    # compute warpgroups per CTA: row tiles split the tile's rows, swap_ab the weight rows among them
    compute_wgs: int = 1
    # a dedicated TMA warpgroup feeds the compute ones (emit_pipeline_warp_specialized); False (compute_wgs=1
    # only): the compute warpgroup issues its own copies -- faster for the swap_ab decode tiles (tenth session)
    warp_specialized: bool = True
    # warp-specialised only: one CTA per SM loops over the (tile, block) items, overlapping an item's epilogue with
    # the next one's first copies (H200, 8K tokens, sixteenth session: FP4 prefill down kernel 1.74 -> 1.27 ms; but
    # the bf16 128-row gate/up 3.17 -> 4.36, so the defaults take it where it measured faster)
    persistent: bool = False

    def __post_init__(self):
        if not 1 <= self.compute_wgs <= 3:   # H200, tenth session: a 4-warpgroup FP4 decode tile had not finished
            raise ValueError(f"MgpuConfig: compute_wgs must be 1, 2 or 3 (4 did not finish on the H200), "
                             f"got {self.compute_wgs}")
        if self.persistent and not self.warp_specialized:
            raise ValueError("MgpuConfig: persistent CTAs need warp specialisation (a TMA warpgroup)")
        if not self.warp_specialized and self.compute_wgs != 1:
            raise ValueError(f"MgpuConfig: without warp specialisation one warpgroup computes, got "
                             f"compute_wgs={self.compute_wgs}")


def default_config(backend: str, num_rows: int, num_experts: int, fmt: str = "dense", fp8_acts: bool = False,
                   balanced: bool = False):
    """Tiles by regime: decode/verify (few rows per expert) vs prefill (many); the best of the
    experiments/bench_moe.py sweeps on the H200 where they ran (docs/benchmarks.md); every config here lowers
    at V4-Flash shapes (tests). fp8_acts: FP8 weights with FP8 activations of their block (act_quant).
    balanced: every expert holds exactly num_rows / num_experts rows (forced_balance, the benchmark mode); a
    count that 192-row tiles fit and 128-row ones do not (8K tokens: 192) then gets 192-row tiles, three
    compute warpgroups (8K tokens: FP8 x FP8 3.37 ms against 4.54, bf16 4.88 against 5.44, FP4 6.77 against
    7.67; under random routing the padded 192-row tiles lose: 128 stays the default; part 37)."""
    rows_per_expert = num_rows / max(num_experts, 1)
    fit192 = balanced and num_rows % max(num_experts, 1) == 0 and rows_per_expert % 192 == 0 \
        and rows_per_expert % 128 != 0
    if backend == "mgpu":
        if rows_per_expert <= 16 or (fmt == "fp4" and rows_per_expert <= 32):  # decode: weights as wgmma M
            # one warpgroup issuing its own copies (FP4 64 tokens: 2.03 ms against 2.25 / 2.11 warp-specialised
            # with 1 / 2 compute warpgroups; FP8 1.84 against 2.06 / 1.93)
            if fmt == "fp4":   # bench_moe, held words, one TMA copy a step (fourteenth session, parts 55-57):
                # 64 weight rows, 256-column steps (128-byte TMA rows; 64 tokens: 1.149 ms against 1.448 with
                # 128 x 128, 1.587 with 128 x 64)
                if rows_per_expert <= 16:
                    return MgpuConfig(block_m=16, block_n=64, block_k=256, block_n_down=64, block_k_down=256,
                                      max_concurrent_steps=4, swap_ab=True, warp_specialized=False)
                # verify (32-token tiles): two compute warpgroups of 64 rows in persistent CTAs (part 70, 1024
                # tokens: 1.324 ms against 1.417 with one warpgroup issuing its own copies; slower at 64 / 256)
                return MgpuConfig(block_m=32, block_n=128, block_k=256, block_n_down=128, block_k_down=256,
                                  max_concurrent_steps=4, swap_ab=True, compute_wgs=2, persistent=True)
            return MgpuConfig(block_m=16, block_n=128, block_k=128 if fmt == "fp8" else 64,
                              block_n_down=256 if fmt == "dense" else 128,
                              block_k_down=128 if fmt == "fp8" else 64,
                              max_concurrent_steps=6 if fmt == "dense" else 5, swap_ab=True,
                              warp_specialized=False)
        # prefill, two compute warpgroups (bench_moe at 8K tokens, tenth session: 5.57 / 6.84 / 8.45 ms bf16 /
        # FP8 / FP4 against 6.53 / 8.43 / 11.40 with one); quantised weights are dequantised in registers (swap_ab)
        # unless FP8 activations meet FP8 weights: FP8 x FP8 row tiles, whose two float32 accumulators per
        # weight (partial and promoted total) fit 64 columns (5.23 ms at 8K tokens; 128 columns spill: 7.39)
        # persistent CTAs (part 66, 8K tokens, balanced, against a CTA per item: FP4 layer 5.377 -> 4.788 ms, bf16
        # 192-row layer 5.353 -> 4.980, FP8 x FP8 128-row block 4.382 -> 4.208; not the bf16 128-row tiles)
        if fp8_acts:
            return MgpuConfig(block_m=192 if fit192 else 128, block_n=64, block_k=128, block_n_down=128,
                              block_k_down=128, max_concurrent_steps=4 if fit192 else 6,
                              compute_wgs=3 if fit192 else 2, persistent=True)
        if fmt in ("fp8", "fp4"):
            big = fit192 and fmt == "fp4"  # [64, 192] float32 accumulators per weight and warpgroup
            # 128-column steps (FP4 at 8K tokens, parts 79 / 81: 3.751 ms against 4.157 with 64 columns at 192-token
            # tiles, where gate/up fit 2 slots and down 3; 4.737 against 5.010 at 128-token tiles, random routing)
            return MgpuConfig(block_m=192 if big else 128, block_n=128, block_k=128, block_n_down=128,
                              block_k_down=128, swap_ab=True, compute_wgs=2, max_concurrent_steps=3 if big else 4,
                              persistent=True)
        if fit192:                       # three compute warpgroups leave 152 registers a thread: 64 columns
            return MgpuConfig(block_m=192, compute_wgs=3, block_n=64, block_k=64, block_n_down=128,
                              block_k_down=64, max_concurrent_steps=4, persistent=True)
        if rows_per_expert > 64:         # the row tiles' down projection gets 3 slots of 256 columns (SMEM)
            return MgpuConfig(block_m=128, compute_wgs=2, block_n=128, block_k=64, block_n_down=256,
                              block_k_down=64, max_concurrent_steps=4)
        return MgpuConfig()
    if rows_per_expert <= 16:          # decode / verify: one tile holds all of an expert's rows
        return TritonConfig(block_m=16)
    if rows_per_expert <= 48:
        return TritonConfig(block_m=32)
    # prefill: MMA-friendly tiles; 128 rows once a tile is at least half full (bench_moe, bf16: 319 / 394
    # TFLOP/s at 96 / 192 rows per expert against 257 / 377 with 64-row tiles)
    return TritonConfig(block_m=64 if rows_per_expert <= 64 else 128, block_n=128, block_k=64, block_n_down=128,
                        block_k_down=64, num_warps=4 if rows_per_expert <= 64 else 8, num_stages=3)


# --------------------------------------------------------------------------------- in-kernel dequantisers


def _precision(dtype):
    # float32 operands (the model's parity mode): IEEE, not Triton's default TF32
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.dtype(jnp.float32) else None


def _dot_nt(a, b):
    """a [m, k] . b [n, k]^T -> [m, n] float32 (2-D dot; Triton transposes b itself)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a.dtype),
                           preferred_element_type=jnp.float32)


def _wdot(xk, w_ref, s_ref, e, n0, k0, *, fmt, bn, bk, fp8_block, kn=False):
    """Tile rows against expert e's weight rows n0:n0+bn over stored columns k0:k0+bk -> [bm, bn] f32.

    dense/fp8: xk = (x [bm, bk],); fp8 with FP8 activations: xk = (x float8 [bm, bk], the rows' act_quant
    scales [bm, 1] of this block), one FP8 MMA; fp4: xk = (x_even, x_odd), each [bm, bk] against bk packed
    bytes (2*bk logical columns); the fp4 result is E2M1-folded (times 2^-14, see e2m1_pair; the kernels
    multiply their accumulators by FP4_FOLD).
    """
    if kn:  # dense weights stored [E, in, out]
        w = w_ref[e, pl.ds(k0, bk), pl.ds(n0, bn)]
        return jnp.dot(xk[0], w.astype(xk[0].dtype), precision=_precision(xk[0].dtype),
                       preferred_element_type=jnp.float32)
    if fmt == "dense":
        w = w_ref[e, pl.ds(n0, bn), pl.ds(k0, bk)]
        return _dot_nt(xk[0], w.astype(xk[0].dtype))
    if fmt == "fp8":
        # the tile sits inside one scale block (bn, bk divide B): scale the partial product once
        w = w_ref[e, pl.ds(n0, bn), pl.ds(k0, bk)]
        s = e8m0(s_ref[e, n0 // fp8_block, k0 // fp8_block])
        if len(xk) == 2:  # FP8 activations: both operands FP8, both scales on the f32 product
            return _dot_nt(xk[0], w) * (xk[1] * s)
        return _dot_nt(xk[0], w.astype(xk[0].dtype)) * s
    # fp4: bytes k0:k0+bk hold logical columns 2*k0 .. 2*(k0+bk); one UE8M0 scale per 16 bytes
    xe, xo = xk
    lo, hi = fp4_tile(w_ref[e, pl.ds(n0, bn), pl.ds(k0, bk)], s_ref[e, pl.ds(n0, bn), pl.ds(k0 // 16, bk // 16)])
    return _dot_nt(xe, lo.astype(xe.dtype)) + _dot_nt(xo, hi.astype(xo.dtype))


def _swiglu(g, u, limit):
    if limit > 0:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return g / (1.0 + jnp.exp(-g)) * u


# ----------------------------------------------------------------------------------------- Triton kernels


def _tiles(cfg_bn, cfg_bk, n, k_stored, fmt, w, s, what):
    """Clamp the tiles to the problem and the format; validate."""
    bn, bk = min(cfg_bn, n), min(cfg_bk if fmt != "fp4" else cfg_bk // 2, k_stored)
    fp8_block = ref.fp8_block_size(w.shape, s.shape) if fmt == "fp8" else 0
    if fmt == "fp8":
        bn, bk = min(bn, fp8_block), min(bk, fp8_block)
    for name, v in (("block_n", bn), ("block_k", bk)):
        if v & (v - 1):
            raise ValueError(f"moe {what}: {name}={v} must be a power of two (Triton)")
    if n % bn or k_stored % bk:
        raise ValueError(f"moe {what}: weight [{n}, {k_stored}] (stored) does not tile by ({bn}, {bk})")
    if fmt == "fp8" and (fp8_block % bn or fp8_block % bk):
        raise ValueError(f"moe {what}: FP8 block {fp8_block} must be a multiple of the tile ({bn}, {bk})")
    if fmt == "fp4" and bk % 16:
        raise ValueError(f"moe {what}: FP4 needs block_k >= 32 logical columns, got {2 * bk}")
    return bn, bk, fp8_block


def _triton_call(kernel, *, args, x_parts, bm, bn, grid, out_shape, cfg, interpret, name):
    """grid = (column blocks j, tiles t): program_id(0) = j is the fastest-launched axis, so the programs
    of one tile run together and re-read its activation rows from L2, not HBM (each weight slice is read
    by one program per tile either way)."""
    from jax.experimental.pallas import triton as plt
    full = lambda a: pl.BlockSpec(a.shape, lambda j, t, n=a.ndim: (0,) * n)  # noqa: E731
    row_block = lambda a: pl.BlockSpec((bm,) + a.shape[1:], lambda j, t, n=a.ndim: (t,) + (0,) * (n - 1))  # noqa: E731
    in_specs = [full(args[0])] + [row_block(a) for a in args[1:1 + x_parts]] + [full(a) for a in args[1 + x_parts:]]
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda j, t: (t, j)),
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret, name=name,
    )(*args)


def _x_step(x_refs, xs_ref, k0, bk, fp8_block):
    """One K step's activation operands: x_refs' columns k0:k0+bk, plus (FP8 activations, xs_ref their
    act_quant scales [bm, K / B]) the rows' scale of the block holding them, [bm, 1]."""
    xk = tuple(r[:, pl.ds(k0, bk)] for r in x_refs)
    return xk if xs_ref is None else xk + (xs_ref[:, pl.ds(k0 // fp8_block, 1)],)


def _check_act_scales(x, x_scale, fmt, fp8_block, what):
    if x_scale is None:
        return
    if fmt != "fp8" or x_scale.shape != (x.shape[0], x.shape[1] // fp8_block):
        raise ValueError(f"moe {what}: FP8 activations need FP8 weights and act_quant scales "
                         f"[{x.shape[0]}, {x.shape[1]} / {fp8_block or 'B'}], got {fmt} and {x_scale.shape}")


def _gate_up_triton(xparts, row_weight, tile_expert, w1, w3, s1, s3, *, fmt, limit, cfg: TritonConfig,
                    interpret, out_dtype, kn=False, x_scale=None):
    """z [P, I] = swiglu(x W1_e^T, x W3_e^T) * row_weight per tile; xparts = (xs,) or fp4 (xs_even, xs_odd);
    x_scale: None, or FP8 xs's act_quant scales [P, D / B] (FP8 weights with the same block B: FP8 MMA)."""
    p, ks = xparts[0].shape
    i_dim = w1.shape[2] if kn else w1.shape[1]
    bm = cfg.block_m
    bn, bk, fp8_block = _tiles(cfg.block_n, cfg.block_k, i_dim, ks, fmt, w1, s1, "gate/up")
    _check_act_scales(xparts[0], x_scale, fmt, fp8_block, "gate/up")
    nx, nk = len(xparts) + (x_scale is not None), ks // bk
    post = FP4_FOLD if fmt == "fp4" else 1.0

    def kernel(te_ref, *refs):
        x_refs, rw_ref, w1_ref, w3_ref = refs[:nx], refs[nx], refs[nx + 1], refs[nx + 2]
        s1_ref, s3_ref, z_ref = refs[nx + 3:] if fmt != "dense" else (None, None, refs[nx + 3])
        x_refs, xs_ref = (x_refs, None) if x_scale is None else (x_refs[:-1], x_refs[-1])
        j, t = pl.program_id(0), pl.program_id(1)
        e = te_ref[t]

        @pl.when(e >= 0)
        def _():
            wd = functools.partial(_wdot, e=e, n0=j * bn, fmt=fmt, bn=bn, bk=bk, fp8_block=fp8_block, kn=kn)

            def body(kk, carry):
                g, u = carry
                k0 = pl.multiple_of(kk * bk, bk)
                xk = _x_step(x_refs, xs_ref, k0, bk, fp8_block)
                return g + wd(xk, w1_ref, s1_ref, k0=k0), u + wd(xk, w3_ref, s3_ref, k0=k0)

            zero = jnp.zeros((bm, bn), jnp.float32)
            g, u = lax.fori_loop(0, nk, body, (zero, zero))
            if post != 1.0:
                g, u = g * post, u * post
            z = _swiglu(g, u, limit) * rw_ref[...][:, None]
            z_ref[...] = z.astype(z_ref.dtype)

    # row_weight is blocked by rows like x: put it right after the x parts
    x_args = [*xparts] + ([x_scale] if x_scale is not None else [])
    args = [tile_expert, *x_args, row_weight, w1, w3] + ([s1, s3] if fmt != "dense" else [])
    return _triton_call(kernel, args=args, x_parts=nx + 1, bm=bm, bn=bn, grid=(i_dim // bn, p // bm),
                        out_shape=jax.ShapeDtypeStruct((p, i_dim), out_dtype), cfg=cfg,
                        interpret=interpret, name=f"moe_gate_up_{fmt}")


def _down_triton(zparts, tile_expert, w2, s2, *, fmt, cfg: TritonConfig, out_dtype, interpret, kn=False,
                 z_scale=None):
    """y [P, D] = z W2_e^T per tile; zparts = (z,) or fp4 (z_even, z_odd); z_scale as _gate_up_triton's x_scale."""
    p, ks = zparts[0].shape
    d = w2.shape[2] if kn else w2.shape[1]
    bm = cfg.block_m
    bn, bk, fp8_block = _tiles(cfg.block_n_down, cfg.block_k_down, d, ks, fmt, w2, s2, "down")
    _check_act_scales(zparts[0], z_scale, fmt, fp8_block, "down")
    nz, nk = len(zparts) + (z_scale is not None), ks // bk
    post = FP4_FOLD if fmt == "fp4" else 1.0

    def kernel(te_ref, *refs):
        z_refs, w2_ref = refs[:nz], refs[nz]
        s2_ref, y_ref = refs[nz + 1:] if fmt != "dense" else (None, refs[nz + 1])
        z_refs, zs_ref = (z_refs, None) if z_scale is None else (z_refs[:-1], z_refs[-1])
        j, t = pl.program_id(0), pl.program_id(1)
        e = te_ref[t]

        @pl.when(e >= 0)
        def _():
            def body(kk, acc):
                k0 = pl.multiple_of(kk * bk, bk)
                zk = _x_step(z_refs, zs_ref, k0, bk, fp8_block)
                return acc + _wdot(zk, w2_ref, s2_ref, e, j * bn, k0, fmt=fmt, bn=bn, bk=bk,
                                   fp8_block=fp8_block, kn=kn)

            acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
            if post != 1.0:
                acc = acc * post
            y_ref[...] = acc.astype(y_ref.dtype)

    args = [tile_expert, *zparts] + ([z_scale] if z_scale is not None else []) + [w2] + ([s2] if fmt != "dense" else [])
    return _triton_call(kernel, args=args, x_parts=nz, bm=bm, bn=bn, grid=(d // bn, p // bm),
                        out_shape=jax.ShapeDtypeStruct((p, d), out_dtype), cfg=cfg, interpret=interpret,
                        name=f"moe_down_{fmt}")


# ----------------------------------------------------------------------------------- Mosaic GPU kernels


def _mgpu_params():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    # Warpgroup semantics is the default in 0.11 and must be asked for in 0.10: one code path for both.
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _pipeline_depth(max_steps: int, nk: int, persistent: bool) -> tuple[int, int]:
    """(max_concurrent_steps, delay_release) for a K loop of nk steps. One wgmma group stays in flight, so
    its buffers are released one step late (delay 1, which needs >= 2 slots); a single step needs neither, and
    persistent CTAs (_ws_kernel) release each step at once."""
    if nk <= 1:
        return 1, 0
    return max(2, min(max_steps, nk)), 0 if persistent else 1


def _check_mgpu_tiles(p, n, k, bm, wgs, bn, bk, what):
    if bm % wgs or (bm // wgs) % 64 or bn % 8 or bn > 256:
        raise ValueError(f"moe {what} (mgpu): block_m must be compute_wgs x a multiple of 64 rows and block_n "
                         f"<= 256, got block_m={bm}, compute_wgs={wgs}, block_n={bn}")
    if p % bm or n % bn or k % bk:
        raise ValueError(f"moe {what} (mgpu): [{p}, {k}] x [{n}, {k}] does not tile by ({bm}, {bn}, {bk})")


def _w_operand(plgpu, w_s, kn):
    # [N, K] tiles (the model's [E, out, in] storage) are K-major: wgmma takes them through a transposed view
    return w_s if kn else plgpu.transpose_ref(w_s, (1, 0))


SMEM_BYTES = 232448   # dynamic shared memory per CTA on the H100 / H200 (the limit the lowering reports)


def _fit_steps(max_steps: int, stage_bytes: int, fixed_bytes: int) -> int:
    """Pipeline slots: max_steps, or fewer where that many [stage_bytes] slots and the kernel's fixed_bytes of
    SMEM (epilogue tiles) would not fit (2 at least; a config that does not fit fails at lowering)."""
    return max(2, min(max_steps, (SMEM_BYTES - fixed_bytes - 1024) // stage_bytes))


class _Cta(NamedTuple):
    """What a compute warpgroup knows of its CTA: tile t, output block j, expert e = tile_expert[t],
    warpgroup wg, the tile's routed rows (tile_rows[t]) and the kernel's operand refs (GMEM)."""
    t: jax.Array
    j: jax.Array
    e: jax.Array
    wg: jax.Array
    rows: jax.Array
    operands: tuple


def _ws_kernel(*, plan_arrays, operands, specs, cta_refs, mma, acc_shape, num_accs, epilogue, rw_axis, rw_slice,
               out_block, grid, wgs, specialized, persistent, nk, steps, out_shape, out_dtype, interpret,
               register_carry=False, out_t=False):
    """The grouped GEMM that both Mosaic GPU orientations (row tiles, swap_ab) run.

    Work item (t, j): tile t, output block j of grid (tiles, blocks) = (T, NB), taken in that order (j fastest),
    so the items of one tile run together and share its activations in L2: a CTA per item, or `persistent`
    (specialized only) one CTA per SM looping over the live tiles' items (num_tiles[0] of T, read in the
    kernel), whose memory warpgroup streams the next item's first K steps while the compute warpgroups finish
    the last one's epilogue (its TMA store is awaited only before its SMEM is written again). Item (t, j),
    expert e = tile_expert[t] (-1: nothing to do): the GMEM refs cta_refs(operands, t, j, e) are streamed, nk
    K steps of `specs`, by TMA into `steps` SMEM slots -- `specialized`: by a memory warpgroup
    (emit_pipeline_warp_specialized) for `wgs` compute warpgroups; otherwise the one warpgroup (wgs = 1)
    issues its own copies (emit_pipeline). Each compute
    warpgroup runs accs = mma(cta, k_step, tiles, accs) per step on num_accs float32 accumulators of acc_shape
    (wgmma accumulator refs; with register_carry, specialized only, float32 arrays carried from step to step),
    then epilogue(accs) [times the routing weights row_weight[rw_slice(t, wg)] broadcast along rw_axis,
    where plan_arrays holds them] -> SMEM (out_t: transposed) -> TMA store to out[out_block(t, j, wg)].
    plan_arrays: (tile_expert [T], tile_rows [T], num_tiles [1]) or (..., row_weight [P]).
    Persistent CTAs cannot let a wgmma outlive its K step (the next item's copies would refill its slot), so
    their callers' pipelines release each slot at once (delay_release=0, wgmma_wait(0)).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    n_plan = len(plan_arrays)
    ignore = lambda *_, **__: None  # noqa: E731 -- the allocations do not depend on the bodies
    # each warpgroup's routing weights start on a 128-byte boundary (a TMA destination's alignment)
    rw_len = acc_shape[rw_axis]
    rw_row = -(-rw_len // 32) * 32

    def pipeline(step, context):
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(nk,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=wgs,
            max_concurrent_steps=steps, compute_context=context)

    def body(*refs):
        (te_gmem, tr_gmem, nt_gmem, *rw_gmem), ops, out_gmem = refs[:n_plan], refs[n_plan:-1], refs[-1]

        def scope(allocs, out_smem, rw_smem, bar):
            wg = lax.axis_index("wg") if specialized else 0
            rw_s = rw_smem.at[wg, pl.ds(0, rw_len)]

            def work(t, j):
                cta = _Cta(t, j, te_gmem[t], wg, tr_gmem[t], ops)

                def context(run):
                    if rw_gmem:
                        plgpu.copy_gmem_to_smem(rw_gmem[0].at[rw_slice(t, wg)], rw_s, bar.at[wg])

                    def accumulate(*acc_refs):
                        run(acc_refs)
                        return tuple(r[...] for r in acc_refs)

                    if register_carry:
                        accs = run(tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(num_accs)))
                    else:
                        accs = pl.run_scoped(accumulate, *[plgpu.ACC(acc_shape, jnp.float32)] * num_accs)
                    out = epilogue(accs)
                    if rw_gmem:   # layout inference gives the weights the WGMMA row / column layout of the broadcast
                        plgpu.barrier_wait(bar.at[wg])
                        out = out * lax.broadcast_in_dim(rw_s[...], acc_shape, [rw_axis])
                    out = out.astype(out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last item's store has read the SMEM
                    if out_t and not interpret:   # a transposed SMEM view takes the accumulator's transposed
                        plgpu.transpose_ref(out_smem.at[wg], (1, 0))[...] = plgpu.layout_cast(   # register layout
                            out, plgpu.Layout.WGMMA_TRANSPOSED)
                    else:                         # (the MGPU interpreter has neither: it transposes the value)
                        out_smem.at[wg][...] = out.T if out_t else out
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[out_block(t, j, wg)])

                def step(idx, *rest):
                    return mma(cta, idx[0], rest[:-1], rest[-1])

                @pl.when(cta.e >= 0)
                def _():
                    streamed = cta_refs(ops, t, j, cta.e)
                    if specialized:
                        pipeline(step, context)(*streamed, allocations=allocs)
                    else:
                        context(lambda accs: plgpu.emit_pipeline(
                            lambda idx, *tiles: mma(cta, idx[0], tiles, accs), grid=(nk,), in_specs=specs,
                            max_concurrent_steps=steps)(*streamed))

            if persistent:   # the live tiles' items, interleaved over the SMs
                plgpu.nd_loop((nt_gmem[0], grid[1]), collective_axes="sm")(lambda item: work(*item.index))
            else:
                work(lax.axis_index("t"), lax.axis_index("n"))
            plgpu.wait_smem_to_gmem(0)

        scratch = (plgpu.SMEM((wgs, *(acc_shape[::-1] if out_t else acc_shape)), out_dtype),
                   plgpu.SMEM((wgs, rw_row), jnp.float32), plgpu.Barrier(num_barriers=wgs))
        if specialized:
            pl.run_scoped(scope, pipeline(ignore, ignore).get_allocations(*cta_refs(ops, 0, 0, 0)), *scratch,
                          collective_axes="wg")
        else:
            pl.run_scoped(functools.partial(scope, None), *scratch)

    if register_carry and not specialized:
        raise ValueError("moe (mgpu): without warp specialisation one warpgroup computes on wgmma accumulators; "
                         "FP8 x FP8 carries its totals in registers and needs a TMA warpgroup")
    launch = dict(grid=(_num_sms(interpret),), grid_names=("sm",)) if persistent else dict(grid=grid,
                                                                                         grid_names=("t", "n"))
    if specialized:
        launch.update(num_threads=wgs + 1, thread_name="wg")
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype), compiler_params=_mgpu_params(),
                        interpret=interpret, **launch)(*plan_arrays, *operands)


def _num_sms(interpret) -> int:
    """Persistent CTAs: one per SM of the GPU (132 on the H100 / H200, also when lowering for CUDA on a CPU);
    the MGPU interpreter runs three, so that its tests interleave several items per CTA."""
    if interpret:
        return 3
    return getattr(jax.devices()[0], "core_count", 132) if jax.default_backend() == "gpu" else 132


def _row_gemm(what, x, plan_arrays, ws, *, bn, bk, cfg: MgpuConfig, kn, epilogue, out_dtype, interpret,
              x_scale_t=None, ss=None):
    """Row tiles: out [P, N] = epilogue([x_t W_e^T for W in ws]) (* routing weights) for each tile t of block_m
    rows of x [P, K]; ws: weights [E, N, K] ([E, K, N] if kn), wgmma's B through a transposed SMEM view.
    The cfg.compute_wgs compute warpgroups each own block_m / compute_wgs rows of the tile (wgmma's M, a
    multiple of 64) and keep one wgmma group in flight (but persistent ones); one whose rows are all padding
    (past tile_rows[t]) skips its wgmmas, leaving the tensor cores to the others.

    FP8 x FP8 (x_scale_t given): x float8_e4m3fn with its act_quant scales transposed, x_scale_t [K / B, P], ws
    FP8 with UE8M0 block scales ss [E, N / B, K / B]; a K step is one scale block (bk = B). Each step's wgmma
    accumulates into a fresh float32 partial, which is then scaled by its rows' and its weight block's scales
    and added to the float32 totals carried in registers (per-block promotion, as DeepGEMM does), so both
    operands stay FP8 on the tensor cores; warp-specialised only, and padding warpgroups still multiply."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    p, k = x.shape
    n = ws[0].shape[2] if kn else ws[0].shape[1]
    bm, wgs = cfg.block_m, cfg.compute_wgs
    bn, bk = min(bn, n), min(bk, k)
    _check_mgpu_tiles(p, n, k, bm, wgs, bn, bk, what)
    wm, nk, nw, item = bm // wgs, k // bk, len(ws), jnp.dtype(x.dtype).itemsize
    fp8 = x_scale_t is not None
    if fp8:
        block = ref.fp8_block_size((ws[0].shape[0], n, k), ss[0].shape)
        if bk != block or block % bn or x_scale_t.shape != (k // block, p):
            raise ValueError(f"moe {what} (mgpu FP8 x FP8): a K step must be the scale block {block} (block_k "
                             f"{bk}), the block a multiple of block_n ({bn}), and x_scale_t [{k // block}, {p}], "
                             f"got {x_scale_t.shape}")
    fit = _fit_steps(cfg.max_concurrent_steps, (bm + nw * bn) * bk * item + (4 * bm if fp8 else 0),
                     wgs * wm * (bn * jnp.dtype(out_dtype).itemsize + 4))
    steps, delay = _pipeline_depth(fit, nk, cfg.persistent)
    delay = 0 if fp8 else delay      # FP8: each step waits for its wgmmas (the promotion reads them)
    w_block, w_index = ((bk, bn), lambda kk: (kk, 0)) if kn else ((bn, bk), lambda kk: (0, kk))
    specs = [plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), delay_release=delay)] + \
            ([plgpu.BlockSpec((1, bm), lambda kk: (kk, 0), delay_release=delay)] if fp8 else []) + \
            [plgpu.BlockSpec(w_block, w_index, delay_release=delay)] * nw
    n_x = 2 if fp8 else 1                     # streamed activation operands: x (and its scales)

    def cta_refs(ops, t, j, e):
        tile, cols = pl.ds(t * bm, bm), pl.ds(j * bn, bn)
        xs = (ops[0].at[tile],) + ((ops[1].at[:, tile],) if fp8 else ())
        return (*xs, *(w.at[e, :, cols] if kn else w.at[e, cols] for w in ops[n_x:n_x + nw]))

    def mma(cta, kk, tiles, accs):
        rows = pl.ds(cta.wg * wm, wm)
        x_s, w_s = tiles[0].at[rows], tiles[n_x:]
        if fp8:   # this step's partial products in fresh accumulators, promoted into the carried totals
            def partials(*parts):
                for part, w in zip(parts, w_s):
                    plgpu.wgmma(part, x_s, _w_operand(plgpu, w, kn))
                return tuple(part[...] for part in parts)    # reading an accumulator waits for its wgmma

            parts = pl.run_scoped(partials, *[plgpu.ACC((wm, bn), jnp.float32)] * nw)
            row_scale = lax.broadcast_in_dim(tiles[1][0, rows], (wm, bn), [0])
            return tuple(total + part * (row_scale * _scale_scalar(s_g, cta.e, (cta.j * bn) // block, kk))
                         for total, part, s_g in zip(accs, parts, cta.operands[n_x + nw:]))

        @pl.when(cta.wg * wm < cta.rows)
        def _():
            for acc, w in zip(accs, w_s):
                plgpu.wgmma(acc, x_s, _w_operand(plgpu, w, kn))
        plgpu.wgmma_wait(delay)
        return accs

    operands = (x,) + ((x_scale_t,) if fp8 else ()) + tuple(ws) + (tuple(ss) if fp8 else ())
    return _ws_kernel(plan_arrays=plan_arrays, operands=operands, specs=specs, cta_refs=cta_refs, mma=mma,
                      acc_shape=(wm, bn), num_accs=nw, epilogue=epilogue, rw_axis=0, register_carry=fp8,
                      rw_slice=lambda t, wg: pl.ds(t * bm + wg * wm, wm),
                      out_block=lambda t, j, wg: (pl.ds(t * bm + wg * wm, wm), pl.ds(j * bn, bn)),
                      grid=(p // bm, n // bn), wgs=wgs, specialized=cfg.warp_specialized, persistent=cfg.persistent,
                      nk=nk, steps=steps, out_shape=(p, n), out_dtype=out_dtype, interpret=interpret)


# ---------------------------------------------- Mosaic GPU, swapped operands (weights = wgmma M, tokens = N)
#
# Decode/verify tiles hold a handful of rows, but wgmma's M is 64: with the weights as the M operand
# (the [E, out, in] storage is already wgmma's K-major A layout) and the tile's tokens as N (any multiple of
# 8 up to 256) a tile costs one pass over its expert's weights whatever its row count. The activations go
# in transposed ([D, P], gathered so by the dispatch kernel `transpose`) and z comes out transposed ([I, P]),
# so no operand needs a transposed SMEM view (which keeps the bf16 kernels runnable in the MGPU CPU
# interpreter); the down kernel stores y [P, D] through one, so that the combine gathers whole rows.
# Quantised weights are dequantised in registers (wgmma's A operand may live in registers):
#   FP8  E4M3 -> f32 times the tile's UE8M0 block scale -> bf16;
#   FP4  a K step is G whole scale groups (16 packed bytes = 32 logical columns, one UE8M0 scale per weight
#        row), streamed as one held [bn, 8G] uint16 tile (fp4_kernel_weights); a thread's 32-bit words are
#        decoded to bf16 in inline PTX (nine integer instructions per 8 weights) and the step's groups form
#        one [bn, 32G] operand (_fp4_operand) in the weights' own K order. The scales enter as bf16,
#        transposed ([E, in/32, out], fp4_kernel_scales) so that a group's scales are one contiguous [bn] row.
# The CPU interpreter has no register operand, so the quantised paths are checked by lowering and on the GPU.

FP4_GROUP = 16   # packed bytes per UE8M0 scale (32 logical columns)


def _scale_scalar(s_gmem, e, r, c):
    """UE8M0 byte at s[e, r, c] (GMEM scalar) -> float32 2^(b-127). (exp2 of an integer is a power of two;
    Mosaic GPU cannot bitcast scalars.)"""
    return jnp.exp2(s_gmem[e, r, c].astype(jnp.float32) - 127.0)


# FP4 weights as the swap kernels read them ("kernel words", fp4_kernel_weights; the model holds routed experts'
# so): a scale group's 16 bytes of a row as four 32-bit held words, each holding 8 weights in slots j = 2w + l
# with their bits permuted, so that a thread of the WGMMA layout decodes its word into four bf16x2 words
# (decoded word w: lane l from slot 2w + l) with nine integer instructions: four rotations and five masks /
# merges (the byte decodes before took 18 per 8 weights). Decoded word w gets each field of its slots -- E2M1 bit f
# (mantissa, exponent low, exponent high, sign) onto bf16 bit FP4_FIELD_BITS[f] (the exponent's low two bits,
# the mantissa's top bit, the sign; lane 1: +16) -- by rotating the held word right by FP4_WORD_SHIFTS[w][f].
# That makes the bf16 value E2M1 x 2^-126 for all 16 codes (0.5 becomes the subnormal 2^-127); the 2^126 is
# folded into the scales (FP4_KERNEL_FOLD: 2^(b-1) for UE8M0 byte b, which bf16 holds for b <= 128, scales <= 2;
# e8m0_bf16 makes the larger ones NaN; the Triton kernels take any scale). Exact where it applies, provided the
# bf16 multiply keeps the subnormal input (bf16 mul has no flush-to-zero in PTX; tests/test_kernels_moe.py
# test_gpu_fp4_half_codes). The shifts are one of the cheapest layouts (9 instructions) of an exhaustive search
# (experiments/probes/fp4_word_layout_search.py): no layout decodes every word with one rotation each (the
# field pattern does not tile the 16-bit lane).
FP4_FIELD_BITS = (6, 7, 8, 15)
FP4_WORD_SHIFTS = ((0, 0, 0, 0), (10, 2, 2, 2), (12, 12, 12, 12), (6, 6, 6, 6))
FP4_KERNEL_FOLD = 126


def _word_fields(w: int) -> dict[int, int]:
    """{right rotation: bf16x2 mask} that decoded word w takes from the held word."""
    masks: dict[int, int] = {}
    for bit, shift in zip(FP4_FIELD_BITS, FP4_WORD_SHIFTS[w]):
        masks[shift] = masks.get(shift, 0) | (0x10001 << bit)
    return masks


def fp4_held_bit(j: int, f: int) -> int:
    """Bit of a held 32-bit word that holds E2M1 bit f of its slot j = 2w + l (decoded word w, lane l)."""
    w, lane = divmod(j, 2)
    return (FP4_FIELD_BITS[f] + 16 * lane + FP4_WORD_SHIFTS[w][f]) % 32


def _words_ptx() -> str:
    """Inline PTX: $4 = a held word -> $0..$3 = the four bf16x2 words (E2M1 x 2^-126)."""
    shifts = sorted({s for w in range(4) for s in FP4_WORD_SHIFTS[w]} - {0})
    src = {0: "$4", **{s: f"r{s}" for s in shifts}}
    lines = [".reg .b32 t, " + ", ".join(src[s] for s in shifts) + ";"]
    lines += [f"shf.r.wrap.b32 r{s}, $4, $4, {s};" for s in shifts]
    for w in range(4):
        (s0, m0), *rest = _word_fields(w).items()
        acc = f"${w}" if not rest else "t"
        lines.append(f"and.b32 {acc}, {src[s0]}, {m0:#010x};")
        for n, (s, m) in enumerate(rest):     # (src & mask) | acc
            lines.append(f"lop3.b32 {f'${w}' if n == len(rest) - 1 else 't'}, {src[s]}, {m:#010x}, t, 0xEA;")
    return "{\n" + "\n".join(lines) + "\n}"


_E2M1_WORDS_PTX = _words_ptx()


def e2m1_word_decode(q: np.ndarray) -> tuple[np.ndarray, ...]:
    """numpy model of _E2M1_WORDS_PTX (for tests): held uint32 words -> the four bf16x2 words, uint32."""
    q = np.asarray(q, np.uint64)
    rotr = lambda s: ((q >> np.uint64(s)) | (q << np.uint64((32 - s) % 32))) & np.uint64(0xFFFFFFFF)  # noqa: E731
    words = []
    for w in range(4):
        word = np.zeros_like(q)
        for s, m in _word_fields(w).items():
            word |= rotr(s) & np.uint64(m)
        words.append(word.astype(np.uint32))
    return tuple(words)


def _fp4_operand(plgpu, tile, scale_rows):
    """One K step's wgmma A operand from FP4: its G scale groups' held words, a [n, 8G] uint16 tile
    (fp4_kernel_weights, WGMMA layout: a thread's register is one held word, axis 1 of the register array the
    8-column blocks, i.e. the groups), and their scale rows [n] (bf16 powers of two with FP4_KERNEL_FOLD) ->
    [n, 32G] bf16, per group its decoded words 0..3 (8 columns each, the weights' own K order: see
    fp4_kernel_weights). The words' registers are concatenated along K, which moves no data."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    n, g = tile.shape[0], len(scale_rows)
    wgmma = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(wgmma, (wgmma,) * g),
                       return_type=plgpu.ShapeDtypeStruct((n, 2 * FP4_GROUP * g), jnp.bfloat16, layout=wgmma))
    def decode(_, held, scales):
        i32 = ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        assert held.layout == mgpu.WGMMA_LAYOUT, held.layout
        parts = []
        for q, s in enumerate(scales):
            group = held.registers[:, q:q + 1]
            words = [np.empty_like(group) for _ in range(4)]
            for idx, reg in np.ndenumerate(group):
                out = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [mgpu.utils.bitcast(reg, i32)],
                                      _E2M1_WORDS_PTX, "=r,=r,=r,=r,r")
                for w in range(4):
                    words[w][idx] = mgpu.utils.bitcast(llvm.extractvalue(i32, out, [w]), bf16x2)
            parts += [(mgpu.FragmentedArray(_registers=r, _layout=held.layout, _is_signed=None) * s).registers
                      for r in words]
        return mgpu.FragmentedArray(_registers=np.concatenate(parts, axis=1), _layout=mgpu.WGMMA_LAYOUT,
                                    _is_signed=None)

    return decode(tile, tuple(lax.broadcast_in_dim(b, (n, FP4_GROUP // 2), [0]) for b in scale_rows))


class _SwapTiles(NamedTuple):
    bm: int            # tokens per tile (wgmma N)
    bn: int            # weight rows per tile, split over the compute warpgroups (wgmma M: bn / compute_wgs)
    bk: int            # logical input columns per K step
    fp8_block: int     # FP8 scale block (0 otherwise)


def _swap_tiles(what, fmt, cfg: MgpuConfig, names, out_dim, in_dim, p, w, s) -> _SwapTiles:
    """Clamp the tiles named `names` (the MgpuConfig fields of this kernel's block_n, block_k) to the problem
    and validate them."""
    bm, bn, bk = cfg.block_m, min(getattr(cfg, names[0]), out_dim), min(getattr(cfg, names[1]), in_dim)
    wgs = cfg.compute_wgs
    fp8_block = ref.fp8_block_size(w.shape, s.shape) if fmt == "fp8" else 0
    if bm % 16 or bm > 256 or bn % (64 * wgs) or p % bm or out_dim % bn or in_dim % bk:
        raise ValueError(f"moe {what} (mgpu swap): tokens/tile {bm} must be a multiple of 16 <= 256, weight "
                         f"rows/tile {bn} a multiple of 64 x compute_wgs ({wgs}); [{out_dim}, {in_dim}] x "
                         f"[{in_dim}, {p}] must tile by ({bn}, {bk}, {bm})")
    if fmt == "fp8" and (fp8_block % bn or fp8_block % bk):
        raise ValueError(f"moe {what} (mgpu swap): FP8 block {fp8_block} must be a multiple of ({bn}, {bk})")
    # a register operand's wgmma takes K = the whole step, which must fill the activation tile's swizzle
    # (the largest of 32 / 64 / 128 bytes dividing its 2 * block_m-byte rows)
    k_align = max(math.gcd(2 * bm, 128) // 2, 2 * FP4_GROUP if fmt == "fp4" else 1)
    if fmt != "dense" and bk % k_align:
        raise ValueError(f"moe {what} (mgpu swap): {fmt.upper()} with block_m={bm} needs {names[1]} a multiple "
                         f"of {k_align}, got {bk}")
    return _SwapTiles(bm, bn, bk, fp8_block)


def e8m0_bf16(b: jax.Array, fold: int = 0) -> jax.Array:
    """UE8M0 bytes -> bf16 scales 2^(b - 127 + fold): b + fold = 0 -> the subnormal 2^-127, and NaN for b = 255
    (as reference._e8m0) or where bf16 cannot hold the power (b + fold > 254). Unsigned 16-bit and one select:
    XLA fuses that with the swap kernels' transpose of the scales (0.06 ms a V4-Flash scale tensor on the H200;
    signed with two selects it split into three fusions, 0.20 ms: experiments/probes/moe_fp4_scales.py)."""
    b = b.astype(jnp.uint16)
    bits = jnp.maximum((b + fold) << 7, jnp.uint16(0x40))
    bits = jnp.where(b > min(254 - fold, 254), jnp.uint16(0x7FC0), bits)
    return lax.bitcast_convert_type(bits, jnp.bfloat16)


FP4_KERNEL_MAX_BYTE = 254 - FP4_KERNEL_FOLD   # the largest UE8M0 byte bf16 holds with that fold (scale 2)


def is_fp4_kernel_layout(s: jax.Array) -> bool:
    """Whether FP4 scales come as fp4_kernel_scales made them (bf16) rather than as UE8M0 bytes (FP4 weights as
    fp4_kernel_weights made them are uint16)."""
    return s.dtype == jnp.bfloat16


def fp4_kernel_scales(s: jax.Array) -> jax.Array:
    """FP4 UE8M0 scales [..., out, in/32] (uint8 or float8_e8m0fnu) -> the swap kernels' operand: bf16
    [..., in/32, out] of 2^(b - 127 + FP4_KERNEL_FOLD) (e8m0_bf16: NaN for b > 128, scales above 2). Models hold
    routed experts' FP4 scales so (model.moe.Experts), so no decode step transposes and converts them: that
    per-call pass took 0.07 ms per V4-Flash scale tensor, 0.21 ms per layer (twelfth session, H200); the
    price is 2 bytes per 32 weights instead of 1 (the kernels read the bf16 either way)."""
    if is_fp4_kernel_layout(s):
        return s
    return e8m0_bf16(jnp.swapaxes(_as_e8m0_bytes(s), -1, -2), FP4_KERNEL_FOLD)


def fp4_scale_bytes(s: jax.Array) -> jax.Array:
    """FP4 scales in either layout -> UE8M0 bytes uint8 [..., out, in/32]: checkpoint bytes as they are,
    fp4_kernel_scales' back (its NaN -> 255)."""
    if not is_fp4_kernel_layout(s):
        return _as_e8m0_bytes(s)
    e = (lax.bitcast_convert_type(s, jnp.uint16) >> 7).astype(jnp.int32) & 0xFF
    return jnp.swapaxes(jnp.where(e == 255, 255, e - FP4_KERNEL_FOLD).astype(jnp.uint8), -1, -2)


def _held_byte_bits(w: int) -> np.ndarray:
    """[256] uint32: the bits of a held word that checkpoint byte b of a group's word w (its nibbles 2c, 2c + 1
    -- weights 8w + 2c, 8w + 2c + 1) fills, for every b (fp4_held_bit, nibbles 2w and 2w + 1 of the held word)."""
    b = np.arange(256)
    bits = np.zeros(256, np.uint32)
    for lane in range(2):
        for f in range(4):
            bits |= (((b >> (4 * lane + f)) & 1) << fp4_held_bit(2 * w + lane, f)).astype(np.uint32)
    return bits


_HELD_BYTE_BITS = np.stack([_held_byte_bits(w) for w in range(4)])      # [w, byte value]


@jax.jit   # eager, the loader's per-tensor conversion took 12x longer (CPU)
def fp4_kernel_weights(w: jax.Array) -> jax.Array:
    """Packed FP4 weights [..., out, in/2] (int8 / uint8, the checkpoint's E2M1 pairs) -> the swap kernels'
    operand: uint16 [..., out, in/4], each scale group's 16 bytes of a row held as four 32-bit words (two uint16,
    low first). Held word c of a group holds weights 8w + 2c + l (w = 0..3, l = 0, 1) in slot 2w + l, with their
    bits where the register decode finds them (fp4_held_bit), so that decoded word w of the thread holding word c
    is operand column 8w + 2c + l of the WGMMA layout: the weights' own order, the activations need none.
    Models hold routed experts' FP4 weights so (model.moe.Experts); as many bytes as the checkpoint's."""
    if w.dtype == jnp.uint16:
        return w
    *lead, out, half = w.shape
    if w.dtype not in (jnp.int8, jnp.uint8) or half % FP4_GROUP:
        raise ValueError(f"fp4_kernel_weights: packed FP4 [..., out, in/2] int8/uint8 with in/2 a multiple of "
                         f"{FP4_GROUP}, got {w.dtype} {w.shape}")
    byte = w.astype(jnp.uint8).reshape(*lead, out, half // FP4_GROUP, 4, 4)      # [..., out, group, w, c]
    held = jnp.zeros(byte.shape[:-2] + (4,), jnp.uint32)
    for src in range(4):                                                          # held word c |= bits of byte (w, c)
        held = held | jnp.asarray(_HELD_BYTE_BITS[src])[byte[..., src, :].astype(jnp.int32)]
    return lax.bitcast_convert_type(held, jnp.uint16).reshape(*lead, out, half // 2)


@jax.jit   # eager, the loader's per-tensor conversion took 12x longer (CPU)
def fp4_weight_bytes(w: jax.Array) -> jax.Array:
    """FP4 weights in either layout -> the checkpoint's packed int8 [..., out, in/2]."""
    if w.dtype != jnp.uint16:
        return w
    *lead, out, quarter = w.shape
    words = lax.bitcast_convert_type(w.reshape(*lead, out, quarter // 8, 4, 2), jnp.uint32)[..., None, :]
    # [..., out, g, 1 (w), c]
    byte = jnp.zeros(words.shape[:-2] + (4, 4), jnp.uint32)                           # [..., out, g, w, c]
    for lane in range(2):
        for f in range(4):
            src = jnp.asarray([fp4_held_bit(2 * s + lane, f) for s in range(4)], jnp.uint32)[:, None]
            byte = byte | (((words >> src) & 1) << (4 * lane + f))
    return byte.astype(jnp.uint8).reshape(*lead, out, 2 * quarter).astype(jnp.int8)


def fp4_logical_shape(w: jax.Array) -> tuple[int, ...]:
    """(..., out, in) of FP4 weights in either layout."""
    return (*w.shape[:-1], (4 if w.dtype == jnp.uint16 else 2) * w.shape[-1])


def _swap_w(fmt, w, s):
    """A weight's kernel operands: (w,), FP8 (w, s), FP4 (fp4_kernel_weights, fp4_kernel_scales): held so by the
    model they go straight in; the checkpoint's bytes cost a per-call pass (0.07 ms per V4-Flash scale tensor,
    H200). bf16 scales save the decode kernels two integer instructions per scale over bytes: Nsight Compute
    found them bound by the integer ALU pipe (B256 gate/up kernel: ALU 61% busy, DRAM 29%; eleventh session)."""
    if fmt != "fp4":
        return (w,) if fmt == "dense" else (w, s)
    return fp4_kernel_weights(w), fp4_kernel_scales(s)


def _swap_gemm(what, x, plan_arrays, ws, ss, *, fmt, names, cfg: MgpuConfig, epilogue, out_dtype, interpret,
               rows=None, out_rows=False):
    """swap_ab: outT [N, P] = epilogue([W_e xT_t for W in ws]) (* routing weights) for each tile t of block_m
    token columns of xT [K, P] (wgmma's N) -- x is xT, or with rows = (row_token [P], live rows) the token rows
    [M, K] that `transpose` gathers into it (one pass; the tiles past the live rows are left unwritten);
    out_rows: out [P, N] instead of outT (the epilogue stores through a transposed SMEM view);
    ws: weights [E, N, K] in storage format (FP4 either layout), ss their scales (None).

    Each K step streams the activations' [bk, bm] and per weight its [bn, bk] tile -- FP4: the held [bn, 8G]
    uint16 tile of its G scale groups (fp4_kernel_weights; one TMA copy of 16G-byte rows: decode 11% faster at
    G = 4 than one [bn, 8] copy per group, fourteenth session) and their scales [G, bn]; FP8 scales are read as
    GMEM scalars. The cfg.compute_wgs
    compute warpgroups each own bn / compute_wgs weight rows (wgmma's M): SMEM operands (dense) stay one
    step in flight (but in persistent CTAs); register operands (FP8, FP4 dequantised in registers) must outlive
    their wgmma, so a warpgroup's step ends waiting for them -- while another warpgroup decodes."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    k, p = (x.shape[1], rows[0].shape[0]) if rows else x.shape
    n = logical_shape(ws[0], fmt)[1]
    bm, bn, bk, fp8_block = _swap_tiles(what, fmt, cfg, names, n, k, p, ws[0], ss[0])
    xt = transpose(x, *rows, interpret=interpret is not None) if rows else x
    wgs, nk, nw = cfg.compute_wgs, k // bk, len(ws)
    wb, g = bn // wgs, bk // (2 * FP4_GROUP)
    ops = [_swap_w(fmt, w, s) for w, s in zip(ws, ss)]
    per_w = len(ops[0])
    w_bytes = {"dense": 2 * bn * bk, "fp8": bn * bk, "fp4": bn * (bk // 2 + 2 * g)}[fmt]   # per weight and step
    fit = _fit_steps(cfg.max_concurrent_steps, bk * bm * jnp.dtype(xt.dtype).itemsize + nw * w_bytes,
                     wgs * (wb * bm * jnp.dtype(out_dtype).itemsize + 4 * max(bm, 32)))
    steps, delay = _pipeline_depth(fit, nk, cfg.persistent)
    spec = lambda shape, index: plgpu.BlockSpec(shape, index, delay_release=delay)  # noqa: E731
    if fmt == "fp4":    # the step's held words (one copy of G groups a row) and their scales [G, bn]
        w_specs = [spec((bn, g * FP4_GROUP // 2), lambda kk: (0, kk)), spec((g, bn), lambda kk: (kk, 0))]
    else:
        w_specs = [spec((bn, bk), lambda kk: (0, kk))]
    specs = [spec((bk, bm), lambda kk: (kk, 0))] + w_specs * nw

    def cta_refs(refs, t, j, e):
        rows = pl.ds(j * bn, bn)
        streamed = []
        for i in range(nw):
            w_g = refs[1 + i * per_w]
            streamed.append(w_g.at[e, rows])
            if fmt == "fp4":
                streamed.append(refs[2 + i * per_w].at[e, :, rows])
        return (refs[0].at[:, pl.ds(t * bm, bm)], *streamed)

    def mma(cta, kk, tiles, accs):
        x_s, per_acc = tiles[0], len(w_specs)
        rows = pl.ds(cta.wg * wb, wb)
        for i, acc in enumerate(accs):
            w_t = tiles[1 + i * per_acc:1 + (i + 1) * per_acc]
            if fmt == "dense":
                a = w_t[0].at[rows]
            elif fmt == "fp8":
                sc = _scale_scalar(cta.operands[2 + i * per_w], cta.e, (cta.j * bn) // fp8_block,
                                   (kk * bk) // fp8_block)
                a = (w_t[0].at[rows][...].astype(jnp.float32) * sc).astype(jnp.bfloat16)
            else:
                a = _fp4_operand(plgpu, w_t[0].at[rows][...], [w_t[1][q, rows] for q in range(g)])
            plgpu.wgmma(acc, a, x_s)
        plgpu.wgmma_wait(delay if fmt == "dense" else 0)
        return accs

    def out_block(t, j, wg):     # this warpgroup's weight rows x the tile's tokens, or the transpose
        block = (pl.ds(j * bn + wg * wb, wb), pl.ds(t * bm, bm))
        return block[::-1] if out_rows else block

    return _ws_kernel(plan_arrays=plan_arrays, operands=(xt, *(a for o in ops for a in o)),
                      specs=specs, cta_refs=cta_refs, mma=mma, acc_shape=(wb, bm), num_accs=nw, epilogue=epilogue,
                      rw_axis=1, rw_slice=lambda t, wg: pl.ds(t * bm, bm), out_block=out_block,
                      grid=(p // bm, n // bn), wgs=wgs, specialized=cfg.warp_specialized, persistent=cfg.persistent,
                      nk=nk, steps=steps, out_shape=(p, n) if out_rows else (n, p), out_dtype=out_dtype,
                      interpret=interpret, out_t=out_rows)


def _row_tiles(a: jax.Array, rows, live, *, transposed: bool, interpret: bool) -> jax.Array:
    """a [R, C] (rows None) or a[rows] (rows [P] int32), transposed or not, copied by one Triton kernel of 64-row x
    128-byte tiles; the tiles whose first (gathered) row is at or past `live` (int32 scalar, None: all) are not
    written. Rows are gathered as whole 128-byte runs, so each tile's loads and stores are coalesced."""
    from jax.experimental.pallas import triton as plt
    r, c = a.shape if rows is None else (rows.shape[0], a.shape[1])
    br, bc = math.gcd(r, 64), math.gcd(c, 128 // a.dtype.itemsize)
    live = jnp.reshape(jnp.int32(r) if live is None else live, (1,)).astype(jnp.int32)

    def kern(live_ref, *refs):
        *idx_ref, a_ref, o_ref = refs
        i, j = pl.program_id(0), pl.program_id(1)

        @pl.when(i * br < live_ref[0])
        def _():
            tile = a_ref[idx_ref[0][...], pl.ds(j * bc, bc)] if idx_ref else a_ref[...]
            o_ref[...] = tile.T if transposed else tile

    scalar = pl.BlockSpec((1,), lambda i, j: (0,))
    if rows is None:
        specs, args = [pl.BlockSpec((br, bc), lambda i, j: (i, j))], (a,)
    else:   # a whole: each tile gathers its rows
        specs, args = [pl.BlockSpec((br,), lambda i, j: (i,)), pl.BlockSpec(a.shape, lambda i, j: (0, 0))], \
            (rows.astype(jnp.int32), a)
    out = (pl.BlockSpec((bc, br), lambda i, j: (j, i)), (c, r)) if transposed else \
        (pl.BlockSpec((br, bc), lambda i, j: (i, j)), (r, c))
    return pl.pallas_call(
        kern, grid=(r // br, c // bc), in_specs=[scalar, *specs], out_specs=out[0],
        out_shape=jax.ShapeDtypeStruct(out[1], a.dtype), compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name="moe_transpose" if transposed else "moe_take_rows",
    )(live, *args)


def transpose(a: jax.Array, rows: jax.Array | None = None, live: jax.Array | None = None, *,
              interpret: bool = False) -> jax.Array:
    """a.T, or with rows [P] int32 the gathered a[rows].T [C, P], for an a [R, C], materialised by one Triton
    kernel (live, an int32 scalar: output columns from live on are left unwritten -- the swap kernels' dead
    tiles, which nothing reads). The gathered form is the swap kernels' dispatch: one pass instead of a row
    gather and a transpose (8K tokens: 0.20 ms against 0.26 + 0.37; experiments/probes/moe_combine.py, H200).
    Left to XLA, a transpose fused into its consumer's gather, which then read strided columns at 3-10% of HBM
    bandwidth, and layout assignment relabels an XLA-side copy: only a custom call keeps the copy physical."""
    return _row_tiles(a, rows, live, transposed=True, interpret=interpret)


def act_quant_rows(a: jax.Array, block: int, live_rows: jax.Array, *, rows: int = 64, interpret: bool = False
                   ) -> tuple[jax.Array, jax.Array]:
    """`reference.act_quant` of a [P, N] (float32 / bf16) by a Triton kernel, for the routed rows before live_rows
    (int32 scalar; the tile-padded rows past it are left unwritten: no kernel reads them) ->
    (q float8_e4m3fn [P, N], scales transposed [N / block, P] float32, as the FP8 row tiles stream them).
    XLA spent 0.62 ms on the whole [81920, 2048] float32 SwiGLU output at 8K tokens, about half of it on
    padding rows (experiments/probes/moe_prefill_glue.py, H200). Bit-identical to the reference: the exponent
    ceil(log2(amax / 448)) is read off amax's bits (448 = 1.75 * 2^8: it is amax's exponent - 8, plus 1 when
    the mantissa exceeds 1.75; f32 division never rounds across 1 there), then x * 2^-e is exact and the E4M3
    cast rounds to nearest even with saturation, as the reference's clip-then-cast."""
    from jax.experimental.pallas import triton as plt
    p, n = a.shape
    if n % block or p % rows:
        raise ValueError(f"act_quant_rows: [{p}, {n}] must tile by ({rows}, {block})")

    def kern(live_ref, a_ref, q_ref, s_ref):
        @pl.when(pl.program_id(0) * rows < live_ref[0])
        def _():
            x = a_ref[...].astype(jnp.float32)
            amax = jnp.maximum(jnp.max(jnp.abs(x), axis=1), 1e-4)
            bits = lax.bitcast_convert_type(amax, jnp.int32)
            exp = (bits >> 23) - (127 + 8) + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
            exp = jnp.clip(exp, -126, 127)         # amax >= 1e-4 keeps it far inside; the reference clips at 127
            inv = lax.bitcast_convert_type((127 - exp) << 23, jnp.float32)
            q_ref[...] = jnp.clip(x * inv[:, None], -ref.FP8_E4M3_MAX, ref.FP8_E4M3_MAX).astype(q_ref.dtype)
            s_ref[...] = lax.bitcast_convert_type((exp + 127) << 23, jnp.float32)[None, :]

    live = jnp.reshape(live_rows, (1,)).astype(jnp.int32)
    return pl.pallas_call(
        kern, grid=(p // rows, n // block),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)), pl.BlockSpec((rows, block), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((rows, block), lambda i, j: (i, j)), pl.BlockSpec((1, rows), lambda i, j: (j, i))],
        out_shape=[jax.ShapeDtypeStruct((p, n), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((n // block, p), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2), interpret=interpret, name="moe_act_quant",
    )(live, a)


def take_rows(a: jax.Array, index: jax.Array, live: jax.Array | None = None, *, interpret: bool = False
              ) -> jax.Array:
    """jnp.take(a, index, axis=0) for a [R, C] by one Triton kernel; the 64-row output tiles from `live` (int32
    scalar) on are left unwritten (the dead tiles of a RoutePlan, which no kernel reads: half the rows of the
    192-row balanced prefill tiles). Narrow elements travel as 4-byte words: XLA's row gather of 1- and 2-byte
    elements ran 3.6x / 1.9x slower than of words (experiments/probes/moe_prefill_glue.py, H200)."""
    per = 4 // a.dtype.itemsize if a.dtype.itemsize < 4 else 1
    if per == 1 or a.shape[1] % per:
        return _row_tiles(a, index, live, transposed=False, interpret=interpret)
    words = lax.bitcast_convert_type(a.reshape(a.shape[0], -1, per), jnp.uint32)
    out = _row_tiles(words, index, live, transposed=False, interpret=interpret)
    return lax.bitcast_convert_type(out, a.dtype).reshape(index.shape[0], a.shape[1])


# ----------------------------------------------------------------------------------------- entry point


def choose_backend(fmt: str, compute_dtype, rows_per_expert: float = 0.0) -> str:
    """The kernel that measured fastest on the H200 for the load (experiments/bench_moe.py, docs/benchmarks.md):
    Mosaic GPU for FP4 at every load (swap_ab: registers decode the E2M1 table) and for bf16 / FP8 prefill
    (> 64 rows per expert; warp-specialised, two compute warpgroups: 8K tokens bf16 5.57 ms against Triton's
    6.29, FP8 6.84 against 9.61), Triton for bf16 / FP8 decode and verify. Off Hopper (and in the CPU
    interpreters, which have no register wgmma operand) Triton serves all."""
    if jnp.dtype(compute_dtype) == jnp.dtype(jnp.bfloat16) and on_hopper() and (
            fmt == "fp4" or (rows_per_expert > 64 and fmt in ("dense", "fp8"))):
        return "mgpu"
    return "triton"


def moe_experts(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w1: jax.Array, w2: jax.Array,
                w3: jax.Array, limit: float, *, scales=None, backend: str = "auto", config=None,
                interpret=None, weight_layout: str = "out_in", compute_dtype=jnp.bfloat16, act_block: int = 0,
                balanced: bool = False) -> jax.Array:
    """Routed-expert SwiGLU block (drop-in for `reference.moe_experts`, plus quantised weights).

    x [M, D], expert_ids [M, k] int (ids outside [0, E) are dropped: they cost nothing and add 0 -- an
    expert-parallel shard passes the rows it does not own that way), weights [M, k] float32 (routing weights),
    w1/w3 [E, I, D], w2 [E, D, I] in storage format (dense; FP8 E4M3; FP4 packed [E, out, in/2]),
    scales: None or (s1, s2, s3) UE8M0 scales of w1, w2, w3 (see module docstring; FP4 ones also as
    fp4_kernel_scales, which the swap kernels take without a per-call pass),
    backend: "auto" | "triton" | "mgpu"; config: TritonConfig / MgpuConfig (None -> by regime);
    interpret: None (auto: interpret on CPU) | bool | an InterpretGPUParams for mgpu;
    weight_layout: "out_in" (the model's [E, out, in]) or "in_out" (dense, or FP8 on the mgpu row tiles, scales
    unchanged: w1/w3 [E, D, I], w2 [E, I, D],
    as ragged_dot takes them; the MGPU CPU interpreter has no transposed wgmma operand, so its tests use this).
    Activations enter the GEMMs as `compute_dtype` (bf16; dense weights use their own dtype).
    act_block > 0: both GEMMs' inputs are FP8 act_quant'd per `act_block` values first (the official model's
    numerics, `reference.moe_experts(act_block=)`). With FP8 weights of the same block on the Triton backend,
    at decode / verify loads (<= 48 rows per expert), or on the mgpu row tiles (MgpuConfig(swap_ab=False),
    block_k = the block), the kernels then multiply FP8 x FP8 (tensor-core FP8
    MMA, both scales on the f32 partial products); otherwise the rounded activations enter the usual kernels
    in `compute_dtype` (exact: 4 significant bits).
    balanced: the routing gives every expert the same row count (forced_balance); only the default tiling
    uses it (default_config).
    Returns [M, D] float32 = sum_k w_k * W2_e(swiglu(W1_e x, W3_e x)).
    """
    # FP4 comes in either layout (fp4_kernel_weights / fp4_kernel_scales): the swap kernels take the held operands,
    # the Triton kernels the checkpoint's bytes (converted in their branch only); the checks read shapes
    s1, s2, s3 = (None, None, None) if scales is None else tuple(scales)
    fmt = weight_format(w1, s1)
    if fmt == "fp8":
        s1, s2, s3 = (_as_e8m0_bytes(s) for s in (s1, s2, s3))
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
    if backend == "auto":
        backend = choose_backend(fmt, cdt, m * k / e)
    if config is None:
        config = default_config(backend, m * k, e, fmt, fp8_acts=fp8_acts, balanced=balanced)
    if kn and fmt == "fp8" and not (backend == "mgpu" and not config.swap_ab):
        raise ValueError("moe_experts: FP8 weights in the 'in_out' layout run on the mgpu row tiles only")
    interp = interpret_flag(backend, interpret)
    # FP8 x FP8 MMA: in Triton where it measured faster (bench_moe, H200): decode / verify tiles (3.84-3.90 TB/s
    # against 3.32-3.43 for the Mosaic GPU swap kernels at 64 / 256 tokens); Triton's prefill tiles ran 186-193
    # TFLOP/s, below the bf16 MMA of the rounded activations, but the mgpu row tiles (which take FP8 weights
    # only this way) 473 at 8K tokens, against 362 for the swap kernels (eleventh session)
    row_tiles = backend == "mgpu" and isinstance(config, MgpuConfig) and not config.swap_ab
    fp8_mma = fp8_acts and (row_tiles or (backend == "triton" and m * k <= 48 * e))
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
        z = _gate_up_triton(split(xs), plan.row_weight, plan.tile_expert, w1, w3, s1, s3, fmt=fmt,
                            limit=limit, cfg=config, interpret=interp, out_dtype=z_dtype, kn=kn, x_scale=x_scale)
        z, z_scale = gemm_input(z)
        y = _down_triton(split(z), plan.tile_expert, w2, s2, fmt=fmt, cfg=config, out_dtype=cdt,
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
        zt = _swap_gemm("gate/up", xq, tiles + (plan.row_weight,), (w1, w3), (s1, s3), fmt=fmt,
                        names=("block_n", "block_k"), cfg=config, epilogue=lambda accs: _swiglu(*accs, limit),
                        out_dtype=z_dtype, interpret=interp, rows=(plan.row_token, live_rows))
        zt = rounded(zt.T).T if act_block else zt
        y = _swap_gemm("down", zt, tiles, (w2,), (s2,), fmt=fmt, names=("block_n_down", "block_k_down"),
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
        z = _row_gemm("gate/up", xs, tiles + ((plan.row_weight,) if config.route_weight_in_kernel else ()),
                      (w1, w3), bn=config.block_n, bk=config.block_k, cfg=config, kn=kn,
                      epilogue=lambda accs: _swiglu(*accs, limit), out_dtype=z_dtype, interpret=interp,
                      x_scale_t=None if x_scale is None else x_scale.T, ss=(s1, s3))
        if fp8_mma:
            zs, z_scale_t = act_quant_rows(z, act_block, live_rows,
                                           rows=math.gcd(config.block_m, 64), interpret=interp is not None)
        else:
            zs, z_scale_t = rounded(z), None
        y = _row_gemm("down", zs, tiles, (w2,), bn=config.block_n_down, bk=config.block_k_down, cfg=config,
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
        return jnp.sum(rows, axis=1)
