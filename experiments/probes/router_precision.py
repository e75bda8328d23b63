"""Tool: the gate's logits GEMM and top-k at V4-Flash widths -- which precisions change the top-6, what each costs.

The official gate computes its logits with torch's float32 linear of the upcast operands (no TF32). XLA runs a
float32 GEMM on the GPU as TF32 (10-bit operand mantissas) unless asked for `Precision.HIGHEST`. At V4-Flash
widths (D = 4096, 256 experts, sqrt-softplus scores plus the selection bias, top-6) this counts the tokens whose
expert set differs from the float64 choice and times the logits (CUPTI, all kernels of the jitted function, the
converts included) at prefill (8K tokens) and decode (64 tokens) loads, for
  bf16 upcast, default   bf16 operands converted to float32, TF32 GEMM
  bf16, f32 accumulation bf16 operands multiplied as they are into float32 (products exact: the model's gate)
  float32, default       a float32 model's operands on TF32
  float32, highest       the same in IEEE float32 (the model's gate for float32 operands)
and then the top-6 of the scores at 64 to 8192 rows: lax.top_k (XLA sorts the rows) against six rounds of
argmax (model.moe.argmax_rounds; top_k_ids takes them past TOP_K_SORT_ROWS rows).
Run: python -m experiments.probes.router_precision   (GPU; on the CPU every variant is IEEE: no flips)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_kernels import cupti_ms
from model.moe import argmax_rounds

D, E, K = 4096, 256, 6
F32 = jnp.float32
VARIANTS = {   # name: (operand dtype, logits function)
    "bf16 upcast, default": (jnp.bfloat16, lambda h, w: jnp.einsum("md,ed->me", h.astype(F32), w.astype(F32))),
    "bf16, f32 accumulation": (jnp.bfloat16, lambda h, w: jnp.einsum("md,ed->me", h, w, preferred_element_type=F32)),
    "float32, default": (F32, lambda h, w: jnp.einsum("md,ed->me", h, w)),
    "float32, highest": (F32, lambda h, w: jnp.einsum("md,ed->me", h, w, precision=jax.lax.Precision.HIGHEST)),
}


def top_k_sets(logits: np.ndarray, bias: np.ndarray) -> np.ndarray:
    scores = np.sqrt(np.logaddexp(0.0, logits.astype(np.float64))) + bias
    return np.sort(np.argsort(-scores, axis=1)[:, :K], axis=1)


def timed(f, x, *rest, rows=(8192, 64)) -> str:
    """CUPTI ms of f(x[:m], *rest) for each m of rows."""
    if jax.default_backend() != "gpu":
        return "no CUPTI here"
    return " / ".join(f"{np.median(cupti_ms(f, x[:m], *rest, iterations=20)):.4f}" for m in rows) + \
        f" ms ({' / '.join(map(str, rows))} tokens)"


def main():
    rng = np.random.default_rng(0)
    h64, w64 = rng.standard_normal((8192, D)), rng.standard_normal((E, D)) * D ** -0.5
    bias = rng.standard_normal(E) * 0.3
    print(f"{jax.devices()[0].device_kind}; {h64.shape[0]} tokens, top-{K} of {E}, D = {D}")
    for name, (dtype, fn) in VARIANTS.items():
        h, w = jnp.asarray(h64, dtype), jnp.asarray(w64, dtype)
        want = top_k_sets(np.asarray(h, np.float64) @ np.asarray(w, np.float64).T, bias)
        f = jax.jit(fn)
        flips = int(np.sum(np.any(top_k_sets(np.asarray(f(h, w)), bias) != want, axis=1)))
        print(f"logits {name:24s} other expert sets: {flips:5d} ({100 * flips / h.shape[0]:.2f}%); {timed(f, h, w)}")
    scores = jnp.asarray(rng.standard_normal((8192, E)), F32)
    tops = {"lax.top_k": jax.jit(lambda s: jax.lax.top_k(s, K)[1]), "argmax x6": jax.jit(lambda s: argmax_rounds(s, K))}
    same = np.array_equal(*(np.asarray(f(scores)) for f in tops.values()))
    for name, f in tops.items():
        print(f"top-{K} {name:24s} same ids as lax.top_k: {same}; "
              f"{timed(f, scores, rows=(8192, 2048, 1024, 512, 256, 64))}")


if __name__ == "__main__":
    main()
