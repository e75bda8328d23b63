"""Speculative decoding inside the jitted loop: propose -> verify -> accept -> rollback (docs/model.md §16.2).

Each iteration the target verifies [pending, d_1..d_m] as one causal chunk. Greedy: accept the longest
prefix with d_j equal to the target's argmax, then the target's own token (correction or bonus).
Sampling (temperature > 0): accept d_j with probability min(1, p_t(d_j) / p_d(d_j)); on the first
rejection draw from normalise(max(0, p_t - p_d)); if all are accepted draw a bonus from p_t. Both
keep the output distribution exactly the target's. Caches roll back by length; the drafter commits
the accepted rows (MTP rows or DSpark context keys) and proposes again from the new pending token.

Policies: "fixed" verifies every proposed draft; "confidence" (DSpark) chooses per sequence how many
to verify from the confidence head's survival products a_j = prod_{i<=j} sigmoid(c_i) and a
cost-per-verified-width curve of this engine: m_b = argmax_m (1 + sum_{j<=m} a_j) / cost(m + 1);
the batch verifies max_b m_b drafts (a `lax.switch` over widths, so fewer drafts cost less).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import draft as D
from model.cache import Cache
from model.config import ModelConfig
from model.transformer import Transformer
from pallas_kernels.invariant import row_blocks

from .replay import prefill_with_store
from .sampler import categorical, filter_logits, fold_in, is_per_sequence, sample, split, uniform


@dataclasses.dataclass(frozen=True)
class SpecParams:
    """How to draft and verify (static: part of the compiled program) and how to sample (temperature, top_k,
    top_p: pytree leaves, traced under jit, so new values do not recompile)."""

    kind: str  # "mtp" | "dspark"
    num_draft: int
    policy: str = "fixed"  # "fixed" | "confidence"
    cost: tuple[float, ...] = ()  # cost of a verify step of width w = 1..num_draft+1 (relative units)
    temperature: Any = 0.0
    top_k: Any = 0
    top_p: Any = 1.0
    replay_tail: int | None = None  # [V4.1] decoder-side bounded replay in prefill


jax.tree_util.register_dataclass(SpecParams, data_fields=["temperature", "top_k", "top_p"],
                                 meta_fields=["kind", "num_draft", "policy", "cost", "replay_tail"])

# Drafts one MTP-1 proposal may hold: MTP-1 is trained to predict one token ahead, further drafts chain it on its
# own output streams (their acceptance falls off quickly), and each one unrolls another MTP block into the
# compiled loop (compile time grows with every draft).
MAX_MTP_DRAFTS = 8


def check_spec(cfg: ModelConfig, kind: str, num_draft: int, policy: str) -> None:
    """The speculative options against the config (the drafter's weights are checked by `allocate_draft`)."""
    if kind not in ("mtp", "dspark"):
        raise ValueError(f"speculative must be 'mtp' or 'dspark', got {kind!r}")
    if not isinstance(num_draft, numbers.Integral) or isinstance(num_draft, bool) or num_draft < 1:
        raise ValueError(f"num_draft must be >= 1 (an integer), got {num_draft!r}")
    if policy not in ("fixed", "confidence"):
        raise ValueError(f"policy must be 'fixed' or 'confidence', got {policy!r}")
    if not cfg.num_mtp_layers:
        raise ValueError(f"{cfg.name} has no draft weights (no mtp.* tensors were loaded): cannot use {kind!r}")
    if kind == "mtp":
        if cfg.generation != "v4":
            raise ValueError("MTP-1 drafting is V4's; V4.1 drafts with speculative='dspark'")
        if num_draft > MAX_MTP_DRAFTS:
            raise ValueError(f"num_draft {num_draft} exceeds the {MAX_MTP_DRAFTS} drafts MTP-1 chains (it is trained "
                             "to predict one token ahead; each further draft reuses it on its own output)")
    if kind == "dspark":
        if cfg.generation != "v41":
            raise ValueError("DSpark drafting needs a V4.1 model")
        if num_draft > cfg.dspark_block_size:
            raise ValueError(f"num_draft {num_draft} exceeds the DSpark block size {cfg.dspark_block_size}")
    if policy == "confidence" and kind != "dspark":
        raise ValueError("the confidence policy needs DSpark's confidence head")


def default_cost(num_draft: int) -> tuple[float, ...]:
    """A verify step's cost vs its width w (1..k+1) when no measured curve is given: weight-bound decode,
    so the step costs about the same whatever its width, plus a little per extra row."""
    return tuple(1.0 + 0.05 * (w - 1) for w in range(1, num_draft + 2))


# ----------------------------------------------------------------------------- drafter glue

def _propose(model, dc, pending, commit_out, key, sp: SpecParams) -> D.Proposal:
    def choose(logits, j):
        return sample(logits, fold_in(key, j), sp.temperature, sp.top_k, sp.top_p)

    if sp.kind == "mtp":
        logits, streams = commit_out
        return D.mtp_propose(model, dc, logits, streams, sp.num_draft, choose)
    p = D.dspark_propose(model, dc, pending, choose)
    conf = None if p.confidence is None else p.confidence[:, :sp.num_draft]
    return D.Proposal(tokens=p.tokens[:, :sp.num_draft], logits=p.logits[:, :sp.num_draft], confidence=conf)


def _commit(model, dc, extras, next_tokens, n_new, sp: SpecParams):
    """Drafter state for the rows the target just committed (first n_new rows of `extras`).

    -> (cache, what `_propose` needs: MTP's logits and streams of the last committed row)."""
    if sp.kind == "mtp":
        logits, streams, dc = D.mtp_commit(model, dc, extras["residual"], next_tokens, n_new)
        last = jnp.maximum(n_new - 1, 0)[:, None]
        return dc, (jnp.take_along_axis(logits, last[..., None], 1)[:, 0],
                    jnp.take_along_axis(streams, last[..., None, None], 1)[:, 0])
    return D.dspark_commit(model, dc, extras["main_hidden"], n_new), None


def _next_tokens(tokens: jax.Array, n_new: jax.Array, after: jax.Array) -> jax.Array:
    """x_{p+1} for each committed row p: the chunk shifted left, with `after` [B] at row n_new-1."""
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    rows = jnp.arange(tokens.shape[1])[None, :]
    return jnp.where(rows == (n_new - 1)[:, None], after[:, None], shifted)


# ----------------------------------------------------------------------------- acceptance

def accept(target_logits: jax.Array, proposal: D.Proposal, n_verify: jax.Array, key, sp: SpecParams
           ) -> tuple[jax.Array, jax.Array]:
    """target_logits [B, w+1, V] for [pending, d_1..d_w]; n_verify [B] <= w drafts checked per sequence.

    -> (accepted count a [B], the target's next token [B] (correction, or bonus after all accepted))."""
    drafts = proposal.tokens[:, :target_logits.shape[1] - 1]
    w = drafts.shape[1]
    j = jnp.arange(w)[None, :]

    def greedy(key):
        target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, w+1]
        ok = (drafts == target[:, :w]) & (j < n_verify[:, None])
        a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
        return a, jnp.take_along_axis(target, a[:, None], 1)[:, 0]

    def sampled(key):
        return _accept_sampled(target_logits, proposal, drafts, n_verify, key, sp)

    return jax.lax.cond(jnp.asarray(sp.temperature) > 0, sampled, greedy, key)


