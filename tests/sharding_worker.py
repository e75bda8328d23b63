"""Subprocess side of tests/test_sharding.py: runs with simulated CPU devices (the device count must
be set before jax is imported, so the pytest process, which has one device, launches this).

    python tests/sharding_worker.py meshes OUT.json            # 8 devices: MESHES x EP variants
    python tests/sharding_worker.py meshes-extra OUT.json      # 8 devices: EXTRA_MESHES (slow)
    python tests/sharding_worker.py generations OUT.json       # 8 devices: greedy generate on every mesh
    python tests/sharding_worker.py multihost OUT PORT PID CKPT  # one of 2 processes x 4 devices
    python tests/sharding_worker.py fp8 OUT.json                # 8 devices: FP8-resident dense weights
    python tests/sharding_worker.py engram OUT.json             # 8 devices: Engram table placements (and
                                                                # engram-full, slow: every mesh and output)

Results go to OUT as JSON (or .npy logits) for the test to check; this file asserts nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (dp, ep, tp) meshes of the CI run ("meshes"): one per distinct sharding path. dp only: experts whole on every
# device (ep and tp drop out of every spec); ep only: dp drops out, one expert per shard; dp x ep: the batch
# and caches over both axes (the mesh every EP variant, born-sharded build and Pallas case below also runs on,
# and generate's prefill / decode strategies); the tp mesh: heads, output groups and the experts' width split.
# V4.1's own layers (Engram, Reuse, candidate source, Reindex) hold arrays that the tables lay out as V4's
# (replicated, or batch over dp x ep): they run on dp x ep, with and without the Pallas attention kernels.
MESHES = {"tiny-v4": [(2, 4, 1), (1, 8, 1), (8, 1, 1), (2, 2, 2)], "tiny-v41": [(2, 4, 1)]}
# The same paths at the other sizes of the acceptance list (`slow`, mode "meshes-extra"): dp=4 x ep=2 is dp x ep
# with two experts per shard instead of four; V4.1 on ep=8 is V4's ep-only path with V4.1's layers.
EXTRA_MESHES = {"tiny-v4": [(4, 2, 1)], "tiny-v41": [(1, 8, 1)]}


# ----------------------------------------------------------------------------- the parent side (pytest)

class Run:
    """One worker subprocess: `python tests/sharding_worker.py MODE DIR/results.json`, its output in
    DIR/results.log (a file, not a pipe: a run started ahead of its test has no reader until the test waits).
    With `after`, the subprocess starts only once that run has ended (a thread waits for it), so that queued runs
    share one CPU core instead of taking the test process's."""

    def __init__(self, mode: str, directory: Path, after: Run | None = None):
        self.mode = mode
        self.out = Path(directory) / "results.json"
        self.log = self.out.with_suffix(".log")
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        self._started = threading.Event()   # set once the subprocess started (or will never start)
        if after is None:
            self._start()
        else:
            threading.Thread(target=self._start_after, args=(after,), daemon=True).start()

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        with self._lock:
            if not self._cancelled:
                with open(self.log, "w") as log:
                    self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), self.mode,
                                                  str(self.out)], env=env, stdout=log, stderr=subprocess.STDOUT)
            self._started.set()

    def _start_after(self, run: Run) -> None:
        run._started.wait()
        if run.proc is not None:
            run.proc.wait()
        self._start()

    def wait(self, timeout: float) -> int:
        """The exit status (killed and re-raised on a timeout; the time a queued run waits to start counts)."""
        deadline = time.monotonic() + timeout
        if not self._started.wait(timeout):
            self.cancel()
            raise subprocess.TimeoutExpired(f"sharding_worker {self.mode} (queued)", timeout)
        if self.proc is None:
            raise RuntimeError(f"sharding_worker {self.mode} was cancelled before it started")
        try:
            return self.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def cancel(self) -> None:
        """Kill the subprocess, or keep a queued one from starting."""
        with self._lock:
            self._cancelled = True
            self._started.set()
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else "(no log: the run never started)"


