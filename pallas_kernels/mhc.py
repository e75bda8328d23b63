"""Manifold-constrained hyper-connections as two fused kernels, Pallas (Triton lowering) (docs/model.md §2).

The XLA path (model/mhc.py) runs a sublayer's mHC as a dozen kernels: the RMS statistic, a skinny GEMM, the
Sinkhorn rounds as a device loop (two kernels and a host round trip per round), the collapse, and the expand as a
batched GEMM of contraction 4. Here it is two kernels per sublayer:

  mix_in   x [R, n, D] -> (y [R, D], coefficients [R, P]). One program per block of rows: a loop over the n D
           columns accumulates sum(x^2) and fn x (MMA into float32: fn is split into three bf16 terms whose
           products with bf16 x are exact in the accumulator, so the skinny GEMM is the float32 one), then
           pre / post / the row softmax and Sinkhorn rounds of comb on per-row registers, then the collapse
           y = sum_i a_i X_i over column chunks (a = this pre, or the vector carried in: V4.1 single-pass).
  mix_out  X'_j = post_j F + sum_i comb_ij X_i, one program per (block of rows, chunk of D): x and F read once,
           X' written once.

The coefficients travel packed, one float32 row of P = max(16, next_pow2((2+n) n)) columns per token: pre at
[0, n), post at [n, 2n), comb row-major at [2n, 2n + n^2). As in the model, the expand multiplies with comb and
post rounded to the model dtype; its sums run in float32 and round once.

The reference is model/mhc.py's hc_coefficients / collapse / expand; tests/test_mhc_kernels.py compares them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .common import interpret_flag, next_pow2

F32 = jnp.float32


def packed_width(n: int) -> int:
    """Columns of a packed coefficient row for n streams (a power of two >= 16, the MMA's minimum N)."""
    return max(16, next_pow2((2 + n) * n))


def _column(tile: jax.Array, c: int) -> jax.Array:
    """Column c of a [rows, w] register tile as a [rows] vector (Triton has no register slicing)."""
    cols = lax.broadcasted_iota(jnp.int32, tile.shape, 1)
    return jnp.sum(jnp.where(cols == c, tile, 0.0), axis=1)


def _sigmoid(z):
    return 1.0 / (1.0 + jnp.exp(-z))


def _sinkhorn(logits: list[list[jax.Array]], iters: int, eps: float) -> list[list[jax.Array]]:
    """Row softmax + eps, a column normalisation, then iters - 1 rounds of rows then columns (model/mhc.py)."""
    n = len(logits)
    c = []
    for row in logits:
        top = functools.reduce(jnp.maximum, row)
        e = [jnp.exp(v - top) for v in row]
        total = functools.reduce(jnp.add, e)
        c.append([v / total + eps for v in e])

    def columns(c):
        sums = [functools.reduce(jnp.add, [c[i][j] for i in range(n)]) + eps for j in range(n)]
        return [[c[i][j] / sums[j] for j in range(n)] for i in range(n)]

    def rows(c):
        return [[v / (functools.reduce(jnp.add, row) + eps) for v in row] for row in c]

    c = columns(c)
    for _ in range(iters - 1):
        c = columns(rows(c))
    return c


def _split3(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 -> three bf16 terms summing to it within float32 rounding (bf16 x bf16 products are exact in f32)."""
    hi = w.astype(jnp.bfloat16)
    r = w - hi.astype(F32)
    mid = r.astype(jnp.bfloat16)
    return hi, mid, (r - mid.astype(F32)).astype(jnp.bfloat16)


def _mix_in_kernel(*refs, n, d, bk, bd, iters, norm_eps, hc_eps, carried):
    """x [br, nD]; fnT [nD, P] f32; colscale, base [P]; (carried [br, >= n]) -> y [br, D], coef [br, P]."""
    x_ref, fn_ref, colscale_ref, base_ref = refs[:4]
    a_ref = refs[4] if carried else None
    y_ref, coef_ref = refs[-2:]
    br, p = coef_ref.shape
    nd = n * d
    exact_split = x_ref.dtype != F32

    def accumulate(k, carry):
        acc, ss = carry
        cols = pl.ds(pl.multiple_of(k * bk, bk), bk)
        xk = x_ref[:, cols]
        xf = xk.astype(F32)
        ss = ss + jnp.sum(xf * xf, axis=1)
        w = fn_ref[cols, :]
        if exact_split:
            xb = xk.astype(jnp.bfloat16)
            for part in _split3(w):
                acc = acc + jnp.dot(xb, part, preferred_element_type=F32)
        else:
            acc = acc + jnp.dot(xf, w, precision=lax.Precision.HIGHEST, preferred_element_type=F32)
        return acc, ss

    acc, ss = lax.fori_loop(0, nd // bk, accumulate, (jnp.zeros((br, p), F32), jnp.zeros((br,), F32)))
    rho = lax.rsqrt(ss / nd + norm_eps)
    z = acc * rho[:, None] * colscale_ref[...][None, :] + base_ref[...][None, :]
    zs = [_column(z, c) for c in range((2 + n) * n)]
    pre = [_sigmoid(zs[i]) + hc_eps for i in range(n)]
    post = [2.0 * _sigmoid(zs[n + i]) for i in range(n)]
    comb = _sinkhorn([[zs[2 * n + i * n + j] for j in range(n)] for i in range(n)], iters, hc_eps)
    values = pre + post + [v for row in comb for v in row]
    cols = lax.broadcasted_iota(jnp.int32, (br, p), 1)
    packed = jnp.zeros((br, p), F32)
    for c, v in enumerate(values):
        packed = jnp.where(cols == c, v[:, None], packed)
    coef_ref[...] = packed

    a = pre if a_ref is None else [_column(a_ref[...].astype(F32), i) for i in range(n)]

    def collapse(c, _):
        y = jnp.zeros((br, bd), F32)
        for i in range(n):
            xi = x_ref[:, pl.ds(pl.multiple_of(i * d + c * bd, bd), bd)].astype(F32)
            y = y + a[i][:, None] * xi
        y_ref[:, pl.ds(pl.multiple_of(c * bd, bd), bd)] = y.astype(y_ref.dtype)
        return 0

    lax.fori_loop(0, d // bd, collapse, 0)


def _mix_out_kernel(x_ref, f_ref, coef_ref, o_ref, *, n):
    """x [br, n, bd], F [br, bd], coef [br, P] -> X' [br, n, bd]."""
    dt = o_ref.dtype
    coef = coef_ref[...]

    def rounded(c):  # a coefficient in the model dtype, as the model multiplies with it
        return _column(coef, c).astype(dt).astype(F32)[:, None]

    f = f_ref[...].astype(F32)
    xs = [x_ref[:, i, :].astype(F32) for i in range(n)]
    for j in range(n):
        out = rounded(n + j) * f
        for i in range(n):
            out = out + rounded(2 * n + i * n + j) * xs[i]
        o_ref[:, j, :] = out.astype(dt)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"mhc kernels: {msg}")


def _block(total: int, cap: int) -> int:
    """The largest power of two <= cap dividing total (0 when none >= 16 does)."""
    b = cap
    while b >= 16 and total % b:
        b //= 2
    return b if b >= 16 else 0


def supported(n: int, d: int) -> bool:
    """Whether the kernels take n streams of width d (n a power of two, d a multiple of 16)."""
    return n >= 1 and n & (n - 1) == 0 and d % 16 == 0


def _rows_block(r: int, cap: int) -> int:
    return min(cap, max(16, next_pow2(r)))


@functools.partial(jax.jit, static_argnames=("norm_eps", "hc_eps", "iters", "block_rows", "block_k", "block_d",
                                             "num_warps", "num_stages", "interpret"))
def mix_in(x: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, carried: jax.Array | None = None, *,
           norm_eps: float, hc_eps: float, iters: int, block_rows: int = 32, block_k: int = 256,
           block_d: int = 512, num_warps: int = 4, num_stages: int = 2, interpret=None
           ) -> tuple[jax.Array, jax.Array]:
    """x [R, n, D] (bf16 / f32), fn [(2+n)n, nD], base [(2+n)n], scale [3], carried [R, w >= n] (the collapse vector
    in its first n columns; None: this sublayer's own pre) -> (y [R, D] in x.dtype, coefficients [R, P] float32)."""
    r, n, d = x.shape
    _check(supported(n, d), f"need n a power of two and D a multiple of 16, got n={n}, D={d}")
    m = (2 + n) * n
    _check(fn.shape == (m, n * d) and base.shape == (m,) and scale.shape == (3,),
           f"fn [{m}, {n * d}], base [{m}], scale [3] expected, got {fn.shape}, {base.shape}, {scale.shape}")
    if carried is not None:
        _check(carried.ndim == 2 and carried.shape[0] == r and carried.shape[1] >= n,
               f"carried must be [R={r}, >= {n}], got {carried.shape}")
    p = packed_width(n)
    br = _rows_block(r, block_rows)
    rp = -(-r // br) * br
    bk, bd = _block(n * d, block_k), _block(d, block_d)
    xf = x.reshape(r, n * d)
    if rp != r:
        xf = jnp.pad(xf, ((0, rp - r), (0, 0)))
        carried = None if carried is None else jnp.pad(carried, ((0, rp - r), (0, 0)))
    fnt = jnp.zeros((n * d, p), F32).at[:, :m].set(fn.astype(F32).T)
    kinds = jnp.array([0] * n + [1] * n + [2] * (n * n) + [0] * (p - m), jnp.int32)
    colscale = scale.astype(F32)[kinds]
    base_p = jnp.zeros((p,), F32).at[:m].set(base.astype(F32))
    args = [xf, fnt, colscale, base_p]
    in_specs = [pl.BlockSpec((br, n * d), lambda i: (i, 0)), pl.BlockSpec((n * d, p), lambda i: (0, 0)),
                pl.BlockSpec((p,), lambda i: (0,)), pl.BlockSpec((p,), lambda i: (0,))]
    if carried is not None:
        args.append(carried)
        in_specs.append(pl.BlockSpec((br, carried.shape[1]), lambda i: (i, 0)))
    kernel = functools.partial(_mix_in_kernel, n=n, d=d, bk=bk, bd=bd, iters=int(iters), norm_eps=float(norm_eps),
                               hc_eps=float(hc_eps), carried=carried is not None)
    y, coef = pl.pallas_call(
        kernel, grid=(rp // br,), in_specs=in_specs,
        out_specs=[pl.BlockSpec((br, d), lambda i: (i, 0)), pl.BlockSpec((br, p), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((rp, d), x.dtype), jax.ShapeDtypeStruct((rp, p), F32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret_flag("triton", interpret), name="mhc_mix_in",
    )(*args)
    return y[:r], coef[:r]


@functools.partial(jax.jit, static_argnames=("block_rows", "block_d", "num_warps", "num_stages", "interpret"))
def mix_out(x: jax.Array, f: jax.Array, coef: jax.Array, *, block_rows: int = 16, block_d: int = 256,
            num_warps: int = 4, num_stages: int = 2, interpret=None) -> jax.Array:
    """x [R, n, D], F [R, D] (the sublayer's output), coef [R, P] (mix_in's) -> X' [R, n, D] in x.dtype."""
    r, n, d = x.shape
    _check(supported(n, d), f"need n a power of two and D a multiple of 16, got n={n}, D={d}")
    _check(f.shape == (r, d) and coef.shape == (r, packed_width(n)),
           f"F [{r}, {d}] and coef [{r}, {packed_width(n)}] expected, got {f.shape}, {coef.shape}")
    br = _rows_block(r, block_rows)
    rp = -(-r // br) * br
    bd = _block(d, block_d)
    if rp != r:
        pad = lambda a: jnp.pad(a, [(0, rp - r)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
        x, f, coef = pad(x), pad(f), pad(coef)
    out = pl.pallas_call(
        functools.partial(_mix_out_kernel, n=n), grid=(rp // br, d // bd),
        in_specs=[pl.BlockSpec((br, n, bd), lambda i, c: (i, 0, c)), pl.BlockSpec((br, bd), lambda i, c: (i, c)),
                  pl.BlockSpec((br, coef.shape[1]), lambda i, c: (i, 0))],
        out_specs=pl.BlockSpec((br, n, bd), lambda i, c: (i, 0, c)),
        out_shape=jax.ShapeDtypeStruct((rp, n, d), x.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret_flag("triton", interpret), name="mhc_mix_out",
    )(x, f.astype(x.dtype), coef)
    return out[:r]