def _accept_sampled(target_logits, proposal, drafts, n_verify, key, sp: SpecParams):
    """Rejection sampling of `accept` (temperature > 0). Per-sequence keys [B, 2] keep every sequence on its own:
    the filtering, the residual and its draw on fixed blocks of rows (`row_blocks`), the uniforms drawn for all
    num_draft drafts whatever the verified width."""
    w = drafts.shape[1]
    j = jnp.arange(w)[None, :]
    b = target_logits.shape[0]
    per_sequence = is_per_sequence(key)
    p_t = _filtered_probs(target_logits, sp, per_sequence)  # [B, w+1, V]
    p_d = _filtered_probs(proposal.logits[:, :w], sp, per_sequence)  # the distributions the drafts were sampled from
    pt_d = jnp.take_along_axis(p_t[:, :w], drafts[..., None], -1)[..., 0]
    pd_d = jnp.take_along_axis(p_d, drafts[..., None], -1)[..., 0]
    k_u, k_s = split(key)
    u = uniform(k_u, proposal.tokens.shape)[:, :w] if per_sequence else uniform(k_u, (b, w))
    ok = (u * pd_d < pt_d) & (j < n_verify[:, None])
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_a = jnp.take_along_axis(p_t, a[:, None, None], 1)[:, 0]  # target distribution at row a
    q_a = jnp.take_along_axis(jnp.pad(p_d, ((0, 0), (0, 1), (0, 0))), a[:, None, None], 1)[:, 0]
    rejected = a < n_verify
    args = (p_a, q_a, rejected, k_s)
    return a, row_blocks(_residual_draw, *args) if per_sequence else _residual_draw(*args)