STARTED: dict[str, Run] = {}   # mode -> the run started at collection (start_early), until a test takes it
_EARLY_DIRS: list[tempfile.TemporaryDirectory] = []


def start_early(modes: list[str]) -> None:
    """Start the runs of `modes` now, before the tests that need them (tests/conftest.py: at the end of collection,
    in the order their tests come), one after another: the worker compiles in its own process, on the CPU core that
    the test process (one compile at a time) mostly leaves idle, and each test takes its results from STARTED."""
    previous = None
    for mode in modes:
        _EARLY_DIRS.append(tempfile.TemporaryDirectory(prefix=f"sharding_worker_{mode}_"))
        previous = STARTED[mode] = Run(mode, Path(_EARLY_DIRS[-1].name), after=previous)


def stop_early() -> None:
    """End of the test run: kill the runs no test took (a -x stop, a deselection), keep queued ones from starting,
    and remove their files."""
    for run in reversed(list(STARTED.values())):
        run.cancel()
    STARTED.clear()
    while _EARLY_DIRS:
        _EARLY_DIRS.pop().cleanup()


# ----------------------------------------------------------------------------- the worker side

def rel_err(a, b) -> float:
    from common import rel_err as shared  # tests/common.py (imports jax: only once the worker has set it up)

    return shared(a, b)


def small_config(preset: str):
    from common import small_config as shared  # tests/common.py (imports jax: as rel_err above)

    return shared(preset)


def inputs(cfg):
    import numpy as np

    rng = np.random.default_rng(11)
    tokens = rng.integers(3, cfg.vocab_size - 2, (8, 12))
    prompts = [rng.integers(3, cfg.vocab_size - 2, n).tolist() for n in (5, 9, 3, 12, 7, 4, 10, 6)]
    return tokens, prompts


