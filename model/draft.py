"""Drafters: MTP-1 [V4] and DSpark [V4.1] (docs/model.md §12.1, §12.2, §16.2).

Both keep their own position-indexed state (`DraftCache`: one SWA ring per stage plus the number of
context positions written), so a speculative step is: `commit` the rows the target just accepted,
then `propose` drafts from the pending token. Rolling back a rejected draft is a length update.

MTP-1: the MTP row at position p combines the target's residual streams at p with the embedding of
x_{p+1} and predicts x_{p+2}. Committing writes one MTP row per newly accepted position; proposing k
drafts applies the module recursively, feeding its own output streams back as the residual.

DSpark: every committed position p writes a context key kappa_p = kv(RMSNorm(W_main hbar_p)) into each
stage's ring (hbar = stream-averaged inputs of the target layers). Proposing runs the three stages on
the block [x_C, noise, ...] at positions C..C+beta-1 (non-causal inside the block, context = the last W
positions), then the Markov head corrects the logits slot by slot while tokens are chosen, and the
confidence head scores each slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from .cache import LayerCache, Step, allocate_layer, ring_positions, ring_write
from .mhc import collapse
from .transformer import Transformer


@struct.dataclass
class DraftCache:
    lengths: jax.Array  # [B] context positions written (MTP rows / DSpark context keys)
    layers: tuple  # one LayerCache (SWA ring) per draft stage
    floor: jax.Array | None = None  # [B] first position written (rows below it are never attended; None: 0)


def allocate_draft(model: Transformer, batch: int, max_len: int, spec_room: int = 8) -> DraftCache:
    cfg = model.config
    if not len(model.mtp):
        raise ValueError(f"{cfg.name} has no draft weights (num_mtp_layers = 0); load a checkpoint with "
                         "mtp.* tensors or use random weights")
    layers = tuple(allocate_layer(cfg, cfg.num_layers + j, batch, max_len, model.dtype, spec_room)
                   for j in range(len(model.mtp)))
    return DraftCache(lengths=jnp.zeros((batch,), jnp.int32), layers=layers, floor=jnp.zeros((batch,), jnp.int32))


@struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, k] drafted tokens
    logits: jax.Array  # [B, k, V] the distributions they were drawn from (float32, before temperature)
    confidence: jax.Array | None = None  # [B, k] DSpark confidence logits (sigmoid = P(accept | prefix))


# ----------------------------------------------------------------------------- MTP-1 (V4)

def mtp_commit(model: Transformer, dc: DraftCache, residual: jax.Array, next_tokens: jax.Array, n_new: jax.Array
               ) -> tuple[jax.Array, jax.Array, DraftCache]:
    """MTP rows for newly committed positions dc.lengths + i (valid i < n_new): residual [B, S, n, D] target
    streams, next_tokens [B, S] = x_{p+1}. -> (logits [B, S, V] predicting x_{p+2}, output streams, cache)."""
    mtp = model.mtp[0]
    step = Step.make(dc.lengths, n_new, next_tokens.shape[1], dc.floor)
    y, streams, layer = mtp.hidden(residual, model.embed(next_tokens), step, next_tokens, dc.layers[0])
    return model.logits(y), streams, dc.replace(lengths=step.end, layers=(layer,))


def mtp_propose(model: Transformer, dc: DraftCache, logits: jax.Array, streams: jax.Array, k: int, choose
                ) -> Proposal:
    """k drafts from the last committed MTP row (logits [B, V], streams [B, n, D]); recursive rows go to
    positions dc.lengths, dc.lengths+1, ... and are forgotten (the cache passed in is not modified).
    `choose(logits [B, V], j) -> tokens [B]` picks draft j (greedy or sampled)."""
    tokens, dists = [], []
    for j in range(k):
        tok = choose(logits, j)
        tokens.append(tok)
        dists.append(logits)
        if j + 1 < k:
            step_logits, step_streams, dc = mtp_commit(model, dc, streams[:, None], tok[:, None],
                                                       jnp.ones_like(dc.lengths))
            logits, streams = step_logits[:, 0], step_streams[:, 0]
    return Proposal(tokens=jnp.stack(tokens, 1), logits=jnp.stack(dists, 1))


# ----------------------------------------------------------------------------- DSpark (V4.1)

def dspark_commit(model: Transformer, dc: DraftCache, main_hidden: jax.Array, n_new: jax.Array) -> DraftCache:
    """Context keys for newly committed positions dc.lengths + i (valid i < n_new) from the target's
    DSpark hidden rows main_hidden [B, S, len(targets)*D], written into every stage's ring."""
    first = model.mtp[0]
    main_x = first.main_norm(first.main_proj(main_hidden))
    step = Step.make(dc.lengths, n_new, main_hidden.shape[1])
    layers = tuple(LayerCache(kv=ring_write(lc.kv, stage.attn.keys(main_x, step.positions), step))
                   for stage, lc in zip(model.mtp, dc.layers))
    return dc.replace(lengths=step.end, layers=layers)


def dspark_propose(model: Transformer, dc: DraftCache, anchor: jax.Array, choose) -> Proposal:
    """beta drafts after the pending token `anchor` [B] (at position C = dc.lengths); `choose(logits [B, V],
    i) -> tokens [B]` picks slot i from its Markov-corrected logits."""
    cfg = model.config
    beta = cfg.dspark_block_size
    b = anchor.shape[0]
    block = jnp.full((b, beta), cfg.dspark_noise_token_id, jnp.int32).at[:, 0].set(anchor)
    positions = dc.lengths[:, None] + jnp.arange(beta, dtype=jnp.int32)[None, :]
    x = model.embed_streams(block)
    pre = jnp.zeros(x.shape[:-1], jnp.float32).at[..., 0].set(1.0)
    for stage, lc in zip(model.mtp, dc.layers):
        ring_pos = ring_positions(dc.lengths, lc.kv.shape[1])
        visible = (ring_pos >= 0) & (ring_pos >= dc.lengths[:, None] - cfg.sliding_window)
        if dc.floor is not None:
            visible &= ring_pos >= dc.floor[:, None]

        def attend(h, stage=stage, lc=lc, visible=visible):
            return stage.attn.draft_block(h, positions, lc.kv, visible)

        x, pre = stage.sublayers(x, pre, attend, block)
    last = model.mtp[-1]
    y = collapse(x, pre, cfg.batch_invariant)  # single-pass collapse
    base = model.logits(last.norm(y))  # [B, beta, V]
    tok = anchor
    tokens, dists, embeds = [], [], []
    for i in range(beta):
        e = last.markov_head.embed(tok)
        logits = base[:, i] + last.markov_head.head(e)
        tok = choose(logits, i)
        tokens.append(tok)
        dists.append(logits)
        embeds.append(e)
    markov = jnp.stack(embeds, 1)
    confidence = last.confidence_head.proj(jnp.concatenate([y.astype(jnp.float32), markov.astype(jnp.float32)],
                                                           axis=-1))[..., 0]
    return Proposal(tokens=jnp.stack(tokens, 1), logits=jnp.stack(dists, 1), confidence=confidence)

