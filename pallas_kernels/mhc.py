"""Manifold-constrained hyper-connections in a few kernels, Pallas (Triton lowering) (docs/model.md §2).

The XLA path (model/mhc.py) runs a sublayer's mHC as a dozen kernels: the RMS statistic, a skinny GEMM, the
Sinkhorn rounds as a device loop (kernels and a host round trip per round), the collapse, and the expand as a
batched GEMM of contraction n (4). Here a sublayer's mHC is:

  coefficients  XLA's skinny GEMM m = rho (fn x) (float32 products: bf16 x against fn split in three bf16 terms),
                then one kernel: pre / post / the row softmax and every
                Sinkhorn round of comb on per-row registers -> packed rows [R, P];
  collapse      y = sum_i a_i X_i, one program per (block of rows, chunk of D) (a = this pre, or the vector carried
                in: V4.1 single-pass);
  mix_out       X'_j = post_j F + sum_i comb_ij X_i, one program per (block of rows, chunk of D): x and F read
                once, X' written once.

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

from .common import interpret_flag, next_pow2, split_bf16x3
from .invariant import rms_scale
from .invariant_linear import TILES as INVARIANT_TILES
from .invariant_linear import bf16_invariant_linear

F32 = jnp.float32
INVARIANT_K_STEP = INVARIANT_TILES.block_k_down  # the fixed tiles' K step: nD padded to whole steps
INVARIANT_K_CHUNK = 1024  # nD per chunk of the batch-invariant coefficient GEMM (V4-Flash's 16,384: 16 chunks)


def packed_width(n: int) -> int:
    """Columns of a packed coefficient row for n streams (a power of two >= 16: Triton tiles are powers of two, and
    the skinny GEMM's N stays a multiple of 16)."""
    return max(16, next_pow2((2 + n) * n))


def _column(tile: jax.Array, c: int) -> jax.Array:
    """Column c of a [rows, w] register tile as a [rows] vector (Triton has no register slicing)."""
    cols = lax.broadcasted_iota(jnp.int32, tile.shape, 1)
    return jnp.sum(jnp.where(cols == c, tile, 0.0), axis=1)


def _sigmoid(z):
    return 1.0 / (1.0 + jnp.exp(-z))


def _sinkhorn(logits: list[list[jax.Array]], iters: int, eps: float) -> list[list[jax.Array]]:
    """Row softmax + eps, a column normalisation, then iters - 1 rounds of rows then columns (model/mhc.py). The
    rounds run as a loop over one short body: unrolled, the kernel took ~32 us a call on the H200 at any row count
    (8 to 8,192), the time of a long serial run of code rather than of its data."""
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

    def matrix(flat):
        return [list(flat[i * n:(i + 1) * n]) for i in range(n)]

    def one_round(_, flat):
        return tuple(v for row in columns(rows(matrix(flat))) for v in row)

    return matrix(lax.fori_loop(0, iters - 1, one_round, tuple(v for row in columns(c) for v in row)))


def _coefficients_kernel(z_ref, coef_ref, *, n, iters, hc_eps):
    """z [br, P] (the pre-activations rho (fn x) * scale + base, zero-padded columns) -> packed coefficients
    [br, P]. Each column is read and written on its own ([br] vectors, one layout throughout)."""
    m = (2 + n) * n
    zs = [z_ref[:, c] for c in range(m)]
    pre = [_sigmoid(zs[i]) + hc_eps for i in range(n)]
    post = [2.0 * _sigmoid(zs[n + i]) for i in range(n)]
    comb = _sinkhorn([[zs[2 * n + i * n + j] for j in range(n)] for i in range(n)], iters, hc_eps)
    for c, v in enumerate(pre + post + [v for row in comb for v in row]):
        coef_ref[:, c] = v
    for c in range(m, coef_ref.shape[1]):
        coef_ref[:, c] = jnp.zeros_like(zs[0])


def _collapse_kernel(x_ref, a_ref, y_ref, *, n):
    """x [br, n, bd], a [br, w >= n] (the collapse vector in its first n columns) -> y [br, bd]."""
    a = a_ref[...].astype(F32)
    y = _column(a, 0)[:, None] * x_ref[:, 0, :].astype(F32)
    for i in range(1, n):
        y = y + _column(a, i)[:, None] * x_ref[:, i, :].astype(F32)
    y_ref[...] = y.astype(y_ref.dtype)


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
    """The largest power of two <= cap dividing total (a multiple of 16: `supported`)."""
    b = cap
    while total % b:
        b //= 2
    return b


def supported(n: int, d: int) -> bool:
    """Whether the kernels take n streams of width d (n a power of two, d a multiple of 16)."""
    return n >= 1 and n & (n - 1) == 0 and d % 16 == 0


def _check_supported(n: int, d: int) -> None:
    _check(supported(n, d), f"need n a power of two and D a multiple of 16, got n={n}, D={d}")


def _rows_block(r: int, cap: int) -> int:
    """Rows per program: cap, or fewer for a short batch (at least 16, Triton's smallest MMA / tile)."""
    return min(cap, max(16, next_pow2(r)))


def _skinny_gemm(flat: jax.Array, fn: jax.Array, norm_eps: float, invariant: bool) -> jax.Array:
    """m = rho (fn x) [R, P] for flat x [R, nD] and fn [P, nD] float32, with the norm as a post-scale. bf16 x: fn split
    into three bf16 terms (hi, mid, lo summing to it within float32 rounding) stacked into one [3P, nD] operand, so
    one bf16 GEMM reads x once and its products are exact in the float32 accumulator: the float32 linear, not
    XLA's TF32 one. float32 x: an IEEE float32 GEMM. invariant: `_invariant_skinny_gemm`."""
    if invariant:
        return _invariant_skinny_gemm(flat, fn, norm_eps)
    xf = flat.astype(F32)
    rho = lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + norm_eps)
    if flat.dtype == F32:
        return rho * jnp.einsum("rk,ok->ro", xf, fn, precision=lax.Precision.HIGHEST)
    hi, mid, lo = split_bf16x3(fn)
    parts = jnp.einsum("rk,ok->ro", flat.astype(jnp.bfloat16), jnp.concatenate([hi, mid, lo]),
                       preferred_element_type=F32).reshape(flat.shape[0], 3, fn.shape[0])
    return rho * (parts[:, 0] + parts[:, 1] + parts[:, 2])


