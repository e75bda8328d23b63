"""Small building blocks: Linear, Embedding, RMSNorm, interleaved RoPE with YaRN, Hadamard.

Weights are stored `[out, in]` exactly as in the checkpoints, so loading is a rename.
Numerics (DESIGN.md): matmuls in the weight dtype; norms, RoPE rotation and anything marked
`fp32=True` in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import Yarn


class Table(nnx.Variable):
    """A non-trainable array loaded from the checkpoint (e.g. the hash-routing table `tid2eid`)."""


def normal_init(rngs: nnx.Rngs, shape, std: float, mean: float = 0.0, dtype=jnp.float32) -> jax.Array:
    return (mean + std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x @ W.T with W `[out, in]`; `fp32=True` computes in float32 (router, compressor, head)."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 fp32: bool = False):
        self.weight = nnx.Param(normal_init(rngs, (out_features, in_features), in_features ** -0.5, dtype=dtype))
        self.fp32 = fp32

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        if self.fp32:
            return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w.astype(jnp.float32))
        return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.weight = nnx.Param(normal_init(rngs, (vocab, dim), 0.5, dtype=dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """w * x / rms(x), computed in float32 (weight kept float32), cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (dim,), 0.1, mean=1.0))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return (self.weight[...] * rms_normalize(x, self.eps)).astype(x.dtype)


# ----------------------------------------------------------------------------- RoPE

def rope_frequencies(rope_dim: int, theta: float, yarn: Yarn | None) -> tuple[float, ...]:
    """Per-pair angular frequencies omega_k, k < rope_dim/2 (a hashable tuple, static under jit).

    YaRN interpolates frequencies only (no magnitude factor): with
    c(beta) = R ln(orig / (2 pi beta)) / (2 ln theta), lo = max(floor(c(beta_fast)), 0),
    hi = min(ceil(c(beta_slow)), R - 1), ramp_k = clip((k - lo) / max(hi - lo, 1e-3), 0, 1),
    omega'_k = omega_k / factor * ramp_k + omega_k * (1 - ramp_k).
    """
    k = np.arange(rope_dim // 2, dtype=np.float64)
    freqs = 1.0 / theta ** (2.0 * k / rope_dim)
    if yarn is None or yarn.factor == 1.0:
        return tuple(freqs.tolist())

    def corr(beta: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (beta * 2 * math.pi)) / (
            2 * math.log(theta))

    lo = max(math.floor(corr(yarn.beta_fast)), 0)
    hi = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
    ramp = np.clip((k - lo) / max(hi - lo, 1e-3), 0.0, 1.0)
    return tuple((freqs / yarn.factor * ramp + freqs * (1.0 - ramp)).tolist())


def apply_rope(x: jax.Array, positions: jax.Array, freqs: tuple[float, ...], inverse: bool = False) -> jax.Array:
    """Rotate interleaved pairs of the LAST 2*len(freqs) channels of x by angle position*omega.

    x: [..., S, (heads,) dim] with positions [..., S] broadcast over any axes between S and dim
    (pass positions shaped to broadcast against x[..., 0]). inverse=True rotates by -angle.
    """
    rope_dim = 2 * len(freqs)
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)  # [..., R/2]
    if inverse:
        angle = -angle
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].astype(jnp.float32)
    pairs = rope.reshape(*rope.shape[:-1], rope_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    rotated = rotated.reshape(rope.shape).astype(x.dtype)
    return jnp.concatenate([nope, rotated], axis=-1)


def hadamard(x: jax.Array) -> jax.Array:
    """Sylvester-order Walsh-Hadamard transform over the last axis, scaled by n^-1/2 (orthonormal)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two width, got {n}")
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return jnp.einsum("...i,ij->...j", x.astype(jnp.float32), jnp.asarray(h / math.sqrt(n), jnp.float32)
                      ).astype(x.dtype)
