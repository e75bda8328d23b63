"""Self-distillation of the drafter on the target's own continuations.

  python -m experiments.train_drafter --preset tiny-v4 --steps 400 --batch 16 --seq-len 64 --lr 2e-3 --out DIR
  python -m experiments.train_drafter --preset tiny-v41 --steps 400 --batch 16 --seq-len 64 --lr 2e-3 --out DIR
  (memorisation check: --pool 32 --reuse 0 --steps 300 --eval-train-prompts)
  python -m experiments.train_drafter --preset tiny-v4 --target-corpus markov --target-steps 300 --steps 200 \
      --pool 128 --log-every 25 --out DIR                       # a predictable (pre-trained) target first

0. Optional (`--target-corpus markov`): the random target is first trained as a language model on a
   synthetic Markov-chain language (`MarkovCorpus`: every token has 4 successors with Zipf probabilities,
   1.08 nats/token), so it has a learnt next-token rule as a real LM does; prompts then come from that
   language. Only the target's parameters move (`pretrain_target`); the drafter is trained afterwards.

1. Data: random prompts (seeded numpy rng) continued by the frozen target with `sampling.generate`
   (greedy, or sampled with --temperature).
2. Features: one full-sequence target forward gives what the drafter sees at inference ([V4] the
   final residual streams per position, [V4.1] the DSpark `main_hidden` rows) and the labels: the
   target's argmax at every position (its greedy token; `--labels soft` uses its distribution).
3. Training (optax AdamW on the `mtp.*` parameters only; everything else is split off and never
   updated) with a loss that is exactly inference's drafting, teacher-forced:
   * [V4] MTP row t (target residual_t + token x_{t+1}) predicts the target's x_{t+2}; drafts 2..k
     are unrolled as at inference (`draft.mtp_commit` at position t+j-1 on the MTP's own output
     streams of the previous draft and token x_{t+j}, attending to the committed MTP rows <= t and
     the earlier recursive rows), predicting x_{t+j+1}.
   * [V4.1] for every anchor p the block [x_{p+1}, noise, ...] at positions p+1..p+beta, with the
     stages' context keys of positions p-W+1..p (non-causal inside the block, as
     `draft.dspark_propose`), gives Markov-corrected logits with teacher-forced Markov inputs
     (x_{p+1+i}) predicting x_{p+2+i}; plus a confidence-head binary cross-entropy on whether the
     slot's greedy draft equals the target's token (its inputs are stop-gradient: a probe that
     does not pull on the drafter).
   Anchors are the positions inference drafts from: p >= prompt_len - 1.
   Because the inputs are teacher-forced, a draft is accepted at inference exactly when it and the
   drafts before it are right here; so the training metric `accept_len` (1 + leading correct drafts
   of num_draft, averaged over anchors) is what greedy speculative decoding would measure there.
4. Evaluation: `generate(..., speculative=kind, num_draft=3)` greedy on held-out prompts before and
   after training (mean accepted length; the tokens are checked against plain greedy generation).
   The model (target + trained drafter) is saved with `save_orbax`, with a JSON record.

Measured on the shared 2-core CPU (experiments/results/train_drafter_*.json): 400 steps on 6400 fresh
continuations lift the held-out mean accepted length (3 drafts, greedy) from 1.005 to 1.08 (tiny-v4,
MTP) and from 1.016 to 1.15 (tiny-v41, DSpark), ~15 min each, 70% of it generating data. The random
tiny targets are chaotic rather than repetitive: near-flat logits (median top-1/top-2 gap 0.25 against
a logit std of 1), a token 11 positions back flips the argmax 59% of the time, and (tiny-v4) a linear
map of (residual_t, x_t, x_{t+1}) explains 12% of the variance of the target's next hidden. So held-out
acceptance grows slowly with data; a drafter trained on a fixed pool memorises it instead (accepted
length 4.0 of 4 on its training prompts, ~1.02-1.04 held out).

With a target pre-trained on the Markov language (300 steps, LM loss 6.0 -> 1.11 against the chain's
1.08 floor, ~5 min) the same self-distillation passes an accepted length of 2.0 quickly: teacher-forced
accepted length 2.1 on the training batches after 25 drafter steps, 3.99 held out after 100; held-out
greedy generation (32 prompts, 48 new tokens, 3 drafts) 1.001 -> 4.000 (tiny-v4, MTP) and 1.20 -> 3.995 (tiny-v41, DSpark),
tokens equal to plain greedy; 200 drafter steps in 278 s / 383 s, ~85% of it generating the 3200 target
continuations (experiments/results/train_drafter_tiny-v4{,1}_markov.json). Its greedy continuations
follow the chain's most likely successor, which a one-block drafter learns exactly: an upper bound,
where the random-weight target is the lower one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from model import draft as D
from model.cache import LayerCache, Step, allocate_layer
from model.transformer import Transformer

DRAFT_PARAMS = nnx.All(nnx.Param, nnx.PathContains("mtp"))  # the drafter's parameters (`mtp.*`)


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def draft_kind(model: Transformer) -> str:
    return "mtp" if model.config.generation == "v4" else "dspark"


# ----------------------------------------------------------------------------- 0. a predictable target

@dataclasses.dataclass(frozen=True)
class MarkovCorpus:
    """A synthetic language: a first-order Markov chain where every token has `branching` successors
    (a random table) with Zipf probabilities 1/r^alpha. A target pre-trained on it (`pretrain_target`)
    has a learnt, low-entropy next-token rule, as a real LM does; a random-weight target does not."""
    vocab: int
    branching: int = 4
    alpha: float = 1.5
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.branching <= self.vocab:
            raise ValueError(f"branching {self.branching} must lie in [1, vocab {self.vocab}]")

    @property
    def successors(self) -> np.ndarray:
        """[V, branching] successor table (distinct successors per token)."""
        rng = np.random.default_rng(self.seed)
        return np.stack([rng.choice(self.vocab, self.branching, replace=False) for _ in range(self.vocab)])

    @property
    def probs(self) -> np.ndarray:
        w = 1.0 / np.arange(1, self.branching + 1) ** self.alpha
        return w / w.sum()

    def entropy(self) -> float:
        """Per-token entropy of the chain (nats): the floor of a target's LM loss on it."""
        return float(-(self.probs * np.log(self.probs)).sum())

    def sample(self, n: int, length: int, seed: int) -> np.ndarray:
        """n sequences [n, length] int32 from uniform start tokens."""
        rng = np.random.default_rng(seed)
        succ, probs = self.successors, self.probs
        out = np.empty((n, length), np.int32)
        out[:, 0] = rng.integers(0, self.vocab, n)
        for t in range(1, length):
            out[:, t] = succ[out[:, t - 1], rng.choice(self.branching, n, p=probs)]
        return out


