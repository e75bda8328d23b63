"""Tool: the indexer's top-k at its step shapes, four ways: XLA's lax.top_k on the whole rows;
`indexer.grouped_topk`'s two stages (k of the group maxima, then k of their entries) by XLA's sorts and by the
selection kernel (`pallas_kernels.topk.topk_select`, what the model runs on a GPU); the selection kernel on the
whole rows. Prints the CUPTI kernel time of each (median of the calls; everything the way launches) beside the HBM
floor (the scores read once at 4.4 TB/s), and whether each way returns lax.top_k's sets.

    python -m experiments.probes.topk_select                       # GPU: V4 prefill 2 x 4096 and verify 256 x 4
    python -m experiments.probes.topk_select --shapes 4x304x16 --interpret   # CPU: the sets only
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_kernels import cupti_ms
from pallas_kernels import reference as ref
from pallas_kernels.indexer import GROUP, grouped_topk
from pallas_kernels.topk import topk_select

HBM = 4.4e12
# rows x visible entries x k: V4-Flash's CSA indexer at 32K context (ratio 4, k 512) for prefill 2 x 4096 and
# verify 256 x 4
SHAPES = "8192x9216x512,1024x8448x512"


def scores_of(rows: int, n: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Random scores [rows, n] with a causal-looking -inf tail per row, and their group maxima."""
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((rows, n)).astype(np.float32)
    visible = rng.integers(n // 2, n + 1, size=rows)
    s[np.arange(n)[None] >= visible[:, None]] = -np.inf
    s = jnp.asarray(s)
    return s, s.reshape(rows, n // GROUP, GROUP).max(-1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help="ROWSxNxK (comma list; N a multiple of 8)")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--interpret", action="store_true", help="interpret the kernel (CPU): the sets, no times")
    args = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    interpret = True if args.interpret else None
    print("| rows x entries, k | lax.top_k us | two stages, sorts us | two stages, kernel us | kernel, whole rows us "
          "| floor us | sets equal to lax.top_k's |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for shape in args.shapes.split(","):
        rows, n, k = (int(v) for v in shape.split("x"))
        s, gmax = scores_of(rows, n)
        ways = [jax.jit(lambda s, g: ref.topk_indices(s, k)),
                jax.jit(lambda s, g: grouped_topk(s, g, k, n, select="sort")),
                jax.jit(lambda s, g: grouped_topk(s, g, k, n, select="kernel")),
                jax.jit(lambda s, g: topk_select(s, k, interpret=interpret))]
        want = [set(r.tolist()) for r in np.asarray(ways[0](s, gmax))]
        equal = ["yes" if [set(r.tolist()) for r in np.asarray(f(s, gmax))] == want else "NO" for f in ways[1:]]
        times = []
        for f in ways:
            t = cupti_ms(f, s, gmax, iterations=args.iterations) if gpu else None
            times.append(f"{float(np.median(t)) * 1e3:.1f}" if t else "-")
        floor = rows * n * 4 / HBM * 1e6
        print(f"| {rows} x {n}, {k} | {' | '.join(times)} | {floor:.1f} | {', '.join(equal)} |",
              flush=True)


if __name__ == "__main__":
    main()
