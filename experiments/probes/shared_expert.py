"""Tool: V4-Flash's shared expert (4096 -> 2048 -> 4096, FP8 128-blocks) at decode / verify loads, on XLA's GEMMs
over the in-graph dequantised weights (the model's reference path) against one routed expert on the MoE kernels
(model/moe.py `MLP`) at the tuning table's tiling and at tilings with more programs per GEMM (a single expert
leaves most SMs idle at the MoE decode tiles). Prints the CUPTI kernel time of each (median of the calls) and its
error against the float32 SwiGLU of the dequantised weights.

    python -m experiments.probes.shared_expert              # GPU: 32, 256 and 1024 rows
    python -m experiments.probes.shared_expert --rows 8     # CPU: errors only (interpret mode)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.bench_kernels import cupti_ms, rel_err
from model import ModelConfig
from model.moe import MLP
from pallas_kernels import moe as pallas_moe
from pallas_kernels import reference as ref
from pallas_kernels.moe import MgpuConfig, TritonConfig

TILINGS = {
    "triton m16 n64 k128 (the decode tiling)": TritonConfig(block_m=16),
    "triton n16 k256": TritonConfig(block_m=16, block_n=16, block_k=256, block_n_down=16, block_k_down=256),
    "triton n32 k256": TritonConfig(block_m=16, block_n=32, block_k=256, block_n_down=32, block_k_down=256),
    "triton m32 n16 k256": TritonConfig(block_m=32, block_n=16, block_k=256, block_n_down=16, block_k_down=256),
    "mgpu swap 16 x 64": MgpuConfig(block_m=16, block_n=64, block_k=128, block_n_down=64, block_k_down=128,
                                    max_concurrent_steps=5, swap_ab=True, warp_specialized=False),
    "mgpu swap 64 x 64": MgpuConfig(block_m=64, block_n=64, block_k=128, block_n_down=64, block_k_down=128,
                                    max_concurrent_steps=5, swap_ab=True, warp_specialized=False),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="32,256,1024", help="rows per call (comma list)")
    p.add_argument("--iterations", type=int, default=20)
    args = p.parse_args(argv)
    cfg = ModelConfig.preset("v4-flash")
    mlp = MLP(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    for w in (mlp.w1, mlp.w2, mlp.w3):
        w.quantise(128)
    ws = tuple(w.weight[...][None] for w in (mlp.w1, mlp.w2, mlp.w3))
    ss = tuple(w.scale[...][None] for w in (mlp.w1, mlp.w2, mlp.w3))
    dense = [ref.dequant_fp8_blocks(w.weight[...], w.scale[...]) for w in (mlp.w1, mlp.w2, mlp.w3)]
    gpu = jax.default_backend() == "gpu"
    print("| rows | path | us | rel err vs float32 |")
    print("|---:|---|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, cfg.hidden_size)), jnp.bfloat16)
        hi = jax.lax.Precision.HIGHEST
        xf = x.astype(jnp.float32)
        z = ref.clamped_swiglu(jnp.dot(xf, dense[0].T, precision=hi), jnp.dot(xf, dense[2].T, precision=hi),
                               cfg.swiglu_limit)
        want = jnp.dot(z.astype(jnp.bfloat16).astype(jnp.float32), dense[1].T, precision=hi)
        ids, wts = jnp.zeros((rows, 1), jnp.int32), jnp.ones((rows, 1), jnp.float32)
        graphdef, state = nnx.split(mlp)
        held = (state, ws, ss)   # every path takes the weights as arguments (no constants in the programs)
        paths = {"XLA on dequantised weights": jax.jit(lambda x, h: nnx.merge(graphdef, h[0])(x))}
        paths["MoE kernels, auto"] = jax.jit(lambda x, h: pallas_moe.moe_experts(x, ids, wts, *h[1],
                                                                                 cfg.swiglu_limit, scales=h[2]))
        for name, c in TILINGS.items():
            backend = "mgpu" if isinstance(c, MgpuConfig) else "triton"
            if backend == "mgpu" and not gpu:
                continue
            paths[name] = jax.jit(lambda x, h, c=c, backend=backend: pallas_moe.moe_experts(
                x, ids, wts, *h[1], cfg.swiglu_limit, scales=h[2], backend=backend, config=c))
        for name, f in paths.items():
            try:
                err = rel_err(f(x, held), want)
                ts = cupti_ms(f, x, held, iterations=args.iterations) if gpu else None
            except Exception as e:   # a tiling a kernel refuses: report it and go on
                print(f"| {rows} | {name} | failed: {type(e).__name__}: {str(e)[:80]} | |", flush=True)
                continue
            us = f"{float(np.median(ts)) * 1e3:.1f}" if ts else "-"
            print(f"| {rows} | {name} | {us} | {err:.2e} |", flush=True)


if __name__ == "__main__":
    main()