TARGET_PARAMS = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("mtp")))  # everything the drafter is not


def pretrain_target(model: Transformer, corpus: MarkovCorpus, steps: int, batch: int, seq_len: int,
                    lr: float = 3e-3, seed: int = 0, log=progress) -> dict:
    """Train the target's own parameters (not the drafter's) in place as a language model on `corpus`
    (next-token cross-entropy over full sequences through `Transformer.forward`, AdamW with warm-up and
    cosine decay). -> {"loss": [...] per step, "entropy_floor", "train_s"}."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    graphdef, params, rest = nnx.split(model, TARGET_PARAMS, ...)
    tx = make_optimizer(TrainConfig(steps=steps, lr=lr, warmup=max(1, steps // 10), weight_decay=0.0))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, rest, tokens):
        def loss_fn(params):
            logits, _ = nnx.merge(graphdef, params, rest).forward(tokens[:, :-1])
            return jnp.mean(_label_loss(logits, tokens[:, 1:], None))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        tokens = jnp.asarray(corpus.sample(batch, seq_len + 1, seed * 1_000_003 + step))
        params, opt_state, loss = train_step(params, opt_state, rest, tokens)
        losses.append(float(loss))
        if step % max(1, steps // 10) == 0 or step == steps:
            log(f"target step {step}/{steps}: LM loss {np.mean(losses[-max(1, steps // 10):]):.3f} "
                f"(chain entropy {corpus.entropy():.3f}; {time.perf_counter() - t0:.0f} s)")
    nnx.update(model, params)
    return {"loss": losses, "entropy_floor": corpus.entropy(), "train_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- 1. data

def random_prompts(cfg, n: int, prompt_len: int, seed: int, corpus: MarkovCorpus | None = None) -> np.ndarray:
    """n prompts [n, prompt_len]: uniform random tokens, or samples of `corpus` (in-distribution prompts
    for a target pre-trained on it)."""
    if corpus is not None:
        return corpus.sample(n, prompt_len, seed)
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(n, prompt_len)).astype(np.int32)


def generate_sequences(model: Transformer, n: int, prompt_len: int, seq_len: int, seed: int,
                       temperature: float = 0.0, chunk: int = 64, corpus: MarkovCorpus | None = None) -> np.ndarray:
    """n sequences [n, seq_len]: prompts of prompt_len tokens (`random_prompts`) continued by the target."""
    from sampling.generate import generate

    if not 0 < prompt_len < seq_len:
        raise ValueError(f"need 0 < prompt_len ({prompt_len}) < seq_len ({seq_len})")
    prompts = random_prompts(model.config, n, prompt_len, seed, corpus)
    out = []
    for i in range(0, n, chunk):
        p = prompts[i:i + chunk]
        if len(p) < chunk:  # keep one compiled shape
            p = np.concatenate([p, np.repeat(p[:1], chunk - len(p), 0)])
        g = generate(model, p, max_new_tokens=seq_len - prompt_len, temperature=temperature, seed=seed + i)
        out.append(np.concatenate([p, g.tokens], axis=1)[:min(chunk, n - i)])
    seqs = np.concatenate(out)
    assert (seqs >= 0).all(), "no stop tokens are used, every row is full"
    return seqs


# ----------------------------------------------------------------------------- 2. target features

@nnx.jit(static_argnames="soft")
def _target_features(model: Transformer, tokens: jax.Array, soft: bool):
    logits, extras = model.forward(tokens)
    feat = extras["residual"] if model.config.generation == "v4" else extras["main_hidden"]
    out = {"feat": feat.astype(jnp.float32), "labels": jnp.argmax(logits, -1).astype(jnp.int32)}
    if soft:
        out["probs"] = jax.nn.softmax(logits, -1)
    return out


def target_features(model: Transformer, tokens: np.ndarray, soft: bool = False, chunk: int = 64) -> dict:
    """Frozen-target forward over full sequences -> {"tokens", "feat" ([V4] residual [N, T, n, D],
    [V4.1] main_hidden [N, T, 3D]), "labels" [N, T] target argmax, ("probs" [N, T, V])}."""
    parts = []
    for i in range(0, len(tokens), chunk):
        t = tokens[i:i + chunk]
        pad = chunk - len(t)
        if pad:  # keep one compiled shape
            t = np.concatenate([t, np.repeat(t[:1], pad, 0)])
        parts.append({k: np.asarray(v)[:chunk - pad] for k, v in _target_features(model, jnp.asarray(t), soft).items()})
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    out["tokens"] = tokens.astype(np.int32)
    return out


# ----------------------------------------------------------------------------- 3. losses

def _label_loss(logits: jax.Array, labels: jax.Array, probs: jax.Array | None) -> jax.Array:
    """Cross-entropy per row: hard (target argmax) or soft (target distribution)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    if probs is None:
        return -jnp.take_along_axis(logp, labels[..., None], -1)[..., 0]
    return -jnp.sum(probs * logp, -1)


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, ...], idx [B, A] -> [B, A, ...] (row idx[b, a] of sequence b)."""
    return jax.vmap(lambda xb, ib: jnp.take(xb, ib, axis=0))(x, idx)


def anchor_grid(seq_len: int, prompt_len: int, depth: int) -> np.ndarray:
    """Anchor positions p (last committed position before drafting) from which `depth` drafts still have
    labels inside the sequence: prompt_len - 1 <= p <= seq_len - 1 - depth."""
    lo, hi = prompt_len - 1, seq_len - 1 - depth
    if hi < lo:
        raise ValueError(f"seq_len {seq_len} leaves no anchor after a {prompt_len}-token prompt with {depth} drafts")
    return np.arange(lo, hi + 1, dtype=np.int32)


def mtp_forward(model: Transformer, tokens: jax.Array, residual: jax.Array, anchors: jax.Array, depth: int
                ) -> jax.Array:
    """[V4] MTP-1 drafts for every anchor p, teacher-forced, as `draft.mtp_propose` makes them.

    tokens [B, T], residual [B, T, n, D] target streams, anchors [A] -> logits [B, A, depth, V]; draft j
    (1-based) predicts x_{p+j+1}. Draft 1 is the MTP row p over the full sequence (residual_p, x_{p+1});
    draft j > 1 is `draft.mtp_commit` of one recursive row at position p+j-1 (the previous draft's output
    streams and token x_{p+j}) attending to the committed MTP rows <= p and the earlier recursive rows."""
    cfg = model.config
    b, t = tokens.shape
    s = t - 1  # committed rows 0..T-2: residual_q with x_{q+1}
    # A ring holding every position (+ the recursive rows): no wrap, the same keys as inference's ring.
    layer = allocate_layer(cfg, cfg.num_layers, b, t + depth, residual.dtype, spec_room=t + depth)
    step = Step.make(jnp.zeros((b,), jnp.int32), jnp.full((b,), s, jnp.int32), s)
    y, streams, layer = model.mtp[0].hidden(residual[:, :s], model.embed(tokens[:, 1:]), step, tokens[:, 1:], layer)
    a = anchors.shape[0]
    n = b * a
    idx = jnp.broadcast_to(anchors[None, :], (b, a))
    out = [_gather_rows(model.logits(y), idx)]
    dc = D.DraftCache(lengths=(idx + 1).reshape(n), layers=(LayerCache(kv=jnp.repeat(layer.kv, a, axis=0)),))
    st = _gather_rows(streams, idx).reshape(n, *streams.shape[2:])
    for j in range(2, depth + 1):
        tok = _gather_rows(tokens, idx + j).reshape(n, 1)
        lj, sj, dc = D.mtp_commit(model, dc, st[:, None], tok, jnp.ones((n,), jnp.int32))
        out.append(lj[:, 0].reshape(b, a, -1))
        st = sj[:, 0]
    return jnp.stack(out, 2)


def mtp_loss(model: Transformer, batch: dict, anchors: jax.Array, depth: int, num_draft: int):
    """[V4] cross-entropy of the unrolled MTP drafts against the target's tokens. -> (loss, metrics)."""
    logits = mtp_forward(model, batch["tokens"], batch["feat"], anchors, depth)
    b, a = logits.shape[:2]
    lab_idx = (anchors[:, None] + 1 + jnp.arange(depth)[None, :]).reshape(1, -1)  # draft j: labels[p + j]
    lab_idx = jnp.broadcast_to(lab_idx, (b, a * depth))
    lab = _gather_rows(batch["labels"], lab_idx).reshape(b, a, depth)
    probs = batch.get("probs")
    pr = None if probs is None else _gather_rows(probs, lab_idx).reshape(b, a, depth, -1)
    return _finish(_label_loss(logits, lab, pr), logits, lab, num_draft, {})


