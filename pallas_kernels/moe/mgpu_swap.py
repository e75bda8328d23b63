"""Mosaic GPU swap_ab tiles: the weights are wgmma's M operand and a tile's 16..256 tokens its N.

Decode/verify tiles hold a handful of rows, but wgmma's M is 64: with the weights as the M operand (the
[E, out, in] storage is already wgmma's K-major A layout) and the tile's tokens as N (any multiple of 8 up to
256) a tile costs one pass over its expert's weights whatever its row count. The activations go in transposed
([D, P], gathered so by the dispatch kernel `row_kernels.transpose`) and z comes out transposed ([I, P]), so no
operand needs a transposed SMEM view (which keeps the bf16 kernels runnable in the MGPU CPU interpreter); the
down kernel stores y [P, D] through one, so that the combine gathers whole rows.
Quantised weights are dequantised in registers (wgmma's A operand may live in registers):
  FP8  E4M3 -> f32 times the tile's UE8M0 block scale -> bf16 (blocks of whole tiles, V4's 128 x 128); blocks of
       ROW_SCALE_BLOCK (V4.1's 32 x 32) take their scales as rows, one per weight row and 32 columns (the FP4
       kernels' scale layout, `fp8_row_scales`), streamed beside the weights: each 32-column group of a tile
       times its scale row (_fp8_rows_operand);
  FP4  a K step is G whole scale groups (16 packed bytes = 32 logical columns, one UE8M0 scale per weight row),
       streamed as one held [bn, 8G] uint16 tile (layouts.fp4_kernel_weights); a thread's 32-bit words are
       decoded to bf16 in inline PTX (nine integer instructions per 8 weights) and the step's groups form one
       [bn, 32G] operand (_fp4_operand) in the weights' own K order. The scales enter as bf16, transposed
       ([E, in/32, out], layouts.fp4_kernel_scales) so that a group's scales are one contiguous [bn] row.
The CPU interpreter has no register operand, so the quantised paths are checked by lowering and on the GPU.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .. import reference as ref
from .configs import MgpuConfig
from .layouts import E2M1_WORDS_PTX, FP4_GROUP, e8m0_bf16, logical_shape, swap_operands
from .mgpu_pipeline import fit_steps, pipeline_depth, scale_scalar, ws_kernel
from .row_kernels import transpose


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
                                      E2M1_WORDS_PTX, "=r,=r,=r,=r,r")
                for w in range(4):
                    words[w][idx] = mgpu.utils.bitcast(llvm.extractvalue(i32, out, [w]), bf16x2)
            parts += [(mgpu.FragmentedArray(_registers=r, _layout=held.layout, _is_signed=None) * s).registers
                      for r in words]
        return mgpu.FragmentedArray(_registers=np.concatenate(parts, axis=1), _layout=mgpu.WGMMA_LAYOUT,
                                    _is_signed=None)

    return decode(tile, tuple(lax.broadcast_in_dim(b, (n, FP4_GROUP // 2), [0]) for b in scale_rows))


ROW_SCALE_BLOCK = 32   # FP8 scale blocks of this size enter as scale rows (one per weight row and 32 columns)


def fp8_row_scales(s: jax.Array) -> jax.Array:
    """UE8M0 bytes [E, N/32, K/32] of 32 x 32 blocks -> the scale rows the swap tiles stream: bf16 [E, K/32, N] of
    2^(b - 127), each block's scale repeated over its 32 weight rows (layouts.e8m0_bf16: NaN for byte 255)."""
    rows = jnp.repeat(jnp.swapaxes(s, -1, -2), ROW_SCALE_BLOCK, axis=-1)
    return e8m0_bf16(rows)


def _fp8_rows_operand(plgpu, tile, scale_rows):
    """One K step's wgmma A operand from FP8 with scale rows: the tile [n, 32G] as float32 (WGMMA layout: axis 1 of
    its register array the 8-column blocks, four a group) and its G groups' scale rows [n] -> [n, 32G] bf16, each
    group's columns times its row's scale (exact: powers of two). The groups' registers are concatenated along K,
    which moves no data."""
    import jax.experimental.mosaic.gpu as mgpu
    n, g = tile.shape[0], len(scale_rows)
    wgmma = plgpu.Layout.WGMMA
    per_group = ROW_SCALE_BLOCK // 8

    @plgpu.inline_mgpu(arg_types=(wgmma, (wgmma,) * g),
                       return_type=plgpu.ShapeDtypeStruct((n, ROW_SCALE_BLOCK * g), jnp.float32, layout=wgmma))
    def scaled(_, values, scales):
        assert values.layout == mgpu.WGMMA_LAYOUT, values.layout
        parts = []
        for q, s in enumerate(scales):
            group = values.registers[:, q * per_group:(q + 1) * per_group]
            parts.append((mgpu.FragmentedArray(_registers=group, _layout=values.layout, _is_signed=None)
                          * s).registers)
        return mgpu.FragmentedArray(_registers=np.concatenate(parts, axis=1), _layout=mgpu.WGMMA_LAYOUT,
                                    _is_signed=None)

    rows = tuple(lax.broadcast_in_dim(b.astype(jnp.float32), (n, ROW_SCALE_BLOCK), [0]) for b in scale_rows)
    return scaled(tile, rows).astype(jnp.bfloat16)


