"""End-to-end step benchmark: prefill and decode of the whole model in DeepInfer's benchmark mode and in
realistic mode (BENCHMARKS.md sections 3-5).

    python -m experiments.bench --quick                                   # CPU smoke run (tiny-v4)
    python -m experiments.bench --preset v4-flash-4l --dtype bfloat16 --moe-impl pallas \\
        --attention-impl pallas --mode both --phase decode --batch 8,64,256 --context 32768
    python -m experiments.bench --phase prefill --batch 1,2,4 --context 126976 --new-tokens 4096

Modes
  deepinfer  Routing forced to perfect balance (every expert gets equal load: token row i's choice j goes
             to expert (i k + j) mod E, `sharding.placement.forced_balance_ids`); one random prompt whose
             cached prefix is filled once and forked across the batch; decode verifies a fixed
             `--num-draft` (3) drafts per step and converts at an assumed 3.25 accepted tokens per step:
             tokens/s = requests x 3.25 / step time. The timed decode step is the target's verify step
             (`--step verify`, the default here) or the whole speculative iteration (`--step spec`).
  realistic  The router's own choices; distinct prompts (a distinct cached prefix per sequence); decode
             runs the whole speculative iteration (`sampling.speculative.spec_step`: verify, accept,
             roll back, commit and propose with the model's drafter, MTP-1 on V4 / DSpark on V4.1)
             and measures acceptance: tokens/s = sum over sequences of (1 + accepted drafts) / step time.
             Every step is timed and recorded. With random weights the drafter rarely agrees with the
             target (acceptance ~ 0); `--checkpoint` loads a trained model (e.g. experiments/train_drafter).

Phases
  prefill  `batch` sequences each append `--new-tokens` rows after `--context` cached positions (tokens per
           step = batch x new_tokens; DeepInfer's 128K contexts with 4K new tokens: --context 126976
           --new-tokens 4096). After each timed step the cache lengths go back to `context`, so every step
           does the same work.
  decode   `batch` sequences with `--context` cached positions verify 1 + num_draft rows each. In deepinfer
           mode the cache then keeps num_draft positions (about the assumed 3.25 accepted tokens), so the
           context grows by num_draft per step; in realistic mode it keeps 1 + accepted.

Batch invariance (`--batch-invariant on|both`): ModelConfig.batch_invariant, which runs the reference paths with
every reduction in a batch-independent order, and the MoE, mHC, FP8 linear and attention kernels (as asked) on
fixed tilings (docs/batch_invariance.md); "both" times each configuration in the fast mode as asked and then
batch-invariant in the same call, for the cost table.

Synthetic context (the default): the cache stores (SWA rings, compressed-entry stores, indexer keys, the
compressors' projection rings, the drafter's rings) are filled with random values and `lengths` set to the
context, instead of prefilling up to 128K tokens: attention / indexer work and bytes are the same as after a
real prefill, the values are random. `--real-prefill` prefills real random prompts instead (small
contexts; deepinfer prefills one prompt and forks its cache).

Timing (BENCHMARKS.md 5): random weights, tokens and caches (never zeros); every step function is compiled
ahead of time (compile time reported separately), run `--warmup` times, then `--repeats` timed calls, each
ended by `jax.block_until_ready`; medians (and p10/p90) over the timed calls. Every record carries the
roofline of its step (experiments/roofline.py: per-device bytes / FLOPs floor on the H200 ceilings) and the
achieved fraction floor / median; prefill also MFU. With `--kernel-times N` (a GPU) a record also gets the
step's kernels per component (experiments/step_profile.py) and the step issued 20 times back to back, which
splits the gap between kernels and wall time into the host's dispatch and wait and the device's idle time.
Before building anything the GPU memory (weights + cache + a rough activation estimate) is checked against the
device and configurations that do not fit are refused with a message (status "refused").

Output: one JSON record per configuration (command line, git revision, device, jax version, shapes,
dtype, warm-up and repeat counts, medians, compile times, roofline) in
experiments/results/bench_<stamp>_<backend>.json plus a markdown table (.md); both are rewritten after every
configuration (a run cut short keeps what it finished) and copied to $OUT when that is set.

Forced balance: the model runs with `make_runtime(cfg, mesh_or_None, forced_balance=True)` (model/runtime.py),
whose expert functions replace the router's ids and then run the configured expert implementation
(`cfg.moe_impl`, on each shard of a mesh too).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from . import compile_cache
from .bench_floor import DEEPINFER_ACCEPTED, roofline_of
from .bench_caches import filled_cache, real_prefill, synthetic, to_device
from .bench_memory import device_capacity, estimate_memory, memory_message
from .bench_cli import MODES, PHASES, STEPS, choice_list, defaults, parse_args
from .bench_report import command_line, copy_to_out, environment, markdown, write_results
from .progress import Progress


warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

PIPELINED_CALLS = 20    # steps issued back to back to split the gap (pipelined_gap)
DISPATCH_CALLS = 5      # synchronous calls whose return is timed (pipelined_gap)
TRACED_STEPS = 2        # steps under jax.profiler (trace_steps)
LOOP_CALLS = 3          # calls of the device loop, the first untimed (looped_steps)


# ----------------------------------------------------------------------------------------------- the points

@dataclasses.dataclass(frozen=True)
class Point:
    """One configuration: phase, mode and shapes (batch = global sequences)."""

    phase: str
    mode: str
    batch: int
    context: int
    new_tokens: int = 4096  # prefill rows per sequence (decode: ignored, 1 + num_draft rows)
    num_draft: int = 3
    step: str = ""  # decode: "verify" | "spec" ("" = the mode's default)
    replay: bool = False  # [V4.1] decoder-side bounded replay in prefill
    mesh: tuple = (1, 1, 1)

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.step not in ("",) + STEPS:
            raise ValueError(f"step must be one of {STEPS}, got {self.step!r}")
        if self.batch < 1 or self.context < 0 or self.new_tokens < 1 or self.num_draft < 0:
            raise ValueError(f"need batch >= 1, context >= 0, new_tokens >= 1, num_draft >= 0: {self}")

    @property
    def kind(self) -> str:
        """The timed step: "prefill", "verify" or "spec"."""
        if self.phase == "prefill":
            return "prefill"
        if self.step:
            return self.step
        return "verify" if self.mode == "deepinfer" else "spec"

    @property
    def rows(self) -> int:
        """New rows per sequence in the timed step."""
        return self.new_tokens if self.phase == "prefill" else 1 + self.num_draft

    def label(self) -> str:
        m = "x".join(str(x) for x in self.mesh)
        extra = f" new={self.new_tokens}" if self.phase == "prefill" else f" k={self.num_draft} {self.kind}"
        return (f"{self.phase} {self.mode} b={self.batch} ctx={self.context}{extra}"
                f"{' replay' if self.replay else ''} mesh={m}")

    def key(self) -> dict:
        d = dataclasses.asdict(self)
        d["step"] = self.kind
        d["mesh"] = list(self.mesh)
        if self.phase == "prefill":
            d["num_draft"] = 0
        else:
            d["new_tokens"] = 1 + self.num_draft
        return d


# ----------------------------------------------------------------------------------------------- config

def resolve_config(preset: str, layers: int | None = None, moe_impl: str | None = None,
                   attention_impl: str | None = None, expert_weights: str | None = None,
                   dense_weights: str | None = None, engram_vocab: int | None = None,
                   head_dtype: str | None = None, index_key_format: str | None = None, *,
                   dense_impl: str | None = None, mhc_impl: str | None = None, quant_sim: bool = False,
                   scan_layers: bool = False):
    """A preset, scaled to `layers`, with the kernels and weight formats asked for. [V4.1] `engram_vocab`
    replaces the Engram hash vocabulary (the tables' rows follow from it: v41-flash's 16M gives 2 x 197 GB
    of bf16 tables); a token reads the same number of rows whatever the vocabulary, so a small one keeps the
    step's bytes and lets V4.1 widths run on one GPU. `head_dtype` / `index_key_format` / `dense_impl` /
    `mhc_impl` / `quant_sim` (the official numerics: act_quant'd FP8 GEMM inputs, KV fake-quant): the ModelConfig fields;
    `scan_layers`: run repeated layer groups as scanned bodies (ModelConfig.scan_layers)."""
    from model import ModelConfig

    from .layer_scaling import scale_layers

    cfg = ModelConfig.preset(preset)
    if layers:
        cfg = scale_layers(cfg, layers)
    changes = {k: v for k, v in (("moe_impl", moe_impl), ("attention_impl", attention_impl),
                                 ("expert_weights", expert_weights), ("dense_weights", dense_weights),
                                 ("head_dtype", head_dtype), ("index_key_format", index_key_format),
                                 ("dense_impl", dense_impl), ("mhc_impl", mhc_impl), ("quant_sim", quant_sim)) if v}
    if scan_layers:
        changes["scan_layers"] = True
    if engram_vocab:
        if not cfg.engram_layer_ids:
            raise ValueError(f"--engram-vocab: {cfg.name} has no Engram layers")
        changes.update(engram_vocab_size=int(engram_vocab), engram_num_embeddings=())
    return cfg.replace(**changes) if changes else cfg


def invariance_variants(cfg, which: str) -> list:
    """The configurations `--batch-invariant` asks for: "off" cfg as given, "on" its batch-invariant mode (which
    runs the reference implementations but the MoE, mHC and attention kernels (the Triton attention kernel for a
    forced Mosaic GPU one) and the FP8 linears without quant_sim: ModelConfig.batch_invariant), "both" the two,
    fast mode first."""
    if which == "off":
        return [cfg]
    invariant = cfg.replace(batch_invariant=True,
                            attention_impl="pallas" if cfg.attention_impl == "mgpu" else cfg.attention_impl,
                            dense_impl="reference" if cfg.quant_sim else cfg.dense_impl)
    return {"on": [invariant], "both": [cfg, invariant]}[which]


def spec_kind(cfg) -> str:
    return "mtp" if cfg.generation == "v4" else "dspark"


def cache_len(cfg, p: Point, warmup: int, repeats: int, tail: int, extra: int = 0) -> tuple[int, int]:
    """(max_len of the cache rounded up to 64 and capped at the model's context, positions the run needs);
    `extra`: steps run after the timed ones (`extra_steps`)."""
    if p.phase == "prefill":
        need = p.context + p.new_tokens
    elif p.kind == "verify":
        need = p.context + (warmup + repeats + extra) * p.num_draft + p.rows
    else:
        need = p.context + (warmup + repeats + 1) * p.rows
    return int(min(-(-need // 64) * 64, cfg.max_position_embeddings)), need


def extra_steps(kernel_steps: int, traced: bool, loop_steps: int) -> int:
    """Verify steps a point runs after its timed ones: under CUPTI with the back-to-back split
    (`kernel_profile`), traced (`trace_steps`) and looped (`looped_steps`); each advances the cache."""
    profiled = kernel_steps + PIPELINED_CALLS + DISPATCH_CALLS if kernel_steps else 0
    return profiled + TRACED_STEPS * traced + LOOP_CALLS * loop_steps


# ----------------------------------------------------------------------------------------------- routing


def set_routing(model, forced: bool, mesh):
    """Forced balance or the router's choices, on one device or a mesh -> (the model with that runtime,
    a description for the record)."""
    from model.runtime import make_runtime

    model = model.with_runtime(make_runtime(model.config, mesh, forced_balance=forced))
    how = "forced-balance" if forced else "router"
    if mesh is None:
        return model, f"{how} ({model.config.moe_impl} experts, one device)"
    return model, f"{how} (expert parallel, {model.config.moe_impl} experts per shard)"


# ----------------------------------------------------------------------------------------------- model

@dataclasses.dataclass
class Setup:
    """A model on a mesh (or one device) and the run's settings, shared by many points."""

    cfg: Any
    preset: str
    dtype: str
    mesh_shape: tuple
    mesh: Any
    model: Any
    init_s: float
    seed: int = 0
    warmup: int = 3
    repeats_prefill: int = 10
    repeats_decode: int = 60
    real_prefill: bool = False
    kernel_steps: int = 0  # > 0: that many extra steps under CUPTI, attributed per component (kernel_profile)
    trace_dir: str | None = None  # two more steps under jax.profiler, a timeline per configuration (trace_steps)
    loop_steps: int = 0   # > 0: verify steps that many at a time in one device loop (looped_steps)
    assumed_accepted: float = DEEPINFER_ACCEPTED
    checkpoint: str | None = None
    progress: Progress = dataclasses.field(default_factory=Progress)
    # compiled step programs by what makes them one program (`program_key`): points that share one compile once
    programs: dict = dataclasses.field(default_factory=dict)

    def context(self):
        import contextlib

        import jax

        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)


