"""The jitted generation loop: prefill every prompt (ragged) into a fresh cache, then decode one
token per sequence per iteration inside `lax.while_loop`, all under one `jit` with the cache donated.

`generate(..., timing=True)` runs the very same phases as separate jitted calls instead of one, so
prefill and decode (speculative: prefill, verify and draft) can be timed, and their compile times
reported, separately.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.cache import Cache, allocate
from model.draft import allocate_draft
from model.sharded import allocate_cache, on_mesh, shard_model
from model.transformer import Transformer
from sharding.apply import shard_batch, to_host as global_to_host
from sharding.mesh import check_batch, describe as describe_mesh

from .sampler import fold_in, sample, sequence_keys
from .replay import prefill_with_store
from . import speculative as spec
from .speculative import SpecParams, check_spec, default_cost, run_loop, summarize


@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray  # [B, max_new_tokens] int32, -1 after a stop token
    lengths: np.ndarray  # [B] number of generated tokens (stop token included)
    stats: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    replay_tail: int | None = None  # [V4.1] decoder-side bounded replay in prefill (None = exact)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def prepare_prompts(prompts, lengths=None) -> tuple[np.ndarray, np.ndarray]:
    """A list of 1-D token sequences, or a padded [B, S] array plus lengths -> (padded int32, lengths)."""
    if isinstance(prompts, (list, tuple)) and prompts and not np.isscalar(prompts[0]):
        if lengths is not None:
            raise ValueError("pass lengths only with a padded [batch, seq] array of prompts")
        seqs = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        lens = np.array([len(s) for s in seqs], np.int32)
        arr = np.zeros((len(seqs), max(1, int(lens.max()))), np.int64)
        for i, s in enumerate(seqs):
            arr[i, :len(s)] = s
    else:
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise ValueError(f"prompts must be a list of sequences or a [batch, seq] array, got shape {arr.shape}")
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


@nnx.jit(static_argnames=("params", "max_new_tokens"), donate_argnames="cache")
def _generate_fused(model, cache, tokens, lengths, key, stop_tokens, params, max_new_tokens):
    _TRACES["fused"] += 1
    first, cache = _prefill_phase(model, cache, tokens, lengths, key, params)
    out, n_gen, steps, _ = _decode_phase(model, cache, first, key, stop_tokens, params, max_new_tokens)
    return out, n_gen, steps


@nnx.jit(static_argnames=("sp", "max_new_tokens"), donate_argnames=("cache", "dc"))
def _speculative_fused(model, cache, dc, tokens, lengths, key, stop_tokens, sp, max_new_tokens):
    _TRACES["speculative"] += 1
    return run_loop(model, cache, dc, tokens, lengths, key, stop_tokens, sp, max_new_tokens)


# speculative decoding's phases as separate calls (timing=True): the loop body of `run_loop`, split
@nnx.jit(static_argnames=("sp", "max_new_tokens"), donate_argnames=("cache", "dc"))
def _spec_init_jit(model, cache, dc, tokens, lengths, key, stop_tokens, sp, max_new_tokens):
    _TRACES["speculative"] += 1
    return spec.init_state(model, cache, dc, tokens, lengths, key, stop_tokens, sp, max_new_tokens)


@nnx.jit(static_argnames=("sp", "max_new_tokens"), donate_argnames="state")
def _spec_verify_jit(model, state, key, stop_tokens, sp, max_new_tokens):
    return spec.verify_phase(model, state, key, stop_tokens, sp, max_new_tokens)


@nnx.jit(static_argnames="sp", donate_argnames="state")
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


@nnx.jit(static_argnames="params", donate_argnames="cache")
def _prefill_jit(model, cache, tokens, lengths, key, params):
    _TRACES["prefill"] += 1
    return _prefill_phase(model, cache, tokens, lengths, key, params)


@nnx.jit(static_argnames=("params", "max_new_tokens"), donate_argnames="cache")
def _decode_jit(model, cache, first, key, stop_tokens, params, max_new_tokens):
    _TRACES["decode"] += 1
    out, n_gen, steps, _ = _decode_phase(model, cache, first, key, stop_tokens, params, max_new_tokens)
    return out, n_gen, steps


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
             timing: bool = False, speculative: str | None = None, num_draft: int = 3, policy: str = "fixed",
             verify_cost: Sequence[float] | None = None, bounded_replay: bool | int = False, mesh=None,
             prefix_store=None, sequence_ids: Sequence[int] | None = None) -> GenerateOutput:
    """Generate up to `max_new_tokens` per prompt. Prompts: a list of token sequences (any lengths) or
    a padded [B, S] array with `lengths`. Greedy when temperature == 0.

    sequence_ids: one id per prompt (ints in [0, 2^32)): each sequence then draws its randomness from `seed` and
    its own id alone, never from its batch row (`sampler.sequence_keys`); a batch-invariant model
    (cfg.batch_invariant) always does, its ids defaulting to the rows. Without either, one key serves the batch.

    speculative: None, "mtp" (V4) or "dspark" (V4.1) with `num_draft` drafts per step and `policy`
    "fixed" or "confidence" (DSpark; `verify_cost[w-1]` = cost of a verify step of width w, e.g. measured
    by experiments/bench.py; default nearly flat). Lossless: greedy output equals plain greedy output,
    sampled output has the target's distribution.

    bounded_replay [V4.1]: decoder-side SWA bounded replay in prefill (MODEL_SPEC 3.4): True keeps the last
    window (+ num_draft with speculative decoding) rows per prompt after the last KV-source layer; an int
    sets that tail. An approximation (measured by experiments/replay_error.py); False is exact.

    prefix_store (sampling.replay.PrefixStore): reuse the longest cached prefix of each prompt and store
    new ones ([V4] exact resume; [V4.1] encoder-side replay of the last window before the hit).

    stats: prompt lengths, steps run; speculative: mean accepted length, its histogram and per-step trace,
    per-position acceptance rates; with `timing=True` compile and run times and tokens/s (plain decoding
    times prefill and decode separately, speculative decoding prefill, verify and draft: the phases then
    run as separate jitted calls; results are identical).

    mesh: a (dp, ep, tp) mesh (sharding.ParallelConfig.make_mesh): the batch (a multiple of dp*ep),
    the cache and the activations are split over dp x ep, experts over ep; a model not yet on the mesh
    is laid out there first (model.shard_model, with the mesh's default runtime). stats["parallel"] records
    the mesh and the expert parallel strategy of each phase.
    """
    replay_tail = None
    if bounded_replay is not False and bounded_replay is not None:
        if model.config.generation != "v41":
            raise ValueError("decoder-side bounded replay is a V4.1 mechanism (it needs KV-source layers)")
        replay_tail = (model.config.sliding_window + (num_draft if speculative else 0)
                       if bounded_replay is True else int(bounded_replay))
        if replay_tail < 1:
            raise ValueError(f"bounded_replay tail must be >= 1, got {replay_tail}")
    if speculative is not None:
        check_spec(model, speculative, num_draft, policy)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cfg = model.config
    tokens, lens = prepare_prompts(prompts, lengths)
    if tokens.max() >= cfg.vocab_size or tokens.min() < 0:
        raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
    room = num_draft + 2 if speculative is not None else 0  # verify rows past the last emitted token
    need = int(lens.max()) + max_new_tokens + room
    if need > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {int(lens.max())} + max_new_tokens {max_new_tokens} = {need} exceeds "
                         f"the model's context of {cfg.max_position_embeddings} positions")
    # Bucket shapes so nearby requests share compilations.
    width = min(_round_up(tokens.shape[1], 16), cfg.max_position_embeddings)
    max_len = min(_round_up(need, 64), cfg.max_position_embeddings)
    tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1]))).astype(np.int32)
    params = SamplingParams(float(temperature), int(top_k), float(top_p), replay_tail)
    key = request_key(cfg, seed, sequence_ids, tokens.shape[0])
    stops = jnp.asarray(list(stop_tokens) if stop_tokens else [-2], jnp.int32)
    stats: dict[str, Any] = {"prompt_lengths": lens.tolist(), "max_len": max_len}
    spec_room = max(8, num_draft + 2)
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
    if prefix_store is not None:
        if speculative is not None or mesh is not None:
            raise NotImplementedError("prefix reuse is not combined with speculative decoding or meshes yet")
        logits, cache, hits = prefill_with_store(model, new_cache(), tokens, lens, prefix_store, replay_tail)
        first = sample(logits, fold_in(key, 0), params.temperature, params.top_k, params.top_p)
        out, n_gen, steps = _decode_jit(model, cache, first, key, stops, params, max_new_tokens)
        stats.update(prefix_hits=hits.tolist(), prefix_store=prefix_store.stats, steps=int(steps))
        return GenerateOutput(tokens=np.asarray(out), lengths=np.asarray(n_gen), stats=stats)
    if speculative is not None:
        sp = SpecParams(speculative, int(num_draft), policy, tuple(verify_cost or default_cost(num_draft)),
                        float(temperature), int(top_k), float(top_p), replay_tail)
        if len(sp.cost) < num_draft + 1:
            raise ValueError(f"verify_cost needs {num_draft + 1} entries (widths 1..num_draft+1)")
        new_dc = lambda: allocate_draft(model, tokens.shape[0], max_len, spec_room)  # noqa: E731
        with context:
            t0 = time.perf_counter()
            if timing:
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
