"""One attention block driven by `LayerSpec` (docs/model.md §4, §5, §6, §7, §8): [V4] SWA, CSA (own compressor +
indexer top-k) or HCA (own compressor, all entries); [V4.1] SWA, Full, Reindex or Reuse (CSA2).

Common path: c_q = RMSNorm(W_qa h); q = W_qb c_q -> [H, Dh] ([V4] per-head weightless RMS norm),
RoPE on the last R dims; kv = RoPE(RMSNorm(W_kv h)) is both key and value. Keys are the window
(positions p-W+1..p) plus compressed entries (selected by top-k, or all visible for HCA); a per-head
sink joins the softmax denominator. The output's rope dims are rotated back by -p, then the grouped
output projection: G groups of (H/G)*Dh -> o_lora each (W_oa), then W_ob.

[V4.1] global KV, index keys, top-k and the candidate mask flow down the layer stack in `Shared`:
sources publish them, Reuse layers read them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from pallas_kernels import invariant as inv
from pallas_kernels import reference as ref

from .cache import LayerCache, Step, read, ring_positions, ring_write
from .compressor import Compressor, Indexer, store_entries, visible_entries
from .config import LayerSpec, ModelConfig
from .layers import (Linear, RMSNorm, apply_rope, fp4_fake_quant, fp8_kernel_linear, fp8_kernel_runs, normal_init,
                     per_batch_shard, rms_normalize, rope_frequencies)


@struct.dataclass
class Shared:
    """[V4.1] what sources hand down the stack within one step (docs/model.md §7, §7.2, §8)."""

    kv: jax.Array | None = None  # latest source's global KV store [B, N, Dh]
    keys: jax.Array | None = None  # its index keys [B, N, DI] (or MXFP4 rows uint8 [B, N, DI/2 + DI/32])
    topk: jax.Array | None = None  # latest index source's selection [B, S, K]
    candidates: jax.Array | None = None  # candidate source's mask [B, S, N]


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
        self.compressor = Compressor(cfg, spec, dh, rngs=rngs, dtype=dtype) if spec.owns_kv else None
        self.indexer = Indexer(cfg, spec, rngs=rngs, dtype=dtype) if spec.indexer else None
        self.spec = spec
        self.v4 = cfg.generation == "v4"
        self.quant_sim = cfg.quant_sim
        self.rope_dim = cfg.rope_head_dim
        self.num_heads, self.head_dim = h, dh
        self.o_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.window = cfg.sliding_window
        self.eps = cfg.rms_norm_eps
        self.freqs = rope_frequencies(cfg.rope_head_dim, spec.rope_theta, spec.yarn)
        self.batch_invariant = cfg.batch_invariant  # every query row's sums in a fixed order (_rows_attention)
        # "reference" | "pallas" | "triton" | "mgpu" (_attention_kernel, _topk_kernel; under batch_invariant the
        # Triton kernel's invariant launch, each row's keys in the canonical order of _rows_attention, and the
        # indexer's scores on their kernel at one tiling, _fixed_tile_scores)
        self.impl = cfg.attention_impl
        # the runner of the Pallas kernels on a mesh (sharding.BatchParallel: once per batch shard, as GSPMD cannot
        # split a pallas_call; static), from the model's runtime (Transformer._bind); None: on the whole batch
        self.per_shard = None

    def queries(self, h: jax.Array, positions: jax.Array, normalize: bool = True) -> tuple[jax.Array, jax.Array]:
        """h [B, T, D] -> (q [B, T, H, Dh] rotated, c_q [B, T, q_lora]). normalize=False leaves V4's per-head
        normalisation to the attention kernel (`q_norm_eps`), which folds it into the scores."""
        c_q = self.q_norm(self.wq_a(h))
        q = self.wq_b(c_q).reshape(*h.shape[:-1], self.num_heads, self.head_dim)
        if self.v4 and normalize:
            q = rms_normalize(q, self.eps, self.batch_invariant).astype(h.dtype)
        return apply_rope(q, positions[..., None], self.freqs), c_q

    def keys(self, h: jax.Array, positions: jax.Array) -> jax.Array:
        """The layer's own window kv [B, T, Dh] (rotated at each row's position, FP8 sim)."""
        return self.quantize_kv(apply_rope(self.kv_norm(self.wkv(h)), positions, self.freqs))

    def quantize_kv(self, kv: jax.Array) -> jax.Array:
        """FP8 sim of window / [V4] compressed KV: V4 on the non-rope dims per 64, V4.1 all dims per 32."""
        if not self.quant_sim:
            return kv
        if not self.v4:
            return ref.fp8_fake_quant(kv, 32)
        nope = kv.shape[-1] - self.rope_dim
        return jnp.concatenate([ref.fp8_fake_quant(kv[..., :nope], 64), kv[..., nope:]], axis=-1)

    def compress(self, h: jax.Array, step: Step, cache: LayerCache) -> LayerCache:
        """Own compressor (and V4 indexer compressor): add the blocks this chunk closes to the stores."""
        r = self.spec.compress_ratio
        comp = cache.comp
        lat, j, pa, pg = self.compressor.latents(h, step, comp.proj_a, comp.proj_g, h.dtype)
        at = j * r
        entries = apply_rope(lat, at, self.freqs)
        if self.v4:
            entries = self.quantize_kv(entries)
        elif self.quant_sim:
            entries = fp4_fake_quant(entries, 16, e4m3_scale=True)
        cache = cache.replace(comp=comp.replace(proj_a=pa, proj_g=pg, entries=store_entries(comp.entries, entries, j)))
        if self.indexer is None:
            return cache
        index = cache.index
        if self.v4:
            klat, kj, ka, kg = self.indexer.compressor.latents(h, step, index.proj_a, index.proj_g, h.dtype)
            keys = self.indexer.finish_keys(apply_rope(klat, kj * r, self.freqs))
            index = index.replace(proj_a=ka, proj_g=kg, entries=store_entries(index.entries, self.indexer.cached(keys),
                                                                              kj))
        else:
            keys = self.indexer.cached(self.indexer.keys_from_latent(lat, at))
            index = index.replace(entries=store_entries(index.entries, keys, j))
        return cache.replace(index=index)

    def output(self, o: jax.Array, positions: jax.Array) -> jax.Array:
        """o [B, T, H, Dh] -> inverse RoPE -> grouped output projection -> [B, T, D]."""
        o = apply_rope(o, positions[..., None], self.freqs, inverse=True)
        o = o.reshape(*o.shape[:-2], self.o_groups, -1)
        with jax.named_scope("proj"):
            u = self._grouped_fp8_kernel(o)
            if u is None:
                w_a = self.wo_a.dense_weight().reshape(self.o_groups, self.o_lora_rank, -1)

                def grouped(o):
                    return jnp.einsum("...gi,goi->...go", o.astype(w_a.dtype), w_a)
                u = inv.row_blocks(grouped, o, lead=o.ndim - 2) if self.batch_invariant else grouped(o)
        return self.wo_b(u.reshape(*u.shape[:-2], -1))

    def _grouped_fp8_kernel(self, o: jax.Array) -> jax.Array | None:
        """o [..., G, in] -> u [..., G, r] as one grouped FP8 GEMM on wo_a's kernels (group g's rows against its own
        weight rows), or None where they do not run: wo_a not on the kernels, scale blocks across groups, or a load
        the kernels leave to the in-graph path (`fp8_kernel_runs`)."""
        lin, g, r = self.wo_a, self.o_groups, self.o_lora_rank
        if not lin.fp8_kernel:
            return None
        w, s = lin.weight[...], lin.scale[...]
        block = w.shape[0] // s.shape[0]
        if r % block:
            return None
        wg, sg = w.reshape(g, r, -1), s.reshape(g, r // block, -1)
        if not fp8_kernel_runs(o.size // (g * o.shape[-1]), wg, sg, lin.act_block, lin.dtype, lin.batch_invariant):
            return None
        u = fp8_kernel_linear(jnp.moveaxis(o.reshape(-1, g, o.shape[-1]), 1, 0), wg, sg, lin.act_block, lin.dtype,
                              lin.batch_invariant)
        return jnp.moveaxis(u, 0, 1).reshape(*o.shape[:-2], g, r)

    def __call__(self, h: jax.Array, step: Step, cache: LayerCache, shared: Shared
                 ) -> tuple[jax.Array, LayerCache, Shared]:
        """h [B, S, D] rows of `step` -> ([B, S, D], cache with this chunk written, shared state).

        Keys: the SWA ring (positions before the chunk), the chunk's own rows, and (compressed layers)
        the global entry store after adding the blocks this chunk closes (inside a scanned group the cache's
        arrays are views: `cache.read`).
        """
        pos = step.positions
        q, c_q = self.queries(h, pos, normalize=self.impl == "reference")
        kv = self.keys(h, pos)
        floor = step.floor[:, None]
        ring_pos = ring_positions(step.start, cache.kv.shape[1])
        ring_pos = jnp.where(ring_pos >= floor, ring_pos, -1)  # -1: not attended (empty or below the floor)
        own_pos = jnp.where(step.valid & (pos >= floor), pos, -1)
        keys = [read(cache.kv), kv]
        masks = [self._window(pos, ring_pos, ring_pos >= 0), self._window(pos, own_pos, own_pos >= 0)]
        cache = cache.replace(kv=ring_write(cache.kv, kv, step))
        if self.spec.compress_ratio > 0:
            if self.compressor is not None:
                if step.write_global:  # (replay over a cached prefix reads the stores, never rewrites them)
                    with jax.named_scope("compressor"):
                        cache = self.compress(h, step, cache)
                shared = shared.replace(kv=read(cache.comp.entries),
                                        keys=read(cache.index.entries) if cache.index is not None else None)
            entries = shared.kv
            visible = visible_entries(pos, entries.shape[1], self.spec.compress_ratio)
            if self.indexer is not None:
                with jax.named_scope("indexer"):
                    iq, iw = self.indexer.queries(h, c_q, pos)
                    if self.impl != "reference" and not self.batch_invariant:
                        topk, cand = self._topk_kernel(iq, iw, shared.keys, pos, shared.candidates)
                    else:
                        scores = (functools.partial(self._fixed_tile_scores, pos=pos) if self.impl != "reference"
                                  else None)
                        topk, cand = self.indexer.select(iq, iw, shared.keys, pos, shared.candidates, scores)
                shared = shared.replace(topk=topk, candidates=cand)
            if self.spec.topk_source is not None:
                visible = visible & ref.indices_to_mask(shared.topk, entries.shape[1])
            keys.append(entries)
            masks.append(visible)
        with jax.named_scope("attn_core"):
            if self.impl != "reference":
                o = self._attention_kernel(q, step, keys, ring_pos, own_pos, shared)
            elif self.batch_invariant:
                o = self._rows_attention(q, step, keys, ring_pos, own_pos, shared)
            else:
                o = ref.sink_attention(q, jnp.concatenate(keys, axis=1), jnp.concatenate(masks, axis=2),
                                       self.attn_sink[...], self.head_dim ** -0.5)
        return self.output(o, pos), cache, shared

    # ------------------------------------------------------------ attention_impl "pallas" / "mgpu"
    def _topk_kernel(self, iq: jax.Array, iw: jax.Array, keys: jax.Array, pos: jax.Array,
                     candidates: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
        """Fused indexer scores + top-k (pallas_kernels.indexer) -> (top-k, the candidate mask passed on):
        [V4.1] the candidate source publishes its mask, Reindex layers select inside the one they get."""
        from pallas_kernels import indexer as pk_indexer
        ix = self.indexer
        group = ix.candidate_block_size if ix.candidate_source or ix.uses_candidates else pk_indexer.GROUP

        def kernel(iq, iw, keys, pos, restrict):
            return pk_indexer.indexer_select(
                iq, iw, keys, pos, ratio=ix.ratio, k=ix.topk, candidates=restrict, group=group,
                publish_groups=ix.candidate_topk_blocks if ix.candidate_source else 0)
        topk, published = self._per_sequence(kernel, (iq, iw, keys, pos, candidates if ix.uses_candidates else None))
        return topk, published if ix.candidate_source else candidates

    def _fixed_tile_scores(self, iq: jax.Array, iw: jax.Array, keys: jax.Array, pos: jax.Array) -> jax.Array:
        """Under cfg.batch_invariant: the indexer's scores [B, T, N] on its fused kernel at one tiling whatever the
        rows (its prefill tiles), the keys as cached (MXFP4 rows read as stored): each (row, entry) score is one MMA
        over the head dim and a sum over heads in a fixed order, whatever the batch, the chunk or the cache length."""
        from pallas_kernels import indexer as pk_indexer

        def kernel(iq, iw, keys, pos):
            scores, _ = pk_indexer.indexer_scores(iq, iw, keys, pos, ratio=self.indexer.ratio, mode="prefill")
            return scores[..., :keys.shape[1]]
        return self._per_sequence(kernel, (iq, iw, keys, pos))

    def _per_sequence(self, fn, batched: tuple, replicated: tuple = ()):
        return per_batch_shard(self.per_shard, fn, batched, replicated)

    def _attention_kernel(self, q: jax.Array, step: Step, keys: list, ring_pos: jax.Array, own_pos: jax.Array,
                          shared: Shared) -> jax.Array:
        """The sparse window kernel on the same keys as the dense path: keys = [ring, own rows(, entries)];
        selected entries by index (topk layers) or all visible ones, no [B, S, R+S+N] mask."""
        from pallas_kernels import attention as pk_attention

        comp = keys[2] if len(keys) > 2 else None
        idx = shared.topk if comp is not None and self.spec.topk_source is not None else None
        start = step.start if self.batch_invariant else None   # the invariant launch: keys in canonical order

        def kernel(q, q_pos, own_kv, own_pos, ring_kv, ring_pos, comp, idx, start, sink):
            return pk_attention.sparse_attention(
                q, q_pos, own_kv, own_pos, sink, scale=self.head_dim ** -0.5, window=self.window, ring_kv=ring_kv,
                ring_pos=ring_pos, comp_kv=comp, comp_idx=idx, ratio=max(self.spec.compress_ratio, 1),
                impl=self.impl, q_norm_eps=self.eps if self.v4 else None, window_start=start)
        return self._per_sequence(kernel, (q, step.positions, keys[1], own_pos, keys[0], ring_pos, comp, idx, start),
                                  (self.attn_sink[...],))

    def _rows_attention(self, q: jax.Array, step: Step, keys: list, ring_pos: jax.Array, own_pos: jax.Array,
                        shared: Shared) -> jax.Array:
        """The reference attention with every query row's sums in a fixed order (cfg.batch_invariant): the same
        keys as the dense path (keys = [ring, own rows(, entries)]), gathered per row in a canonical order that
        no batching, chunking or cache size changes: its W window positions p-W+1..p oldest first (from the ring
        below the chunk's start, else from the chunk's own rows), then its selected entries in top-k order, or
        (HCA) every entry in blocks of `invariant.ENTRY_BLOCK`. -> [B, S, H, Dh]."""
        ring, own = keys[0], keys[1]
        entries = keys[2] if len(keys) > 2 else None
        topk = shared.topk if entries is not None and self.spec.topk_source is not None else None
        b, s = step.positions.shape
        w, ratio = self.window, max(self.spec.compress_ratio, 1)
        seq_of_row = inv.row_sequences(b, s)

        def block(q, seq, pos, idx):
            kp = pos[:, None] - (w - 1) + jnp.arange(w, dtype=jnp.int32)[None, :]  # [C, W] key positions
            seq = seq[:, None]
            start = step.start[seq]
            in_ring = kp < start
            slot = jnp.mod(kp, ring.shape[1])
            row = jnp.clip(kp - start, 0, s - 1)
            kv = jnp.where(in_ring[..., None], ring[seq, slot], own[seq, row].astype(ring.dtype))
            ok = (kp >= 0) & jnp.where(in_ring, ring_pos[seq, slot] == kp, own_pos[seq, row] == kp)
            blocks = None
            if entries is not None:
                n = entries.shape[1]
                visible = ((pos + 1) // ratio)[:, None]
                if idx is not None:  # the selected entries, in top-k order
                    kv = jnp.concatenate([kv, entries[seq, jnp.clip(idx, 0, n - 1)].astype(kv.dtype)], axis=1)
                    ok = jnp.concatenate([ok, (idx >= 0) & (idx < visible)], axis=1)
                else:  # every entry, block after block
                    j = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (pos.shape[0], n))
                    blocks = (inv.entry_blocks(entries[seq[:, 0]].astype(kv.dtype)),
                              inv.entry_blocks(j < visible, fill=False))
            return inv.sink_attention(q, kv, ok, self.attn_sink[...], self.head_dim ** -0.5, blocks)

        return inv.row_blocks(block, q, seq_of_row, step.positions, topk, lead=2)

    def draft_block(self, h: jax.Array, positions: jax.Array, ctx_kv: jax.Array, ctx_visible: jax.Array) -> jax.Array:
        """[DSpark] non-causal attention of a draft block: h [B, beta, D] at positions [B, beta] attends to
        the context keys ctx_kv [B, R, Dh] where ctx_visible [B, R], and to all beta block rows. Under
        cfg.batch_invariant each query row attends on fixed blocks of rows (`_rows_draft_attention`)."""
        q, _ = self.queries(h, positions)
        kv = self.keys(h, positions)
        if self.batch_invariant:
            return self.output(self._rows_draft_attention(q, kv, ctx_kv, ctx_visible), positions)
        beta = h.shape[1]
        mask = jnp.concatenate([jnp.broadcast_to(ctx_visible[:, None, :], (h.shape[0], beta, ctx_kv.shape[1])),
                                jnp.ones((h.shape[0], beta, beta), bool)], axis=2)
        o = ref.sink_attention(q, jnp.concatenate([ctx_kv, kv], axis=1), mask, self.attn_sink[...],
                               self.head_dim ** -0.5)
        return self.output(o, positions)

    def _rows_draft_attention(self, q: jax.Array, kv: jax.Array, ctx_kv: jax.Array, ctx_visible: jax.Array
                              ) -> jax.Array:
        """`draft_block`'s attention with every query row's sums in a fixed order (cfg.batch_invariant): q [B, beta,
        H, Dh], the block's keys kv [B, beta, Dh]; each query row against its own sequence's R context keys (in the
        caller's order: fixed by the sequence's positions and the ring size) then its block's beta keys, on blocks
        of `invariant.ROWS` query rows. -> [B, beta, H, Dh]."""
        b, beta = q.shape[:2]
        keys = jnp.concatenate([ctx_kv, kv.astype(ctx_kv.dtype)], axis=1)  # [B, R + beta, Dh]
        ok = jnp.concatenate([ctx_visible, jnp.ones((b, beta), bool)], axis=1)
        seq_of_row = inv.row_sequences(b, beta)

        def block(q, seq):
            return inv.sink_attention(q, keys[seq], ok[seq], self.attn_sink[...], self.head_dim ** -0.5)

        return inv.row_blocks(block, q, seq_of_row, lead=2)

    def _window(self, q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array) -> jax.Array:
        """[B, S] query positions x [B, N] key positions -> [B, S, N]: 0 <= q - k < W and key valid."""
        delta = q_pos[:, :, None] - k_pos[:, None, :]
        return (delta >= 0) & (delta < self.window) & k_valid[:, None, :]