def dspark_forward(model: Transformer, tokens: jax.Array, main_hidden: jax.Array, anchors: jax.Array):
    """[V4.1] batched DSpark blocks for every anchor p (teacher-forced Markov chain).

    tokens [B, T], main_hidden [B, T, 3D], anchors [A] -> (Markov-corrected logits [B, A, beta, V]
    predicting x_{p+2..p+beta+1}, collapsed hidden y [B, A, beta, D], Markov embeddings [B, A, beta, r]).
    Same math as `draft.dspark_commit` + `draft.dspark_propose` (context keys of positions p-W+1..p in
    each stage, non-causal block), batched over anchors."""
    cfg = model.config
    beta, w = cfg.dspark_block_size, cfg.sliding_window
    b, t = tokens.shape
    a = anchors.shape[0]
    n = b * a
    first, last = model.mtp[0], model.mtp[-1]
    main_x = first.main_norm(first.main_proj(main_hidden))  # [B, T, D]
    seq_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    ctx_pos = anchors[:, None] - w + 1 + jnp.arange(w, dtype=jnp.int32)[None, :]  # [A, W]
    visible = jnp.broadcast_to((ctx_pos >= 0)[None], (b, a, w)).reshape(n, w)
    ctx_idx = jnp.broadcast_to(jnp.maximum(ctx_pos, 0)[None], (b, a, w)).reshape(b, a * w)
    blk_pos = anchors[:, None] + 1 + jnp.arange(beta, dtype=jnp.int32)[None, :]  # [A, beta]
    true_next = _gather_rows(tokens, jnp.broadcast_to(blk_pos[None], (b, a, beta)).reshape(b, a * beta))
    true_next = true_next.reshape(n, beta)  # x_{p+1..p+beta}: the Markov chain's teacher-forced inputs
    block = jnp.full((n, beta), cfg.dspark_noise_token_id, jnp.int32).at[:, 0].set(true_next[:, 0])
    positions = jnp.broadcast_to(blk_pos[None], (b, a, beta)).reshape(n, beta)
    x = model.embed_streams(block)
    pre = jnp.zeros(x.shape[:-1], jnp.float32).at[..., 0].set(1.0)
    for stage in model.mtp:
        keys = stage.attn.keys(main_x, seq_pos)  # context keys of every position [B, T, Dh]
        ctx_kv = _gather_rows(keys, ctx_idx).reshape(n, w, -1)

        def attend(h, stage=stage, ctx_kv=ctx_kv):
            return stage.attn.draft_block(h, positions, ctx_kv, visible)

        x, pre = stage.sublayers(x, pre, attend, block)
    y = jnp.einsum("...n,...nd->...d", pre, x.astype(jnp.float32)).astype(x.dtype)
    base = model.logits(last.norm(y))  # [N, beta, V]
    e = last.markov_head.embed(true_next)  # tok_0 = x_{p+1}, tok_i = x_{p+1+i}
    logits = base + last.markov_head.head(e)
    return (logits.reshape(b, a, beta, -1), y.reshape(b, a, beta, -1), e.reshape(b, a, beta, -1))


