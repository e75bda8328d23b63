"""Manifold-constrained hyper-connections (docs/model.md §2).

The residual is n streams X [..., n, D]. For each sublayer, coefficients come from X:
rho = rsqrt(mean(flat(X)^2) + eps), m = rho * (fn @ flat(X)) (fp32), then
pre = sigmoid(m_pre * s0 + b_pre) + hc_eps, post = 2 sigmoid(m_post * s1 + b_post),
comb = Sinkhorn(softmax_rows(M * s2 + B) + hc_eps) ending on a column normalisation.
collapse: y = sum_i pre_i X_i; expand: X'_j = post_j F + sum_i comb_ij X_i.
batch_invariant=True (cfg.batch_invariant): the jnp functions run on fixed blocks of tokens (`invariant.row_blocks`;
as elementwise trees, `invariant.weighted_sum`, the collapses were not invariant on XLA:CPU once fused with their
neighbours: tests/test_batch_invariance.py), the kernels with their coefficient GEMM on fixed tiles
(pallas_kernels/mhc.py `coefficients`).

A sublayer uses them through `mix_in` (coefficients + collapse) and `mix_out` (expand), which run either these
jnp functions (cfg.mhc_impl "reference") or the two fused kernels of pallas_kernels/mhc.py ("pallas"). Between the
two calls the coefficients travel as (pre, post, comb) on the reference path and as packed float32 rows [..., P]
on the kernel path; `pre_vector` reads the pre vector out of either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import mhc as pk_mhc
from pallas_kernels.invariant import row_blocks

from .layers import normal_init, per_batch_shard, rms_normalize


class HyperConnection(nnx.Module):
    """Holds one sublayer's (fn [(2+n)n, nD], base [(2+n)n], scale [3]) and computes its coefficients."""

    def __init__(self, hc_mult: int, dim: int, *, rngs: nnx.Rngs):
        n = hc_mult
        self.fn = nnx.Param(normal_init(rngs, ((2 + n) * n, n * dim), 0.05))
        self.base = nnx.Param(normal_init(rngs, ((2 + n) * n,), 0.2))
        self.scale = nnx.Param(normal_init(rngs, (3,), 0.2, mean=0.5))


def hc_coefficients(fn: jax.Array, base: jax.Array, scale: jax.Array, x: jax.Array, *, norm_eps: float,
                    hc_eps: float, sinkhorn_iters: int, batch_invariant: bool = False):
    """x: [..., n, D] -> pre [..., n], post [..., n], comb [..., n, n] (all float32)."""
    if batch_invariant:
        return row_blocks(lambda x: hc_coefficients(fn, base, scale, x, norm_eps=norm_eps, hc_eps=hc_eps,
                                                    sinkhorn_iters=sinkhorn_iters), x, lead=x.ndim - 2)
    n = x.shape[-2]
    flat = rms_normalize(x.reshape(*x.shape[:-2], -1), norm_eps)
    m = jnp.einsum("...k,ok->...o", flat, fn.astype(jnp.float32))
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = (m[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*m.shape[:-1], n, n)
    comb = jax.nn.softmax(logits, axis=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdims=True) + hc_eps)

    def sinkhorn_step(_, c):
        c = c / (c.sum(-1, keepdims=True) + hc_eps)
        return c / (c.sum(-2, keepdims=True) + hc_eps)

    comb = jax.lax.fori_loop(0, sinkhorn_iters - 1, sinkhorn_step, comb)
    return pre, post, comb


def collapse(x: jax.Array, pre: jax.Array, batch_invariant: bool = False) -> jax.Array:
    """y = sum_i pre_i X_i (float32 sum, cast to the residual dtype). x [..., n, D], pre [..., n]."""
    if batch_invariant:
        return row_blocks(collapse, x, pre, lead=x.ndim - 2)
    return jnp.einsum("...n,...nd->...d", pre, x.astype(jnp.float32)).astype(x.dtype)


def expand(x: jax.Array, out: jax.Array, post: jax.Array, comb: jax.Array, batch_invariant: bool = False
           ) -> jax.Array:
    """X'_j = post_j * F + sum_i comb_ij X_i. x [..., n, D], out F [..., D]."""
    if batch_invariant:
        return row_blocks(expand, x, out, post, comb, lead=x.ndim - 2)
    dt = x.dtype
    mixed = jnp.einsum("...ij,...id->...jd", comb.astype(dt), x)
    return post.astype(dt)[..., None] * out.astype(dt)[..., None, :] + mixed


