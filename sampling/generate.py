"""The jitted generation loop: prefill every prompt (ragged) into a fresh cache, then decode one
token per sequence per iteration inside `lax.while_loop`, all under one `jit` with the cache donated.

`generate(..., timing=True)` runs the very same phases as separate jitted calls instead of one, so
prefill and decode (speculative: prefill, verify and draft) can be timed, and their compile times
reported, separately.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import time
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.cache import Cache, allocate
from model.config import ModelConfig
from model.draft import allocate_draft
from model.sharded import allocate_cache, on_mesh, shard_model
from model.transformer import Transformer
from sharding.apply import shard_batch, to_host as global_to_host
from sharding.mesh import check_batch, describe as describe_mesh

from . import speculative as spec
from .replay import PrefixStore, prefill_with_store
from .sampler import check_sampling, fold_in, is_real, sample, sequence_keys
from .speculative import SpecParams, check_spec, default_cost, run_loop, summarize

DEFAULT_NUM_DRAFT = 3


@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray  # [B, max_new_tokens] int32, -1 after a stop token
    lengths: np.ndarray  # [B] number of generated tokens (stop token included)
    stats: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature / top_k / top_p: pytree leaves, traced under jit (new values do not recompile);
    replay_tail: static (it shapes the program)."""

    temperature: Any = 0.0
    top_k: Any = 0
    top_p: Any = 1.0
    replay_tail: int | None = None  # [V4.1] decoder-side bounded replay in prefill (None = exact)


jax.tree_util.register_dataclass(SamplingParams, data_fields=["temperature", "top_k", "top_p"],
                                 meta_fields=["replay_tail"])


def _knobs(temperature, top_k, top_p) -> tuple:
    """The sampling knobs as fixed-dtype scalars: a Python int and a float temperature must not trace twice."""
    return np.float32(temperature), np.int32(top_k), np.float32(top_p)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def prepare_prompts(prompts, lengths=None) -> tuple[np.ndarray, np.ndarray]:
    """A list of 1-D token sequences, or a padded [B, S] array plus lengths -> (padded int32, lengths)."""
    if isinstance(prompts, (list, tuple)) and prompts and not np.isscalar(prompts[0]):
        if lengths is not None:
            raise ValueError("pass lengths only with a padded [batch, seq] array of prompts")
        seqs = [np.asarray(p).reshape(-1) for p in prompts]
        for i, s in enumerate(seqs):
            if s.size and (not np.issubdtype(s.dtype, np.integer) or s.dtype == np.bool_):
                raise ValueError(f"prompt {i}: token ids must be integers, got {s.dtype}")
        seqs = [s.astype(np.int64) for s in seqs]
        lens = np.array([len(s) for s in seqs], np.int32)
        arr = np.zeros((len(seqs), max(1, int(lens.max()))), np.int64)
        for i, s in enumerate(seqs):
            arr[i, :len(s)] = s
    else:
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise ValueError(f"prompts must be a list of sequences or a [batch, seq] array, got shape {arr.shape}")
        if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
            raise ValueError(f"prompts: token ids must be integers, got {arr.dtype}")
        if lengths is None:
            lens = np.full((arr.shape[0],), arr.shape[1], np.int32)
        else:
            lens = np.asarray(lengths, np.int32).reshape(-1)
            if lens.shape[0] != arr.shape[0]:
                raise ValueError(f"lengths has {lens.shape[0]} entries but prompts has {arr.shape[0]} rows")
            if (lens > arr.shape[1]).any():
                raise ValueError(f"lengths {lens.tolist()} exceed the prompt array width {arr.shape[1]}")
    if arr.shape[0] == 0:
        raise ValueError("no prompts given")
    if (lens <= 0).any():
        raise ValueError(f"empty prompt(s) at rows {np.nonzero(lens <= 0)[0].tolist()}")
    return arr, lens


# ----------------------------------------------------------------------------- the two phases