def _filtered_probs(logits: jax.Array, sp: SpecParams, per_sequence: bool) -> jax.Array:
    """softmax(filter_logits) of logits [B, R, V] -> [B, R, V]; per_sequence: on fixed blocks of rows."""
    def probs(logits):
        return jax.nn.softmax(filter_logits(logits, sp.temperature, sp.top_k, sp.top_p), -1)

    if per_sequence:
        return row_blocks(probs, logits, lead=2)
    b, r, v = logits.shape
    return probs(logits.reshape(-1, v)).reshape(b, r, v)


def _residual_draw(p_a: jax.Array, q_a: jax.Array, rejected: jax.Array, key: jax.Array) -> jax.Array:
    """The token after the accepted drafts [B]: drawn from normalise(max(0, p_a - q_a)) where the draft was
    rejected, else from p_a (the bonus); p_a, q_a [B, V] the target's and the drafter's distributions there."""
    residual = jnp.maximum(p_a - jnp.where(rejected[:, None], q_a, 0.0), 0.0)
    mass = jnp.sum(residual, -1, keepdims=True)
    residual = jnp.where(mass > 1e-12, residual / jnp.maximum(mass, 1e-30), p_a)  # empty residual: fall back
    nxt = categorical(key, jnp.log(jnp.maximum(residual, 1e-38)))
    return jnp.where(residual.max(-1) > 0, nxt, jnp.argmax(p_a, -1).astype(jnp.int32))


def choose_width(proposal: D.Proposal, sp: SpecParams) -> jax.Array:
    """Drafts to verify per sequence [B] (1..k)."""
    b, k = proposal.tokens.shape
    if sp.policy == "fixed":
        return jnp.full((b,), k, jnp.int32)
    survival = jnp.cumprod(jax.nn.sigmoid(proposal.confidence.astype(jnp.float32)), axis=1)  # [B, k]
    expected = 1.0 + jnp.cumsum(survival, axis=1)  # tokens per step when verifying m = 1..k drafts
    cost = jnp.asarray(sp.cost[1:k + 1], jnp.float32)  # widths m + 1
    return (jnp.argmax(expected / cost[None, :], axis=1) + 1).astype(jnp.int32)


# ----------------------------------------------------------------------------- one iteration

@dataclasses.dataclass
class Verified:
    """What verification hands the drafter: the step's start lengths, the verified chunk [B, k+1], the
    target's per-row extras (padded to k+1 rows), accepted counts a [B] and the next pending token [B]."""
    start: jax.Array
    chunk: jax.Array
    extras: dict
    a: jax.Array
    nxt: jax.Array


jax.tree_util.register_dataclass(Verified, data_fields=["start", "chunk", "extras", "a", "nxt"], meta_fields=[])