def make_mesh(mesh_shape: tuple):
    """None for (1, 1, 1) (the single-device path), else a (dp, ep, tp) mesh over the first devices."""
    import jax

    if tuple(mesh_shape) == (1, 1, 1):
        return None
    from sharding import ParallelConfig

    n = int(np.prod(mesh_shape))
    if n > jax.device_count():
        raise ValueError(f"mesh {mesh_shape} needs {n} devices, {jax.device_count()} visible")
    return ParallelConfig(*mesh_shape).make_mesh(jax.devices()[:n])


def build(cfg, preset: str, dtype: str, mesh_shape=(1, 1, 1), seed: int = 0, checkpoint: str | None = None,
          progress: Progress | None = None, **settings) -> Setup:
    """Random weights (or a `save_orbax` checkpoint) laid out on the mesh."""
    import jax

    from model import init_random

    progress = progress or Progress()
    mesh = make_mesh(mesh_shape)
    t0 = time.perf_counter()
    if checkpoint:
        from model.checkpoint import restore_orbax

        model = restore_orbax(checkpoint, cfg, dtype)  # built from `cfg`: the requested kernels apply
        if mesh is not None:
            from model.sharded import shard_model

            model = shard_model(model, mesh)
    else:
        progress.log(f"initialising {cfg.name} ({dtype}, random weights, seed {seed}) on mesh "
                     f"{'x'.join(map(str, mesh_shape))}")
        model = init_random(cfg, seed=seed, dtype=dtype, mesh=mesh)
    jax.block_until_ready(jax.tree.leaves(_state(model)))
    init_s = time.perf_counter() - t0
    progress.log(f"model ready in {init_s:.1f} s")
    return Setup(cfg=cfg, preset=preset, dtype=dtype, mesh_shape=tuple(mesh_shape), mesh=mesh, model=model,
                 init_s=init_s, seed=seed, checkpoint=checkpoint, progress=progress, **settings)