def _prefill_phase(model: Transformer, cache: Cache, tokens, lengths, key, params: SamplingParams):
    logits, cache, _ = model.step(tokens, cache, lengths, last_only=True, replay_tail=params.replay_tail)
    first = sample(logits[:, 0], fold_in(key, 0), params.temperature, params.top_k, params.top_p)
    return first, cache


def _decode_phase(model: Transformer, cache: Cache, first, key, stop_tokens, params: SamplingParams,
                  max_new_tokens: int):
    b = first.shape[0]
    out = jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stop_tokens)
    n_gen = jnp.ones((b,), jnp.int32)

    def cond(state):
        i, _, _, done, _, _ = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(state):
        i, cache, last, done, out, n_gen = state
        logits, cache, _ = model.step(last[:, None], cache, jnp.ones((b,), jnp.int32))
        tok = sample(logits[:, 0], fold_in(key, i), params.temperature, params.top_k, params.top_p)
        tok = jnp.where(done, -1, tok)
        out = out.at[:, i].set(tok)
        n_gen = n_gen + (~done).astype(jnp.int32)
        done = done | jnp.isin(tok, stop_tokens)
        return i + 1, cache, jnp.maximum(tok, 0), done, out, n_gen

    state = (jnp.int32(1), cache, first, done, out, n_gen)
    steps, cache, _, _, out, n_gen = jax.lax.while_loop(cond, body, state)
    return out, n_gen, steps, cache


# The decode phase returns no cache, so XLA cannot reuse every donated buffer; that is expected.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

_TRACES = {"fused": 0, "prefill": 0, "decode": 0, "speculative": 0}  # trace counters (tests check the loop never retraces)


@nnx.jit(static_argnames="max_new_tokens", donate_argnames="cache")
def _generate_fused(model, cache, tokens, lengths, key, stop_tokens, params, max_new_tokens):
    _TRACES["fused"] += 1
    first, cache = _prefill_phase(model, cache, tokens, lengths, key, params)
    out, n_gen, steps, _ = _decode_phase(model, cache, first, key, stop_tokens, params, max_new_tokens)
    return out, n_gen, steps


@nnx.jit(static_argnames="max_new_tokens", donate_argnames=("cache", "dc"))
def _speculative_fused(model, cache, dc, tokens, lengths, key, stop_tokens, sp, max_new_tokens):
    _TRACES["speculative"] += 1
    return run_loop(model, cache, dc, tokens, lengths, key, stop_tokens, sp, max_new_tokens)


# speculative decoding's phases as separate calls (timing=True): the loop body of `run_loop`, split
@nnx.jit(static_argnames="max_new_tokens", donate_argnames=("cache", "dc"))
def _spec_init_jit(model, cache, dc, tokens, lengths, key, stop_tokens, sp, max_new_tokens):
    _TRACES["speculative"] += 1
    return spec.init_state(model, cache, dc, tokens, lengths, key, stop_tokens, sp, max_new_tokens)


@nnx.jit(static_argnames="max_new_tokens", donate_argnames="state")
def _spec_verify_jit(model, state, key, stop_tokens, sp, max_new_tokens):
    return spec.verify_phase(model, state, key, stop_tokens, sp, max_new_tokens)


@nnx.jit(donate_argnames="state")
def _spec_draft_jit(model, state, verified, key, sp):
    return spec.draft_phase(model, state, verified, key, sp)