def verify(model: Transformer, cache: Cache, pending, proposal: D.Proposal, key, sp: SpecParams):
    """The target half of an iteration: verify [pending, drafts], accept, roll the cache back.

    -> (cache, emitted tokens [B, k+1] (first a+1 valid), n_verify [B], Verified)."""
    k = sp.num_draft
    if k > cache.spec_room:
        raise ValueError(f"verifying {k} drafts writes {k} rows past the kept length, but the cache has "
                         f"spec_room={cache.spec_room}: allocate it with spec_room >= {k}")
    n_verify = choose_width(proposal, sp)
    start = cache.lengths
    chunk = jnp.concatenate([pending[:, None], proposal.tokens], axis=1)  # [B, k+1]

    def width_step(width):
        def run(cache):
            logits, cache, extras = model.step(chunk[:, :width + 1], cache, 1 + jnp.minimum(n_verify, width))
            a, nxt = accept(logits, proposal, jnp.minimum(n_verify, width), key, sp)
            pad = k - width
            extras = {name: jnp.pad(extras[name], ((0, 0), (0, pad)) + ((0, 0),) * (extras[name].ndim - 2))
                      for name in ("residual", "main_hidden") if name in extras}
            return cache, extras, a, nxt
        return run

    if sp.policy == "fixed":
        cache, extras, a, nxt = width_step(k)(cache)
    else:
        cache, extras, a, nxt = jax.lax.switch(jnp.max(n_verify) - 1, [width_step(w) for w in range(1, k + 1)],
                                               cache)
    cache = cache.rollback(start + 1 + a)
    emitted = jnp.concatenate([proposal.tokens, jnp.zeros_like(pending)[:, None]], axis=1)
    emitted = jnp.where(jnp.arange(k + 1)[None, :] == a[:, None], nxt[:, None], emitted)
    return cache, emitted, n_verify, Verified(start, chunk, extras, a, nxt)


def draft(model: Transformer, dc, v: Verified, key, sp: SpecParams):
    """The drafter half: commit the accepted rows [pending, d_1..d_a] (row r's next token is chunk[r+1],
    and nxt after row a) and propose from the new pending token. -> (dc, proposal)."""
    n_new = 1 + v.a
    dc, commit_out = _commit(model, dc.replace(lengths=v.start), v.extras, _next_tokens(v.chunk, n_new, v.nxt),
                             n_new, sp)
    return dc, _propose(model, dc, v.nxt, commit_out, key, sp)


def spec_step(model: Transformer, cache: Cache, dc, pending, proposal: D.Proposal, key, sp: SpecParams):
    """Verify the proposal, accept, roll back, commit the drafter, propose again.

    -> (cache, dc, emitted tokens [B, k+1] (first a+1 valid), a [B], n_verify [B], next pending, proposal)."""
    k_acc, k_prop = split(key)
    cache, emitted, n_verify, v = verify(model, cache, pending, proposal, k_acc, sp)
    dc, proposal = draft(model, dc, v, k_prop, sp)
    return cache, dc, emitted, v.a, n_verify, v.nxt, proposal


def commit_rows(model: Transformer, dc, extras: dict, tokens, start, after, sp: SpecParams):
    """The drafter's commit of the rows a prefill chunk returned: tokens [B, S] the chunk (row i at position
    start[b] + i), after [B] the token following each sequence's last row. Under bounded replay the returned
    rows are each sequence's kept tail: the drafter starts there. -> (dc, what `_propose` needs)."""
    rows = extras["rows"]
    offset = (extras["row_start"] - start)[:, None] + jnp.arange(extras["residual"].shape[1])[None, :]
    row_tokens = jnp.take_along_axis(tokens, jnp.minimum(offset, tokens.shape[1] - 1), 1)
    dc = dc.replace(lengths=extras["row_start"])
    return _commit(model, dc, extras, _next_tokens(row_tokens, rows, after), rows, sp)


def prefill_and_propose(model: Transformer, cache: Cache, dc, tokens, lengths, key, sp: SpecParams):
    """Prompt prefill + the first token + the drafter's state and first proposal."""
    start = cache.lengths
    logits, cache, extras = model.step(tokens, cache, lengths, last_only=True, replay_tail=sp.replay_tail)
    dc, first, proposal = first_proposal(model, dc, logits[:, 0], extras, tokens, start, key, sp)
    return cache, dc, first, proposal


def first_proposal(model: Transformer, dc, logits, extras: dict, tokens, start, key, sp: SpecParams):
    """After the prompt's last prefill chunk (tokens [B, S] from `start`, its extras): the first token from the
    last rows' logits [B, V], the drafter's commit of the chunk (`commit_rows`) and its first proposal.
    -> (dc, first, proposal)."""
    k_first, k_prop = split(key)
    first = sample(logits, k_first, sp.temperature, sp.top_k, sp.top_p)
    dc, commit_out = commit_rows(model, dc, extras, tokens, start, first, sp)
    return dc, first, _propose(model, dc, first, commit_out, k_prop, sp)


