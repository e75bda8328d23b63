"""One attention block driven by `LayerSpec`: SWA, CSA (compressor + indexer top-k) or HCA
(MODEL_SPEC 2.4-2.5).

Common path: c_q = RMSNorm(W_qa h); q = W_qb c_q -> [H, Dh], per-head weightless RMS norm,
RoPE on the last R dims; kv = RoPE(RMSNorm(W_kv h)) is both key and value. Keys are the window
(positions p-W+1..p) plus compressed entries (selected by the indexer for CSA, all visible for HCA);
a per-head sink joins the softmax denominator. The output's rope dims are rotated back by -p,
then the grouped output projection: G groups of (H/G)*Dh -> o_lora each (W_oa), then W_ob.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import reference as ref

from .cache import LayerCache, Step, ring_positions, ring_write
from .compressor import Compressor, Indexer, visible_entries
from .config import LayerSpec, ModelConfig
from .layers import Linear, RMSNorm, apply_rope, normal_init, rms_normalize, rope_frequencies


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs, dtype):
        h, dh = cfg.num_heads, cfg.head_dim
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, rngs=rngs, dtype=dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, rngs=rngs)
        self.wq_b = Linear(cfg.q_lora_rank, h * dh, rngs=rngs, dtype=dtype)
        self.wkv = Linear(cfg.hidden_size, dh, rngs=rngs, dtype=dtype)
        self.kv_norm = RMSNorm(dh, cfg.rms_norm_eps, rngs=rngs)
        self.wo_a = Linear(h * dh // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, rngs=rngs, dtype=dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, rngs=rngs, dtype=dtype)
        self.attn_sink = nnx.Param(normal_init(rngs, (h,), 0.5))
        self.compressor = (Compressor(cfg, spec, dh, rngs=rngs, dtype=dtype)
                           if spec.compress_ratio > 0 else None)
        self.indexer = Indexer(cfg, spec, rngs=rngs, dtype=dtype) if spec.indexer else None
        self.spec = spec
        self.num_heads, self.head_dim = h, dh
        self.o_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.window = cfg.sliding_window
        self.eps = cfg.rms_norm_eps
        self.freqs = rope_frequencies(cfg.rope_head_dim, spec.rope_theta, spec.yarn)

    def queries(self, h: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """h [B, T, D] -> (q [B, T, H, Dh] rotated, c_q [B, T, q_lora])."""
        c_q = self.q_norm(self.wq_a(h))
        q = self.wq_b(c_q).reshape(*h.shape[:-1], self.num_heads, self.head_dim)
        q = rms_normalize(q, self.eps).astype(h.dtype)
        return apply_rope(q, positions[..., None], self.freqs), c_q

    def keys(self, h: jax.Array, positions: jax.Array) -> jax.Array:
        """The layer's own window kv [B, T, Dh] (rotated at each row's position)."""
        return apply_rope(self.kv_norm(self.wkv(h)), positions, self.freqs)

    def output(self, o: jax.Array, positions: jax.Array) -> jax.Array:
        """o [B, T, H, Dh] -> inverse RoPE -> grouped output projection -> [B, T, D]."""
        o = apply_rope(o, positions[..., None], self.freqs, inverse=True)
        o = o.reshape(*o.shape[:-2], self.o_groups, -1)
        w_a = self.wo_a.weight[...].reshape(self.o_groups, self.o_lora_rank, -1)
        u = jnp.einsum("...gi,goi->...go", o.astype(w_a.dtype), w_a)
        return self.wo_b(u.reshape(*u.shape[:-2], -1))

    def __call__(self, h: jax.Array, step: Step, cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        """h [B, S, D] rows of `step` -> ([B, S, D], cache with this chunk written).

        Keys: the SWA ring (positions before the chunk), the chunk's own rows, and (compressed layers)
        the entry store after adding the blocks this chunk closes.
        """
        pos = step.positions
        q, c_q = self.queries(h, pos)
        kv = self.keys(h, pos)
        ring_pos = ring_positions(step.start, cache.kv.shape[1])
        keys = [cache.kv, kv]
        masks = [self._window(pos, ring_pos, ring_pos >= 0), self._window(pos, pos, step.valid)]
        new = cache.replace(kv=ring_write(cache.kv, kv, step))
        if self.compressor is not None:
            comp = self.compressor.update(h, step, cache.comp)
            n = comp.entries.shape[1]
            visible = visible_entries(pos, n, self.spec.compress_ratio)
            if self.indexer is not None:
                index = self.indexer.compressor.update(h, step, cache.index)
                iq, iw = self.indexer.queries(h, c_q, pos)
                chosen = self.indexer.select(iq, iw, index.entries, pos)
                visible = visible & ref.indices_to_mask(chosen, n)
                new = new.replace(index=index)
            keys.append(comp.entries)
            masks.append(visible)
            new = new.replace(comp=comp)
        o = ref.sink_attention(q, jnp.concatenate(keys, axis=1), jnp.concatenate(masks, axis=2),
                               self.attn_sink[...], self.head_dim ** -0.5)
        return self.output(o, pos), new

    def _window(self, q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array) -> jax.Array:
        """[B, S] query positions x [B, N] key positions -> [B, S, N]: 0 <= q - k < W and key valid."""
        delta = q_pos[:, :, None] - k_pos[:, None, :]
        return (delta >= 0) & (delta < self.window) & k_valid[:, None, :]
