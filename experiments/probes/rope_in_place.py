"""Tool: the attention's RoPE passes at V4-Flash widths (64 heads x 512, 64 rope channels), the rotated channels
concatenated after the others (the CPU's formulation) against written over the input in place (the GPU's,
model/layers.py `apply_rope`): the queries' normalisation + rotation and the output's rotation back. Prints the
CUPTI kernel time of each (median of the calls) and whether the two agree bitwise.

    python -m experiments.probes.rope_in_place              # GPU: prefill 2 x 4096 and verify 256 x 4
    python -m experiments.probes.rope_in_place --shapes 1x8  # CPU: agreement only
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import model.layers as layers
from experiments.bench_kernels import cupti_ms
from pallas_kernels.common import on_gpu

HEADS, HEAD_DIM = 64, 512
FREQS = tuple(float(f) for f in np.geomspace(1.0, 1e-4, 32))


def queries(x, pos):
    return layers.apply_rope(layers.rms_normalize(x, 1e-6).astype(x.dtype), pos[..., None], FREQS)


def output(x, pos):
    return layers.apply_rope(x, pos[..., None], FREQS, inverse=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="2x4096,256x4", help="BATCHxTOKENS (comma list)")
    p.add_argument("--iterations", type=int, default=20)
    args = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    print("| batch x tokens | pass | concatenated us | in place us | bitwise equal |")
    print("|---|---|---:|---:|---|")
    for shape in args.shapes.split(","):
        b, t = (int(v) for v in shape.split("x"))
        x = jnp.asarray(np.random.default_rng(0).normal(size=(b, t, HEADS, HEAD_DIM)), jnp.bfloat16)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + 30000, (b, t))
        for name, fn in (("queries: normalise + rotate", queries), ("output: rotate back", output)):
            outs, times = [], []
            for in_place in (False, True):
                layers.on_gpu = lambda in_place=in_place: in_place   # apply_rope's choice, traced below
                try:
                    f = jax.jit(fn)
                    outs.append(np.asarray(f(x, pos).astype(jnp.float32)))
                    ts = cupti_ms(f, x, pos, iterations=args.iterations) if gpu else None
                finally:
                    layers.on_gpu = on_gpu
                times.append(f"{float(np.median(ts)) * 1e3:.1f}" if ts else "-")
            print(f"| {b} x {t} | {name} | {times[0]} | {times[1]} | {np.array_equal(outs[0], outs[1])} |",
                  flush=True)


if __name__ == "__main__":
    main()