def _state(model):
    from flax import nnx

    return nnx.state(model)


# ----------------------------------------------------------------------------------------------- step functions

def step_functions(setup: Setup, p: Point):
    """Pure jitted functions over the model state's leaves (nnx.split and flatten once: a call flattens a flat
    list, where an nnx.State costs ~1 us a leaf on the host, on the critical path of a synchronous step)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sampling.speculative import SpecParams, default_cost, prefill_and_propose, spec_step

    cfg = setup.cfg
    graphdef, tree = nnx.split(setup.model)
    state, treedef = jax.tree.flatten(tree)

    def merged(leaves):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    replay_tail = cfg.sliding_window if p.replay else None
    k = p.num_draft

    def prefill_fn(state, cache, tokens):
        model = merged(state)
        start = cache.lengths
        n_new = jnp.full(start.shape, tokens.shape[1], jnp.int32)
        logits, cache, _ = model.step(tokens, cache, n_new, last_only=True, replay_tail=replay_tail)
        return _greedy(logits[:, 0]), cache.replace(lengths=start)

    def verify_fn(state, cache, tokens):
        model = merged(state)
        start = cache.lengths
        n_new = jnp.full(start.shape, tokens.shape[1], jnp.int32)
        logits, cache, _ = model.step(tokens, cache, n_new)
        return _greedy(logits), cache.rollback(start + k)  # greedy verification: the argmax of every row

    def loop_fn(state, cache, tokens, n):
        """n verify steps in one device loop, each step's greedy ids the next one's tokens; n is traced, so the
        loop's condition is data, as in the sampling loop (sampling/generate.py)."""
        def body(carry):
            i, cache, tokens = carry
            (ids, _), cache = verify_fn(state, cache, tokens)
            return i + 1, cache, ids
        _, cache, tokens = jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), cache, tokens))
        return tokens, cache

    sp = SpecParams(spec_kind(cfg), k, "fixed", default_cost(k), 0.0, 0, 1.0, replay_tail)

    def first_fn(state, cache, dc, tokens, lengths, key):
        model = merged(state)
        cache, dc, first, proposal = prefill_and_propose(model, cache, dc, tokens, lengths, key, sp)
        return cache, dc, first, proposal

    def spec_fn(state, cache, dc, pending, proposal, key):
        model = merged(state)
        cache, dc, _, a, n_verify, nxt, proposal = spec_step(model, cache, dc, pending, proposal, key, sp)
        return cache, dc, nxt, proposal, a, n_verify

    return state, {
        "prefill": jax.jit(prefill_fn, donate_argnums=1),
        "verify": jax.jit(verify_fn, donate_argnums=1),
        "loop": jax.jit(loop_fn, donate_argnums=1),
        "first": jax.jit(first_fn, donate_argnums=(1, 2)),
        "spec": jax.jit(spec_fn, donate_argnums=(1, 2)),
    }, sp