def _invariant_skinny_gemm(flat: jax.Array, fn: jax.Array, norm_eps: float) -> jax.Array:
    """`_skinny_gemm` with every sum in an order fixed by fn's shape (ModelConfig.batch_invariant): rho by
    `invariant.rms_scale`'s pairwise tree, the products of fn's three bf16 terms on `bf16_invariant_linear`'s fixed
    tiles (a float32 x as three bf16 terms too: nine exact products) with nD cut into chunks of INVARIANT_K_CHUNK
    (one [R, 3P] output per chunk: parallel programs where one tile column would run the whole nD alone); nD
    zero-padded to whole 128-deep K steps where it is not (exact zeros added)."""
    p, k = fn.shape
    kp = -(-k // INVARIANT_K_STEP) * INVARIANT_K_STEP
    k_split = kp // INVARIANT_K_CHUNK if kp % INVARIANT_K_CHUNK == 0 else 1
    w = jnp.pad(jnp.concatenate(split_bf16x3(fn)), ((0, 0), (0, kp - k)))
    x = jnp.pad(flat, ((0, 0), (0, kp - k)))
    parts = bf16_invariant_linear(x, w, k_split=k_split).reshape(flat.shape[0], 3, p)
    return rms_scale(flat, norm_eps) * (parts[:, 0] + parts[:, 1] + parts[:, 2])


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    return a if a.shape[0] == rows else jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


@functools.partial(jax.jit, static_argnames=("norm_eps", "hc_eps", "iters", "invariant", "block_rows", "num_warps",
                                             "interpret"))
def coefficients(x: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, norm_eps: float, hc_eps: float,
                 iters: int, invariant: bool = False, block_rows: int = 32, num_warps: int = 4,
                 interpret=None) -> jax.Array:
    """x [R, n, D], fn [(2+n)n, nD], base [(2+n)n], scale [3] -> packed coefficients [R, P] float32. The skinny GEMM
    m = rho (fn x) is XLA's (`_skinny_gemm`, fn zero-padded to P rows so m arrives packed); the activations, the
    row softmax and the Sinkhorn rounds run in one kernel on per-row registers. invariant
    (ModelConfig.batch_invariant): the GEMM on fixed tiles (`_invariant_skinny_gemm`) and block_rows rows per
    program whatever R."""
    r, n, d = x.shape
    _check_supported(n, d)
    m = (2 + n) * n
    _check(fn.shape == (m, n * d) and base.shape == (m,) and scale.shape == (3,),
           f"fn [{m}, {n * d}], base [{m}], scale [3] expected, got {fn.shape}, {base.shape}, {scale.shape}")
    p = packed_width(n)
    mp = _skinny_gemm(x.reshape(r, n * d), jnp.pad(fn.astype(F32), ((0, p - m), (0, 0))), norm_eps, invariant)
    scale = scale.astype(F32)
    colscale = jnp.concatenate([jnp.broadcast_to(scale[k], (w,)) for k, w in enumerate((n, n, n * n))]
                               + [jnp.zeros((p - m,), F32)])
    z = mp * colscale + jnp.pad(base.astype(F32), (0, p - m))
    br = block_rows if invariant else _rows_block(r, block_rows)
    rp = -(-r // br) * br
    coef = pl.pallas_call(
        functools.partial(_coefficients_kernel, n=n, iters=int(iters), hc_eps=float(hc_eps)), grid=(rp // br,),
        in_specs=[pl.BlockSpec((br, p), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((br, p), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((rp, p), F32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret_flag("triton", interpret), name="mhc_coefficients",
    )(_pad_rows(z, rp))
    return coef[:r]


@functools.partial(jax.jit, static_argnames=("block_rows", "block_d", "interpret"))
def collapse(x: jax.Array, a: jax.Array, *, block_rows: int = 16, block_d: int = 512, interpret=None) -> jax.Array:
    """y = sum_i a_i X_i: x [R, n, D], a [R, w >= n] (packed coefficients, or a pre vector) -> y [R, D] in
    x.dtype (float32 sum)."""
    r, n, d = x.shape
    _check_supported(n, d)
    _check(a.ndim == 2 and a.shape[0] == r and a.shape[1] >= n and a.shape[1] & (a.shape[1] - 1) == 0,
           f"a must be [R={r}, w >= {n}] with w a power of two, got {a.shape}")
    br = _rows_block(r, block_rows)
    rp = -(-r // br) * br
    bd = _block(d, block_d)
    y = pl.pallas_call(
        functools.partial(_collapse_kernel, n=n), grid=(rp // br, d // bd),
        in_specs=[pl.BlockSpec((br, n, bd), lambda i, c: (i, 0, c)),
                  pl.BlockSpec((br, a.shape[1]), lambda i, c: (i, 0))],
        out_specs=pl.BlockSpec((br, bd), lambda i, c: (i, c)),
        out_shape=jax.ShapeDtypeStruct((rp, d), x.dtype),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret_flag("triton", interpret), name="mhc_collapse",
    )(_pad_rows(x, rp), _pad_rows(a, rp))
    return y[:r]


def mix_in(x: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, carried: jax.Array | None = None, *,
           norm_eps: float, hc_eps: float, iters: int, invariant: bool = False, interpret=None
           ) -> tuple[jax.Array, jax.Array]:
    """x [R, n, D] (bf16 / f32), fn [(2+n)n, nD], base [(2+n)n], scale [3], carried [R, n] (the collapse vector;
    None: this sublayer's own pre) -> (y [R, D] in x.dtype, packed coefficients [R, P] float32). invariant: as
    `coefficients`'s (the collapse and expand add each row's n terms in one order whatever the rows already)."""
    coef = coefficients(x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, iters=iters, invariant=invariant,
                        interpret=interpret)
    n = x.shape[1]
    if carried is not None:
        _check(carried.shape == (x.shape[0], n), f"carried must be [R={x.shape[0]}, {n}], got {carried.shape}")
    a = coef if carried is None else jnp.pad(carried.astype(F32), ((0, 0), (0, coef.shape[1] - n)))
    return collapse(x, a, interpret=interpret), coef


@functools.partial(jax.jit, static_argnames=("block_rows", "block_d", "num_warps", "num_stages", "interpret"))
def mix_out(x: jax.Array, f: jax.Array, coef: jax.Array, *, block_rows: int = 16, block_d: int = 256,
            num_warps: int = 4, num_stages: int = 2, interpret=None) -> jax.Array:
    """x [R, n, D], F [R, D] (the sublayer's output), coef [R, P] (mix_in's) -> X' [R, n, D] in x.dtype."""
    r, n, d = x.shape
    _check_supported(n, d)
    _check(f.shape == (r, d) and coef.shape == (r, packed_width(n)),
           f"F [{r}, {d}] and coef [{r}, {packed_width(n)}] expected, got {f.shape}, {coef.shape}")
    br = _rows_block(r, block_rows)
    rp = -(-r // br) * br
    bd = _block(d, block_d)
    x, f, coef = _pad_rows(x, rp), _pad_rows(f, rp), _pad_rows(coef, rp)
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
