"""Mosaic GPU row tiles: a tile's tokens are wgmma's M (64 rows per compute warpgroup), the weights its B.

The prefill orientation for dense bf16 / f16 weights, and for FP8 weights with FP8 activations of their block
(FP8 x FP8: per-block promotion of float32 partials into register-carried totals, as DeepGEMM does).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import reference as ref
from .configs import MgpuConfig
from .mgpu_pipeline import fit_steps, pipeline_depth, scale_scalar, ws_kernel


def _check_mgpu_tiles(p, n, k, bm, wgs, bn, bk, what):
    if bm % wgs or (bm // wgs) % 64 or bn % 8 or bn > 256:
        raise ValueError(f"moe {what} (mgpu): block_m must be compute_wgs x a multiple of 64 rows and block_n "
                         f"<= 256, got block_m={bm}, compute_wgs={wgs}, block_n={bn}")
    if p % bm or n % bn or k % bk:
        raise ValueError(f"moe {what} (mgpu): [{p}, {k}] x [{n}, {k}] does not tile by ({bm}, {bn}, {bk})")


def _w_operand(plgpu, w_s, kn):
    # [N, K] tiles (the model's [E, out, in] storage) are K-major: wgmma takes them through a transposed view
    return w_s if kn else plgpu.transpose_ref(w_s, (1, 0))


def row_gemm(what, x, plan_arrays, ws, *, bn, bk, cfg: MgpuConfig, kn, epilogue, out_dtype, interpret,
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
    fit = fit_steps(cfg.max_concurrent_steps, (bm + nw * bn) * bk * item + (4 * bm if fp8 else 0),
                     wgs * wm * (bn * jnp.dtype(out_dtype).itemsize + 4))
    steps, delay = pipeline_depth(fit, nk, cfg.persistent)
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
            return tuple(total + part * (row_scale * scale_scalar(s_g, cta.e, (cta.j * bn) // block, kk))
                         for total, part, s_g in zip(accs, parts, cta.operands[n_x + nw:]))

        @pl.when(cta.wg * wm < cta.rows)
        def _():
            for acc, w in zip(accs, w_s):
                plgpu.wgmma(acc, x_s, _w_operand(plgpu, w, kn))
        plgpu.wgmma_wait(delay)
        return accs

    operands = (x,) + ((x_scale_t,) if fp8 else ()) + tuple(ws) + (tuple(ss) if fp8 else ())
    return ws_kernel(plan_arrays=plan_arrays, operands=operands, specs=specs, cta_refs=cta_refs, mma=mma,
                     acc_shape=(wm, bn), num_accs=nw, epilogue=epilogue, rw_axis=0, register_carry=fp8,
                     rw_slice=lambda t, wg: pl.ds(t * bm + wg * wm, wm),
                     out_block=lambda t, j, wg: (pl.ds(t * bm + wg * wm, wm), pl.ds(j * bn, bn)),
                     grid=(p // bm, n // bn), wgs=wgs, specialized=cfg.warp_specialized, persistent=cfg.persistent,
                     nk=nk, steps=steps, out_shape=(p, n), out_dtype=out_dtype, interpret=interpret)
