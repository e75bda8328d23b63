"""Token-to-entry compression and the lightning indexer [V4] (MODEL_SPEC 2.5).

Compressor (ratio r, output width d, overlap iff the layer is CSA): per token, in float32,
a_t = W_kv h_t and g_t = W_gate h_t + ape[t mod r]. Entry j pools its block T_j = [jr, jr+r)
with a per-channel softmax over the gate scores:
  non-overlap: C_j = sum_{t in T_j} softmax(g) * a,
  overlap:     C_j pools 2r slots: the A halves (first d channels) of T_{j-1} and the B halves of
               T_j (for j = 0 the A slots are absent).
then C_j <- RoPE(RMSNorm(C_j), position j*r). Entries are a pure function of the projections of
their blocks, so they can be rebuilt from stored projections at any time (chunking, rollback).

Indexer: q^I = RoPE(W^I_qb c_q) (Hadamard), keys from its own overlap compressor (Hadamard),
weights w = W^I_w h / sqrt(DI * HI), score_{p,j} = sum_h w_h ReLU(q^I_h . k_j) over visible
entries j < (p+1)//r, then top-k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import reference as ref

from .cache import CompressorCache, Step, ring_gather, ring_write
from .config import LayerSpec, ModelConfig
from .layers import Linear, RMSNorm, apply_rope, hadamard, normal_init, rope_frequencies

NEG_LARGE = -1e30  # gate of an absent projection row: softmax weight exactly 0, never NaN


class Compressor(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, out_dim: int, *, rngs: nnx.Rngs, dtype,
                 hadamard_out: bool = False):
        width = (2 if spec.overlap else 1) * out_dim
        self.wkv = Linear(cfg.hidden_size, width, rngs=rngs, dtype=dtype, fp32=True)
        self.wgate = Linear(cfg.hidden_size, width, rngs=rngs, dtype=dtype, fp32=True)
        self.ape = nnx.Param(normal_init(rngs, (spec.compress_ratio, width), 0.1))
        self.norm = RMSNorm(out_dim, cfg.rms_norm_eps, rngs=rngs)
        self.ratio = spec.compress_ratio
        self.overlap = spec.overlap
        self.out_dim = out_dim
        self.hadamard_out = hadamard_out  # indexer keys are stored Hadamard-rotated
        self.freqs = rope_frequencies(cfg.rope_head_dim, spec.rope_theta, spec.yarn)

    def project(self, h: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """h [B, T, D], positions [B, T] -> (a, g) float32 [B, T, c*d]."""
        a = self.wkv(h)
        g = self.wgate(h) + jnp.take(self.ape[...], positions % self.ratio, axis=0)
        return a, g

    def pool(self, a: jax.Array, g: jax.Array, first_position: jax.Array, out_dtype) -> jax.Array:
        """Entries of consecutive whole blocks; a, g [B, n*r, c*d] float32, block 0 at `first_position` [B].

        -> [B, n, d] (normalised, rotated at each block's first position, out_dtype). Rows whose gate
        is NEG_LARGE (absent) get weight 0; with overlap, block 0 has no previous block.
        """
        b, length, width = a.shape
        n, r, d = length // self.ratio, self.ratio, self.out_dim
        a = a.reshape(b, n, r, width)
        g = g.reshape(b, n, r, width)
        if self.overlap:
            prev_a = jnp.pad(a[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
            prev_g = jnp.pad(g[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=NEG_LARGE)
            a = jnp.concatenate([prev_a, a[..., d:]], axis=2)
            g = jnp.concatenate([prev_g, g[..., d:]], axis=2)
        pooled = jnp.sum(jax.nn.softmax(g, axis=2) * a, axis=2)
        entries = self.norm(pooled.astype(out_dtype))
        positions = first_position[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :] * r
        entries = apply_rope(entries, positions, self.freqs)
        return hadamard(entries) if self.hadamard_out else entries

    def update(self, h: jax.Array, step: Step, cache: CompressorCache) -> CompressorCache:
        """Add a chunk: h [B, S, D] at `step` -> cache with every block closed by the chunk stored.

        Each sequence pools a window of whole blocks starting at the block before its first open
        block (overlap) or at its first open block, reading rows before `step.start` from the
        projection ring and the rest from the chunk.
        """
        a, g = self.project(h, step.positions)
        r, s = self.ratio, h.shape[1]
        back = 2 * r if self.overlap else r
        span = -(-(s + back) // r) * r
        base = (step.start // r) * r - (r if self.overlap else 0)  # [B]
        pos = base[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :]  # [B, span]
        from_ring = pos < step.start[:, None]
        in_chunk = jnp.clip(pos - step.start[:, None], 0, s - 1)[..., None]
        win_a = jnp.where(from_ring[..., None], ring_gather(cache.proj_a, pos),
                          jnp.take_along_axis(a, in_chunk, axis=1))
        win_g = jnp.where(from_ring[..., None], ring_gather(cache.proj_g, pos),
                          jnp.take_along_axis(g, in_chunk, axis=1))
        present = ((pos >= 0) & (pos < step.end[:, None]))[..., None]
        win_a = jnp.where(present, win_a, 0.0)
        win_g = jnp.where(present, win_g, NEG_LARGE)
        entries = self.pool(win_a, win_g, base, cache.entries.dtype)
        first = 1 if self.overlap else 0  # with overlap, window block 0 only lends its A halves
        j = base[:, None] // r + jnp.arange(first, span // r, dtype=jnp.int32)[None, :]
        closed = (j >= 0) & ((j + 1) * r <= step.end[:, None])
        j = jnp.where(closed, j, cache.entries.shape[1])  # out of range -> dropped
        bidx = jnp.arange(h.shape[0])[:, None]
        return CompressorCache(
            proj_a=ring_write(cache.proj_a, a, step),
            proj_g=ring_write(cache.proj_g, g, step),
            entries=cache.entries.at[bidx, j].set(entries[:, first:], mode="drop"),
        )


def visible_entries(positions: jax.Array, num_entries: int, ratio: int) -> jax.Array:
    """Query at position p sees entry j iff j < (p+1)//ratio. positions [B, T] -> [B, T, N] bool."""
    return jnp.arange(num_entries)[None, None, :] < ((positions + 1) // ratio)[..., None]


class Indexer(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs, dtype):
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, rngs=rngs, dtype=dtype)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, rngs=rngs, dtype=dtype, fp32=True)
        self.compressor = Compressor(cfg, spec, cfg.index_head_dim, rngs=rngs, dtype=dtype, hadamard_out=True)
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.topk = cfg.index_topk
        self.freqs = rope_frequencies(cfg.rope_head_dim, spec.rope_theta, spec.yarn)

    def queries(self, h: jax.Array, c_q: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """-> q^I [B, T, HI, DI] (rotated, Hadamard) and head weights [B, T, HI] float32 (scaled)."""
        q = self.wq_b(c_q).reshape(*c_q.shape[:-1], self.n_heads, self.head_dim)
        q = hadamard(apply_rope(q, positions[..., None], self.freqs))
        w = self.weights_proj(h) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return q, w

    def select(self, q: jax.Array, w: jax.Array, keys: jax.Array, positions: jax.Array) -> jax.Array:
        """Top-k entry indices per query [B, T, min(K, N)] (-1 = none)."""
        visible = visible_entries(positions, keys.shape[1], self.compressor.ratio)
        return ref.topk_indices(ref.indexer_scores(q, w, keys, visible), self.topk)

