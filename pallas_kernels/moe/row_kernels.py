"""The MoE block's small Triton kernels around the grouped GEMMs: the dispatch (`transpose` with rows: token
rows gathered and written transposed, the swap kernels' input; `take_rows`: gathered as they are, the row tiles'
and Triton kernels' input) and `act_quant_rows` (FP8 act_quant of the SwiGLU output for the FP8 x FP8 down
kernel). Each writes the live tiles of a RoutePlan only: no kernel reads the dead ones.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import reference as ref


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
    gather and a transpose. Left to XLA, a transpose fused into its consumer's gather, which then read strided
    columns, and layout assignment relabels an XLA-side copy: only a custom call keeps the copy physical."""
    return _row_tiles(a, rows, live, transposed=True, interpret=interpret)


def act_quant_rows(a: jax.Array, block: int, live_rows: jax.Array, *, rows: int = 64, interpret: bool = False
                   ) -> tuple[jax.Array, jax.Array]:
    """`reference.act_quant` of a [P, N] (float32 / bf16) by a Triton kernel, for the routed rows before live_rows
    (int32 scalar; the tile-padded rows past it are left unwritten: no kernel reads them) ->
    (q float8_e4m3fn [P, N], scales transposed [N / block, P] float32, as the FP8 row tiles stream them);
    XLA's act_quant would also quantise the padding rows. Bit-identical to the reference: the exponent
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
    192-row balanced prefill tiles). Narrow elements travel as 4-byte words, which gather several times
    faster than 1- and 2-byte elements."""
    per = 4 // a.dtype.itemsize if a.dtype.itemsize < 4 else 1
    if per == 1 or a.shape[1] % per:
        return _row_tiles(a, index, live, transposed=False, interpret=interpret)
    words = lax.bitcast_convert_type(a.reshape(a.shape[0], -1, per), jnp.uint32)
    out = _row_tiles(words, index, live, transposed=False, interpret=interpret)
    return lax.bitcast_convert_type(out, a.dtype).reshape(index.shape[0], a.shape[1])