def dspark_loss(model: Transformer, batch: dict, anchors: jax.Array, num_draft: int, conf_weight: float):
    tokens, probs = batch["tokens"], batch.get("probs")
    beta = model.config.dspark_block_size
    logits, y, e = dspark_forward(model, tokens, batch["feat"], anchors)
    b, a = logits.shape[:2]
    lab_idx = jnp.broadcast_to((anchors[:, None] + 1 + jnp.arange(beta)[None, :])[None], (b, a, beta))
    lab = _gather_rows(batch["labels"], lab_idx.reshape(b, -1)).reshape(b, a, beta)  # target token x_{p+2+i}
    pr = None if probs is None else _gather_rows(probs, lab_idx.reshape(b, -1)).reshape(b, a, beta, -1)
    ce = _label_loss(logits, lab, pr)
    # confidence head: P(slot i's greedy draft is the target's token | drafts before it were)
    last = model.mtp[-1]
    feats = jnp.concatenate([jax.lax.stop_gradient(y).astype(jnp.float32),
                             jax.lax.stop_gradient(e).astype(jnp.float32)], -1)
    conf = last.confidence_head.proj(feats)[..., 0]
    hit = jax.lax.stop_gradient((jnp.argmax(logits, -1) == lab).astype(jnp.float32))
    bce = optax.sigmoid_binary_cross_entropy(conf, hit)
    extra = {"conf_bce": jnp.mean(bce),
             "conf_calibration": jnp.mean(jax.nn.sigmoid(conf)) - jnp.mean(hit)}
    return _finish(ce, logits, lab, num_draft, extra, conf_weight * jnp.mean(bce))


