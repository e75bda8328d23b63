"""Probe: how often does a TF32 router GEMM change V4-Flash's top-6 experts, and what does IEEE float32 cost?

The official gate computes its logits with torch's float32 linear (no TF32). XLA runs a float32 GEMM on the
GPU as TF32 (10-bit operand mantissas) unless asked for `Precision.HIGHEST`. At V4-Flash widths (D = 4096, 256
experts, sqrt-softplus scores plus the selection bias, top-6) this counts the tokens whose expert set differs
from the float64 choice, at each precision, for bf16 operands (the bf16 model's: TF32 holds them exactly) and
float32 ones (a float32 model's), and times the logits GEMM at prefill (8K tokens) and decode (64 tokens)
loads (CUPTI, all kernels of the jitted function, the converts included).
Run: python -m experiments.probes.router_precision   (GPU; on the CPU both precisions are IEEE: no flips)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_kernels import cupti_ms

D, E, K = 4096, 256, 6
PRECISIONS = {"default (TF32 on the GPU)": None, "highest (IEEE float32)": jax.lax.Precision.HIGHEST}


def logits_fn(precision):
    return jax.jit(lambda h, w: jnp.einsum("md,ed->me", h.astype(jnp.float32), w.astype(jnp.float32),
                                           precision=precision))


def top_k_sets(logits: np.ndarray, bias: np.ndarray) -> np.ndarray:
    scores = np.sqrt(np.logaddexp(0.0, logits.astype(np.float64))) + bias
    return np.sort(np.argsort(-scores, axis=1)[:, :K], axis=1)


def main():
    rng = np.random.default_rng(0)
    h64, w64 = rng.standard_normal((8192, D)), rng.standard_normal((E, D)) * D ** -0.5
    bias = rng.standard_normal(E) * 0.3
    on_gpu = jax.default_backend() == "gpu"
    print(f"{jax.devices()[0].device_kind}; {h64.shape[0]} tokens, top-{K} of {E}, D = {D}")
    for dtype in (jnp.bfloat16, jnp.float32):
        h, w = jnp.asarray(h64, dtype), jnp.asarray(w64, dtype)
        want = top_k_sets(np.asarray(h, np.float64) @ np.asarray(w, np.float64).T, bias)
        for name, precision in PRECISIONS.items():
            f = logits_fn(precision)
            flips = int(np.sum(np.any(top_k_sets(np.asarray(f(h, w)), bias) != want, axis=1)))
            times = {m: cupti_ms(f, h[:m], w, iterations=20) for m in (8192, 64)} if on_gpu else {}
            timing = "no CUPTI here" if not times else \
                f"GEMM {np.median(times[8192]):.3f} ms at 8192 tokens, {np.median(times[64]):.4f} ms at 64"
            print(f"{jnp.dtype(dtype).name:8s} {name:26s} other expert sets: {flips:5d} "
                  f"({100 * flips / h.shape[0]:.2f}%); {timing}")


if __name__ == "__main__":
    main()
