"""How much V4.1 SWA bounded replay changes the model's outputs, and how much prefill time it saves.

  python -m experiments.replay_error                    # tiny + mid, prompts of 3 lengths each
  python -m experiments.replay_error --quick            # 2 lengths per config, 1 prompt, fewer repeats
  python -m experiments.replay_error --configs tiny --lengths 64,128 --prompts 2 --hit-fracs 0.5,0.75 --combined

For random-weight V4.1 configs (`tiny` = the tiny-v41 preset; `mid` = a 12-layer, D=512 V4.1 config
that keeps every role: 2 KV sources (r2, r1), Reuse, Reindex with and without candidates, a candidate
source, Engram, DSpark slots) and random prompts of several lengths N, each mode below is compared
with the exact cold prefill of the same prompt (docs/model.md §15, §15.1, §15.2):

* `dec` decoder-side replay: layers after the last KV source run on the last `tail` rows only, the
  window floored at the first kept row; tail = W and W + num_draft (ATOM's W + beta).
* `enc` encoder-side replay: a prefix hit at H (page aligned, >= W; H = frac * N rounded down to a
  page, `--hit-fracs`, default 0.5) resumed from a `PrefixStore` (global KV + index keys only):
  [H - W, H) is replayed with the compressors off and the window floored at H - W, then the suffix
  [H, N) is prefilled exactly (as `prefill_with_store` does it: [H, boundary) and [boundary, N),
  boundary = the last page boundary before N).
* `enc+dec` (with `--combined`) both on one prefill path (the store path with replay_tail = W). Each
  suffix chunk keeps its own last W rows: the tail drops rows only from chunks longer than W (none when
  page <= W and N - H <= W + page).
* `control` cold prefill through the store path (chunked at the page boundary, no hit): not an
  approximation, it shows the floating-point noise floor of the metrics.

Metrics at the prompt's last position (float32 logits; KL evaluated in float64): KL(exact || mode) of
the next-token distributions, top-1 agreement, max |logit difference|; greedy continuations of
`--new-tokens` (32) tokens from each prefill (the first token is the prefill's argmax): the fraction
of positions equal before the first divergence, and overall. Each figure is over `--prompts` random
prompts (mean, and max for KL / logits).

Time (the whole prompt batch; compile excluded: one warm-up run each, then `--repeats` runs of the mode
and of its reference interleaved, medians of wall time and of process CPU time):
* dec: the jitted one-shot prefill with replay_tail vs without (same function, the tail static);
* enc: the device work of the resume, i.e. the jitted replay chunk + the jitted suffix chunks on a cache
  the prefix state was already imported into, vs the cold one-shot prefill; and, end to end, the store
  path `prefill_with_store` with a hit (lookup, host->device import, replay, suffix chunks, export of the
  new prefix) vs the same path with an empty store (`control`).
On a CPU these are CPU figures (XLA:CPU runs the MoE's `ragged_dot` about as slowly as a dense product
with every expert, ~12x a dot of the routed rows at mid's shapes, so per-row MoE work is inflated);
the same script runs on a GPU.

Results: experiments/results/replay_error_<date>[_quick].json (env + one record per config, length and
mode) and .md (the table).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_LENGTHS = {"tiny": (64, 128, 256), "mid": (128, 256, 512)}
QUICK_LENGTHS = {"tiny": (64, 128), "mid": (128, 256)}
DEFAULT_PROMPTS = {"tiny": 4, "mid": 2}
DEFAULT_REPEATS = {"tiny": (7, 3), "mid": (3, 2)}  # (full, --quick)


# ----------------------------------------------------------------------------- configs

def mid_config():
    """A mid-size V4.1 config (random weights, CPU in minutes) with the V4.1 roles of v41-flash:

    0 SWA, 1 SWA+Engram, 2 Full r2 (KV source)+Engram, 3 Reuse, 4 Reindex, 5 Reuse,
    6 Full r1 (last KV source, candidate source), 7 Reuse, 8 Reindex+candidates, 9 Reuse,
    10 Reindex+candidates, 11 Reuse; DSpark taps 9-11. Decoder replay narrows layers 7-11 (5 of 12;
    v41-flash: 19 of 40)."""
    from model import ModelConfig

    return ModelConfig.preset("tiny-v41").replace(
        hidden_size=512, moe_intermediate_size=512, num_heads=8, head_dim=128, rope_head_dim=32,
        q_lora_rank=256, o_lora_rank=128, index_head_dim=64, index_topk=16, sliding_window=32, num_layers=12,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0), kv_source_layer_ids=(2, 6),
        index_source_layer_ids=(2, 4, 6, 8, 10), candidate_source_layer_id=6, candidate_topk_blocks=8,
        candidate_block_size=4, dspark_target_layer_ids=(9, 10, 11), max_position_embeddings=1024,
        name="mid-v41")


def get_config(name: str):
    from model import ModelConfig

    if name == "tiny":
        return ModelConfig.preset("tiny-v41")
    if name == "mid":
        return mid_config()
    cfg = ModelConfig.preset(name)
    if cfg.generation != "v41":
        raise ValueError(f"{name}: bounded replay is a V4.1 mechanism")
    return cfg


# ----------------------------------------------------------------------------- metrics

def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def next_token_metrics(exact: np.ndarray, approx: np.ndarray) -> dict:
    """exact, approx: float32 logits [B, V] -> per-prompt lists: kl (exact || approx), top1 (bool),
    max_abs (max |logit difference|), and of the exact distribution: entropy, top-1 margin (logits)."""
    lp, lq = log_softmax64(exact), log_softmax64(approx)
    p = np.exp(lp)
    kl = np.maximum((p * (lp - lq)).sum(-1), 0.0)  # >= 0 up to rounding
    top2 = np.sort(np.asarray(exact, np.float64), -1)[:, -2:]
    return {"kl": kl.tolist(), "top1": (exact.argmax(-1) == approx.argmax(-1)).tolist(),
            "max_abs": np.abs(np.asarray(exact, np.float64) - approx).max(-1).tolist(),
            "entropy": (-(p * lp).sum(-1)).tolist(), "margin": (top2[:, 1] - top2[:, 0]).tolist()}


def greedy_agreement(exact: np.ndarray, approx: np.ndarray) -> dict:
    """Token sequences [B, T] -> per-prompt lists: prefix (fraction of positions equal before the first
    divergence), overall (fraction of equal positions), first_divergence (index, T if none)."""
    exact, approx = np.asarray(exact), np.asarray(approx)
    t = exact.shape[1]
    eq = exact == approx
    first = np.where(eq.all(1), t, np.argmin(eq, axis=1))
    return {"prefix": (first / t).tolist(), "overall": eq.mean(1).tolist(), "first_divergence": first.tolist()}


def summarize(per: dict) -> dict:
    kl, mx = np.asarray(per["kl"]), np.asarray(per["max_abs"])
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1_agree": float(np.mean(per["top1"])),
            "max_abs_logit_diff": float(mx.max()), "greedy_prefix": float(np.mean(per["prefix"])),
            "greedy_overall": float(np.mean(per["overall"]))}


def _timed(fn, setup) -> tuple[float, float]:
    """(wall s, process CPU s) of one fn(setup()) run; setup is untimed (e.g. a fresh cache: caches are
    donated)."""
    import jax

    arg = setup() if setup is not None else None
    jax.block_until_ready(arg)
    w0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(arg))
    return time.perf_counter() - w0, time.process_time() - c0


def median_time(fn, repeats: int, setup=None) -> float:
    """Median wall seconds of `repeats` runs of fn(setup()) after one warm-up run (compile excluded)."""
    _timed(fn, setup)
    return float(np.median([_timed(fn, setup)[0] for _ in range(repeats)]))


def paired_times(ref, mode, repeats: int, setup_ref=None, setup_mode=None) -> dict:
    """Time a reference and a mode interleaved (one warm-up each, then `repeats` pairs, the order
    alternating), so that a changing machine load hits both alike. -> dict of medians in ms: ref_ms,
    mode_ms (wall), ref_cpu_ms, mode_cpu_ms (process CPU time, all threads: the work done, less sensitive to
    other processes), saved_pct / saved_cpu_pct (1 - mode / ref of the medians), pair_ratio (median of the
    per-pair wall ratios mode / ref), and the raw wall times."""
    _timed(ref, setup_ref)
    _timed(mode, setup_mode)
    r, m = [], []
    for i in range(repeats):
        if i % 2:
            m.append(_timed(mode, setup_mode))
            r.append(_timed(ref, setup_ref))
        else:
            r.append(_timed(ref, setup_ref))
            m.append(_timed(mode, setup_mode))
    r, m = np.asarray(r) * 1e3, np.asarray(m) * 1e3
    (rw, rc), (mw, mc) = np.median(r, 0), np.median(m, 0)
    return {"ref_ms": float(rw), "mode_ms": float(mw), "ref_cpu_ms": float(rc), "mode_cpu_ms": float(mc),
            "saved_pct": float(100 * (1 - mw / rw)), "saved_cpu_pct": float(100 * (1 - mc / rc)),
            "pair_ratio": float(np.median(m[:, 0] / r[:, 0])),
            "times_ref_ms": np.round(r[:, 0], 3).tolist(), "times_mode_ms": np.round(m[:, 0], 3).tolist()}


# ----------------------------------------------------------------------------- the runner

class Runner:
    """One model: jitted prefill / chunk functions over the split state (no per-call graph traversal, so
    the timings are the compiled computation's), greedy continuations, the encoder-side resume."""

    def __init__(self, cfg, seed: int = 0):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from model import init_random

        self.cfg = cfg
        self.model = init_random(cfg, seed=seed)
        graphdef, self.state = nnx.split(self.model)

        @functools.partial(jax.jit, static_argnames=("last_only", "tail", "write_global"), donate_argnames=("cache",))
        def chunk(state, tokens, cache, n_new, floor, last_only, tail, write_global):
            logits, cache, _ = nnx.merge(graphdef, state).step(tokens, cache, n_new, last_only, tail, floor,
                                                               write_global)
            return logits[:, 0], cache

        self._chunk = chunk
        self.jnp = jnp

    def new_cache(self, batch: int, max_len: int):
        from model.cache import allocate

        return allocate(self.cfg, batch, max_len, self.jnp.float32)

    def prefill(self, tokens, cache, tail=None):
        """One-shot prefill of the whole prompts from position 0 -> (last-row logits [B, V], cache)."""
        b, n = tokens.shape
        return self.chunk(tokens, cache, np.full(b, n), np.zeros(b), True, tail, True)

    def chunk(self, tokens, cache, n_new, floor, last_only, tail, write_global):
        jnp = self.jnp
        return self._chunk(self.state, jnp.asarray(tokens, jnp.int32), cache, jnp.asarray(n_new, jnp.int32),
                           jnp.asarray(floor, jnp.int32), last_only=last_only, tail=tail, write_global=write_global)

    def continue_greedy(self, cache, logits, new_tokens: int) -> np.ndarray:
        """Greedy tokens [B, new_tokens] after a prefill: its argmax, then the jitted decode loop."""
        import jax

        from sampling.generate import SamplingParams, _decode_jit

        first = self.jnp.argmax(logits, -1).astype(self.jnp.int32)
        if new_tokens == 1:
            return np.asarray(first)[:, None]
        out, _, _ = _decode_jit(self.model, cache, first, jax.random.PRNGKey(0), self.jnp.asarray([-2], self.jnp.int32),
                                SamplingParams(), new_tokens)
        return np.asarray(out)

    def nnx_call_overhead(self, calls: int = 20) -> float:
        """Median seconds of an `nnx.jit` call that takes the model and does nothing (the graph traversal
        each call of the store path's jitted chunk pays on top of its computation)."""
        from flax import nnx

        f = nnx.jit(lambda m, x: x + 1)
        x = self.jnp.ones(())
        return median_time(lambda _: f(self.model, x), calls)

    # ---- encoder side
    def export_states(self, tokens: np.ndarray, hit: int, max_len: int) -> list:
        """Prefix states of tokens[:, :hit] from an exact cold prefill (what an earlier request stored)."""
        from model.cache import export_prefix

        b = tokens.shape[0]
        # last_only=True: the same compiled chunk as a suffix of `hit` rows (only the cache is used)
        _, cache = self.chunk(tokens[:, :hit], self.new_cache(b, max_len), np.full(b, hit), np.zeros(b), True, None,
                              True)
        return [export_prefix(cache, self.cfg, i, hit, include_window=False) for i in range(b)]

    def store_with(self, tokens: np.ndarray, states: list, page: int):
        from sampling.replay import PrefixStore

        store = PrefixStore(page_size=page)
        for i, st in enumerate(states):
            store.insert(tokens[i, :st.length], st)
        return store

    def imported_cache(self, tokens: np.ndarray, states: list, max_len: int):
        """A fresh cache holding the prefix states, rolled back to the replay start H - W, with the Engram
        token history before it (what prefill_with_store prepares before its replay chunk)."""
        from model.cache import import_prefix, set_token_history

        cache = self.new_cache(tokens.shape[0], max_len)
        for i, st in enumerate(states):
            cache = import_prefix(cache, self.cfg, i, st)
        start = np.full(tokens.shape[0], states[0].length - self.cfg.sliding_window, np.int32)
        cache = cache.replace(lengths=self.jnp.asarray(start))
        return set_token_history(cache, tokens, start)

    def resume(self, tokens: np.ndarray, cache, hit: int, page: int, tail=None):
        """Replay [H - W, H) (compressors off, window floored at H - W), then prefill the suffix in the chunks
        prefill_with_store uses: [H, boundary) and [boundary, N), boundary = the last page boundary before N
        (which matters with a decoder tail: each chunk keeps its own last `tail` rows)."""
        b, n = tokens.shape
        w = self.cfg.sliding_window
        _, cache = self.chunk(tokens[:, hit - w:hit], cache, np.full(b, w), np.full(b, hit - w), True, None, False)
        boundary = max((n - 1) // page * page, hit)
        if boundary > hit:
            _, cache = self.chunk(tokens[:, hit:boundary], cache, np.full(b, boundary - hit), np.zeros(b), True, tail,
                                  True)
        return self.chunk(tokens[:, boundary:], cache, np.full(b, n - boundary), np.zeros(b), True, tail, True)

    def store_prefill(self, tokens: np.ndarray, cache, store, tail=None):
        """`prefill_with_store` (what generate runs with a prefix store) -> (logits [B, V], cache, hits)."""
        from sampling.replay import prefill_with_store

        return prefill_with_store(self.model, cache, tokens, np.full(tokens.shape[0], tokens.shape[1], np.int32),
                                  store, tail)


_RUNNERS: dict = {}


def get_runner(name: str, seed: int = 0) -> Runner:
    """The Runner of a config name and weight seed (built once per process)."""
    if (name, seed) not in _RUNNERS:
        _RUNNERS[(name, seed)] = Runner(get_config(name), seed=seed)
    return _RUNNERS[(name, seed)]


# ----------------------------------------------------------------------------- one config

def hit_points(n: int, window: int, page: int, fracs) -> list[int]:
    out = []
    for f in fracs:
        h = int(n * f) // page * page
        if h >= max(window, page) and h <= n - 1 and h not in out:
            out.append(h)
    return out


def run_config(name: str, lengths, args, log, records: list | None = None, save=None) -> list[dict]:
    """Measure one config; appends to `records` (returned) and calls `save()` after each length."""
    import jax

    t0 = time.perf_counter()
    runner = get_runner(name, args.seed)
    cfg = runner.cfg
    w = cfg.sliding_window
    num_draft = args.num_draft if args.num_draft is not None else cfg.dspark_block_size
    tails = [w, w + num_draft] if num_draft else [w]
    page = args.page or max(16, w)
    n_prompts = args.prompts or (1 if args.quick else DEFAULT_PROMPTS.get(name, 2))
    repeats = args.repeats or DEFAULT_REPEATS.get(name, (3, 2))[bool(args.quick)]
    cut = max(cfg.kv_source_layer_ids) + 1
    overhead = runner.nnx_call_overhead()
    log(f"{cfg.name}: built in {time.perf_counter() - t0:.1f} s; W={w}, layers {cfg.num_layers} "
        f"(decoder replay narrows {cut}..{cfg.num_layers - 1}), tails {tails}, page {page}, "
        f"{n_prompts} prompts/length; nnx.jit call overhead {overhead * 1e3:.1f} ms")
    rng = np.random.default_rng(args.seed + 1)
    base = {"config": name, "model": cfg.name, "window": w, "num_layers": cfg.num_layers, "narrowed_from": cut,
            "num_draft": num_draft, "batch": n_prompts, "new_tokens": args.new_tokens, "repeats": repeats,
            "page": page, "nnx_call_overhead_ms": overhead * 1e3}
    records = [] if records is None else records
    for n in lengths:
        if n + args.new_tokens + 8 > cfg.max_position_embeddings:
            log(f"  N={n}: skipped (N + new tokens exceeds the {cfg.max_position_embeddings}-position context)")
            continue
        tokens = rng.integers(3, cfg.vocab_size, (n_prompts, n)).astype(np.int32)
        max_len = -(-(n + args.new_tokens + 8) // 64) * 64
        fresh = lambda: runner.new_cache(n_prompts, max_len)  # noqa: E731
        recs = []

        # exact cold prefill (the reference of every mode)
        ex_logits, ex_cache = runner.prefill(tokens, fresh())
        ex_logits = np.asarray(ex_logits)
        ex_greedy = runner.continue_greedy(ex_cache, ex_logits, args.new_tokens)
        exact = lambda c: runner.prefill(tokens, c)[0]  # noqa: E731
        log(f"  N={n}")

        def record(mode, param, logits, greedy, timing, store=None, **extra):
            """timing: paired_times vs the exact prefill; store: paired_times of the store path (cold -> hit)."""
            per = {**next_token_metrics(ex_logits, np.asarray(logits)), **greedy_agreement(ex_greedy, greedy)}
            rec = {**base, "length": n, "mode": mode, **param, **summarize(per),
                   "t_exact_ms": timing["ref_ms"], "t_mode_ms": timing["mode_ms"], "saved_pct": timing["saved_pct"],
                   "t_exact_cpu_ms": timing["ref_cpu_ms"], "t_mode_cpu_ms": timing["mode_cpu_ms"],
                   "saved_cpu_pct": timing["saved_cpu_pct"], "pair_ratio": timing["pair_ratio"],
                   "times_exact_ms": timing["times_ref_ms"], "times_mode_ms": timing["times_mode_ms"]}
            if store is not None:
                rec.update(t_cold_store_ms=store["ref_ms"], t_store_ms=store["mode_ms"],
                           saved_store_pct=store["saved_pct"], t_cold_store_cpu_ms=store["ref_cpu_ms"],
                           t_store_cpu_ms=store["mode_cpu_ms"], saved_store_cpu_pct=store["saved_cpu_pct"],
                           times_cold_store_ms=store["times_ref_ms"], times_store_ms=store["times_mode_ms"])
            rec.update(extra, per_prompt=per)
            recs.append(rec)
            log(f"    {mode:8s} {json.dumps(param):24s} KL {rec['kl_mean']:.3e} (max {rec['kl_max']:.3e}) "
                f"top1 {rec['top1_agree']:.2f} max|dlogit| {rec['max_abs_logit_diff']:.3e} greedy "
                f"{rec['greedy_prefix']:.2f}/{rec['greedy_overall']:.2f}; {rec['t_exact_ms']:.1f} -> "
                f"{rec['t_mode_ms']:.1f} ms, saved {rec['saved_pct']:.1f}% (cpu {rec['saved_cpu_pct']:.1f}%)"
                + (f"; store path saved {rec['saved_store_pct']:.1f}%" if store else ""))

        # (a) decoder-side replay
        for tail in tails:
            if tail >= n:
                log(f"    dec tail {tail}: skipped (tail >= N is exact)")
                continue
            logits, cache = runner.prefill(tokens, fresh(), tail=tail)
            greedy = runner.continue_greedy(cache, logits, args.new_tokens)
            timing = paired_times(exact, lambda c: runner.prefill(tokens, c, tail=tail)[0], repeats, fresh, fresh)
            record("dec", {"tail": tail}, logits, greedy, timing)

        # control: cold prefill through the store path (page-chunked, no hit)
        from sampling.replay import PrefixStore

        empty = lambda: (fresh(), PrefixStore(page_size=page))  # noqa: E731
        cold_store = lambda a: runner.store_prefill(tokens, *a)[0]  # noqa: E731
        logits, cache, _ = runner.store_prefill(tokens, *empty())
        greedy = runner.continue_greedy(cache, logits, args.new_tokens)
        record("control", {}, logits, greedy, paired_times(exact, cold_store, repeats, fresh, empty))

        # (b) encoder-side replay at each hit point (+ combined with decoder replay)
        for hit in hit_points(n, w, page, args.hit_fracs):
            states = runner.export_states(tokens, hit, max_len)
            primed = lambda: (fresh(), runner.store_with(tokens, states, page))  # noqa: E731
            imported = lambda: runner.imported_cache(tokens, states, max_len)  # noqa: E731
            for mode, tail in [("enc", None)] + ([("enc+dec", w)] if args.combined else []):
                # the store path (what generate runs with a prefix store)
                logits, cache, hits = runner.store_prefill(tokens, *primed(), tail)
                assert (hits == hit).all(), (hits, hit)
                greedy = runner.continue_greedy(cache, logits, args.new_tokens)
                store = paired_times(cold_store, lambda a: runner.store_prefill(tokens, *a, tail)[0], repeats, empty,
                                     primed)
                # the device work of the resume: replay chunk + suffix chunks on an imported cache
                hand, _ = runner.resume(tokens, imported(), hit, page, tail)
                path_diff = float(np.abs(np.asarray(hand) - np.asarray(logits)).max())
                timing = paired_times(exact, lambda c: runner.resume(tokens, c, hit, page, tail)[0], repeats, fresh,
                                      imported)
                record(mode, {"hit": hit, **({"tail": tail} if tail else {})}, logits, greedy, timing, store,
                       resume_vs_store_max_abs=path_diff)
        records += recs
        if save is not None:
            save()
        if args.clear_caches:
            jax.clear_caches()
    return records


# ----------------------------------------------------------------------------- output

def env_info() -> dict:
    import jax

    from experiments.bench_report import short_revision

    d = jax.devices()[0]
    return {"git": short_revision(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(d, "device_kind", str(d)), "device_count": jax.device_count(),
            "cpu_count": os.cpu_count(), "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "python": platform.python_version(),
            "platform": platform.platform(), "command": " ".join(["python -m experiments.replay_error", *sys.argv[1:]])}


def _mode_label(r: dict) -> str:
    if r["mode"] == "dec":
        return f"dec tail={r['tail']}"
    if r["mode"] == "enc":
        return f"enc H={r['hit']}"
    if r["mode"] == "enc+dec":
        return f"enc H={r['hit']} + dec tail={r['tail']}"
    return "control (chunked exact)"


def markdown(records: list[dict], env: dict) -> str:
    lines = ["# V4.1 SWA bounded replay: error vs exact prefill, and prefill time saved", "",
             f"git {env['git']} · jax {env['jax']} · backend {env['backend']} · {env['device']} · "
             f"{env['cpu_count']} CPUs (load avg at start {', '.join(f'{x:.1f}' for x in env['load_avg'] or [])}; at "
             f"end {', '.join(f'{x:.1f}' for x in env.get('load_avg_end') or [])}) · wall {env.get('wall_s')} s · "
             f"`{env['command']}`", "",
             "Random weights, float32, random prompts (uniform ids); B = prompts per length. Next-token metrics at "
             "the prompt's last position vs the exact cold prefill (KL(exact‖mode) in nats: mean / max over "
             "prompts; top-1 agreement; max |Δlogit|). Greedy: continuations of the given length from each "
             "prefill vs from the exact prefill — fraction equal before the first divergence / overall. Time: the "
             "batch's prefill, compile excluded, mode and reference run interleaved (medians; 'saved' = 1 − "
             "mode/reference by wall time, 'cpu' = the same by process CPU time, less sensitive to other load). "
             "dec = one-shot prefill with replay_tail; enc = replay chunk + suffix chunks on an imported prefix (the "
             "device work), both vs the exact one-shot prefill; 'store path' = prefill_with_store with a hit vs "
             "with an empty store (end to end: lookup, host import, chunks, export of the new prefix). control = "
             "the exact prompt through the store path (page-chunked, no hit): the metrics' noise floor.", "",
             "| config | W | N | B | mode | KL mean | KL max | top-1 | max \\|Δlogit\\| | greedy prefix | "
             "greedy overall | exact ms | mode ms | saved | saved (cpu) | store path ms (cold → hit) | "
             "saved (store) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        store = (f"{r['t_cold_store_ms']:.1f} → {r['t_store_ms']:.1f}" if "t_store_ms" in r else "")
        saved_store = f"{r['saved_store_pct']:.0f}%" if "saved_store_pct" in r else ""
        lines.append(
            f"| {r['model']} | {r['window']} | {r['length']} | {r['batch']} | {_mode_label(r)} | {r['kl_mean']:.2e} "
            f"| {r['kl_max']:.2e} | {r['top1_agree']:.2f} | {r['max_abs_logit_diff']:.2e} | {r['greedy_prefix']:.2f} "
            f"| {r['greedy_overall']:.2f} | {r['t_exact_ms']:.1f} | {r['t_mode_ms']:.1f} | {r['saved_pct']:.0f}% "
            f"| {r['saved_cpu_pct']:.0f}% | {store} | {saved_store} |")
    ent = {}
    for r in records:
        ent.setdefault((r["model"], r["length"]), (np.mean(r["per_prompt"]["entropy"]),
                                                   np.mean(r["per_prompt"]["margin"])))
    ovh = ", ".join(f"{m} {v:.1f} ms" for m, v in {r["model"]: r["nnx_call_overhead_ms"] for r in records}.items())
    lines += ["", "The store path calls `sampling.replay._chunk` (`nnx.jit`), which pays a graph traversal of the "
              f"model per call (an empty nnx.jit function taking the model: {ovh}); the other times use `jax.jit` "
              "over the split state and pay none."]
    lines += ["", "Exact next-token distributions (context for the KL / top-1 figures): mean entropy (nats) / "
              "mean top-1 − top-2 logit margin: " + "; ".join(f"{m} N={n}: {e:.2f} / {g:.2f}"
                                                              for (m, n), (e, g) in ent.items()), ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="shorter run: 2 lengths per config, 1 prompt, fewer timed repeats")
    p.add_argument("--configs", default="tiny,mid", help="comma list: tiny, mid (or a V4.1 preset name)")
    p.add_argument("--lengths", help="comma list of prompt lengths (all configs); default per config "
                   f"{DEFAULT_LENGTHS} ({QUICK_LENGTHS} with --quick)")
    p.add_argument("--prompts", type=int, help="random prompts per length (default tiny 4, mid 2; quick 1)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy continuation length (default 32)")
    p.add_argument("--repeats", type=int, help="timed runs per measurement after a warm-up (default tiny 7, "
                   "mid 3; quick 3 / 2)")
    p.add_argument("--num-draft", type=int, help="second decoder tail = W + num_draft (default: the config's "
                   "DSpark block size, ATOM's W + beta)")
    p.add_argument("--hit-fracs", default="0.5",
                   help="comma list: encoder-side hit points H = frac * N rounded down to a page (default 0.5)")
    p.add_argument("--page", type=int, help="prefix-store page size (default max(16, W))")
    p.add_argument("--combined", action="store_true",
                   help="also encoder + decoder replay on one prefill path (rows 'enc H + dec tail=W')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clear-caches", action="store_true", help="drop jit caches after each length (less memory)")
    p.add_argument("--out", default=RESULTS, help=f"results directory (default {RESULTS}); '' = do not write")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.hit_fracs = [float(f) for f in args.hit_fracs.split(",") if f]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    env = env_info()
    log(f"jax {env['jax']} on {env['backend']} ({env['device']}), load {env['load_avg']}")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(args.out, f"replay_error_{stamp}{'_quick' if args.quick else ''}") if args.out else None
    records: list[dict] = []
    t0 = time.perf_counter()
    out = {"env": env, "args": {k: v for k, v in vars(args).items() if k != "out"}, "records": records}

    def save() -> str:  # after every config, so that a long run keeps what it measured
        env["wall_s"] = round(time.perf_counter() - t0, 1)
        env["load_avg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        md = markdown(records, env)
        if base:
            os.makedirs(args.out, exist_ok=True)
            with open(base + ".json", "w") as f:
                json.dump(out, f, indent=1, default=float)
            with open(base + ".md", "w") as f:
                f.write(md)
        return md

    md = ""
    for name in [c for c in args.configs.split(",") if c]:
        if args.lengths:
            lengths = [int(x) for x in args.lengths.split(",") if x]
        else:
            lengths = (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS).get(name, (64, 128))
        run_config(name, lengths, args, log, records, save)
        md = save()
    print(md)
    if base:
        log(f"wrote {base}.json and .md ({env['wall_s']} s)")
        out["paths"] = [base + ".json", base + ".md"]
    return out

if __name__ == "__main__":
    main()
