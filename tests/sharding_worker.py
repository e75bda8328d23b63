"""Subprocess side of tests/test_sharding.py: runs with simulated CPU devices (the device count must
be set before jax is imported, so the pytest process, which has one device, launches this).

    python tests/sharding_worker.py meshes OUT.json            # 8 devices: MESHES x EP variants
    python tests/sharding_worker.py meshes-extra OUT.json      # 8 devices: EXTRA_MESHES (slow)
    python tests/sharding_worker.py generations OUT.json       # 8 devices: greedy generate on every mesh
    python tests/sharding_worker.py multihost OUT PORT PID CKPT  # one of 2 processes x 4 devices
    python tests/sharding_worker.py fp8 OUT.json                # 8 devices: FP8-resident dense weights

Results go to OUT as JSON (or .npy logits) for the test to check; this file asserts nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
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
    DIR/results.log (a file, not a pipe: a run started ahead of its test has no reader until the test waits)."""

    def __init__(self, mode: str, directory: Path):
        self.out = Path(directory) / "results.json"
        self.log = self.out.with_suffix(".log")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), mode, str(self.out)],
                                         env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float) -> int:
        """The exit status (killed and re-raised on a timeout)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:]


STARTED: dict[str, Run] = {}   # mode -> the run started at collection (start_early), until a test takes it
_EARLY_DIRS: list[tempfile.TemporaryDirectory] = []


def start_early(mode: str) -> None:
    """Start MODE's run now, before the test that needs it (tests/conftest.py: at the end of collection): the
    worker compiles in its own process, on the CPU core that the test process (one compile at a time) mostly
    leaves idle, and the test takes its results from STARTED."""
    _EARLY_DIRS.append(tempfile.TemporaryDirectory(prefix=f"sharding_worker_{mode}_"))
    STARTED[mode] = Run(mode, Path(_EARLY_DIRS[-1].name))


def stop_early() -> None:
    """End of the session: kill the runs no test took (a -x stop, a deselection) and remove their files."""
    for run in STARTED.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
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


def run_multihost(out_prefix: str, port: str, pid: str, checkpoint: str) -> None:
    """One of two processes: join the job, load the checkpoint onto an ep=8 mesh spanning both
    (each process reads only its own experts), run a forward (expert all-to-all across processes)."""
    from sharding import initialize_multihost

    initialize_multihost(f"localhost:{port}", 2, int(pid), timeout_s=60)
    import jax
    import numpy as np

    from model import load_checkpoint
    from sharding import ParallelConfig, local_experts, shard_batch, to_host

    assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.devices())
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
    devices = 4 if mode == "multihost" else 8
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
    else:
        run_multihost(*sys.argv[2:6])
