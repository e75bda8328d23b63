"""logits -> token: greedy, temperature, top-k, top-p. Explicit PRNG keys; deterministic given a key.

The knobs are scalars, traced under jit (changing them does not recompile): temperature 0 means greedy
(a `lax.cond`, so greedy decoding never sorts the vocabulary), top_k 0 disables top-k, top_p 1 disables
top-p. `check_sampling` validates them before anything is traced.

A key is one PRNG key for the whole batch ([2]: one draw over all rows), or one key per sequence ([B, 2],
`sequence_keys`: row b draws from key b alone, its filtering on fixed blocks of rows, so a sequence's randomness
and its numbers never depend on its batch row or its batch-mates). `fold_in`, `split`, `uniform` and
`categorical` take either form.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.invariant import row_blocks


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _item(x):
    """A 0-d numpy / jax array as its Python scalar (other values unchanged)."""
    return x.item() if isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0 else x


def check_sampling(temperature, top_k, top_p) -> None:
    """ValueError naming the knob unless temperature is a finite number >= 0, top_k an integer >= 0 and top_p
    a number in (0, 1] (Python or numpy scalars, or 0-d arrays)."""
    temperature, top_k, top_p = _item(temperature), _item(top_k), _item(top_p)
    if not is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, (bool, np.bool_)) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k), got {top_k!r}")
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1] (1 = no top-p), got {top_p!r}")


def sequence_keys(seed: int, sequence_ids: jax.Array) -> jax.Array:
    """One PRNG key per sequence [B, 2] from the caller's seed and each sequence's id [B] (ints in [0, 2^32))."""
    base = jax.random.PRNGKey(seed)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(sequence_ids, jnp.uint32))


def is_per_sequence(key: jax.Array) -> bool:
    """Whether `key` holds one key per sequence ([B, 2], `sequence_keys`) rather than one for the batch."""
    return key.ndim == 2


def fold_in(key: jax.Array, data) -> jax.Array:
    """jax.random.fold_in of a batch key or of every sequence's key."""
    if is_per_sequence(key):
        return jax.vmap(jax.random.fold_in, (0, None))(key, data)
    return jax.random.fold_in(key, data)


def split(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two independent keys (of the same form) from one."""
    if is_per_sequence(key):
        pair = jax.vmap(jax.random.split)(key)
        return pair[:, 0], pair[:, 1]
    first, second = jax.random.split(key)
    return first, second


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """U[0, 1) float32 of `shape` [B, ...]; per-sequence keys draw row b's values from key b."""
    if is_per_sequence(key):
        return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(key)
    return jax.random.uniform(key, shape)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per row of logits [B, V] -> [B] int32; per-sequence keys: row b from key b."""
    if is_per_sequence(key):
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
    """logits [B, V] -> tokens [B] int32 (scalar knobs, Python or traced; per-sequence keys [B, 2]: each row on
    its own, on fixed row blocks)."""
    def greedy(logits, key):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn(logits, key):
        return categorical(key, filter_logits(logits, temperature, top_k, top_p))

    def draw(logits, key):
        return jax.lax.cond(jnp.asarray(temperature) > 0, drawn, greedy, logits, key)
    return row_blocks(draw, logits, key) if is_per_sequence(key) else draw(logits, key)