@nnx.jit
def _commit_jit(model, dc, extras, tokens, start, after, sp):
    return commit_rows(model, dc, extras, tokens, start, after, sp)[0]


@nnx.jit
def _first_proposal_jit(model, dc, logits, extras, tokens, start, key, sp):
    return first_proposal(model, dc, logits, extras, tokens, start, key, sp)


def prefill_with_store_and_propose(model: Transformer, cache: Cache, dc, tokens: np.ndarray, lengths: np.ndarray,
                                   store, key, sp: SpecParams):
    """`replay.prefill_with_store` with the drafter committing every chunk's rows, then the first token and
    proposal (the keys of `init_state`). The drafter's window starts at each sequence's first prefilled row:
    [V4] a hit restores the target's state but no drafter rows, so drafts right after a hit see no context
    before it (acceptance may change, the output never does); [V4.1] the encoder replay's rows [H - W, H) are
    committed like any other. -> (cache, dc, first token [B], proposal, hits [B])."""
    last: dict = {}

    def commit(extras, rows, start, after):
        nonlocal dc
        rows, start = jnp.asarray(rows), jnp.asarray(start, jnp.int32)
        if not last:  # the first chunk: nothing below its rows was committed
            dc = dc.replace(floor=start)
        last.update(extras=extras, rows=rows, start=start)
        if after is not None:
            dc = _commit_jit(model, dc, extras, rows, start, jnp.asarray(after, jnp.int32), sp)

    logits, cache, hits = prefill_with_store(model, cache, tokens, lengths, store, sp.replay_tail, commit)
    dc, first, proposal = _first_proposal_jit(model, dc, logits, last["extras"], last["rows"], last["start"],
                                              fold_in(key, 0), sp)
    return cache, dc, first, proposal, hits


# ----------------------------------------------------------------------------- the loop

def init_state(model: Transformer, cache: Cache, dc, tokens, lengths, key, stop_tokens, sp: SpecParams,
               max_new_tokens: int) -> dict:
    """Prefill + first proposal -> the loop state (output buffer, per-sequence progress, statistics)."""
    cache, dc, first, proposal = prefill_and_propose(model, cache, dc, tokens, lengths, fold_in(key, 0), sp)
    return start_state(cache, dc, first, proposal, stop_tokens, sp, max_new_tokens)


def start_state(cache: Cache, dc, first, proposal: D.Proposal, stop_tokens, sp: SpecParams, max_new_tokens: int
                ) -> dict:
    """The loop state after the prefill: the first token emitted, the drafter's first proposal pending."""
    b = first.shape[0]
    k = sp.num_draft
    out = jnp.full((b, max_new_tokens + k + 1), -1, jnp.int32).at[:, 0].set(first)
    n_out = jnp.ones((b,), jnp.int32)
    done = jnp.isin(first, stop_tokens) | (n_out >= max_new_tokens)
    zeros = jnp.zeros((k,), jnp.int32)
    return dict(i=jnp.int32(1), cache=cache, dc=dc, pending=first, proposal=proposal, out=out, n_out=n_out,
                done=done, verified=zeros, accepted=zeros, steps_active=jnp.int32(0), tokens_active=jnp.int32(0),
                accept_hist=jnp.zeros((k + 1,), jnp.int32),
                accepted_per_step=jnp.zeros((max_new_tokens,), jnp.float32))