def _greedy(logits):
    """(argmax ids, all maxima finite): the max comes with the argmax's reduction, so checking costs ~nothing."""
    import jax.numpy as jnp

    return jnp.argmax(logits, -1).astype(jnp.int32), jnp.all(jnp.isfinite(jnp.max(logits, -1)))


def compile_timed(fn, *args) -> tuple[Any, float]:
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def program_key(setup: Setup, p: Point, kind: str, args: tuple) -> tuple | None:
    """What makes a step program of `setup`'s model one program: the step function (kind, replay, drafts), the
    model's graph (config, runtime: mesh and routing) and the arguments' structure, shapes, dtypes and
    layouts. None where the graph holds an unhashable static value (then nothing is shared)."""
    from flax import nnx

    import jax

    leaves, treedef = jax.tree_util.tree_flatten(args)
    avals = tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in leaves)
    key = (kind, p.replay, p.num_draft, nnx.graphdef(setup.model), treedef, avals)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def compile_step_program(setup: Setup, p: Point, kind: str, fn, *args) -> tuple[Any, float, str]:
    """The compiled program of step function `fn` on `args`, compiled once per `program_key` in a setup ->
    (compiled, compile seconds, how: "reused" (another point compiled it), or the persistent cache's "hit" /
    "miss" / "off")."""
    from .compile_cache import CacheEvents

    key = program_key(setup, p, kind, args)
    if key is not None and key in setup.programs:
        return setup.programs[key], 0.0, "reused"
    with CacheEvents() as events:
        compiled, seconds = compile_timed(fn, *args)
    if key is not None:
        setup.programs[key] = compiled
    return compiled, seconds, events.status


def summary_ms(times_s: list[float]) -> dict:
    ms = sorted(t * 1e3 for t in times_s)
    q = lambda f: float(np.percentile(ms, f))  # noqa: E731
    return {"median": statistics.median(ms), "mean": statistics.fmean(ms), "min": ms[0], "max": ms[-1],
            "p10": q(10), "p90": q(90), "n": len(ms)}


# ----------------------------------------------------------------------------------------------- one point