def run_meshes(out_path: str, mode: str = "meshes") -> None:
    """"meshes": logits on MESHES and every EP variant (both generations), greedy generation on dp=2 x ep=4
    (V4); "meshes-extra": logits on EXTRA_MESHES; "generations": greedy generation on dp=8, dp=2 x ep=4 and
    ep=8 for both generations instead (slow)."""
    import jax
    import numpy as np

    from model import init_random, load_checkpoint, shard_model
    from model.checkpoint import save_safetensors
    from sampling import generate
    from sharding import EPConfig, ParallelConfig, rebalance, shard_batch, to_host

    assert jax.device_count() == 8, jax.devices()
    full = mode == "generations"
    results: dict = {"cases": [], "timings": {}}
    new_tokens = 4

    def forward(model, mesh, tokens):
        with jax.set_mesh(mesh):
            return to_host(model(shard_batch(tokens, mesh)))

    for preset in ("tiny-v4", "tiny-v41"):
        t0 = time.perf_counter()
        cfg = small_config(preset)
        model = init_random(cfg, seed=0, dtype="float32")
        tokens, prompts = inputs(cfg)
        ref_logits = None if full else np.asarray(model(tokens))
        gen_here = full or (mode == "meshes" and preset == "tiny-v4")
        ref_tokens = generate(model, prompts, max_new_tokens=new_tokens).tokens if gen_here else None
        results["timings"][f"{preset} single device"] = time.perf_counter() - t0

        def case(name, mesh, model_s, logits=True, gen=False, want=None, **extra):
            t = time.perf_counter()
            rec = {"preset": preset, "case": name, "mesh": dict(mesh.shape), **extra}
            if logits:
                rec["logits_rel_err"] = rel_err(forward(model_s, mesh, tokens), ref_logits if want is None else want)
            if gen:
                out = generate(model_s, prompts, max_new_tokens=new_tokens, mesh=mesh)
                rec["tokens_equal"] = bool(np.array_equal(out.tokens, ref_tokens))
                rec["ep_record"] = out.stats["parallel"]["expert_parallel"]
            plan = model_s.runtime.expert_parallel
            rec["strategy"] = plan.describe(tokens.size)
            rec["seconds"] = time.perf_counter() - t
            results["cases"].append(rec)

        if full:
            for dp, ep, tp in [(8, 1, 1), (2, 4, 1), (1, 8, 1)]:
                mesh = ParallelConfig(dp, ep, tp).make_mesh()
                case("auto", mesh, shard_model(model, mesh), logits=False, gen=True)
            results["timings"][preset] = time.perf_counter() - t0
            continue
        for dp, ep, tp in (EXTRA_MESHES if mode == "meshes-extra" else MESHES)[preset]:
            mesh = ParallelConfig(dp, ep, tp).make_mesh()
            # default EPConfig: forward (12 tokens/device) all_to_all; generate: prefill all_to_all, decode replicate
            case("auto", mesh, shard_model(model, mesh), gen=gen_here and (dp, ep) == (2, 4))
        if mode == "meshes-extra":  # the default EPConfig only: the variants below ran in "meshes"
            results["timings"][preset] = time.perf_counter() - t0
            continue
        if preset == "tiny-v4":  # the EP variants (gather is the default above) and born-sharded models
            mesh = ParallelConfig(2, 4, 1).make_mesh()
            case("all_to_all/padded", mesh, shard_model(model, mesh, EPConfig("all_to_all", "padded")))
            case("replicate", mesh, shard_model(model, mesh, EPConfig("replicate")))
            # the Pallas grouped-GEMM kernel per shard (interpreted on CPU), dispatch and replicate
            pallas = init_random(cfg.replace(moe_impl="pallas"), seed=0, dtype="float32")
            for ep_cfg in (EPConfig("all_to_all", "padded"), EPConfig("replicate")):
                case(f"pallas {ep_cfg.strategy}", mesh, shard_model(pallas, mesh, ep_cfg), impl="pallas")
            # FP4-resident experts (packed weights and scales split over ep alike), against one device
            for impl in ("reference", "pallas"):
                fp4 = init_random(cfg.replace(expert_weights="fp4", moe_impl=impl), seed=0, dtype="float32")
                case(f"fp4 {impl}", mesh, shard_model(fp4, mesh, EPConfig("all_to_all", "padded")),
                     want=np.asarray(fp4(tokens)), impl=impl)
            # quant_sim: act_quant of the expert GEMM inputs inside each shard (gather transport)
            sim = init_random(cfg.replace(expert_weights="fp4", quant_sim=True), seed=0, dtype="float32")
            case("fp4 quant_sim", mesh, shard_model(sim, mesh), want=np.asarray(sim(tokens)))
            # Pallas attention + indexer per batch shard (sharding.BatchParallel), the 8 sequences 1 per device
            attn = init_random(cfg.replace(attention_impl="pallas"), seed=0, dtype="float32")
            case("pallas attention", mesh, shard_model(attn, mesh), want=np.asarray(attn(tokens)),
                 shards=shard_model(attn, mesh).layers[0].attn.per_shard.shards())
            # born sharded: init_random(mesh=) and load_checkpoint(mesh=) give the same numbers
            case("init_random(mesh)", mesh, init_random(cfg, seed=0, dtype="float32", mesh=mesh))
            with tempfile.TemporaryDirectory() as d:
                save_safetensors(model, d)
                case("load_checkpoint(mesh)", mesh, load_checkpoint(d, dtype="float32", mesh=mesh))
            # redundant experts + rebalancing from a skewed load: placement changes, results do not
            mesh8 = ParallelConfig(1, 8, 1).make_mesh()
            load = np.arange(1, cfg.n_routed_experts + 1) ** 2
            placement = rebalance(load, ep=8, num_redundant=8)
            case("redundant+rebalanced", mesh8, shard_model(model, mesh8, EPConfig("all_to_all", "padded"),
                                                            placements=placement),
                 slot_to_expert=list(placement.slot_to_expert))
        else:  # V4.1's candidate source and Reindex layers on the fused indexer, per batch shard
            mesh = ParallelConfig(2, 4, 1).make_mesh()
            attn = init_random(cfg.replace(attention_impl="pallas"), seed=0, dtype="float32")
            case("pallas attention", mesh, shard_model(attn, mesh), want=np.asarray(attn(tokens)),
                 shards=shard_model(attn, mesh).layers[0].attn.per_shard.shards())
        results["timings"][preset] = time.perf_counter() - t0
    Path(out_path).write_text(json.dumps(results, indent=1))


