"""Pure-jnp definitions of the hot paths. Every Pallas kernel is tested against these, and the
model calls them directly when `impl="reference"` (always available, any XLA backend).

Shapes: B batch, T query rows, N key rows (window and/or compressed entries), H heads,
Dh head dim (one shared KV vector per key, used as key and value), E experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def sink_attention(q: jax.Array, kv: jax.Array, mask: jax.Array, sink: jax.Array, scale: float) -> jax.Array:
    """Shared-KV MQA with a per-head sink in the softmax denominator.

    q [B, T, H, Dh], kv [B, N, Dh] (key == value), mask [B, T, N] bool (True = attend), sink [H].
    P[h, t, s] = exp(z) / (exp(sink_h) + sum_{s' valid} exp(z')), z = scale * q.k (float32).
    Returns o [B, T, H, Dh] in q's dtype; rows with no valid key return 0.
    """
    z = jnp.einsum("bthd,bnd->bhtn", q, kv, preferred_element_type=jnp.float32) * scale
    z = jnp.where(mask[:, None], z, NEG_INF)
    sink = sink.astype(jnp.float32)[None, :, None, None]
    m = jnp.maximum(jnp.max(z, axis=-1, keepdims=True), sink)
    p = jnp.exp(z - m)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - m)
    p = p / denom
    o = jnp.einsum("bhtn,bnd->bthd", p.astype(kv.dtype), kv, preferred_element_type=jnp.float32)
    return o.astype(q.dtype)


def indexer_scores(q: jax.Array, weights: jax.Array, keys: jax.Array, visible: jax.Array) -> jax.Array:
    """Lightning-indexer scores: sum_h weights[h] * ReLU(q_h . k_j), -inf where not visible.

    q [B, T, HI, DI], weights [B, T, HI] (already scaled), keys [B, N, DI], visible [B, T, N] bool.
    Returns [B, T, N] float32.
    """
    s = jnp.einsum("bthd,bnd->bthn", q.astype(jnp.float32), keys.astype(jnp.float32))
    s = jnp.einsum("bthn,bth->btn", jax.nn.relu(s), weights.astype(jnp.float32))
    return jnp.where(visible, s, NEG_INF)


def topk_indices(scores: jax.Array, k: int) -> jax.Array:
    """Indices of the k best scores per row (ties -> lower index), -1 where the score is -inf.

    scores [..., N] -> [..., min(k, N)] int32.
    """
    k = min(k, scores.shape[-1])
    vals, idx = jax.lax.top_k(scores, k)
    return jnp.where(vals > NEG_INF, idx, -1).astype(jnp.int32)


def indices_to_mask(indices: jax.Array, n: int) -> jax.Array:
    """[B, T, K] int indices (-1 = none) -> [B, T, n] bool membership mask."""
    b, t, _ = indices.shape
    slot = jnp.where(indices >= 0, indices, n)  # -1 -> out of range -> dropped
    bi = jnp.arange(b)[:, None, None]
    ti = jnp.arange(t)[None, :, None]
    return jnp.zeros((b, t, n), bool).at[bi, ti, slot].set(True, mode="drop")


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, L)) * clip(up, -L, L) (no clamp when L <= 0), float32."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def moe_experts(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w1: jax.Array, w2: jax.Array,
                w3: jax.Array, limit: float) -> jax.Array:
    """Routed-expert SwiGLU block with the routing weight applied before the down projection.

    x [M, D], expert_ids [M, k] int, weights [M, k] float32, w1/w3 [E, I, D], w2 [E, D, I].
    Rows are sorted by expert and run through `jax.lax.ragged_dot` (experts with no rows cost nothing).
    Returns [M, D] float32 = sum_k w_k * W2_e (swiglu(W1_e x, W3_e x)).
    """
    m, k = expert_ids.shape
    num_experts = w1.shape[0]
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // k
    xs = jnp.take(x, token_of, axis=0).astype(w1.dtype)
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    gate = jax.lax.ragged_dot(xs, jnp.swapaxes(w1, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    up = jax.lax.ragged_dot(xs, jnp.swapaxes(w3, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    z = clamped_swiglu(gate, up, limit) * jnp.take(weights.reshape(-1), order)[:, None]
    y = jax.lax.ragged_dot(z.astype(w2.dtype), jnp.swapaxes(w2, 1, 2), group_sizes,
                           preferred_element_type=jnp.float32)
    return jnp.zeros((m, x.shape[-1]), jnp.float32).at[token_of].add(y)