def run_point(setup: Setup, p: Point, check_memory: bool = True) -> dict:
    """Measure one configuration. -> a JSON-ready record (status "ok", "refused", "skipped" or "error")."""
    cfg = setup.cfg
    rec: dict[str, Any] = {
        "bench": "bench", "key": p.key(), "preset": setup.preset, "config": cfg.name, "generation": cfg.generation,
        "layers": cfg.num_layers, "scan_layers": cfg.scan_layers, "dtype": setup.dtype,
        "batch_invariant": cfg.batch_invariant, "moe_impl": cfg.moe_impl, "expert_weights": cfg.expert_weights,
        "dense_weights": cfg.dense_weights, "dense_impl": cfg.dense_impl, "mhc_impl": cfg.mhc_impl,
        "quant_sim": cfg.quant_sim,
        "head_dtype": cfg.head_dtype, "index_key_format": cfg.index_key_format,
        "engram_vocab_size": cfg.engram_vocab_size or None,
        "attention_impl": cfg.attention_impl, "mode": p.mode, "phase": p.phase, "step": p.kind,
        "mesh": {"dp": p.mesh[0], "ep": p.mesh[1], "tp": p.mesh[2]}, "devices": int(np.prod(p.mesh)),
        "batch": p.batch, "context": p.context, "new_tokens": p.rows, "num_draft": p.num_draft if
        p.phase == "decode" else 0, "replay": p.replay, "seed": setup.seed, "checkpoint": setup.checkpoint,
        "context_fill": "real-prefill" if setup.real_prefill else "synthetic",
        "prefix": "forked" if p.mode == "deepinfer" else "distinct",
        "warmup": setup.warmup,
        "repeats": setup.repeats_prefill if p.phase == "prefill" else setup.repeats_decode,
        "init_s": round(setup.init_s, 3), "status": "ok", "notes": [],
    }
    if tuple(p.mesh) != setup.mesh_shape:
        raise ValueError(f"point mesh {p.mesh} != the model's mesh {setup.mesh_shape}")
    why = skip_reason(cfg, p)
    if why:
        rec.update(status="skipped", reason=why)
        return rec
    dp, ep, _ = p.mesh
    if p.batch % (dp * ep):
        rec.update(status="skipped", reason=f"batch {p.batch} is not a multiple of dp*ep = {dp * ep}")
        return rec
    tail = prompt_tail(p)
    max_len, need = cache_len(cfg, p, setup.warmup, rec["repeats"], tail,
                              extra_steps(setup.kernel_steps, bool(setup.trace_dir), setup.loop_steps))
    if need > cfg.max_position_embeddings:
        rec.update(status="refused", reason=f"the run needs {need} positions > the model's context "
                   f"{cfg.max_position_embeddings}")
        return rec
    capacity, where = device_capacity()
    mem = estimate_memory(cfg, setup.dtype, p, max_len, capacity)
    rec["memory_estimate"] = mem
    if check_memory and not mem["fits"]:
        rec.update(status="refused", reason=memory_message(mem, where))
        setup.progress.log(f"REFUSED {p.label()}: {rec['reason']}")
        return rec
    try:
        with setup.context():
            rec.update(_measure(setup, p, max_len, tail, rec["repeats"]))
    except Exception as e:  # noqa: BLE001 - one failed point must not end a sweep
        import traceback

        traceback.print_exc()
        rec.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}")
        return rec
    if not rec.get("finite_outputs", True):
        rec["notes"].append("NON-FINITE logits in the timed step (NaN/inf): the timing is suspect")
    rec["roofline"], rec["roofline_fraction"], extra = roofline_of(cfg, setup.dtype, p, rec)
    rec.update(extra)
    if rec["repeats"] < 10:
        rec["notes"].append("fewer than 10 timed repeats (BENCHMARKS.md 5 asks for >= 10)")
    if setup.dtype != "bfloat16":
        rec["notes"].append(f"weights and KV are {setup.dtype}; the roofline counts bf16 bytes")
    if not rec["notes"]:
        del rec["notes"]
    return rec


def prompt_tail(p: Point) -> int:
    """Speculative decoding starts from a short real prompt tail (its prefill gives the first proposal)."""
    return max(1, min(16, p.context)) if p.kind == "spec" else 0


def skip_reason(cfg, p: Point) -> str | None:
    if p.replay and cfg.generation != "v41":
        return "bounded replay is a V4.1 mechanism (needs KV-source layers)"
    if p.replay and p.phase == "decode":
        return "bounded replay changes prefill only; decode steps are unaffected"
    if p.phase == "decode" and p.num_draft < 1 and p.kind == "spec":
        return "speculative decoding needs num_draft >= 1"
    if p.kind == "spec":
        if p.context < 1:
            return "speculative decoding needs a context of at least one position"
        if not cfg.num_mtp_layers:
            return f"{cfg.name} has no drafter"
        if cfg.generation == "v41" and p.num_draft > cfg.dspark_block_size:
            return f"num_draft {p.num_draft} > DSpark block size {cfg.dspark_block_size}"
    return None