def run_prefix(out_path: str, full: bool) -> None:
    """Prefix reuse (sampling.replay.PrefixStore) on a dp=2 x ep=4 mesh against one device: the same prompts twice
    (the second time every prompt hits its stored prefix), greedy plain V4; `full` adds greedy MTP speculative (V4)
    and V4.1 plain (encoder-side replay on a hit); tokens and hits compared."""
    import jax
    import numpy as np

    from model import init_random, shard_model
    from sampling import generate
    from sampling.replay import PrefixStore
    from sharding import ParallelConfig

    assert jax.device_count() == 8, jax.devices()
    mesh = ParallelConfig(2, 4, 1).make_mesh()
    results = []
    for preset, spec in (("tiny-v4", None), ("tiny-v4", "mtp"), ("tiny-v41", None))[:3 if full else 1]:
        cfg = small_config(preset) if spec is None else small_v4()
        model = init_random(cfg, seed=0, dtype="float32")
        prompts = prefix_prompts(cfg)
        kw = dict(max_new_tokens=4, speculative=spec, num_draft=2) if spec else dict(max_new_tokens=4)
        runs = {}
        for where, m, msh in (("one device", model, None), ("mesh", shard_model(model, mesh), mesh)):
            store = PrefixStore(page_size=8)
            outs = [generate(m, prompts, prefix_store=store, mesh=msh, **kw) for _ in range(2)]
            runs[where] = ([o.tokens.tolist() for o in outs], [o.stats["prefix_hits"] for o in outs])
        results.append({"preset": preset, "speculative": spec, "tokens_equal": runs["mesh"][0] == runs["one device"][0],
                        "hits": runs["mesh"][1], "hits_one_device": runs["one device"][1]})
    Path(out_path).write_text(json.dumps(results, indent=1))


def small_v4():
    from common import small_v4 as shared  # tests/common.py (imports jax: as rel_err above)

    return shared()


def param_diff(a, b) -> dict:
    """Every parameter of two models: the largest relative difference of the floating ones (per array, to its
    max magnitude) and the fraction of differing elements of the integer / FP8 ones."""
    import numpy as np
    from flax import nnx

    fa, fb = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
    assert [p for p, _ in fa] == [p for p, _ in fb]
    worst, mismatch = 0.0, 0.0
    for (_, x), (_, y) in zip(fa, fb):
        x, y = np.asarray(x[...]), np.asarray(y[...])
        if x.dtype.kind == "f" and x.dtype.itemsize > 1:
            worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y)) / (np.max(np.abs(x)) + 1e-30)))
        else:
            mismatch = max(mismatch, float(np.mean(x.view(np.uint8) != y.view(np.uint8))))
    return {"params_max_rel_diff": worst, "params_int_mismatch": mismatch}


