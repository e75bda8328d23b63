"""Token-to-entry compression and the lightning indexer (docs/model.md §5, §6, §8 [V4]; §7, §8 [V4.1]).

Compressor (ratio r, width d): per token, in float32, a_t = W_kv h_t and a gate score g_t
(W_gate h_t, plus the learned in-block bias ape[t mod r] in V4). Entry j pools its block
T_j = [jr, jr+r) with a per-channel softmax over the gate scores, then RMSNorm -> the latent L_j.
  [V4] overlap (CSA, r=4): entry j pools 2r slots, the A halves (first d channels) of T_{j-1} and
       the B halves of T_j (for j = 0 the A slots are absent).
  [V4.1] no overlap, no ape; r = 1 is a plain projection (no gate).
Entries are a pure function of the projections of their blocks, rebuilt from the stored
projection ring when a block closes (chunking, rollback and resume are length updates).
The caller rotates latents at position j*r (and derives V4.1 index keys from the unrotated latent).

Indexer: q^I = RoPE(W^I_qb c_q) (V4: Hadamard), weights w = W^I_w h / sqrt(DI * HI),
score_{p,j} = sum_h w_h ReLU(q^I_h . k_j) over visible entries j < (p+1)//r, then top-k.
[V4.1] the candidate source keeps the best blocks of `candidate_block_size` entries (level 1) and
later Reindex layers restrict their scores to them (level 2).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import invariant as inv
from pallas_kernels import reference as ref

from .cache import Step, ring_gather, ring_write, write_rows
from .config import LayerSpec, ModelConfig
from .layers import Linear, RMSNorm, apply_rope, fp4_fake_quant, hadamard, normal_init, rope_frequencies

NEG_LARGE = -1e30  # gate of an absent projection row: softmax weight exactly 0, never NaN


class Compressor(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, out_dim: int, *, rngs: nnx.Rngs, dtype):
        v4 = cfg.generation == "v4"
        r = spec.compress_ratio
        width = (2 if spec.overlap else 1) * out_dim
        gated = v4 or r > 1
        self.wkv = Linear(cfg.hidden_size, width, rngs=rngs, dtype=dtype, fp32=gated)
        self.wgate = Linear(cfg.hidden_size, width, rngs=rngs, dtype=dtype, fp32=True) if gated else None
        self.ape = nnx.Param(normal_init(rngs, (r, width), 0.1)) if v4 else None
        self.norm = RMSNorm(out_dim, cfg.rms_norm_eps, rngs=rngs)
        self.ratio = r
        self.overlap = spec.overlap
        self.out_dim = out_dim
        self.batch_invariant = cfg.batch_invariant  # each entry pooled by fixed trees (invariant.softmax_pool)

    def project(self, h: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """h [B, T, D], positions [B, T] -> (a, g) float32 [B, T, c*d]."""
        a = self.wkv(h).astype(jnp.float32)
        if self.wgate is None:
            return a, jnp.zeros_like(a)
        g = self.wgate(h)
        if self.ape is not None:
            g = g + jnp.take(self.ape[...], positions % self.ratio, axis=0)
        return a, g

    def pool(self, a: jax.Array, g: jax.Array, out_dtype) -> jax.Array:
        """Latents of consecutive whole blocks: a, g [B, n*r, c*d] float32 -> [B, n, d] (normalised).

        Rows whose gate is NEG_LARGE (absent) get weight 0; with overlap, block 0 has no previous block.
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

        pooled = inv.softmax_pool(a, g) if self.batch_invariant else jnp.sum(jax.nn.softmax(g, axis=-2) * a, axis=-2)
        return self.norm(pooled.astype(out_dtype))

    def latents(self, h: jax.Array, step: Step, proj_a: jax.Array, proj_g: jax.Array, out_dtype):
        """Pool every block a chunk can close. h [B, S, D] at `step`; proj_a/g the projection ring.

        Each sequence pools a window of whole blocks starting at the block before its first open
        block (overlap) or at its first open block, reading rows before `step.start` from the ring and
        the rest from the chunk. -> (latents [B, n, d], entry ids j [B, n] (out of range where the
        block is not closed), updated proj_a, proj_g).
        """
        a, g = self.project(h, step.positions)
        r, s = self.ratio, h.shape[1]
        # a chunk of s rows closes at most ceil(s / r) blocks, the first of them the one holding its first row
        # (end // r - start // r <= ceil(s / r)); with overlap the block before lends its A halves
        span = (-(-s // r) + (1 if self.overlap else 0)) * r
        base = (step.start // r) * r - (r if self.overlap else 0)  # [B]
        pos = base[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :]  # [B, span]
        from_ring = (pos < step.start[:, None])[..., None]
        in_chunk = jnp.clip(pos - step.start[:, None], 0, s - 1)[..., None]
        win_a = jnp.where(from_ring, ring_gather(proj_a, pos), jnp.take_along_axis(a, in_chunk, axis=1))
        win_g = jnp.where(from_ring, ring_gather(proj_g, pos), jnp.take_along_axis(g, in_chunk, axis=1))
        present = ((pos >= 0) & (pos < step.end[:, None]))[..., None]
        lat = self.pool(jnp.where(present, win_a, 0.0), jnp.where(present, win_g, NEG_LARGE), out_dtype)
        first = 1 if self.overlap else 0  # with overlap, window block 0 only lends its A halves
        j = base[:, None] // r + jnp.arange(first, span // r, dtype=jnp.int32)[None, :]
        closed = (j >= 0) & ((j + 1) * r <= step.end[:, None])
        j = jnp.where(closed, j, jnp.iinfo(jnp.int32).max)
        return lat[:, first:], j, ring_write(proj_a, a, step), ring_write(proj_g, g, step)


def store_entries(store, values: jax.Array, j: jax.Array):
    """Write entries values [B, n, d] at indices j [B, n] of store [B, N, d] (an array or a LayerSlice);
    out-of-range j are dropped."""
    bidx = jnp.arange(store.shape[0])[:, None]
    return write_rows(store, (bidx, jnp.minimum(j, store.shape[1])), values)


def visible_entries(positions: jax.Array, num_entries: int, ratio: int) -> jax.Array:
    """Query at position p sees entry j iff j < (p+1)//ratio. positions [B, T] -> [B, T, N] bool."""
    return jnp.arange(num_entries)[None, None, :] < ((positions + 1) // ratio)[..., None]


def candidate_blocks(scores: jax.Array, reachable: jax.Array, topk_blocks: int, block: int) -> jax.Array:
    """[V4.1] level-1 selection: scores [B, T, N] (-inf where unreachable), reachable [B, T] entry counts.

    Block score = max over `block` consecutive entries; `reference.top_candidate_groups` keeps the best
    `topk_blocks` blocks (the newest reachable one forced in) -> candidate mask [B, T, N].
    """
    n = scores.shape[-1]
    s = jnp.pad(scores, ((0, 0), (0, 0), (0, -n % block)), constant_values=-jnp.inf)
    keep = ref.top_candidate_groups(jnp.max(s.reshape(*s.shape[:-1], -1, block), axis=-1), reachable, topk_blocks,
                                    block)
    return jnp.repeat(keep, block, axis=-1)[..., :n]


class Indexer(nnx.Module):
    """Lightning indexer. [V4]: own overlap compressor for keys, Hadamard-rotated q and keys.
    [V4.1]: keys from the KV source's latent (`wk`, `k_norm` on KV sources only), no Hadamard."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs, dtype):
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, rngs=rngs, dtype=dtype)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, rngs=rngs, dtype=dtype, fp32=True)
        self.v4 = cfg.generation == "v4"
        self.compressor = Compressor(cfg, spec, cfg.index_head_dim, rngs=rngs, dtype=dtype) if self.v4 else None
        own_keys = not self.v4 and spec.owns_kv
        self.wk = Linear(cfg.head_dim, cfg.index_head_dim, rngs=rngs, dtype=dtype) if own_keys else None
        self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps, rngs=rngs) if own_keys else None
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.topk = cfg.index_topk
        self.ratio = spec.compress_ratio
        self.quant_sim = cfg.quant_sim
        self.key_format = cfg.index_key_format
        self.candidate_source = spec.candidate_source
        self.uses_candidates = spec.uses_candidates
        self.candidate_topk_blocks, self.candidate_block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.freqs = rope_frequencies(cfg.rope_head_dim, spec.rope_theta, spec.yarn)
        self.batch_invariant = cfg.batch_invariant  # each query row's scores in a fixed order (_row_scores)
        self.hadamard_tiles = cfg.dense_impl == "pallas"   # under batch_invariant: the rotation on fixed tiles

    def finish_keys(self, keys: jax.Array) -> jax.Array:
        """Rotated keys -> stored form: V4 Hadamard; FP4 sim (UE8M0 / 32) when quant_sim."""
        if self.v4:
            keys = hadamard(keys, self.batch_invariant, self.hadamard_tiles)
        return fp4_fake_quant(keys, 32) if self.quant_sim else keys

    def cached(self, keys: jax.Array) -> jax.Array:
        """Finished keys [B, n, DI] -> their cache rows: as they are, or MXFP4 rows (index_key_format='fp4')."""
        return ref.quantize_index_keys(keys, "fp4")[0] if self.key_format == "fp4" else keys

    def keys_from_latent(self, latent: jax.Array, positions: jax.Array) -> jax.Array:
        """[V4.1] index keys k_j = RoPE(k_norm(W_k L_j)) at j*r from the unrotated latent."""
        return self.finish_keys(apply_rope(self.k_norm(self.wk(latent)), positions, self.freqs))

    def queries(self, h: jax.Array, c_q: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """-> q^I [B, T, HI, DI] (rotated; V4 Hadamard; FP4 sim) and head weights [B, T, HI] float32 (scaled)."""
        q = self.wq_b(c_q).reshape(*c_q.shape[:-1], self.n_heads, self.head_dim)
        q = self.finish_keys(apply_rope(q, positions[..., None], self.freqs))
        w = self.weights_proj(h) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return q, w

    def select(self, q: jax.Array, w: jax.Array, keys: jax.Array, positions: jax.Array,
               candidates: jax.Array | None = None, row_scores: Callable | None = None
               ) -> tuple[jax.Array, jax.Array | None]:
        """Top-k entry indices per query [B, T, min(K, N)] (-1 = none), and the candidate mask this
        layer publishes (candidate source) or passes on. row_scores (q, w, keys as cached) -> [B, T, N]: under
        cfg.batch_invariant, how each row's scores are computed in their fixed order (None: `_row_scores`)."""
        visible = visible_entries(positions, keys.shape[1], self.ratio)
        if self.batch_invariant:
            scores = jnp.where(visible, (row_scores or self._row_scores)(q, w, keys), ref.NEG_INF)
        else:
            scores = ref.indexer_scores(q, w, self._plain(keys, q.dtype), visible)
        if self.candidate_source:
            candidates = candidate_blocks(scores, (positions + 1) // self.ratio, self.candidate_topk_blocks,
                                          self.candidate_block_size)
        elif self.uses_candidates:
            scores = jnp.where(candidates, scores, -jnp.inf)
        return ref.topk_indices(scores, self.topk), candidates

    @staticmethod
    def _plain(keys: jax.Array, dtype) -> jax.Array:
        """Cached keys [B, N, DI] as values: MXFP4 cache rows (uint8) dequantised (exact in bf16) to dtype."""
        return ref.dequantize_rows(keys, None).astype(dtype) if keys.dtype == jnp.uint8 else keys

    def _row_scores(self, q: jax.Array, w: jax.Array, keys: jax.Array) -> jax.Array:
        """`reference.indexer_scores` unmasked, each query row against its sequence's keys in blocks of
        `invariant.INDEX_KEY_BLOCK` on fixed blocks of rows (cfg.batch_invariant). q [B, T, HI, DI], w [B, T, HI],
        keys [B, N, DI] (or MXFP4 cache rows) -> [B, T, N] float32."""
        b, t = q.shape[:2]
        seq_of_row = inv.row_sequences(b, t)
        keys = self._plain(keys, q.dtype)
        return inv.row_blocks(lambda q, w, seq: inv.indexer_scores(q, w, keys[seq]), q, w, seq_of_row, lead=2)