def _measure(setup: Setup, p: Point, max_len: int, tail: int, repeats: int) -> dict:
    import jax

    from model.draft import allocate_draft

    cfg, prog = setup.cfg, setup.progress
    forced = p.mode == "deepinfer"
    setup.model, routing = set_routing(setup.model, forced, setup.mesh)
    state, fns, sp = step_functions(setup, p)
    rng = np.random.default_rng(setup.seed + 7919 * p.batch + p.context)
    spec_room = max(8, p.num_draft + 2)
    out: dict[str, Any] = {"routing": routing, "cache_max_len": max_len}
    label = p.label()
    prog.log(f"{label}: filling the cache ({'real prefill' if setup.real_prefill else 'synthetic'} context, "
             f"{'forked' if forced else 'distinct'} prefix)")
    t0 = time.perf_counter()
    cache = filled_cache(setup, p, max_len, spec_room, p.context - tail, forced, rng)
    jax.block_until_ready(cache)
    out["fill_s"] = round(time.perf_counter() - t0, 3)

    def tokens(shape):
        return to_device(setup, rng.integers(0, cfg.vocab_size, shape).astype(np.int32))

    times: list[float] = []
    if p.kind in ("prefill", "verify"):
        sets = [tokens((p.batch, p.rows)) for _ in range(2)]
        fn, compile_s, how = compile_step_program(setup, p, p.kind, fns[p.kind], state, cache, sets[0])
        prog.log(f"{label}: compiled in {compile_s:.1f} s ({how})")
        out["compile_s"] = {p.kind: round(compile_s, 3)}
        out["compile_cache"] = {p.kind: how}
        total = setup.warmup + repeats
        for i in range(total):
            t0 = time.perf_counter()
            res, cache = fn(state, cache, sets[i % 2])
            jax.block_until_ready((res, cache))
            dt_ = time.perf_counter() - t0
            if i == 0:
                out["first_run_s"] = round(dt_, 4)
            if i >= setup.warmup:
                times.append(dt_)
            prog.update(label, i + 1, total, [t * 1e3 for t in times])
        out["finite_outputs"] = bool(res[1])
        if setup.trace_dir:
            where = Path(setup.trace_dir) / re.sub(r"[^\w.-]+", "_", label)
            out["trace_dir"], cache = trace_steps(fn, state, cache, sets, where)
        if setup.loop_steps and p.kind == "verify":
            out["looped"], cache = looped_steps(setup, fns["loop"], state, cache, sets[0])
        if setup.kernel_steps:
            out["profile"], cache = kernel_profile(fn, state, cache, sets, setup.kernel_steps,
                                                   statistics.median(times) * 1e3, int(np.prod(p.mesh)))
    else:  # the whole speculative iteration
        dc = allocate_draft(setup.model, p.batch, max_len, spec_room)
        dc_shardings = None
        if setup.mesh is not None:
            from model.sharded import cache_shardings

            dc_shardings = cache_shardings(jax.eval_shape(lambda: dc), setup.mesh)
        dc = synthetic(lambda: dc, dc_shardings, int(rng.integers(1 << 30)), forced, cfg.vocab_size, 0)
        tail_tok = rng.integers(0, cfg.vocab_size, (1 if forced else p.batch, tail)).astype(np.int32)
        tail_tok = to_device(setup, np.repeat(tail_tok, p.batch, 0) if forced else tail_tok)
        tail_len = to_device(setup, np.full((p.batch,), tail, np.int32))
        key = jax.random.PRNGKey(setup.seed)
        first, c_first, how_first = compile_step_program(setup, p, "first", fns["first"], state, cache, dc, tail_tok,
                                                         tail_len, key)
        cache, dc, pending, proposal = first(state, cache, dc, tail_tok, tail_len, key)
        spec, c_spec, how_spec = compile_step_program(setup, p, "spec", fns["spec"], state, cache, dc, pending,
                                                      proposal, key)
        prog.log(f"{label}: compiled in {c_first + c_spec:.1f} s (prompt tail + first proposal {c_first:.1f} s, "
                 f"{how_first}; speculative step {c_spec:.1f} s, {how_spec})")
        out["compile_s"] = {"prefill_and_propose": round(c_first, 3), "spec": round(c_spec, 3)}
        out["compile_cache"] = {"prefill_and_propose": how_first, "spec": how_spec}
        total = setup.warmup + repeats
        accepted, verified = [], []
        for i in range(total):
            key_i = jax.random.fold_in(key, i + 1)
            t0 = time.perf_counter()
            cache, dc, pending, proposal, a, n_verify = spec(state, cache, dc, pending, proposal, key_i)
            jax.block_until_ready((cache, dc, pending, proposal, a))
            dt_ = time.perf_counter() - t0
            if i == 0:
                out["first_run_s"] = round(dt_, 4)
            if i >= setup.warmup:
                times.append(dt_)
                accepted.append(np.asarray(a))
                verified.append(np.asarray(n_verify))
            prog.update(label, i + 1, total, [t * 1e3 for t in times])
        acc = np.stack(accepted)  # [steps, B]
        ver = np.stack(verified)
        per_pos = [(float((acc > j).sum()), float((ver > j).sum())) for j in range(p.num_draft)]
        out["acceptance"] = {
            "mean_accepted_length": float(np.mean(1 + acc)),
            "acceptance_per_position": [a_ / max(v, 1) for a_, v in per_pos],
            "tokens_per_step_per_sequence": [float(x) for x in np.mean(1 + acc, axis=1)],
            "drafter": sp.kind, "greedy": True,
        }
        out["finite_outputs"] = bool(np.all((np.asarray(pending) >= 0) & (np.asarray(pending) < cfg.vocab_size)))
    out["step_ms"] = summary_ms(times)
    out["step_times_ms"] = [round(t * 1e3, 4) for t in times]
    del cache
    return out


