"""Top-k selection without a sort, Pallas (Triton lowering): the set of the k largest entries of each row.

XLA's GPU top-k sorts whole rows; at the indexer's prefill load (8,192 query rows over ~9K entries at 32K context)
its two sorts take 2.6 ms of a ~48 ms V4-Flash 4-layer step. Selecting needs less than sorting: one program holds a
row in registers and settles the k-th largest value bit by bit (32 counting passes over the row, from the top bit of
its order-preserving integer key down), then takes every entry above it and, of the entries equal to it, the lowest
positions first until k are taken -- exactly the set `lax.top_k` returns, ties included. The taken positions are
written in position order (a prefix sum gives each its slot), not best first.

Each lane of the row writes once (no masked store, so the interpreter and the GPU agree): a taken entry its
position to its slot, an untaken one -1 to the slots after the last taken one, or to a trash column past k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .common import interpret_flag, next_pow2

_SIGN = np.int32(-2 ** 31)
VALUES_PER_THREAD = 32   # a row's registers per thread: width / (32 x num_warps), warps between 4 and 16


def _select_kernel(x_ref, o_ref, *, k: int, n: int, width: int):
    """x [width] float32 (its first n columns the row) -> o [next_pow2(k + 1)] int32: the positions of the k
    largest in position order, -1 after them where fewer than k are finite; column k is trash."""
    col = lax.broadcasted_iota(jnp.int32, (width,), 0)
    x = jnp.where(col < n, x_ref[...], -jnp.inf)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)    # signed integer order = float order

    def settle(b, t):   # t: the k-th largest key with its sign bit flipped, settled from bit 31 down to 31 - b
        trial = t | lax.shift_left(np.int32(1), 31 - b)
        return jnp.where(jnp.sum((key >= (trial ^ _SIGN)).astype(jnp.int32)) >= k, trial, t)

    kth = lax.fori_loop(0, 32, settle, np.int32(0)) ^ _SIGN
    above, tied = key > kth, key == kth
    room = k - jnp.sum(above.astype(jnp.int32))
    take = (above | (tied & (jnp.cumsum(tied.astype(jnp.int32)) <= room))) & (x > -jnp.inf)
    taken = jnp.cumsum(take.astype(jnp.int32))
    slot = jnp.where(take, taken - 1, jnp.sum(take.astype(jnp.int32)) + col - taken)
    o_ref[jnp.minimum(slot, k)] = jnp.where(take, col, -1)


@functools.partial(jax.jit, static_argnames=("k", "n", "interpret"))
def topk_select(x: jax.Array, k: int, n: int | None = None, interpret: bool | None = None) -> jax.Array:
    """x [..., Np] float32 (rows of n <= Np scores; -inf = never taken) -> [..., min(k, n)] int32: the positions of
    each row's k largest among its first n, in position order, -1 after them where fewer are finite. The same set
    as `reference.topk_indices(x[..., :n], k)`, exact ties included (the lower positions win)."""
    n = x.shape[-1] if n is None else n
    if x.dtype != jnp.float32:
        raise ValueError(f"topk_select: x must be float32, got {x.dtype}")
    if not 0 < n <= x.shape[-1]:
        raise ValueError(f"topk_select: n must be in [1, {x.shape[-1]}], got {n}")
    if k <= 0:
        raise ValueError(f"topk_select: k must be positive, got {k}")
    k = min(k, n)
    lead, np_ = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, np_)
    width, kp = next_pow2(np_), next_pow2(k + 1)
    warps = int(np.clip(width // (32 * VALUES_PER_THREAD), 4, 16))
    out = pl.pallas_call(
        functools.partial(_select_kernel, k=k, n=n, width=width),
        grid=(rows.shape[0],),
        in_specs=[pl.BlockSpec((None, width), lambda r: (r, 0))],
        out_specs=pl.BlockSpec((None, kp), lambda r: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((rows.shape[0], kp), jnp.int32),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret_flag("triton", interpret), name="topk_select",
    )(rows)
    return out[:, :k].reshape(*lead, k)