class _SwapTiles(NamedTuple):
    bm: int            # tokens per tile (wgmma N)
    bn: int            # weight rows per tile, split over the compute warpgroups (wgmma M: bn / compute_wgs)
    bk: int            # logical input columns per K step
    fp8_block: int     # FP8 scale block (0 otherwise)
    row_scales: bool   # FP8 scale blocks smaller than the tile: scale rows (ROW_SCALE_BLOCK)


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
    row_scales = fmt == "fp8" and fp8_block == ROW_SCALE_BLOCK
    if fmt == "fp8" and not row_scales and (fp8_block % bn or fp8_block % bk):
        raise ValueError(f"moe {what} (mgpu swap): FP8 block {fp8_block} must be {ROW_SCALE_BLOCK} or a multiple of "
                         f"({bn}, {bk})")
    # a register operand's wgmma takes K = the whole step, which must fill the activation tile's swizzle
    # (the largest of 32 / 64 / 128 bytes dividing its 2 * block_m-byte rows)
    k_align = max(math.gcd(2 * bm, 128) // 2, 2 * FP4_GROUP if fmt == "fp4" or row_scales else 1)
    if fmt != "dense" and bk % k_align:
        raise ValueError(f"moe {what} (mgpu swap): {fmt.upper()} with block_m={bm} needs {names[1]} a multiple "
                         f"of {k_align}, got {bk}")
    return _SwapTiles(bm, bn, bk, fp8_block, row_scales)


def swap_gemm(what, x, plan_arrays, ws, ss, *, fmt, names, cfg: MgpuConfig, epilogue, out_dtype, interpret,
              rows=None, out_rows=False, k_split: int = 1):
    """swap_ab: outT [N, P] = epilogue([W_e xT_t for W in ws]) (* routing weights) for each tile t of block_m
    token columns of xT [K, P] (wgmma's N) -- x is xT, or with rows = (row_token [P], live rows) the token rows
    [M, K] that `transpose` gathers into it (one pass; the tiles past the live rows are left unwritten);
    out_rows: out [P, N] instead of outT (the epilogue stores through a transposed SMEM view);
    ws: weights [E, N, K] in storage format (FP4 either layout), ss their scales (None).
    k_split > 1 (dense / FP8): the weights are [E, N, k_split * K] and the plan's group e is weight e // k_split's
    K slice e % k_split (columns (e % k_split) K ..), whose products the caller adds: a split-K GEMM whose
    splits are groups, for weights with too few row blocks to fill the GPU.

    Each K step streams the activations' [bk, bm] and per weight its [bn, bk] tile -- FP4: the held [bn, 8G]
    uint16 tile of its G scale groups (fp4_kernel_weights; one TMA copy of 16G-byte rows, not one per group) and
    their scales [G, bn]; FP8 block scales are read as GMEM scalars, FP8 scale rows streamed as [G, bn]. The
    cfg.compute_wgs compute warpgroups each own bn / compute_wgs weight rows (wgmma's M): SMEM operands (dense)
    stay one step in flight (but in persistent CTAs); register operands (FP8, FP4 dequantised in registers) must
    outlive their wgmma, so a warpgroup's step ends waiting for them -- while another warpgroup decodes."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    k, p = (x.shape[1], rows[0].shape[0]) if rows else x.shape
    n = logical_shape(ws[0], fmt)[1]
    if k_split < 1 or (k_split > 1 and (fmt == "fp4" or rows or ws[0].shape[2] != k_split * k)):
        raise ValueError(f"moe {what} (mgpu swap): k_split={k_split} takes dense / FP8 weights of k_split x "
                         f"{k} input columns and the activations' xT, got {fmt} {ws[0].shape}")
    bm, bn, bk, fp8_block, row_scales = _swap_tiles(what, fmt, cfg, names, n, k, p, ws[0], ss[0])
    xt = transpose(x, *rows, interpret=interpret is not None) if rows else x
    wgs, nk, nw = cfg.compute_wgs, k // bk, len(ws)
    wb, g = bn // wgs, bk // (2 * FP4_GROUP)    # g: 32-column groups a step (FP4, FP8 scale rows)
    ops = [(w, fp8_row_scales(s)) if row_scales else swap_operands(fmt, w, s) for w, s in zip(ws, ss)]
    per_w = len(ops[0])
    w_bytes = {"dense": 2 * bn * bk, "fp8": bn * bk + (2 * g * bn if row_scales else 0),
               "fp4": bn * (bk // 2 + 2 * g)}[fmt]   # per weight and step
    fit = fit_steps(cfg.max_concurrent_steps, bk * bm * jnp.dtype(xt.dtype).itemsize + nw * w_bytes,
                     wgs * (wb * bm * jnp.dtype(out_dtype).itemsize + 4 * max(bm, 32)))
    steps, delay = pipeline_depth(fit, nk, cfg.persistent)
    spec = lambda shape, index: plgpu.BlockSpec(shape, index, delay_release=delay)  # noqa: E731
    if fmt == "fp4":    # the step's held words (one copy of G groups a row) and their scales [G, bn]
        w_specs = [spec((bn, g * FP4_GROUP // 2), lambda kk: (0, kk)), spec((g, bn), lambda kk: (kk, 0))]
    else:               # FP8 scale rows: the step's [G, bn] beside its weights
        w_specs = [spec((bn, bk), lambda kk: (0, kk))] + ([spec((g, bn), lambda kk: (kk, 0))] if row_scales else [])
    specs = [spec((bk, bm), lambda kk: (kk, 0))] + w_specs * nw

    def weight_of(e):   # group e -> (its weight, the first of its K columns)
        return (lax.div(e, k_split), lax.rem(e, k_split) * k) if k_split > 1 else (e, 0)

    def cta_refs(refs, t, j, e):
        rows = pl.ds(j * bn, bn)
        streamed = []
        we, k0 = weight_of(e)
        for i in range(nw):
            w_g = refs[1 + i * per_w]
            streamed.append(w_g.at[we, rows, pl.ds(k0, k)] if k_split > 1 else w_g.at[e, rows])
            if fmt == "fp4":
                streamed.append(refs[2 + i * per_w].at[e, :, rows])
            elif row_scales:
                groups = pl.ds(k0 // ROW_SCALE_BLOCK, k // ROW_SCALE_BLOCK)
                streamed.append(refs[2 + i * per_w].at[we, groups, rows] if k_split > 1
                                else refs[2 + i * per_w].at[e, :, rows])
        return (refs[0].at[:, pl.ds(t * bm, bm)], *streamed)

    def mma(cta, kk, tiles, accs):
        x_s, per_acc = tiles[0], len(w_specs)
        rows = pl.ds(cta.wg * wb, wb)
        we, k0 = weight_of(cta.e)
        for i, acc in enumerate(accs):
            w_t = tiles[1 + i * per_acc:1 + (i + 1) * per_acc]
            if fmt == "dense":
                a = w_t[0].at[rows]
            elif row_scales:
                a = _fp8_rows_operand(plgpu, w_t[0].at[rows][...].astype(jnp.float32),
                                      [w_t[1][q, rows] for q in range(g)])
            elif fmt == "fp8":
                sc = scale_scalar(cta.operands[2 + i * per_w], we, (cta.j * bn) // fp8_block,
                                  (k0 + kk * bk) // fp8_block)
                a = (w_t[0].at[rows][...].astype(jnp.float32) * sc).astype(jnp.bfloat16)
            else:
                a = _fp4_operand(plgpu, w_t[0].at[rows][...], [w_t[1][q, rows] for q in range(g)])
            plgpu.wgmma(acc, a, x_s)
        plgpu.wgmma_wait(delay if fmt == "dense" else 0)
        return accs

    def out_block(t, j, wg):     # this warpgroup's weight rows x the tile's tokens, or the transpose
        block = (pl.ds(j * bn + wg * wb, wb), pl.ds(t * bm, bm))
        return block[::-1] if out_rows else block

    return ws_kernel(plan_arrays=plan_arrays, operands=(xt, *(a for o in ops for a in o)),
                     specs=specs, cta_refs=cta_refs, mma=mma, acc_shape=(wb, bm), num_accs=nw, epilogue=epilogue,
                     rw_axis=1, rw_slice=lambda t, wg: pl.ds(t * bm, bm), out_block=out_block,
                     grid=(p // bm, n // bn), wgs=wgs, specialized=cfg.warp_specialized, persistent=cfg.persistent,
                     nk=nk, steps=steps, out_shape=(p, n) if out_rows else (n, p), out_dtype=out_dtype,
                     interpret=interpret, out_t=out_rows)
