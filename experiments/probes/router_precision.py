"""Probe: how often does a TF32 router GEMM change V4-Flash's top-6 experts, and what does IEEE float32 cost?

The official gate computes its logits with torch's float32 linear (no TF32), and `model.moe.Gate` asks for
`Precision.HIGHEST`. Without it XLA runs a float32 GEMM on the GPU as TF32 (10-bit operand mantissas). At
V4-Flash widths (D = 4096, 256 experts, sqrt-softplus scores plus the selection bias, top-6) this counts the
tokens whose expert set differs from the float64 choice, at each precision, and times the logits GEMM at
prefill (8K tokens) and decode (64 tokens) loads (CUPTI, all kernels of the jitted function, h in bf16 as the
model passes it).
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
    h = jnp.asarray(rng.standard_normal((8192, D)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((E, D)) * D ** -0.5, jnp.bfloat16)
    bias = rng.standard_normal(E) * 0.3
    want = top_k_sets(np.asarray(h, np.float64) @ np.asarray(w, np.float64).T, bias)
    print(f"{jax.devices()[0].device_kind}; {h.shape[0]} tokens, top-{K} of {E}, D = {D}")
    for name, precision in PRECISIONS.items():
        f = logits_fn(precision)
        flips = int(np.sum(np.any(top_k_sets(np.asarray(f(h, w)), bias) != want, axis=1)))
        on_gpu = jax.default_backend() == "gpu"
        times = {m: cupti_ms(f, h[:m], w, iterations=20) for m in (8192, 64)} if on_gpu else {}
        timing = "no CUPTI here" if not times else \
            f"logits GEMM {np.median(times[8192]):.3f} ms at 8192 tokens, {np.median(times[64]):.4f} ms at 64"
        print(f"{name:26s} tokens with another expert set: {flips:5d} ({100 * flips / h.shape[0]:.2f}%); {timing}")


if __name__ == "__main__":
    main()