def run_fp8(out_path: str) -> None:
    """The release's formats (cfg.dense_weights="fp8", cfg.expert_weights="fp4"): init_random(mesh=) and
    load_checkpoint(mesh=) against one device, with the FP8 weights and their scales laid out alike (tiny-v41's
    B=32 grids also split over tp=2) and the FP4 experts' held scales ([E, in/32, out]) split as their weights'
    transposes."""
    import jax
    import numpy as np

    from model import init_random, load_checkpoint
    from model.checkpoint import save_safetensors
    from sharding import ParallelConfig, shard_batch, to_host

    assert jax.device_count() == 8, jax.devices()
    cases = []
    for preset, layouts in (("tiny-v4", [(2, 4, 1)]), ("tiny-v41", [(2, 2, 2)])):
        cfg = small_config(preset).replace(dense_weights="fp8", expert_weights="fp4")
        tokens, _ = inputs(cfg)
        one = init_random(cfg, seed=0, dtype="float32")
        want = np.asarray(one(tokens))
        with tempfile.TemporaryDirectory() as d:
            save_safetensors(one, d)
            for dp, ep, tp in layouts:
                mesh = ParallelConfig(dp, ep, tp).make_mesh()
                for how, model in (("init_random(mesh)", init_random(cfg, seed=0, dtype="float32", mesh=mesh)),
                                   ("load_checkpoint(mesh)", load_checkpoint(d, dtype="float32", mesh=mesh,
                                                                             dense_weights="fp8",
                                                                             expert_weights="fp4"))):
                    wq_b, experts = model.layers[0].attn.wq_b, model.layers[0].ffn.experts
                    with jax.set_mesh(mesh):
                        got = to_host(model(shard_batch(tokens, mesh)))
                    cases.append({"preset": preset, "case": how, "mesh": [dp, ep, tp],
                                  "logits_rel_err": rel_err(got, want), **param_diff(one, model),
                                  "weight_dtype": str(wq_b.weight[...].dtype),
                                  "weight_spec": str(wq_b.weight[...].sharding.spec),
                                  "scale_spec": str(wq_b.scale[...].sharding.spec),
                                  "expert_specs": [str(a[...].sharding.spec) for a in
                                                   (experts.w1, experts.s1, experts.w2, experts.s2)],
                                  "bytes_equal": bool(np.array_equal(np.asarray(wq_b.scale[...]),
                                                                     np.asarray(one.layers[0].attn.wq_b.scale[...])))})
    Path(out_path).write_text(json.dumps(cases, indent=1))


# ----------------------------------------------------------------------------- Engram tables ("engram")
# [V4.1] Engram tables whole on every device, split over the devices or in host memory: the same random model (two
# Engram layers, FP8 tables) with each placement and exchange against the replicated placement on the same mesh,
# bitwise: prefill logits, teacher-forced decode logits, DSpark speculative tokens and greedy tokens; what a traced
# decode step contains (host callbacks, the exchange's collectives, host gathers); born-sharded tables
# (init_random(mesh)) against one device's. "engram": the CI cases on dp=2 x ep=4; "engram-full" (slow): every mesh
# of ENGRAM_MESHES x every variant x every output.

ENGRAM_OUTPUTS = ("prefill", "decode", "speculative", "greedy")
# CI: (placement, exchange, outputs) on dp=2 x ep=4: each exchange in prefill, the all-to-all in decode, the
# speculative loop with host tables (a host gather and an all-to-all in every verify step)
ENGRAM_CASES = [("sharded", "all_to_all", ("prefill", "decode")), ("sharded", "all_gather", ("prefill",)),
                ("host", "all_to_all", ("prefill", "decode", "speculative")), ("host", "all_gather", ("prefill",))]
ENGRAM_MESHES = [(2, 4, 1), (2, 2, 2), (1, 8, 1), (8, 1, 1)]
ENGRAM_NEW_TOKENS = 5


def engram_config():
    """tiny-v41 cut to SWA + Engram, Full (r=2: the KV and index source) + Engram, SWA and one DSpark stage: two
    tables (one exchange for both) of 358 and 522 rows (padded to a multiple of the devices), held as the release
    ships them; the Engram layers at or before the KV source, as bounded replay needs."""
    from model import ModelConfig

    return ModelConfig.preset("tiny-v41").replace(
        num_layers=3, compress_ratios=(0, 2, 0, 0), kv_source_layer_ids=(1,), index_source_layer_ids=(1,),
        candidate_source_layer_id=-1, engram_layer_ids=(0, 1), engram_vocab_size=44, num_mtp_layers=1,
        dspark_target_layer_ids=(1, 2), engram_tables="fp8", name="v41-engram")