def _speculative_timed(model, new_cache, new_dc, args, stops, sp: SpecParams, max_new_tokens: int, to_host):
    """Speculative generation with its phases as separate jitted calls, run twice (the first compiles):
    the same tokens as the fused loop, plus prefill, verify and draft times (stats keys *_s)."""
    key = args[2]
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        state = jax.block_until_ready(_spec_init_jit(model, new_cache(), new_dc(), *args, stops, sp, max_new_tokens))
        t_prefill, t_verify, t_draft = time.perf_counter() - t0, [], []
        while not bool(to_host(jnp.all(state["done"]))):
            t0 = time.perf_counter()
            state, verified = jax.block_until_ready(_spec_verify_jit(model, state, key, stops, sp, max_new_tokens))
            t1 = time.perf_counter()
            state = jax.block_until_ready(_spec_draft_jit(model, state, verified, key, sp))
            t_verify.append(t1 - t0)
            t_draft.append(time.perf_counter() - t1)
        runs.append((t_prefill, t_verify, t_draft))
    (p0, v0, d0), (p1, v1, d1) = runs
    out, n_gen, stats = spec.finish(state, max_new_tokens)
    timing = {"prefill_s": p1, "verify_s": float(np.sum(v1)), "draft_s": float(np.sum(d1)),
              "verify_step_ms_median": 1e3 * float(np.median(v1)) if v1 else 0.0,
              "draft_step_ms_median": 1e3 * float(np.median(d1)) if d1 else 0.0,
              "prefill_compile_s": max(p0 - p1, 0.0),
              "decode_compile_s": max((v0[0] + d0[0]) - (v1[0] + d1[0]), 0.0) if v0 and v1 else 0.0}
    timing["decode_s"] = timing["verify_s"] + timing["draft_s"]
    return out, n_gen, stats, timing


@nnx.jit(static_argnames="max_new_tokens", donate_argnames=("cache", "dc"))
def _speculative_from(model, cache, dc, first, proposal, key, stop_tokens, sp, max_new_tokens):
    _TRACES["speculative"] += 1
    s = spec.start_state(cache, dc, first, proposal, stop_tokens, sp, max_new_tokens)
    return spec.run_from(model, s, key, stop_tokens, sp, max_new_tokens)


@jax.jit
def _sample_jit(logits, key, params):
    return sample(logits, key, params.temperature, params.top_k, params.top_p)


@nnx.jit(donate_argnames="cache")
def _prefill_jit(model, cache, tokens, lengths, key, params):
    _TRACES["prefill"] += 1
    return _prefill_phase(model, cache, tokens, lengths, key, params)


@nnx.jit(static_argnames="max_new_tokens", donate_argnames="cache")
def _decode_jit(model, cache, first, key, stop_tokens, params, max_new_tokens):
    _TRACES["decode"] += 1
    out, n_gen, steps, _ = _decode_phase(model, cache, first, key, stop_tokens, params, max_new_tokens)
    return out, n_gen, steps


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def request_length(cfg: ModelConfig, prompt_len: int, max_new_tokens: int, num_draft: int | None = None) -> int:
    """The cache length of a request (bucketed to 64 so nearby requests share compilations): the prompt, the new
    tokens and, with `num_draft` speculative drafts, the verify rows past the last emitted token. ValueError
    beyond the model's context."""
    need = prompt_len + max_new_tokens + (0 if num_draft is None else num_draft + 2)
    if need > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} = {need} exceeds "
                         f"the model's context of {cfg.max_position_embeddings} positions")
    return min(_round_up(need, 64), cfg.max_position_embeddings)


