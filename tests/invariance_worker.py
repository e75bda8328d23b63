"""Subprocess side of tests/test_batch_invariance.py's mesh checks: 8 simulated CPU devices (the device count is
fixed when jax is imported, so the pytest process launches this).

    python tests/invariance_worker.py mesh OUT.json          # dp=2 x ep=4, default strategies (V4, bf16)
    python tests/invariance_worker.py mesh-matrix OUT.json   # dp=8, ep=8, dp=2 x ep=4; every EP variant,
                                                             # redundant experts; both generations and dtypes
    python tests/invariance_worker.py mesh-speculative OUT.json  # dp=2 x ep=4: MTP (V4) and DSpark (V4.1),
                                                                 # greedy and sampled, num_draft 1 and 3
    python tests/invariance_worker.py mesh-kernels OUT.json  # as mesh, the routed experts on the MoE kernels

Each case compares a batch-invariant model on a mesh with the same model on one device (in this process):
logits of a forward, greedy tokens and sampled tokens of a ragged `generate` (speculative: the tokens and lengths
of greedy and sampled speculative generation, and the greedy ones against plain greedy decoding); OUT gets
{"cases": [{..., "equal": bool}]}. This file asserts nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def run_speculative(out_path: str) -> None:
    import jax
    import numpy as np

    from common import release_compiled_code, small_v4, small_v41, small_vocab
    from model import init_random, shard_model
    from sampling import generate
    from sharding import ParallelConfig

    assert jax.device_count() == 8, jax.devices()
    mesh = ParallelConfig(2, 4).make_mesh()
    cases = []
    sampled = dict(temperature=0.8, top_k=12, top_p=0.95, seed=3, sequence_ids=[11, 3, 29, 7, 0, 18, 2, 40])
    for build, kind, dtype in ((small_v4, "mtp", "bfloat16"), (small_v41, "dspark", "float32")):
        cfg = small_vocab(build(), 16).replace(batch_invariant=True)
        preset = cfg.name
        model = init_random(cfg, seed=2, dtype=dtype)
        sharded = shard_model(model, mesh)
        rng = np.random.default_rng(11)
        prompts = [rng.integers(3, 15, n).tolist() for n in (11, 17, 3, 30, 9, 5, 14, 7)]
        plain = generate(model, prompts, max_new_tokens=8).tokens
        for num_draft in (1, 3):
            for name, options in (("greedy", {}), ("sampled", sampled)):
                t0 = time.perf_counter()
                run_options = dict(max_new_tokens=8, speculative=kind, num_draft=num_draft, **options)
                alone = generate(model, prompts, **run_options)
                meshed = generate(sharded, prompts, mesh=mesh, **run_options)
                equal = {"tokens": bool(np.array_equal(meshed.tokens, alone.tokens)),
                         "lengths": bool(np.array_equal(meshed.lengths, alone.lengths))}
                if name == "greedy":
                    equal["plain"] = bool(np.array_equal(alone.tokens, plain))
                rates = alone.stats["acceptance_per_position"]
                release_compiled_code()
                cases.append({"preset": preset, "dtype": dtype, "case": f"{kind}/{name}/num_draft={num_draft}",
                              "mesh": dict(mesh.shape), **equal, "equal": all(equal.values()),
                              "acceptance_per_position": [round(float(r), 3) for r in rates],
                              "seconds": round(time.perf_counter() - t0, 1)})
                print(cases[-1], flush=True)
    Path(out_path).write_text(json.dumps({"cases": cases}, indent=1))


def run(out_path: str, mode: str) -> None:
    import jax
    import numpy as np

    from flax import nnx

    from common import release_compiled_code, small_config
    from model import init_random, shard_model
    from sampling import generate
    from sharding import EPConfig, ParallelConfig, rebalance, shard_batch, to_host

    assert jax.device_count() == 8, jax.devices()
    matrix = mode == "mesh-matrix"
    kernels = mode == "mesh-kernels"   # every kernel with an invariant tiling (interpreted on the CPU)
    cases = []
    sampled = dict(temperature=1.0, seed=5, sequence_ids=[11, 3, 29, 7, 0, 18, 2, 40])
    for preset, dtype in ([("tiny-v4", "bfloat16"), ("tiny-v4", "float32"), ("tiny-v41", "bfloat16"),
                           ("tiny-v41", "float32")] if matrix else [("tiny-v4", "bfloat16")]):
        cfg = small_config(preset).replace(batch_invariant=True)
        if kernels:   # three Sinkhorn rounds keep the interpreted mHC short
            cfg = cfg.replace(moe_impl="pallas", mhc_impl="pallas", hc_sinkhorn_iters=3, attention_impl="pallas",
                              dense_weights="fp8", dense_impl="pallas")
        model = init_random(cfg, seed=0, dtype=dtype)
        rng = np.random.default_rng(11)
        tokens = rng.integers(3, cfg.vocab_size - 2, (8, 12))
        prompts = [rng.integers(3, cfg.vocab_size - 2, n).tolist() for n in (5, 9, 3, 12, 7, 4, 10, 6)]
        want = {"logits": np.asarray(model(tokens)),
                "greedy": generate(model, prompts, max_new_tokens=4).tokens,
                "sampled": generate(model, prompts, max_new_tokens=4, **sampled).tokens if matrix else None}

        def case(name, mesh, sharded, gen=True, expected=want):
            t0 = time.perf_counter()
            with jax.set_mesh(mesh):
                got = {"logits": to_host(sharded(shard_batch(tokens, mesh)))}
            if gen:
                got["greedy"] = generate(sharded, prompts, max_new_tokens=4, mesh=mesh).tokens
                if matrix:
                    got["sampled"] = generate(sharded, prompts, max_new_tokens=4, mesh=mesh, **sampled).tokens
            equal = {k: bool(np.array_equal(v, expected[k])) for k, v in got.items()}
            cases.append({"preset": preset, "dtype": dtype, "case": name, "mesh": dict(mesh.shape), **equal,
                          "equal": all(equal.values()), "strategy": sharded.runtime.expert_parallel.describe(
                              tokens.size), "seconds": round(time.perf_counter() - t0, 1)})
            print(cases[-1], flush=True)
            release_compiled_code()

        dp_ep = ParallelConfig(2, 4).make_mesh()
        case("auto", dp_ep, shard_model(model, dp_ep))
        if not matrix:
            continue
        for dp, ep in ((8, 1), (1, 8)):
            mesh = ParallelConfig(dp, ep).make_mesh()
            case("auto", mesh, shard_model(model, mesh))
        for ep_cfg in (EPConfig("all_to_all", "padded"), EPConfig("replicate")):
            case(f"{ep_cfg.strategy}/{ep_cfg.transport}", dp_ep, shard_model(model, dp_ep, ep_cfg), gen=False)
        # born sharded: its weights can differ from one device's init in the last bit (XLA:CPU's random normal
        # depends on the per-device shape), so it is compared with the same weights on one device
        born = init_random(cfg, seed=0, dtype=dtype, mesh=dp_ep)
        twin = init_random(cfg, seed=0, dtype=dtype)
        nnx.update(twin, jax.tree.map(lambda x: jax.device_put(to_host(x), jax.devices()[0]), nnx.state(born)))
        case("init_random(mesh)", dp_ep, born, gen=False, expected={"logits": np.asarray(twin(tokens))})
        ep8 = ParallelConfig(1, 8).make_mesh()
        n_experts = cfg.n_routed_experts
        placements = {b: rebalance(np.arange(1, cfg.layer_spec(b).n_experts + 1) ** 2, ep=8,
                                   num_redundant=cfg.layer_spec(b).n_experts) for b in range(cfg.num_blocks)}
        assert all(p.num_experts == n_experts for p in placements.values())
        case("redundant+rebalanced", ep8, shard_model(model, ep8, EPConfig("all_to_all", "padded"),
                                                      placements=placements))
    Path(out_path).write_text(json.dumps({"cases": cases}, indent=1))


if __name__ == "__main__":
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    if sys.argv[1] not in ("mesh", "mesh-matrix", "mesh-kernels", "mesh-speculative"):
        raise SystemExit(f"unknown mode {sys.argv[1]!r}: mesh, mesh-matrix, mesh-kernels or mesh-speculative")
    if sys.argv[1] == "mesh-speculative":
        run_speculative(sys.argv[2])
    else:
        run(sys.argv[2], sys.argv[1])
