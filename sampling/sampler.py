"""logits -> token: greedy, temperature, top-k, top-p. Explicit PRNG keys; deterministic given a key.

All knobs are traced values (changing them does not recompile): temperature <= 0 means greedy,
top_k <= 0 disables top-k, top_p >= 1 disables top-p.

A key is one PRNG key for the whole batch ([2]: one draw over all rows), or one key per sequence ([B, 2],
`sequence_keys`: row b draws from key b alone, its filtering on fixed blocks of rows, so a sequence's randomness
and its numbers never depend on its batch row or its batch-mates). `fold_in`, `split`, `uniform` and
`categorical` take either form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.invariant import row_blocks


def sequence_keys(seed: int, sequence_ids: jax.Array) -> jax.Array:
    """One PRNG key per sequence [B, 2] from the caller's seed and each sequence's id [B] (ints in [0, 2^32))."""
    base = jax.random.PRNGKey(seed)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(sequence_ids, jnp.uint32))


def _per_sequence(key: jax.Array) -> bool:
    return key.ndim == 2


def fold_in(key: jax.Array, data) -> jax.Array:
    """jax.random.fold_in of a batch key or of every sequence's key."""
    if _per_sequence(key):
        return jax.vmap(jax.random.fold_in, (0, None))(key, data)
    return jax.random.fold_in(key, data)


def split(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two independent keys (of the same form) from one."""
    if _per_sequence(key):
        pair = jax.vmap(jax.random.split)(key)
        return pair[:, 0], pair[:, 1]
    first, second = jax.random.split(key)
    return first, second


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """U[0, 1) float32 of `shape` [B, ...]; per-sequence keys draw row b's values from key b."""
    if _per_sequence(key):
        return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(key)
    return jax.random.uniform(key, shape)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per row of logits [B, V] -> [B] int32; per-sequence keys: row b from key b."""
    if _per_sequence(key):
        return jax.vmap(jax.random.categorical)(key, logits).astype(jnp.int32)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


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
    """logits [B, V] -> tokens [B] int32 (per-sequence keys [B, 2]: each row on its own, on fixed row blocks)."""
    def draw(logits, key):
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drawn = categorical(key, filter_logits(logits, temperature, top_k, top_p))
        return jnp.where(jnp.asarray(temperature) > 0, drawn, greedy)
    return row_blocks(draw, logits, key) if _per_sequence(key) else draw(logits, key)