Coefficients = tuple[jax.Array, jax.Array, jax.Array] | jax.Array   # (pre, post, comb) | packed rows [..., P]


def mix_in(hc: HyperConnection, x: jax.Array, carried: jax.Array | None, *, impl: str, norm_eps: float,
           hc_eps: float, sinkhorn_iters: int, batch_invariant: bool = False, per_shard=None
           ) -> tuple[jax.Array, Coefficients]:
    """A sublayer's mHC before it: x [B, S, n, D] -> (its input y [B, S, D], its coefficients). y collapses with
    this sublayer's pre vector, or with `carried` [B, S, n] (V4.1 single-pass). per_shard: the runtime's runner
    of kernels on a mesh (sharding.BatchParallel; None: the whole batch)."""
    if impl == "reference":
        pre, post, comb = hc_coefficients(hc.fn[...], hc.base[...], hc.scale[...], x, norm_eps=norm_eps,
                                          hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters,
                                          batch_invariant=batch_invariant)
        return collapse(x, pre if carried is None else carried, batch_invariant), (pre, post, comb)

    def kernel(x, carried, fn, base, scale):
        lead, (n, d) = x.shape[:-2], x.shape[-2:]
        y, coef = pk_mhc.mix_in(x.reshape(-1, n, d), fn, base, scale,
                                None if carried is None else carried.reshape(-1, carried.shape[-1]),
                                norm_eps=norm_eps, hc_eps=hc_eps, iters=sinkhorn_iters, invariant=batch_invariant)
        return y.reshape(*lead, d), coef.reshape(*lead, coef.shape[-1])
    return per_batch_shard(per_shard, kernel, (x, carried), (hc.fn[...], hc.base[...], hc.scale[...]))


def mix_out(x: jax.Array, out: jax.Array, coef: Coefficients, *, batch_invariant: bool = False, per_shard=None
            ) -> jax.Array:
    """A sublayer's mHC after it: X'_j = post_j F + sum_i comb_ij X_i with F = out [B, S, D] (coef from mix_in)."""
    if isinstance(coef, tuple):
        _, post, comb = coef
        return expand(x, out, post, comb, batch_invariant)

    def kernel(x, out, coef):
        lead, (n, d) = x.shape[:-2], x.shape[-2:]
        return pk_mhc.mix_out(x.reshape(-1, n, d), out.reshape(-1, d), coef.reshape(-1, coef.shape[-1])
                              ).reshape(x.shape)
    return per_batch_shard(per_shard, kernel, (x, out, coef))


def pre_vector(coef: Coefficients, n: int) -> jax.Array:
    """The pre vector [..., n] of either form of the coefficients."""
    return coef[0] if isinstance(coef, tuple) else coef[..., :n]


class HyperHead(nnx.Module):
    """Final collapse [V4]: a_i = sigmoid(rho (fn_i . flat X) scale + base_i) + hc_eps, y = sum a_i X_i."""

    def __init__(self, hc_mult: int, dim: int, *, rngs: nnx.Rngs):
        self.fn = nnx.Param(normal_init(rngs, (hc_mult, hc_mult * dim), 0.05))
        self.base = nnx.Param(normal_init(rngs, (hc_mult,), 0.2))
        self.scale = nnx.Param(normal_init(rngs, (1,), 0.2, mean=0.5))


def hc_head_collapse(fn: jax.Array, base: jax.Array, scale: jax.Array, x: jax.Array, *, norm_eps: float,
                     hc_eps: float, batch_invariant: bool = False) -> jax.Array:
    """x [..., n, D] -> y [..., D] collapsed by the learned head weights."""
    if batch_invariant:
        return row_blocks(lambda x: hc_head_collapse(fn, base, scale, x, norm_eps=norm_eps, hc_eps=hc_eps), x,
                          lead=x.ndim - 2)
    flat = rms_normalize(x.reshape(*x.shape[:-2], -1), norm_eps)
    m = jnp.einsum("...k,ok->...o", flat, fn.astype(jnp.float32))
    pre = jax.nn.sigmoid(m * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)) + hc_eps
    return collapse(x, pre)