def check_request(cfg: ModelConfig, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] | None = None, timing: bool = False,
                  speculative: str | None = None, num_draft: int | None = None, policy: str = "fixed",
                  verify_cost: Sequence[float] | None = None, bounded_replay: bool | int = False, mesh=None,
                  prefix_store=None) -> int | None:
    """`generate`'s options against a config, before anything is built or traced (the CLIs call it before
    building the model): ValueError naming the option and its allowed values, NotImplementedError for a
    combination not built. -> the decoder-side replay tail (None: exact prefill)."""
    if not _integer(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    if not _integer(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if stop_tokens is not None:
        bad = [t for t in stop_tokens if not _integer(t) or not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"stop_tokens must be token ids in [0, {cfg.vocab_size}), got {bad}")
    if speculative is None:
        for name, value, default in (("num_draft", num_draft, None), ("policy", policy, "fixed"),
                                     ("verify_cost", verify_cost, None)):
            if value != default:
                raise ValueError(f"{name}={value!r} needs speculative decoding (speculative='mtp' or 'dspark')")
    else:
        num_draft = DEFAULT_NUM_DRAFT if num_draft is None else num_draft
        check_spec(cfg, speculative, num_draft, policy)
        if verify_cost is not None:
            cost = list(verify_cost)
            if len(cost) < num_draft + 1 or not all(is_real(c) and math.isfinite(c) and c > 0 for c in cost):
                raise ValueError(f"verify_cost needs {num_draft + 1} positive costs (widths 1..num_draft+1), "
                                 f"got {cost}")
    replay_tail = None
    if bounded_replay is not False and bounded_replay is not None:
        if cfg.generation != "v41":
            raise ValueError("decoder-side bounded replay is a V4.1 mechanism (it needs KV-source layers)")
        if bounded_replay is True:
            replay_tail = cfg.sliding_window + (num_draft if speculative else 0)
        elif _integer(bounded_replay) and bounded_replay >= 1:
            replay_tail = int(bounded_replay)
        else:
            raise ValueError(f"bounded_replay must be True, False or a tail length >= 1, got {bounded_replay!r}")
    if mesh is not None and any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        raise NotImplementedError("meshes with explicit axis types are not supported: the model's arrays and steps "
                                  "are laid out for GSPMD propagation (build the mesh with "
                                  "ParallelConfig(axis_type='auto'))")
    if prefix_store is not None:
        if not isinstance(prefix_store, PrefixStore):
            raise ValueError(f"prefix_store must be a sampling.replay.PrefixStore, got {type(prefix_store).__name__}")
        if timing:
            raise NotImplementedError("timing=True with prefix_store: the store path prefills in host-driven chunks "
                                      "(lookups, imports, exports between them) that the timed phases do not cover")
    return replay_tail


def request_key(cfg, seed: int, sequence_ids: Sequence[int] | None, batch: int) -> jax.Array:
    """The PRNG key of a request: per-sequence keys [B, 2] from `seed` and the sequence ids (given, or the rows
    under cfg.batch_invariant), else one key [2] for the batch. ValueError for ids that do not fit the prompts."""
    if sequence_ids is None and not cfg.batch_invariant:
        return jax.random.PRNGKey(seed)
    ids = np.arange(batch) if sequence_ids is None else np.asarray(sequence_ids)
    if ids.shape != (batch,) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"sequence_ids must be {batch} integers (one per prompt), got {sequence_ids!r}")
    if ids.min() < 0 or ids.max() >= 2 ** 32:
        raise ValueError(f"sequence_ids must be in [0, 2^32), got range [{ids.min()}, {ids.max()}]")
    return sequence_keys(seed, ids.astype(np.uint32))


def generate(model: Transformer, prompts, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] | None = None, lengths=None,
             timing: bool = False, speculative: str | None = None, num_draft: int | None = None,
             policy: str = "fixed", verify_cost: Sequence[float] | None = None, bounded_replay: bool | int = False,
             mesh=None, prefix_store=None, sequence_ids: Sequence[int] | None = None) -> GenerateOutput:
    """Generate up to `max_new_tokens` per prompt. Prompts: a list of token sequences (any lengths) or
    a padded [B, S] array with `lengths` (integer token ids). Greedy when temperature == 0. Every option is
    checked before anything is traced (`check_request`); the sampling knobs are traced, so new values of
    temperature, top_k or top_p reuse the compiled loop.

    sequence_ids: one id per prompt (ints in [0, 2^32)): each sequence then draws its randomness from `seed` and
    its own id alone, never from its batch row (`sampler.sequence_keys`); a batch-invariant model
    (cfg.batch_invariant) always does, its ids defaulting to the rows. Without either, one key serves the batch.

    speculative: None, "mtp" (V4) or "dspark" (V4.1) with `num_draft` drafts per step (default 3; at most
    MAX_MTP_DRAFTS for MTP, the block size for DSpark) and `policy` "fixed" or "confidence" (DSpark;
    `verify_cost[w-1]` = cost of a verify step of width w, e.g. measured by experiments/bench.py; default
    nearly flat). Lossless: greedy output equals plain greedy output, sampled output has the target's
    distribution.

    bounded_replay [V4.1]: decoder-side SWA bounded replay in prefill (docs/model.md §15): True keeps the last
    window (+ num_draft with speculative decoding) rows per prompt after the last KV-source layer; an int
    sets that tail. An approximation (measured by experiments/replay_error.py); False is exact.

    prefix_store (sampling.replay.PrefixStore): reuse the longest cached prefix of each prompt and store
    new ones ([V4] exact resume; [V4.1] encoder-side replay of the last window before the hit, an
    approximation). Combines with speculative decoding (lossless against the same store path without it) and with
    a mesh (spanning processes too: every process passes the same prompts and keeps its own store, which sees the
    same prefixes); not with timing=True (NotImplementedError).

    stats: prompt lengths, steps run; speculative: mean accepted length, its histogram and per-step trace,
    per-position acceptance rates; with `timing=True` compile and run times and tokens/s (plain decoding
    times prefill and decode separately, speculative decoding prefill, verify and draft: the phases then
    run as separate jitted calls; results are identical).

    mesh: a (dp, ep, tp) mesh (sharding.ParallelConfig.make_mesh, auto axis types): the batch (a multiple of dp*ep),
    the cache and the activations are split over dp x ep, experts over ep; a model not yet on the mesh
    is laid out there first (model.shard_model, with the mesh's default runtime). stats["parallel"] records
    the mesh and the expert parallel strategy of each phase.
    """
    cfg = model.config
    replay_tail = check_request(cfg, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, timing,
                                speculative, num_draft, policy, verify_cost, bounded_replay, mesh, prefix_store)
    if speculative is not None:
        num_draft = DEFAULT_NUM_DRAFT if num_draft is None else int(num_draft)
    tokens, lens = prepare_prompts(prompts, lengths)
    if tokens.max() >= cfg.vocab_size or tokens.min() < 0:
        raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
    max_len = request_length(cfg, int(lens.max()), max_new_tokens, num_draft if speculative is not None else None)
    width = min(_round_up(tokens.shape[1], 16), cfg.max_position_embeddings)  # bucketed: fewer compilations
    tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1]))).astype(np.int32)
    params = SamplingParams(*_knobs(temperature, top_k, top_p), replay_tail)
    key = request_key(cfg, seed, sequence_ids, tokens.shape[0])
    stops = jnp.asarray(list(stop_tokens) if stop_tokens else [-2], jnp.int32)
    stats: dict[str, Any] = {"prompt_lengths": lens.tolist(), "max_len": max_len}
    spec_room = max(8, num_draft + 2) if speculative is not None else 8
    if mesh is None:
        new_cache = lambda: allocate(cfg, tokens.shape[0], max_len, model.dtype, spec_room)  # noqa: E731
        args = (jnp.asarray(tokens), jnp.asarray(lens), key)
        context, to_host = contextlib.nullcontext(), np.asarray
    else:
        check_batch(tokens.shape[0], mesh, "prompt batch")
        if not on_mesh(model, mesh):
            model = shard_model(model, mesh)
        new_cache = lambda: allocate_cache(cfg, tokens.shape[0], max_len, model.dtype, mesh,  # noqa: E731
                                           spec_room)
        args = (shard_batch(tokens, mesh), shard_batch(lens, mesh), key)
        context, to_host = jax.set_mesh(mesh), global_to_host
        plan = model.runtime.expert_parallel
        stats["parallel"] = {**describe_mesh(mesh), "expert_parallel": {
            "config": dataclasses.asdict(plan.config), "forced_balance": model.runtime.forced_balance,
            "prefill": plan.describe(tokens.size), "decode": plan.describe(tokens.shape[0])}}
    if speculative is not None:
        sp = SpecParams(speculative, num_draft, policy, tuple(verify_cost or default_cost(num_draft)),
                        *_knobs(temperature, top_k, top_p), replay_tail)
        new_dc = lambda: allocate_draft(model, tokens.shape[0], max_len, spec_room)  # noqa: E731
        with context:
            t0 = time.perf_counter()
            if prefix_store is not None:
                cache, dc, first, proposal, hits = spec.prefill_with_store_and_propose(
                    model, new_cache(), new_dc(), tokens, lens, prefix_store, key, sp)
                out, n_gen, spec_stats = _speculative_from(model, cache, dc, first, proposal, key, stops, sp,
                                                           max_new_tokens)
                stats.update(prefix_hits=hits.tolist(), prefix_store=prefix_store.stats)
            elif timing:
                out, n_gen, spec_stats, times = _speculative_timed(model, new_cache, new_dc, args, stops, sp,
                                                                   max_new_tokens, to_host)
                stats.update(times)
            else:
                out, n_gen, spec_stats = _speculative_fused(model, new_cache(), new_dc(), *args, stops, sp,
                                                            max_new_tokens)
            out.block_until_ready()
        stats.update(summarize(spec_stats), speculative=speculative, num_draft=num_draft, policy=policy,
                     wall_s=time.perf_counter() - t0)
        return GenerateOutput(tokens=to_host(out), lengths=to_host(n_gen), stats=stats)
    if prefix_store is not None:
        with context:
            logits, cache, hits = prefill_with_store(model, new_cache(), tokens, lens, prefix_store, replay_tail)
            first = _sample_jit(logits, fold_in(key, 0), params)
            out, n_gen, steps = _decode_jit(model, cache, first, key, stops, params, max_new_tokens)
        stats.update(prefix_hits=hits.tolist(), prefix_store=prefix_store.stats, steps=int(to_host(steps)))
        return GenerateOutput(tokens=to_host(out), lengths=to_host(n_gen), stats=stats)
    with context:
        out, n_gen, steps = _run(model, new_cache, args, key, stops, params, max_new_tokens, timing, lens, stats,
                                  to_host)
    stats["steps"] = int(to_host(steps))
    return GenerateOutput(tokens=to_host(out), lengths=to_host(n_gen), stats=stats)


def _run(model, new_cache, args, key, stops, params, max_new_tokens, timing, lens, stats, to_host):
    cache = new_cache()
    if not timing:
        out, n_gen, steps = _generate_fused(model, cache, *args, stops, params, max_new_tokens)
    else:
        times = []
        for run in range(2):  # the first run compiles; the second is timed
            if run:
                cache = new_cache()
            t0 = time.perf_counter()
            first, cache = _prefill_jit(model, cache, *args, params)
            first.block_until_ready()
            t1 = time.perf_counter()
            out, n_gen, steps = _decode_jit(model, cache, first, key, stops, params, max_new_tokens)
            out.block_until_ready()
            times.append((t1 - t0, time.perf_counter() - t1))
        (p_first, d_first), (p_run, d_run) = times
        decoded = int(to_host(n_gen).sum()) - len(lens)
        stats.update(prefill_s=p_run, decode_s=d_run, prefill_compile_s=max(p_first - p_run, 0.0),
                     decode_compile_s=max(d_first - d_run, 0.0),
                     prefill_tokens_per_s=int(lens.sum()) / max(p_run, 1e-9),
                     decode_tokens_per_s=decoded / max(d_run, 1e-9), decode_steps=int(to_host(steps)) - 1)
    return out, n_gen, steps
