"""Expert-parallel MoE on a mesh: the whole routed-expert block against its transport alone (the all-to-all or
reduce time per step, measured separately; replicate-and-reduce against all-to-all dispatch).

    NCCL_NVLS_ENABLE=0 python -m experiments.bench_ep --mesh 1,2,1 --tokens 64,256,2048,8192 \\
        --strategy all_to_all,replicate --expert-weights fp4 --impl pallas
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m experiments.bench_ep --small    # CPU smoke

For each (tokens, strategy): random activations [M, D] (M = tokens over the whole mesh, split over dp x ep),
router choices (uniform random distinct experts, or `--forced-balance`) and routing weights, and one
layer's routed experts (V4-Flash: 256 x 4096 -> 2048, top-6; `--small`: 16 x 128 -> 128) split over ep.
Two programs are timed (`sharding.expert_parallel.ExpertParallel` over the model's `LocalExperts`): "full"
(dispatch, the experts, combine) and "comm" (comm_only=True: the same dispatch and combine, or the same
reduce, with the expert GEMMs skipped). comm / full is the transport's share of the MoE block; full - comm
what the experts cost there.
Medians of `--repeats` calls after `--warmup`, each ended by `jax.block_until_ready`; compile excluded.
Output: experiments/results/bench_ep_<stamp>_<backend>.{json,md} (and $OUT when set).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from experiments import records as records_io
from experiments.bench import compile_timed, summary_ms
from experiments.bench_cli import int_list, parse_mesh


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", type=parse_mesh, default=(1, 2, 1), help="dp,ep,tp")
    p.add_argument("--tokens", type=int_list, default=[64, 256, 2048, 8192], help="tokens per step, whole mesh")
    p.add_argument("--strategy", default="all_to_all,replicate", help="comma list: all_to_all, replicate")
    p.add_argument("--transport", default="auto", choices=("auto", "ragged", "gather", "padded"))
    p.add_argument("--impl", default="pallas", choices=("reference", "pallas"))
    p.add_argument("--expert-weights", default="dense", choices=("dense", "fp4"))
    p.add_argument("--forced-balance", action="store_true", help="DeepInfer's benchmark routing")
    p.add_argument("--small", action="store_true", help="16 experts, 128 -> 128, top-2 (CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="results directory (default experiments/results; $OUT also gets a copy)")
    return p.parse_args(argv)


def _timed(fn, args, warmup: int, repeats: int) -> tuple[float, float]:
    """(compile seconds, median seconds) of a jitted fn."""
    import jax

    compiled, compile_s = compile_timed(fn, *args)
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return compile_s, summary_ms(times)["median"] / 1e3


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from model.moe import LocalExperts, random_experts
    from pallas_kernels.moe import fp4_kernel_scales, fp4_kernel_weights
    from sharding import EPConfig, ParallelConfig
    from sharding.expert_parallel import ExpertParallel
    from sharding.placement import forced_balance_ids

    dp, ep, tp = args.mesh
    mesh = ParallelConfig(dp, ep, tp).make_mesh(jax.devices()[:dp * ep * tp])
    e, d, i, k = (16, 128, 128, 2) if args.small else (256, 4096, 2048, 6)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    rng = np.random.default_rng(args.seed)
    # drawn on the device, one expert at a time for FP4 (host numpy took minutes at full width)
    fp4 = args.expert_weights == "fp4"
    make = jax.jit(random_experts, static_argnums=(1, 2, 3, 4))
    keys = jax.random.split(jax.random.key(args.seed), 3)
    (w1, s1), (w2, s2), (w3, s3) = (make(jax.random.split(key, e), shape, shape[-1] ** -0.5, fp4, dtype)
                                    for key, shape in zip(keys, ((i, d), (d, i), (i, d))))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    w13, w2s = P("ep", "tp", None), P("ep", None, "tp")
    if fp4:   # FP4 weights and scales as the model holds them (scales [E, in/32, out]: split as the weights'
        # transposes)
        w1, w2, w3 = (fp4_kernel_weights(w) for w in (w1, w2, w3))
    weights = (put(w1, w13), put(w2, w2s), put(w3, w13))
    scales = (put(fp4_kernel_scales(s1), w2s), put(fp4_kernel_scales(s2), w13), put(fp4_kernel_scales(s3), w2s)
              ) if fp4 else None
    records = []
    for m in args.tokens:
        if m % (dp * ep):
            print(f"[bench_ep] skip {m} tokens: not a multiple of dp*ep = {dp * ep}", flush=True)
            continue
        x = put(jnp.asarray(rng.normal(size=(m, d)), dtype), P(("dp", "ep")))
        ids = (forced_balance_ids(m, k, e) if args.forced_balance
               else jnp.asarray(np.argsort(rng.random((m, e)), axis=1)[:, :k], jnp.int32))
        wts = jnp.asarray(rng.uniform(0.1, 1.0, (m, k)), jnp.float32)
        ids, wts = put(ids, P(("dp", "ep"))), put(wts, P(("dp", "ep")))
        for strategy in [s.strip() for s in args.strategy.split(",") if s.strip()]:
            rec = {"tokens": m, "strategy": strategy, "mesh": {"dp": dp, "ep": ep, "tp": tp}}
            for what in ("full", "comm"):
                layer = ExpertParallel(mesh, LocalExperts(args.impl), EPConfig(strategy, args.transport),
                                       comm_only=what == "comm")
                rec["path"] = layer.describe(m)
                fn = jax.jit(lambda x, ids, wts, w, s, layer=layer: layer(x, ids, wts, *w, 10.0, scales=s))
                with jax.set_mesh(mesh):
                    c, t = _timed(fn, (x, ids, wts, weights, scales), args.warmup, args.repeats)
                rec[f"{what}_ms"], rec[f"{what}_compile_s"] = 1e3 * t, c
            rec["comm_share"] = rec["comm_ms"] / rec["full_ms"]
            records.append(rec)
            print(f"[bench_ep] {m} tokens {rec['path']}: full {rec['full_ms']:.3f} ms, transport alone "
                  f"{rec['comm_ms']:.3f} ms ({100 * rec['comm_share']:.0f}%)", flush=True)
    meta = {"backend": jax.default_backend(), "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            "jax": jax.__version__, "experts": e, "d": d, "i": i, "k": k, "dtype": str(np.dtype(dtype)),
            "impl": args.impl, "expert_weights": args.expert_weights, "forced_balance": args.forced_balance,
            "command": "python -m experiments.bench_ep " + " ".join(sys.argv[1:]),
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    return {"meta": meta, "records": records}


def markdown(out: dict) -> str:
    m = out["meta"]
    lines = [f"# Expert-parallel MoE block: full vs transport alone ({m['devices']}, {m['backend']}, jax {m['jax']})",
             "", f"`{m['command']}` — {m['experts']} experts, {m['d']} -> {m['i']}, top-{m['k']}, {m['dtype']} "
             f"activations, {m['expert_weights']} experts, impl {m['impl']}", "",
             "| tokens | mesh dp,ep,tp | path | full ms | transport ms | transport share |", "|---|---|---|---|---|---|"]
    for r in out["records"]:
        mesh = ",".join(str(r["mesh"][a]) for a in ("dp", "ep", "tp"))
        lines.append(f"| {r['tokens']} | {mesh} | {r['path']} | {r['full_ms']:.3f} | {r['comm_ms']:.3f} "
                     f"| {100 * r['comm_share']:.0f}% |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = run(args)
    records_io.save(out, markdown(out), "bench_ep", out["meta"]["backend"], args.out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