def engram_inputs(cfg):
    import numpy as np

    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size - 2, n).tolist() for n in (5, 9, 3, 12, 7, 4, 10, 6)]
    tokens = rng.integers(3, cfg.vocab_size - 2, (8, 11))
    cont = rng.integers(3, cfg.vocab_size - 2, (8, 3))
    return tokens, cont, prompts


def engram_lookups() -> list[dict]:
    """sharding.RowLookup alone against numpy gathers: two tables of three arrays each (FP8 rows, uint8 scales and a
    float32 column of another width), with 8 or 3 sequences (the batch split over dp x ep, or replicated), every
    exchange, on meshes with and without tp, in device and host memory."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from sharding import ParallelConfig
    from sharding.row_lookup import HOST_MEMORY, SPLIT, RowLookup

    rng = np.random.default_rng(12)
    out = []
    for shape, batch, host in (((2, 4, 1), 8, False), ((2, 2, 2), 8, False), ((1, 8, 1), 3, False),
                               ((2, 4, 1), 8, True), ((8, 1, 1), 3, True)):
        mesh = ParallelConfig(*shape).make_mesh()
        split = NamedSharding(mesh, P(SPLIT), memory_kind=HOST_MEMORY if host else None)
        tok = NamedSharding(mesh, P(("dp", "ep")) if batch % (shape[0] * shape[1]) == 0 else P())
        tables, ids, columns = [], [], []
        for primes in ([53, 59, 61, 67, 71, 73], [79, 83, 89, 97, 101, 103]):
            lo = np.concatenate([[0], np.cumsum(primes)[:-1]])
            rows = -(-int(np.sum(primes)) // 8) * 8
            held = (rng.integers(0, 256, (rows, 64), dtype=np.uint8).view(jnp.float8_e4m3fn),
                    rng.integers(0, 256, (rows, 2), dtype=np.uint8), rng.normal(size=(rows, 3)).astype(np.float32))
            tables.append(tuple(jax.device_put(a, split) for a in held))
            ids.append(np.stack([rng.integers(a, a + p, (batch, 5)) for a, p in zip(lo, primes)], -1))
            columns.append(tuple((int(a), int(a + p)) for a, p in zip(lo, primes)))
        for exchange in ("all_to_all", "all_gather"):
            look = RowLookup(mesh, exchange)
            got = jax.jit(lambda t, i: look(t, i, columns))(tables, [jax.device_put(jnp.asarray(i, jnp.int32), tok)
                                                                      for i in ids])
            equal = all(np.array_equal(np.asarray(g).view(np.uint8), np.asarray(a)[i].view(np.uint8))
                        for t, i, gs in zip(tables, ids, got) for a, g in zip(t, gs))
            out.append({"mesh": list(shape), "batch": batch, "host": host, "exchange": exchange, "equal": equal})
    return out


def run_engram(out_path: str, full: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from model import init_random, load_checkpoint, shard_model
    from model.checkpoint import save_safetensors
    from model.sharded import allocate_cache
    from model.transformer import decode, prefill
    from sampling import generate
    from sharding import ParallelConfig, shard_batch, to_host

    assert jax.device_count() == 8, jax.devices()
    cfg = engram_config()
    tokens, cont, prompts = engram_inputs(cfg)
    one = init_random(cfg, seed=0, dtype="float32")
    results = {"cases": [], "born_sharded": [], "timings": {}}
    ckpt = Path(out_path).with_suffix(".ckpt")
    save_safetensors(one, ckpt)

    def outputs(model, mesh, which):
        out = {}
        with jax.set_mesh(mesh):
            if "prefill" in which:
                out["prefill"] = to_host(model(shard_batch(tokens, mesh)))
            if "decode" in which:   # a prefill chunk, then one token at a time
                cache = allocate_cache(model.config, tokens.shape[0], 32, jnp.float32, mesh)
                _, cache = prefill(model, cache, shard_batch(tokens, mesh), shard_batch(np.full(8, 11), mesh))
                steps = []
                for i in range(cont.shape[1]):
                    logits, cache = decode(model, cache, shard_batch(cont[:, i], mesh))
                    steps.append(to_host(logits))
                out["decode"] = np.stack(steps, 1)
        if "speculative" in which:
            out["speculative"] = generate(model, prompts, max_new_tokens=ENGRAM_NEW_TOKENS, mesh=mesh,
                                          speculative="dspark", num_draft=2).tokens
        if "greedy" in which:
            out["greedy"] = generate(model, prompts, max_new_tokens=ENGRAM_NEW_TOKENS, mesh=mesh).tokens
        return out

    def traced_decode(model, mesh) -> str:
        graphdef, state = nnx.split(model)
        cache = allocate_cache(model.config, 8, 32, jnp.float32, mesh)

        def step(state, cache, tok):
            return nnx.merge(graphdef, state).step(tok, cache, jnp.ones((8,), jnp.int32))[:2]

        with jax.set_mesh(mesh):
            return str(jax.make_jaxpr(step)(state, cache, shard_batch(np.zeros((8, 1), np.int32), mesh)))

    def held(model):
        """Each Engram table's arrays as held, padding rows dropped, as numpy bytes."""
        return [[np.asarray(a)[:block.engram.embed.rows].view(np.uint8) for a in block.engram.embed.stored()]
                for block in model.layers if block.engram is not None]

    results["lookups"] = engram_lookups()
    meshes = ENGRAM_MESHES if full else ENGRAM_MESHES[:1]
    cases = [(p, e, ENGRAM_OUTPUTS) for p, e, _ in ENGRAM_CASES] if full else ENGRAM_CASES
    for shape in meshes:
        mesh = ParallelConfig(*shape).make_mesh()
        t0 = time.perf_counter()
        want = outputs(shard_model(one, mesh), mesh, ENGRAM_OUTPUTS if full else ENGRAM_OUTPUTS[:3])
        results["timings"][f"{shape} device"] = time.perf_counter() - t0
        for placement, exchange, which in cases:
            t0 = time.perf_counter()
            # onto the mesh from one device's model, or loaded from the checkpoint (host tables)
            if placement == "host" and exchange == "all_to_all":
                how, model = "load_checkpoint(mesh)", load_checkpoint(
                    ckpt, dtype="float32", mesh=mesh, engram_placement=placement, engram_tables="fp8")
            else:
                how = "shard_model"
                model = shard_model(init_random(cfg.replace(engram_placement=placement, engram_exchange=exchange),
                                                seed=0, dtype="float32"), mesh)
            got = outputs(model, mesh, which)
            table = model.layers[0].engram.embed.stored()[0]
            text = traced_decode(model, mesh)
            results["cases"].append({
                "mesh": list(shape), "placement": placement, "exchange": exchange, "built": how,
                "equal": {k: bool(np.array_equal(got[k], want[k])) for k in got},
                "table_memory": table.sharding.memory_kind, "table_rows": int(table.shape[0]),
                "table_shard_rows": int(table.addressable_shards[0].data.shape[0]),
                "decode_callback": "callback" in text,
                "decode_ops": sorted(op for op in ("all_to_all", "all_gather", "psum_scatter", "compute_on")
                                     if op in text)})
            results["timings"][f"{shape} {placement} {exchange}"] = time.perf_counter() - t0
        # born sharded (init_random(mesh), the tables padded inside the init programs): the tables one device holds
        for placement in ("sharded", "host"):
            born = init_random(cfg.replace(engram_placement=placement), seed=0, dtype="float32", mesh=mesh)
            rec = {"mesh": list(shape), "placement": placement,
                   "tables_equal": all(np.array_equal(a, b) for x, y in zip(held(born), held(one))
                                       for a, b in zip(x, y)),
                   "table_memory": born.layers[0].engram.embed.stored()[0].sharding.memory_kind}
            if full:   # the rest of a born-sharded model matches one device's to float32 rounding, not bitwise
                ref = init_random(cfg, seed=0, dtype="float32", mesh=mesh)
                rec["prefill_equal_born_device"] = bool(np.array_equal(outputs(born, mesh, ("prefill",))["prefill"],
                                                                      outputs(ref, mesh, ("prefill",))["prefill"]))
            results["born_sharded"].append(rec)
    Path(out_path).write_text(json.dumps(results, indent=1))


