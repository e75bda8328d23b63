"""Tool: the profiler target -- one MoE expert block at V4-Flash shapes, called a few times, for a profiler run by
hand: Nsight Compute (`ncu`) or Mosaic GPU's SASS dump (docs/kernels.md cites what they found):

  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu -k regex:mosaic --launch-count 1 --section SpeedOfLight \\
      --section WarpStateStats python -m experiments.probes.moe_profile_target --format fp4 --tokens 256 --calls 1

(without the preallocation switch ncu's kernel replay fails: it saves and restores device memory)

With MOSAIC_GPU_DUMP_SASS=1 (and --cuda-root where nvdisasm lives: jax points Mosaic GPU at the CUDA of its
pip wheels, which has none) the kernels' SASS is printed instead.
Inputs are bench_moe's (random weights in storage format, balanced routing); the default tiling is the one
`moe_experts` picks for the load unless --config gives MgpuConfig fields as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_moe import D, LIMIT, make_routing, make_weights
from pallas_kernels import moe as PK


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="fp4", choices=("bf16", "fp8", "fp4"))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--act-block", type=int, default=0)
    p.add_argument("--config", default="", help="MgpuConfig fields as JSON (default: moe_experts' choice)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--cuda-root", default="", help="CUDA toolkit for Mosaic GPU's tools (nvdisasm)")
    a = p.parse_args()
    if a.cuda_root:
        importlib.import_module("jax.experimental.mosaic.gpu")   # sets MOSAIC_GPU_CUDA_ROOT on import
        os.environ["MOSAIC_GPU_CUDA_ROOT"] = a.cuda_root
    rng = np.random.default_rng(0)
    ids, w, _, _ = make_routing("balanced", a.tokens, rng)
    w1, w2, w3, scales = make_weights(a.format, 1)
    x = jnp.asarray(rng.standard_normal((a.tokens, D), np.float32), jnp.bfloat16)
    cfg = PK.MgpuConfig(**json.loads(a.config)) if a.config else None
    f = jax.jit(lambda x, ids, w, w1, w2, w3, s: PK.moe_experts(
        x, ids, w, w1, w2, w3, LIMIT, scales=s, config=cfg, act_block=a.act_block, backend="mgpu" if cfg else "auto"))
    for _ in range(a.calls):
        out = f(x, ids, w, w1, w2, w3, scales)
    print("done", float(jnp.abs(out).mean()))


if __name__ == "__main__":
    main()
