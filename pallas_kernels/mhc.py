"""Manifold-constrained hyper-connections in a few kernels, Pallas (Triton lowering) (docs/model.md §2).

The XLA path (model/mhc.py) runs a sublayer's mHC as a dozen kernels: the RMS statistic, a skinny GEMM, the
Sinkhorn rounds as a device loop (kernels and a host round trip per round), the collapse, and the expand as a
batched GEMM of contraction n (4). Here a sublayer's mHC is:

  coefficients  two kernels: `project`, one program per (block of rows, chunk of nD columns), reads x once for the
                chunk's partial products fn x (float32 products: bf16 x against fn split in three bf16 terms in
                registers) and its partial sums of squares; then one kernel adds each row's chunks, scales by rho
                and computes pre / post / the row softmax and every Sinkhorn round of comb on per-row registers ->
                packed rows [R, P];
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

from .common import interpret_flag, next_pow2

F32 = jnp.float32


def packed_width(n: int) -> int:
    """Columns of a packed coefficient row for n streams (a power of two >= 16: Triton tiles are powers of two, and
    the projection's dot needs N >= 16)."""
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


def split_bf16x3(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 w -> bf16 (hi, mid, lo) with hi + mid + lo = w within float32 rounding. hi and mid are w's top mantissa
    bits cut off by a bit mask, not rounded conversions: XLA on the GPU (excess precision allowed) folds a float32 ->
    bf16 -> float32 round trip into the identity, which would make w - hi zero."""
    def top(v):
        return lax.bitcast_convert_type(lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFF0000), F32)
    hi = top(w)
    mid = top(w - hi)
    return hi.astype(jnp.bfloat16), mid.astype(jnp.bfloat16), (w - hi - mid).astype(jnp.bfloat16)


def _project_kernel(x_ref, fn_ref, part_ref, sq_ref, *, steps, bk):
    """A block of rows' flattened streams x [br, steps bk] against fn [P, steps bk] (float32), bk columns a step ->
    this column chunk's partial products part [br, P] = x fn^T and sums of squares sq [br], float32. bf16 x: fn
    split in three bf16 terms (split_bf16x3), each product exact in the float32 accumulator; float32 x: IEEE
    float32 products (Triton's default would be TF32)."""
    br, p = x_ref.shape[0], fn_ref.shape[0]

    def dot(a, b):
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32,
                               precision=lax.Precision.HIGHEST if a.dtype == F32 else None)

    def step(i, carry):
        acc, sq = carry
        cols = pl.ds(pl.multiple_of(i * bk, bk), bk)
        x, f = x_ref[:, cols], fn_ref[:, cols]
        for term in ([f] if x.dtype == F32 else split_bf16x3(f)):
            acc = acc + dot(x, term)
        xf = x.astype(F32)
        return acc, sq + jnp.sum(xf * xf, axis=1)

    acc, sq = lax.fori_loop(0, steps, step, (jnp.zeros((br, p), F32), jnp.zeros((br,), F32)))
    part_ref[...] = acc
    sq_ref[...] = sq


def _coefficients_kernel(part_ref, sq_ref, affine_ref, coef_ref, *, n, iters, hc_eps, norm_eps, width):
    """The chunks' partial products part [C, br, P] and sums of squares sq [C, br] of a block of rows (flattened
    width `width`), the pre-activations' column scales and biases affine [2, P] (zero-padded columns) -> packed
    coefficients [br, P]: z = rho (fn x) scale + base, rho = rsqrt(mean(x^2) + norm_eps), the chunks added in
    order. Each column is read and written on its own ([br] vectors, one layout throughout)."""
    m = (2 + n) * n
    total, sq = part_ref[0], sq_ref[0]
    for c in range(1, part_ref.shape[0]):
        total, sq = total + part_ref[c], sq + sq_ref[c]
    rho = lax.rsqrt(sq / width + norm_eps)
    z = rho[:, None] * total * affine_ref[0][None, :] + affine_ref[1][None, :]
    zs = [_column(z, c) for c in range(m)]
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


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    return a if a.shape[0] == rows else jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


PROJECT_STEP = 256      # columns of the flattened streams per step of the projection kernel (at most)
PROJECT_ROWS = 64       # rows per program of the projection kernel (at most)
PROJECT_PROGRAMS = 256  # the projection splits the columns into chunks until about this many programs run


def _project_chunks(row_blocks: int, steps: int) -> int:
    """Column chunks of the projection: the most (a power of two dividing the steps) that keep row_blocks x chunks
    within PROJECT_PROGRAMS, so that a short batch still reads x on most SMs."""
    c = 1
    while steps % (2 * c) == 0 and row_blocks * 2 * c <= PROJECT_PROGRAMS:
        c *= 2
    return c


def project(x: jax.Array, fn: jax.Array, *, block_rows: int = PROJECT_ROWS, interpret=None
            ) -> tuple[jax.Array, jax.Array]:
    """x [R, nD] (bf16 / f32), fn [P, nD] float32 -> (partial products [C, R', P], partial sums of squares [C, R'])
    over C column chunks, float32, for the rows padded to R' (a whole number of row blocks): x read once for
    both."""
    br, bk = _rows_block(x.shape[0], block_rows), _block(x.shape[1], PROJECT_STEP)
    x = _pad_rows(x, -(-x.shape[0] // br) * br)
    r, k = x.shape
    p = fn.shape[0]
    chunks = _project_chunks(r // br, k // bk)
    cols = k // chunks
    return pl.pallas_call(
        functools.partial(_project_kernel, steps=cols // bk, bk=bk), grid=(r // br, chunks),
        in_specs=[pl.BlockSpec((br, cols), lambda i, c: (i, c)), pl.BlockSpec((p, cols), lambda i, c: (0, c))],
        out_specs=[pl.BlockSpec((None, br, p), lambda i, c: (c, i, 0)), pl.BlockSpec((None, br), lambda i, c: (c, i))],
        out_shape=[jax.ShapeDtypeStruct((chunks, r, p), F32), jax.ShapeDtypeStruct((chunks, r), F32)],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret_flag("triton", interpret), name="mhc_project",
    )(x, fn)


@functools.partial(jax.jit, static_argnames=("norm_eps", "hc_eps", "iters", "block_rows", "num_warps", "interpret"))
def coefficients(x: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, norm_eps: float, hc_eps: float,
                 iters: int, block_rows: int = 32, num_warps: int = 4, interpret=None) -> jax.Array:
    """x [R, n, D], fn [(2+n)n, nD], base [(2+n)n], scale [3] -> packed coefficients [R, P] float32. `project` reads
    x once for the chunks of m = fn x and of the sums of squares (fn zero-padded to P rows so m arrives packed);
    then one kernel adds the chunks, scales by rho and runs the activations, the row softmax and the Sinkhorn
    rounds on per-row registers (block_rows rows a program, num_warps warps)."""
    r, n, d = x.shape
    _check_supported(n, d)
    m = (2 + n) * n
    _check(fn.shape == (m, n * d) and base.shape == (m,) and scale.shape == (3,),
           f"fn [{m}, {n * d}], base [{m}], scale [3] expected, got {fn.shape}, {base.shape}, {scale.shape}")
    p = packed_width(n)
    br = _rows_block(r, block_rows)
    rp = -(-r // br) * br
    parts, squares = project(_pad_rows(x.reshape(r, n * d), rp), jnp.pad(fn.astype(F32), ((0, p - m), (0, 0))),
                             interpret=interpret)
    scale = scale.astype(F32)
    colscale = jnp.concatenate([jnp.broadcast_to(scale[k], (w,)) for k, w in enumerate((n, n, n * n))])
    affine = jnp.pad(jnp.stack([colscale, base.astype(F32)]), ((0, 0), (0, p - m)))   # one operand, one XLA op
    chunks = parts.shape[0]
    coef = pl.pallas_call(
        functools.partial(_coefficients_kernel, n=n, iters=int(iters), hc_eps=float(hc_eps),
                          norm_eps=float(norm_eps), width=n * d), grid=(rp // br,),
        in_specs=[pl.BlockSpec((chunks, br, p), lambda i: (0, i, 0)), pl.BlockSpec((chunks, br), lambda i: (0, i)),
                  pl.BlockSpec((2, p), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((br, p), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((rp, p), F32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret_flag("triton", interpret), name="mhc_coefficients",
    )(parts, squares, affine)
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
           norm_eps: float, hc_eps: float, iters: int, interpret=None) -> tuple[jax.Array, jax.Array]:
    """x [R, n, D] (bf16 / f32), fn [(2+n)n, nD], base [(2+n)n], scale [3], carried [R, n] (the collapse vector;
    None: this sublayer's own pre) -> (y [R, D] in x.dtype, packed coefficients [R, P] float32)."""
    coef = coefficients(x, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps, iters=iters, interpret=interpret)
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
