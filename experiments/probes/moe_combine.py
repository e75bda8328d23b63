"""Probe: what does the Mosaic GPU swap-AB path's combine cost, and is a transposed copy first cheaper?

The swap-AB down kernel returns y^T [D, P] (P = tile-padded routed rows); `moe_experts` then gathers each
token's k columns (`jnp.take(yt, dest, axis=1)`), sums them and transposes. In the model's FP4 verify step
(B256 x 4 rows, 4 layers) a `loop_convert_fusion` of 0.33 ms per layer sat beside the FP4 kernels
(docs/benchmarks.md), suspected to be this column gather: neighbouring output elements read columns far
apart. Variants, CUPTI kernel time per call (all kernels of the jitted function):
  columns     the current code: take along axis 1 of y^T, reshape, sum over k, transpose
  rows_fused  take along axis 0 of y^T.T, sum over k (XLA decides the layout)
  rows_copy   y^T.T forced into a physical [P, D] copy first (a flatten: XLA's layout assignment turned an
              optimization_barrier'd transpose into a relabelling, seventh session), then the row gather
  rows_input  the row gather on a [P, D] array given as such: what the combine costs when the down kernel
              writes [P, D] (the Triton path's output)
  rows_kernel y = pallas_kernels.moe.transpose(y^T) (a Triton transpose kernel), then the row gather: the fix
And the dispatch's mirror image, x^T [D, P] built for the swap gate/up kernel from token rows:
  xt_fused    jnp.take(x, row_token, axis=0).T (XLA fuses gather and transpose; the decode tiles' code until
              the fifteenth session)
  xt_kernel   transpose(jnp.take(x, row_token, axis=0)) (the prefill tiles' code until then)
  xt_gather   transpose(x, row_token): one Triton kernel gathers the rows and writes them transposed (now both)
Shapes: D = 4096, E = 256, k = 6, balanced routing, block_m 32 (decode / verify) or 128 (prefill).
Run: python -m experiments.probes.moe_combine   (GPU; on the CPU it only checks the variants agree)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_kernels import cupti_ms
from pallas_kernels.moe import route_plan, transpose

D, E, K = 4096, 256, 6


def columns(yt, dest):
    m = dest.shape[0]
    rows = jnp.take(yt, dest.reshape(-1), axis=1, mode="fill", fill_value=0).astype(jnp.float32)
    return jnp.sum(rows.reshape(yt.shape[0], m, K), axis=2).T


def _rows(y, dest):
    rows = jnp.take(y, dest.reshape(-1), axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    return jnp.sum(rows.reshape(dest.shape[0], K, y.shape[1]), axis=1)


def rows_fused(yt, dest):
    return _rows(yt.T, dest)


def rows_copy(yt, dest):
    return _rows(yt.T.reshape(-1).reshape(yt.shape[1], yt.shape[0]), dest)


def rows_input(y, dest):
    return _rows(y, dest)


def rows_kernel(yt, dest):
    return _rows(transpose(yt, interpret=jax.default_backend() != "gpu"), dest)


def xt_fused(x, row_token):
    return jnp.take(x, row_token, axis=0).T


def xt_kernel(x, row_token):
    return transpose(jnp.take(x, row_token, axis=0), interpret=jax.default_backend() != "gpu")


def xt_gather(x, row_token):
    return transpose(x, row_token, interpret=jax.default_backend() != "gpu")


VARIANTS = (columns, rows_fused, rows_copy, rows_input, rows_kernel)
DISPATCH = (xt_fused, xt_kernel, xt_gather)


def main() -> None:
    gpu = jax.default_backend() == "gpu"
    print(f"{'tokens':>7} {'block_m':>7} {'P':>6} " + " ".join(f"{f.__name__:>11}" for f in VARIANTS + DISPATCH)
          + "  floor  (ms, CUPTI; floor: the k rows read + the f32 output written at 3.40 TB/s)", flush=True)
    for tokens, block_m in ((64, 16), (256, 16), (1024, 32), (8192, 128)) if gpu else ((64, 16),):
        rng = np.random.default_rng(tokens)
        ids = np.stack([rng.permutation(E)[:K] for _ in range(tokens)]).astype(np.int32)
        plan = route_plan(jnp.asarray(ids), jnp.ones((tokens, K), jnp.float32), E, block_m)
        p = plan.row_token.shape[0]
        yt = jnp.asarray(rng.standard_normal((D, p), np.float32), jnp.bfloat16)
        outs, times = [], []
        y = jnp.asarray(np.asarray(yt).T)
        for fn in VARIANTS:
            f, arg = jax.jit(fn), (y if fn is rows_input else yt)
            outs.append(np.asarray(f(arg, plan.dest)))
            if gpu:
                times.append(float(np.median(cupti_ms(f, arg, plan.dest, iterations=20))))
        for o in outs[1:]:
            np.testing.assert_allclose(o, outs[0], rtol=1e-6, atol=1e-6)
        x = jnp.asarray(rng.standard_normal((tokens, D), np.float32), jnp.bfloat16)
        xts = []
        for fn in DISPATCH:
            f = jax.jit(fn)
            xts.append(np.asarray(f(x, plan.row_token)))
            if gpu:
                times.append(float(np.median(cupti_ms(f, x, plan.row_token, iterations=20))))
        for xt in xts[1:]:
            np.testing.assert_array_equal(xt, xts[0])
        floor = (tokens * K * D * 2 + tokens * D * 4) / 3.40e12 * 1e3
        print(f"{tokens:>7} {block_m:>7} {p:>6} " + " ".join(f"{t:>11.4f}" for t in times) + f"  {floor:.4f}",
              flush=True)


if __name__ == "__main__":
    main()