def _finish(ce, logits, lab, num_draft, extra, add=0.0):
    """Mean CE over anchors and draft slots (+ `add`); per-slot accuracy and the accepted length with
    `num_draft` drafts (1 + leading correct drafts), exact for greedy decoding at these anchors."""
    hit = (jnp.argmax(logits, -1) == lab).astype(jnp.float32)  # [B, A, k]
    lead = jnp.sum(jnp.cumprod(hit[..., :num_draft], -1), -1)
    metrics = {"ce": jnp.mean(ce), "acc": jnp.mean(hit, (0, 1)), "accept_len": 1.0 + jnp.mean(lead), **extra}
    loss = jnp.mean(ce) + add
    metrics["loss"] = loss
    return loss, metrics


def draft_loss(model: Transformer, batch: dict, anchors: jax.Array, tc: "TrainConfig"):
    if draft_kind(model) == "mtp":
        return mtp_loss(model, batch, anchors, tc.depth, tc.num_draft)
    return dspark_loss(model, batch, anchors, tc.num_draft, tc.conf_weight)


# ----------------------------------------------------------------------------- training

@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    batch: int = 16
    seq_len: int = 64
    prompt_len: int = 16
    pool: int = 256  # sequences the target generates at a time
    reuse: int = 1  # passes over a pool before fresh sequences replace it (0: one fixed pool)
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01
    clip: float = 1.0
    depth: int = 3  # [V4] MTP drafts unrolled in training
    num_draft: int = 3  # drafts the accept-length metric and the evaluation use
    conf_weight: float = 0.1  # [V4.1] confidence-head BCE weight
    labels: str = "hard"  # "hard": target argmax; "soft": target distribution
    temperature: float = 0.0  # data: target continuations greedy (0) or sampled
    seed: int = 1  # data prompts and batch order
    corpus: MarkovCorpus | None = None  # data prompts from this corpus (else uniform random tokens)