def verify_phase(model: Transformer, s: dict, key, stop_tokens, sp: SpecParams, max_new_tokens: int
                 ) -> tuple[dict, Verified]:
    """Verification and the bookkeeping of one iteration (emitted tokens, stops, statistics)."""
    b, width = s["out"].shape
    k = sp.num_draft
    k_acc, _ = split(fold_in(key, s["i"]))
    cache, emitted, n_verify, v = verify(model, s["cache"], s["pending"], s["proposal"], k_acc, sp)
    a = v.a
    active = ~s["done"]
    j = jnp.arange(k + 1)[None, :]
    valid = j <= a[:, None]
    is_stop = jnp.isin(emitted, stop_tokens) & valid
    first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, 1), k + 1)
    keep = valid & (j <= first_stop[:, None]) & active[:, None]
    slot = jnp.where(keep, s["n_out"][:, None] + j, width)
    out = s["out"].at[jnp.arange(b)[:, None], slot].set(emitted, mode="drop")
    n_out = s["n_out"] + jnp.sum(keep, 1)
    done = s["done"] | (first_stop <= k) | (n_out >= max_new_tokens)
    jj = jnp.arange(k)[None, :]
    n_active = jnp.sum(active)
    step_len = jnp.sum(jnp.where(active, 1 + a, 0))
    return dict(s, i=s["i"] + 1, cache=cache, pending=v.nxt, out=out, n_out=n_out, done=done,
                verified=s["verified"] + jnp.sum((jj < n_verify[:, None]) & active[:, None], 0),
                accepted=s["accepted"] + jnp.sum((jj < a[:, None]) & active[:, None], 0),
                steps_active=s["steps_active"] + n_active, tokens_active=s["tokens_active"] + step_len,
                accept_hist=s["accept_hist"].at[a].add(active.astype(jnp.int32)),
                accepted_per_step=s["accepted_per_step"].at[s["i"] - 1].set(
                    step_len / jnp.maximum(n_active, 1), mode="drop")), v


def draft_phase(model: Transformer, s: dict, v: Verified, key, sp: SpecParams) -> dict:
    """The drafter's half of the iteration whose verification produced `v` (s["i"] already advanced)."""
    _, k_prop = split(fold_in(key, s["i"] - 1))
    dc, proposal = draft(model, s["dc"], v, k_prop, sp)
    return dict(s, dc=dc, proposal=proposal)


def finish(s: dict, max_new_tokens: int):
    """-> (tokens [B, max_new] (-1 past each sequence's end), n_gen [B], statistics arrays)."""
    width = s["out"].shape[1]
    out = jnp.where(jnp.arange(width)[None, :] < jnp.minimum(s["n_out"], max_new_tokens)[:, None], s["out"], -1)
    stats = {name: s[name] for name in ("verified", "accepted", "steps_active", "tokens_active", "accept_hist",
                                        "accepted_per_step")}
    stats["steps"] = s["i"] - 1
    return out[:, :max_new_tokens], jnp.minimum(s["n_out"], max_new_tokens), stats


def run_loop(model: Transformer, cache: Cache, dc, tokens, lengths, key, stop_tokens, sp: SpecParams,
             max_new_tokens: int):
    """The whole speculative generation (traceable): -> (tokens [B, max_new], n_gen [B], stats arrays)."""
    s = init_state(model, cache, dc, tokens, lengths, key, stop_tokens, sp, max_new_tokens)
    return run_from(model, s, key, stop_tokens, sp, max_new_tokens)


def run_from(model: Transformer, s: dict, key, stop_tokens, sp: SpecParams, max_new_tokens: int):
    """Speculative generation from a loop state (`init_state` / `start_state`) to the end (traceable)."""
    def body(s):
        s, v = verify_phase(model, s, key, stop_tokens, sp, max_new_tokens)
        return draft_phase(model, s, v, key, sp)

    s = jax.lax.while_loop(lambda s: ~jnp.all(s["done"]), body, s)
    return finish(s, max_new_tokens)


def summarize(stats: dict[str, Any]) -> dict[str, Any]:
    """Host-side statistics: mean accepted length per verify step (tokens emitted per sequence-step),
    its histogram over sequence-steps (index a: a drafts accepted), the batch-mean accepted length of each
    step, and per-position acceptance rates."""
    verified = np.asarray(stats["verified"])
    accepted = np.asarray(stats["accepted"])
    steps = int(stats["steps_active"])
    n_steps = int(stats["steps"])
    return {"spec_steps": n_steps,
            "mean_accepted_length": float(stats["tokens_active"]) / max(steps, 1),
            "accepted_length_per_step": np.asarray(stats["accepted_per_step"])[:n_steps].round(4).tolist(),
            "accepted_histogram": np.asarray(stats["accept_hist"]).tolist(),
            "acceptance_per_position": (accepted / np.maximum(verified, 1)).tolist(),
            "verified_per_position": verified.tolist()}