def kernel_profile(fn, state, cache, sets: list, steps: int, wall_ms: float, devices: int) -> tuple[dict, Any]:
    """`steps` more calls of a compiled prefill / verify step under CUPTI, the cache threaded as in the timing
    loop -> (experiments.step_profile's breakdown: per component and kernel kind, the host / launch gap against
    the wall-clock median `wall_ms`, the kernels ranked, per device of the step's `devices`; or {error}, cache)."""
    from .step_profile import profile_step

    box = {"cache": cache, "i": 0}

    def run_once():
        res, box["cache"] = fn(state, box["cache"], sets[box["i"] % 2])
        box["i"] += 1
        return res, box["cache"]

    prof = profile_step(fn.as_text(), run_once, steps, wall_ms, devices)
    if "error" not in prof:
        prof.update(pipelined_gap(run_once, prof))
    return prof, box["cache"]


def looped_steps(setup: Setup, loop, state, cache, tokens) -> tuple[dict, Any]:
    """`setup.loop_steps` verify steps per call of `loop` (one device loop), LOOP_CALLS calls, the first
    untimed -> ({steps_per_call, step_ms: the median call / steps, compile_s}, cache): a step's cost where
    the device, not the host, issues the next step."""
    import jax
    import jax.numpy as jnp

    n = jnp.int32(setup.loop_steps)
    fn, compile_s = compile_timed(loop, state, cache, tokens, n)
    calls = []
    for _ in range(LOOP_CALLS):
        t0 = time.perf_counter()
        tokens, cache = fn(state, cache, tokens, n)
        jax.block_until_ready((tokens, cache))
        calls.append(time.perf_counter() - t0)
    step_ms = statistics.median(calls[1:]) * 1e3 / setup.loop_steps
    setup.progress.log(f"  {setup.loop_steps} verify steps in one device loop: {step_ms:.3f} ms a step")
    return {"steps_per_call": setup.loop_steps, "step_ms": round(step_ms, 4), "compile_s": round(compile_s, 3),
            "calls_ms": [round(t * 1e3, 3) for t in calls]}, cache


def trace_steps(fn, state, cache, sets: list, directory: Path, steps: int = TRACED_STEPS) -> tuple[str, Any]:
    """`steps` more calls of a compiled prefill / verify step under jax.profiler, written to `directory` ->
    (the directory, cache)."""
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(directory)):
        for i in range(steps):
            res, cache = fn(state, cache, sets[i % 2])
        jax.block_until_ready((res, cache))
    return str(directory), cache


def pipelined_gap(run_once, prof: dict, calls: int = PIPELINED_CALLS) -> dict:
    """The gap split by issuing `calls` steps back to back and waiting once: per step, the host's side of a
    synchronous call (dispatch and the wait: wall - pipelined) and the device's idle time between kernels
    (pipelined - kernels), which a loop of steps on the device still pays. `dispatch_ms`: the median time a
    synchronous call takes to return (the device idle when it starts), before its wait; how much of the host's
    share is spent handing the step to the device rather than waiting for its end."""
    import time

    import jax

    dispatch = []
    for _ in range(DISPATCH_CALLS):
        t0 = time.perf_counter()
        out = run_once()
        dispatch.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(calls):
        out = run_once()
    jax.block_until_ready(out)
    ms = (time.perf_counter() - t0) * 1e3 / calls
    return {"pipelined_ms": round(ms, 4), "host_gap_ms": round(prof["wall_ms"] - ms, 4),
            "device_idle_ms": round(ms - prof["kernel_ms_per_step"], 4),
            "dispatch_ms": round(statistics.median(dispatch) * 1e3, 4)}


# ----------------------------------------------------------------------------------------------- CLI

def kernel_times_note(backend: str, steps: int) -> str | None:
    """What --kernel-times will not do on this backend (said before the run; each record keeps the reason)."""
    if steps and backend != "gpu":
        return (f"--kernel-times {steps}: per-kernel times need CUPTI on a GPU; on {backend} the steps are timed as "
                "usual and each record's profile says why it has no kernels")
    return None


def stub_record(preset: str, cfg, dtype: str, pt: Point, status: str, reason: str) -> dict:
    """The record of a configuration that did not run (refused before building the model, or out of time)."""
    return {"bench": "bench", "key": pt.key(), "preset": preset, "config": cfg.name, "layers": cfg.num_layers,
            "dtype": dtype, "batch_invariant": cfg.batch_invariant, "moe_impl": cfg.moe_impl,
            "attention_impl": cfg.attention_impl, "mode": pt.mode,
            "phase": pt.phase, "step": pt.kind, "mesh": dict(zip(("dp", "ep", "tp"), pt.mesh)), "batch": pt.batch,
            "context": pt.context, "new_tokens": pt.rows, "status": status, "reason": reason}


