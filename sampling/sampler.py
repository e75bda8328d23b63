"""logits -> token: greedy, temperature, top-k, top-p. Explicit PRNG keys; deterministic given a key.

All knobs are traced values (changing them does not recompile): temperature <= 0 means greedy,
top_k <= 0 disables top-k, top_p >= 1 disables top-p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """Temperature-scaled logits [B, V] with tokens outside top-k / top-p set to -inf (float32)."""
    logits = logits.astype(jnp.float32) / jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    vocab = logits.shape[-1]
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.asarray(top_k, jnp.int32)
    keep_sorted = (k <= 0) | (rank < k)
    probs = jax.nn.softmax(jnp.where(keep_sorted, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of the better-ranked tokens
    keep_sorted &= mass_before < jnp.asarray(top_p, jnp.float32)  # the best token always stays
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


def sample(logits: jax.Array, key: jax.Array, temperature=0.0, top_k=0, top_p=1.0) -> jax.Array:
    """logits [B, V] -> tokens [B] int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.random.categorical(key, filter_logits(logits, temperature, top_k, top_p), axis=-1)
    return jnp.where(jnp.asarray(temperature) > 0, drawn.astype(jnp.int32), greedy)