class TargetData:
    """Training batches from the frozen target: pools of `tc.pool` fresh continuations of random prompts
    (features and labels computed once per pool), each pool used for `tc.reuse` passes in random order
    before the next one is generated (`reuse=0`: the first pool forever). Counts its own cost."""

    def __init__(self, model: Transformer, tc: TrainConfig, chunk: int = 256):
        if tc.pool < tc.batch:
            raise ValueError(f"pool ({tc.pool}) must hold at least one batch ({tc.batch})")
        self.model, self.tc, self.chunk = model, tc, min(chunk, tc.pool)
        self.rng = np.random.default_rng(tc.seed)
        self.pools = 0
        self.seconds = 0.0
        self.data: dict | None = None  # the current pool

    def new_pool(self) -> dict:
        t0 = time.perf_counter()
        tc = self.tc
        seqs = generate_sequences(self.model, tc.pool, tc.prompt_len, tc.seq_len, tc.seed * 100_003 + self.pools,
                                  tc.temperature, self.chunk, tc.corpus)
        self.data = target_features(self.model, seqs, tc.labels == "soft", self.chunk)
        self.pools += 1
        self.seconds += time.perf_counter() - t0
        return self.data

    def __iter__(self):
        tc = self.tc
        while True:
            data = self.new_pool()
            passes = 0
            while tc.reuse == 0 or passes < tc.reuse:
                order = self.rng.permutation(tc.pool)
                for i in range(0, tc.pool - tc.batch + 1, tc.batch):
                    yield {k: v[order[i:i + tc.batch]] for k, v in data.items()}
                passes += 1

    @property
    def sequences(self) -> int:
        return self.pools * self.tc.pool


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, max(1, min(tc.warmup, tc.steps // 2)),
                                               max(tc.steps, 2), end_value=tc.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(tc.clip), optax.adamw(sched, weight_decay=tc.weight_decay))


def train(model: Transformer, batches, tc: TrainConfig, val: dict | None = None, log_every: int = 50,
          log=progress) -> dict:
    """Train the drafter (`mtp.*` parameters) in place on `batches` (an iterable of dicts of numpy arrays
    "tokens", "feat", "labels"(, "probs")); the rest of the model is split off and never updated.
    -> history {"step", "loss", "accept_len", "acc", "val_*", "train_s"}."""
    kind = draft_kind(model)
    depth = tc.depth if kind == "mtp" else model.config.dspark_block_size
    anchors = jnp.asarray(anchor_grid(tc.seq_len, tc.prompt_len, depth))
    graphdef, params, rest = nnx.split(model, DRAFT_PARAMS, ...)
    tx = make_optimizer(tc)
    opt_state = tx.init(params)

    def loss_fn(params, rest, batch):
        return draft_loss(nnx.merge(graphdef, params, rest), batch, anchors, tc)

    @jax.jit
    def train_step(params, opt_state, rest, batch):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return optax.apply_updates(params, updates), opt_state, metrics

    eval_step = jax.jit(lambda params, rest, batch: loss_fn(params, rest, batch)[1])
    hist = {"step": [], "loss": [], "accept_len": [], "acc": [], "val_step": [], "val_loss": [],
            "val_accept_len": [], "val_acc": []}

    def validate(step):
        if val is None:
            return
        ms = [jax.device_get(eval_step(params, rest, {k: jnp.asarray(v[i:i + tc.batch]) for k, v in val.items()}))
              for i in range(0, len(val["tokens"]) - tc.batch + 1, tc.batch)]
        m = {k: np.mean([x[k] for x in ms], 0) for k in ms[0]}
        hist["val_step"].append(step)
        hist["val_loss"].append(float(m["loss"]))
        hist["val_accept_len"].append(float(m["accept_len"]))
        hist["val_acc"].append(np.asarray(m["acc"]).round(4).tolist())
        log(f"  held-out @ {step}: loss {m['loss']:.3f} accept_len {m['accept_len']:.3f} "
            f"acc/slot {np.asarray(m['acc']).round(3).tolist()}")

    validate(0)
    t0 = time.perf_counter()
    window = []
    it = iter(batches)
    for step in range(1, tc.steps + 1):
        batch = {k: jnp.asarray(v) for k, v in next(it).items()}
        params, opt_state, metrics = train_step(params, opt_state, rest, batch)
        window.append(metrics)
        if step % log_every == 0 or step == tc.steps:
            m = jax.device_get(window)
            window = []
            mean = {k: np.mean([x[k] for x in m], 0) for k in m[0]}
            hist["step"].append(step)
            hist["loss"].append(float(mean["loss"]))
            hist["accept_len"].append(float(mean["accept_len"]))
            hist["acc"].append(np.asarray(mean["acc"]).round(4).tolist())
            conf = (f" conf_bce {mean['conf_bce']:.3f} (mean sigma - hit rate {mean['conf_calibration']:+.3f})"
                    if "conf_bce" in mean else "")
            log(f"step {step}/{tc.steps}: loss {mean['loss']:.3f} accept_len {mean['accept_len']:.3f} "
                f"acc/slot {np.asarray(mean['acc']).round(3).tolist()}{conf} |g| {mean['grad_norm']:.2f} "
                f"({time.perf_counter() - t0:.0f} s)")
            if log_every and val is not None and step % (log_every * 4) == 0 and step < tc.steps:
                validate(step)
    hist["train_s"] = time.perf_counter() - t0
    nnx.update(model, params)
    validate(tc.steps)
    return hist


# ----------------------------------------------------------------------------- 4. evaluation

def measure_acceptance(model: Transformer, prompts: np.ndarray, max_new_tokens: int, num_draft: int = 3,
                       plain: np.ndarray | None = None) -> dict:
    """Greedy speculative generation with the model's drafter: mean accepted length per verify step,
    per-position acceptance and whether the tokens equal plain greedy generation (`plain`)."""
    from sampling.generate import generate

    t0 = time.perf_counter()
    out = generate(model, prompts, max_new_tokens=max_new_tokens, speculative=draft_kind(model),
                   num_draft=num_draft)
    rec = {"mean_accepted_length": out.stats["mean_accepted_length"],
           "acceptance_per_position": out.stats["acceptance_per_position"],
           "spec_steps": out.stats["spec_steps"], "wall_s": time.perf_counter() - t0}
    if plain is not None:
        rec["equals_plain_greedy"] = bool(np.array_equal(out.tokens, plain))
    return rec


# ----------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-v4", help="random-weight target preset (tiny-v4, tiny-v41, ...)")
    p.add_argument("--target-seed", type=int, default=0, help="seed of the random target weights")
    p.add_argument("--target-corpus", choices=["none", "markov"], default="none",
                   help="pre-train the target on a synthetic Markov-chain language first (prompts then come "
                        "from that language); none: the random-weight target as initialised")
    p.add_argument("--target-steps", type=int, default=300, help="target pre-training steps")
    p.add_argument("--target-lr", type=float, default=3e-3)
    p.add_argument("--branching", type=int, default=4, help="Markov corpus: successors per token")
    p.add_argument("--alpha", type=float, default=1.5, help="Markov corpus: Zipf exponent of the successors")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16, help="sequences per training step")
    p.add_argument("--seq-len", type=int, default=64, help="prompt + continuation length")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--pool", type=int, default=256, help="sequences the target generates at a time")
    p.add_argument("--reuse", type=int, default=1,
                   help="passes over each pool before fresh sequences replace it (0: one fixed pool)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--depth", type=int, default=3, help="[V4] MTP drafts unrolled in training")
    p.add_argument("--num-draft", type=int, default=3, help="drafts per step in the evaluation")
    p.add_argument("--conf-weight", type=float, default=0.1, help="[V4.1] confidence-head loss weight")
    p.add_argument("--labels", choices=["hard", "soft"], default="hard")
    p.add_argument("--temperature", type=float, default=0.0, help="data: 0 = greedy continuations")
    p.add_argument("--data-seed", type=int, default=1)
    p.add_argument("--eval-seed", type=int, default=12345, help="held-out prompts (and validation sequences)")
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--eval-new-tokens", type=int, default=48)
    p.add_argument("--val-seqs", type=int, default=64, help="held-out sequences for the teacher-forced metric")
    p.add_argument("--eval-train-prompts", action="store_true",
                   help="also measure acceptance on the first training pool's prompts (a memorisation check, "
                        "meaningful with --reuse 0)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--out", required=True, help="output directory (model/ orbax checkpoint + train_drafter.json)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from model import ModelConfig, init_random
    from model.checkpoint import save_orbax
    from sampling.generate import generate

    out_dir = Path(args.out)
    if (out_dir / "model").exists() and any((out_dir / "model").iterdir()):
        raise SystemExit(f"{out_dir / 'model'} exists and is not empty")
    wall0 = time.perf_counter()
    cfg = ModelConfig.preset(args.preset)
    model = init_random(cfg, seed=args.target_seed, dtype="float32")
    kind = draft_kind(model)
    corpus, pretrain = None, None
    if args.target_corpus == "markov":
        corpus = MarkovCorpus(cfg.vocab_size, args.branching, args.alpha, seed=args.target_seed)
        progress(f"pre-training the {cfg.name} target on a Markov corpus (branching {args.branching}, "
                 f"alpha {args.alpha}, entropy {corpus.entropy():.3f} nats/token)")
        pretrain = pretrain_target(model, corpus, args.target_steps, args.batch, args.seq_len, args.target_lr,
                                   seed=args.target_seed)
    tc = TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, prompt_len=args.prompt_len,
                     pool=args.pool, reuse=args.reuse, lr=args.lr, warmup=args.warmup,
                     weight_decay=args.weight_decay, depth=args.depth, num_draft=args.num_draft,
                     conf_weight=args.conf_weight, labels=args.labels, temperature=args.temperature,
                     seed=args.data_seed, corpus=corpus)
    n_draft = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, DRAFT_PARAMS)))
    progress(f"{cfg.name} target (seed {args.target_seed}), drafter {kind}: {n_draft:,} trainable parameters")

    t = time.perf_counter()
    eval_prompts = random_prompts(cfg, args.eval_prompts, args.prompt_len, args.eval_seed, corpus)
    plain = generate(model, eval_prompts, max_new_tokens=args.eval_new_tokens).tokens
    before = measure_acceptance(model, eval_prompts, args.eval_new_tokens, args.num_draft, plain)
    progress(f"before training: mean accepted length {before['mean_accepted_length']:.3f} (per position "
             f"{np.round(before['acceptance_per_position'], 3).tolist()}, {time.perf_counter() - t:.0f} s)")

    t = time.perf_counter()
    val_seqs = generate_sequences(model, args.val_seqs, args.prompt_len, args.seq_len, args.eval_seed + 1,
                                  corpus=corpus)
    val = target_features(model, val_seqs, args.labels == "soft")
    progress(f"held-out data: {len(val_seqs)} sequences ({time.perf_counter() - t:.0f} s)")

    target_before = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(DRAFT_PARAMS)))
    data = TargetData(model, tc)
    hist = train(model, data, tc, val, log_every=args.log_every)
    target_after = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(DRAFT_PARAMS)))
    frozen = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(target_before), jax.tree.leaves(target_after)))
    progress(f"trained {tc.steps} steps in {hist['train_s']:.0f} s ({data.seconds:.0f} s of it generating "
             f"{data.sequences} target sequences); target unchanged: {frozen}")

    t = time.perf_counter()
    after = measure_acceptance(model, eval_prompts, args.eval_new_tokens, args.num_draft, plain)
    progress(f"after training: mean accepted length {after['mean_accepted_length']:.3f} (per position "
             f"{np.round(after['acceptance_per_position'], 3).tolist()}, lossless: {after['equals_plain_greedy']}, "
             f"{time.perf_counter() - t:.0f} s)")

    on_train = None
    if args.eval_train_prompts:
        train_prompts = random_prompts(cfg, tc.pool, tc.prompt_len, tc.seed * 100_003, corpus)[:args.eval_prompts]
        plain_train = generate(model, train_prompts, max_new_tokens=args.eval_new_tokens).tokens
        on_train = measure_acceptance(model, train_prompts, args.eval_new_tokens, args.num_draft, plain_train)
        progress(f"on training prompts: mean accepted length {on_train['mean_accepted_length']:.3f} "
                 f"(lossless: {on_train['equals_plain_greedy']})")

    ckpt = save_orbax(model, out_dir / "model")
    losses = hist["loss"]
    record = {
        "preset": cfg.name, "drafter": kind, "target_seed": args.target_seed, "trainable_params": n_draft,
        "args": vars(args), "train_config": dataclasses.asdict(tc),
        "target_pretraining": None if pretrain is None else {
            "corpus": dataclasses.asdict(corpus), "steps": args.target_steps, "train_s": pretrain["train_s"],
            "entropy_floor": pretrain["entropy_floor"], "loss_first": pretrain["loss"][0],
            "loss_last10": float(np.mean(pretrain["loss"][-10:]))},
        "data": {"train_sequences": data.sequences, "tokens_per_sequence": tc.seq_len,
                 "target_data_s": data.seconds, "val_sequences": len(val_seqs)},
        "loss_curve": {"step": hist["step"], "loss": losses, "accept_len": hist["accept_len"], "acc": hist["acc"],
                       "first": losses[0], "last": losses[-1], "min": min(losses)},
        "validation": {"step": hist["val_step"], "loss": hist["val_loss"], "accept_len": hist["val_accept_len"],
                       "acc": hist["val_acc"]},
        "steps": tc.steps, "train_s": hist["train_s"], "acceptance_before": before, "acceptance_after": after,
        "acceptance_after_on_training_prompts": on_train,
        "eval": {"prompts": args.eval_prompts, "prompt_len": args.prompt_len, "new_tokens": args.eval_new_tokens,
                 "num_draft": args.num_draft, "greedy": True, "seed": args.eval_seed},
        "target_frozen": frozen, "checkpoint": str(ckpt),
        "wall_s": time.perf_counter() - wall0, "device": str(jax.devices()[0]), "cpu_count": _cpus(),
    }
    (out_dir / "train_drafter.json").write_text(json.dumps(record, indent=1))
    progress(f"saved {ckpt} and {out_dir / 'train_drafter.json'} (wall {record['wall_s']:.0f} s)")
    return record


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


if __name__ == "__main__":
    main(sys.argv[1:])
