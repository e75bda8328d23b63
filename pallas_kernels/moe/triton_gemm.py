"""The MoE grouped GEMMs in Pallas-Triton, every weight format (dense, FP8 blocks, packed FP4).

Over a RoutePlan's tile-aligned rows: `gate_up` runs one program per (block of I, tile) -- both projections of
the tile's rows against the same slice of W1_e and W3_e, then the clamped SwiGLU and the routing weight in the
epilogue, written as z [P, I]; `down` one program per (block of D, tile): z_tile W2_e^T -> y [P, D]. Dead tiles
(tile_expert -1) exit at once. Weights are dequantised in registers: FP8 by its block scale on the partial
product (or FP8 x FP8 MMA with act_quant'd activations of the same block), FP4 by the f16 bit trick of
`common.e2m1_pair` on the even / odd column halves of the activations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import reference as ref
from ..common import FP4_FOLD, e8m0, fp4_tile, swiglu
from .configs import TritonConfig


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


def _grid_order(rows_fastest: bool):
    """(grid index 0, grid index 1) -> (column block j, tile t), the one convention `_triton_call`'s specs and its
    kernels read their ids by (it is its own inverse: it also maps (j, t) sizes to the grid's)."""
    return (lambda a, b: (b, a)) if rows_fastest else (lambda a, b: (a, b))


def _triton_call(kernel, *, args, x_parts, bm, bn, grid, out_shape, cfg, interpret, name, rows_fastest=False):
    """grid = (column blocks j, tiles t): program_id(0) = j is the fastest-launched axis, so the programs
    of one tile run together and re-read its activation rows from L2, not HBM (each weight slice is read
    by one program per tile either way). rows_fastest: grid = (t, j), the programs of one column block run
    together and re-read its weight slice from L2 (a dense linear over many row tiles); the kernel reads its
    (j, t) through `_grid_order` too."""
    from jax.experimental.pallas import triton as plt
    jt = _grid_order(rows_fastest)
    full = lambda a: pl.BlockSpec(a.shape, lambda g0, g1, n=a.ndim: (0,) * n)  # noqa: E731
    row_block = lambda a: pl.BlockSpec((bm,) + a.shape[1:],  # noqa: E731
                                       lambda g0, g1, n=a.ndim: (jt(g0, g1)[1],) + (0,) * (n - 1))
    in_specs = [full(args[0])] + [row_block(a) for a in args[1:1 + x_parts]] + [full(a) for a in args[1 + x_parts:]]
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=jt(*grid), in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda g0, g1: jt(g0, g1)[::-1]),
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


def gate_up(xparts, row_weight, tile_expert, w1, w3, s1, s3, *, fmt, limit, cfg: TritonConfig,
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
            z = swiglu(g, u, limit) * rw_ref[...][:, None]
            z_ref[...] = z.astype(z_ref.dtype)

    # row_weight is blocked by rows like x: put it right after the x parts
    x_args = [*xparts] + ([x_scale] if x_scale is not None else [])
    args = [tile_expert, *x_args, row_weight, w1, w3] + ([s1, s3] if fmt != "dense" else [])
    return _triton_call(kernel, args=args, x_parts=nx + 1, bm=bm, bn=bn, grid=(i_dim // bn, p // bm),
                        out_shape=jax.ShapeDtypeStruct((p, i_dim), out_dtype), cfg=cfg,
                        interpret=interpret, name=f"moe_gate_up_{fmt}")


def down(zparts, tile_expert, w2, s2, *, fmt, cfg: TritonConfig, out_dtype, interpret, kn=False,
         z_scale=None, rows_fastest=False):
    """y [P, D] = z W2_e^T per tile; zparts = (z,) or fp4 (z_even, z_odd); z_scale as gate_up's x_scale;
    rows_fastest as `_triton_call`'s (the same products, launched in another order)."""
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
        j, t = _grid_order(rows_fastest)(pl.program_id(0), pl.program_id(1))
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
                        name=f"moe_down_{fmt}", rows_fastest=rows_fastest)