def prefix_prompts(cfg) -> list[list[int]]:
    """Eight prompts sharing a 33-40 token prefix (page size 8: every prompt hits its stored prefix the second time)."""
    import numpy as np

    rng = np.random.default_rng(5)
    shared = rng.integers(3, cfg.vocab_size - 2, 40).tolist()
    return [shared[:n] + rng.integers(3, cfg.vocab_size - 2, 3).tolist() for n in (34, 36, 33, 40, 35, 38, 37, 39)]


def run_multihost(out_prefix: str, port: str, pid: str, checkpoint: str, prefix: bool = False) -> None:
    """One of two processes: join the job, load the checkpoint onto an ep=8 mesh spanning both
    (each process reads only its own experts), run a forward (expert all-to-all across processes); `prefix`: then
    greedy generation with a PrefixStore on dp=2 x ep=4, the same prompts twice, instead."""
    from sharding import initialize_multihost

    initialize_multihost(f"localhost:{port}", 2, int(pid), timeout_s=60)
    import jax
    import numpy as np

    from model import load_checkpoint
    from sharding import ParallelConfig, local_experts, shard_batch, to_host

    assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.devices())
    if prefix:
        from sampling import generate
        from sampling.replay import PrefixStore

        mesh = ParallelConfig(dp=2, ep=4).make_mesh()
        model = load_checkpoint(checkpoint, dtype="float32", mesh=mesh)
        store = PrefixStore(page_size=8)
        outs = [generate(model, prefix_prompts(model.config), max_new_tokens=4, prefix_store=store, mesh=mesh)
                for _ in range(2)]
        Path(f"{out_prefix}.{pid}.json").write_text(json.dumps(
            {"tokens": [o.tokens.tolist() for o in outs], "hits": [o.stats["prefix_hits"] for o in outs]}))
        return
    mesh = ParallelConfig(ep=8).make_mesh()
    model = load_checkpoint(checkpoint, dtype="float32", mesh=mesh)
    tokens, _ = inputs(model.config)
    with jax.set_mesh(mesh):
        logits = to_host(model(shard_batch(tokens, mesh)))
    np.save(f"{out_prefix}.{pid}.npy", logits)
    Path(f"{out_prefix}.{pid}.json").write_text(json.dumps(
        {"local_experts": sorted(local_experts(model.config.n_routed_experts, mesh)),
         "local_devices": len(jax.local_devices())}))


if __name__ == "__main__":
    mode = sys.argv[1]
    devices = 4 if mode.startswith("multihost") else 8
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    # compile time dominates these tiny runs (3x less without XLA's optimisation passes); the
    # single-device references are computed in the same process with the same setting
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    if mode in ("meshes", "meshes-extra", "generations"):
        run_meshes(sys.argv[2], mode)
    elif mode == "fp8":
        run_fp8(sys.argv[2])
    elif mode in ("prefix", "prefix-full"):
        run_prefix(sys.argv[2], mode == "prefix-full")
    elif mode in ("engram", "engram-full"):
        run_engram(sys.argv[2], mode == "engram-full")
    else:
        run_multihost(*sys.argv[2:6], prefix=mode == "multihost-prefix")