def main(argv=None) -> list[dict]:
    args = parse_args(argv, __doc__)
    if args.plot:  # before the run: fails at once where matplotlib is missing
        from .plots import plot_breakdown, read_records
    import jax

    compile_cache.enable(args.compile_cache)
    backend = jax.default_backend()
    d = defaults(backend, args.quick)
    preset = args.preset or d["preset"]
    dtype = args.dtype or d["dtype"]
    cfg = resolve_config(preset, args.layers, args.moe_impl or d["impl"], args.attention_impl or d["impl"],
                         args.expert_weights, args.dense_weights, args.engram_vocab, args.head_dtype,
                         args.index_keys, dense_impl=args.dense_impl, mhc_impl=args.mhc_impl or d["impl"],
                         quant_sim=args.quant_sim,
                         scan_layers=args.scan_layers)
    phases = args.phase if isinstance(args.phase, list) else choice_list(PHASES)(args.phase)
    modes = args.mode if isinstance(args.mode, list) else choice_list(MODES)(args.mode)
    batches = args.batch or d["batch"]
    prefill_batches = args.prefill_batch or batches
    contexts = args.context or [d["context"]]
    new_tokens = args.new_tokens or d["new_tokens"]
    progress = Progress(quiet=args.quiet)
    env = environment(command_line(argv))
    progress.log(f"{env['device']} x{env['device_count']} ({backend}), jax {env['jax']}; {cfg.name}, {dtype}, "
                 f"attention {cfg.attention_impl}, moe {cfg.moe_impl}, mhc {cfg.mhc_impl}")
    if note := kernel_times_note(backend, args.kernel_times):
        progress.log(note)
    # mode-major order (deepinfer decode, deepinfer prefill, realistic ...): with --time-budget the most
    # important configurations come first
    points = [Point(phase, mode, b, c, new_tokens, args.num_draft, args.step or "", args.replay, args.mesh)
              for mode in modes for phase in phases for c in contexts
              for b in (prefill_batches if phase == "prefill" else batches)]
    # refuse what cannot fit before spending minutes on the model
    capacity, where = device_capacity()
    warm = args.warmup if args.warmup is not None else d["warmup"]
    reps = {ph: args.repeats or d[f"repeats_{ph}"] for ph in PHASES}
    recs_refused = {}
    for pt in points:
        max_len, _ = cache_len(cfg, pt, warm, reps[pt.phase], prompt_tail(pt),
                               extra_steps(args.kernel_times, bool(args.trace), args.loop_steps))
        mem = estimate_memory(cfg, dtype, pt, max_len, capacity)
        if not mem["fits"] and not args.no_memory_check:
            recs_refused[pt] = memory_message(mem, where)
            progress.log(f"REFUSED {pt.label()}: {recs_refused[pt]}")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    stem = f"bench_{stamp}_{backend}{'_quick' if args.quick else ''}{'_' + args.tag if args.tag else ''}"
    recs: list[dict] = []
    for variant in invariance_variants(cfg, args.batch_invariant):
        setup = None
        if len(recs_refused) < len(points):
            setup = build(variant, preset, dtype, args.mesh, args.seed, args.checkpoint, progress, warmup=warm,
                          repeats_prefill=reps["prefill"], repeats_decode=reps["decode"],
                          real_prefill=args.real_prefill, kernel_steps=args.kernel_times, trace_dir=args.trace,
                          loop_steps=args.loop_steps)
        for i, pt in enumerate(points):
            progress.log(f"[{i + 1}/{len(points)}] {pt.label()}{' batch-invariant' * variant.batch_invariant}")
            if args.time_budget and time.perf_counter() - progress.t0 > args.time_budget and pt not in recs_refused:
                rec = stub_record(preset, variant, dtype, pt, "skipped",
                                  f"--time-budget {args.time_budget:g} s spent")
            elif pt in recs_refused:
                rec = stub_record(preset, variant, dtype, pt, "refused", recs_refused[pt])
            else:
                rec = run_point(setup, pt, check_memory=not args.no_memory_check)
            recs.append(rec)
            if rec["status"] == "ok":
                progress.log(f"  {rec['step_ms']['median']:.3f} ms/step, {rec['tokens_per_s']:,.0f} tokens/s, "
                             f"{100 * rec['roofline_fraction']:.1f}% of the roofline "
                             f"(floor {rec['roofline']['floor_ms']:.3f} ms)")
            elif rec["status"] != "refused":
                progress.log(f"  {rec['status']}: {rec.get('reason')}")
            paths = write_results(env, recs, stem, Path(args.out) if args.out else None)
    md = markdown(env, recs)
    print(md)
    if recs:
        print(f"wrote {paths[0]} and {paths[1].name}")
    if args.plot and recs:
        written = read_records(paths[0])
        if not written:
            raise SystemExit(f"--plot: no record with status ok in {paths[0]}")
        plot_breakdown(written, paths[0].with_suffix(".png"), title=paths[0].name)
        copy_to_out([paths[0].with_suffix(".png")])
        print(f"wrote {paths[0].with_suffix('.png').name}")
    return recs


if __name__ == "__main__":
    main()
