"""Probe: the XLA glue around the MoE prefill kernels -- what each piece costs and whether a cheaper spelling
exists (issue 6's layer and FP8 block targets; part 31 of experiments/device/h200x2_next.sh measured at 8K
tokens a 0.40 ms row gather of the FP8 activations and 0.61 ms for act_quant of the SwiGLU output around
3.9 ms of FP8 x FP8 kernels).

Variants, CUPTI kernel time per call (all kernels of the jitted function):
  gather_fp8       jnp.take(xq, row_token, axis=0) on act_quant'd rows xq [M, D] float8 (the current code)
  gather_fp8_u32   the same rows gathered by XLA as uint32 words (the dispatch from the eleventh session to the
                   fourteenth)
  gather_fp8_tiles pallas_kernels.moe.take_rows: one Triton kernel copies the words, the live tiles only (now)
  gather_bf16      jnp.take(x, row_token, axis=0) on bf16 rows (the bf16 / FP4 prefill's dispatch)
  gather_bf16_u32  the same as uint32 words ([M, D / 2])
  gather_bf16_tiles  take_rows on the bf16 rows
  gather_bf16_live   the same, the live tiles only (as moe_experts calls it)
  zq_f32           act_quant of the gate/up kernel's float32 output z [P, I] and the transposed scales
                   [I / B, P] the FP8 row kernel streams (the current code)
  zq_f32_barrier   the same with an optimization barrier between the scales and their transpose
  zq_bf16          act_quant of a bf16 z (what a bf16 gate/up output would cost; not bit-identical)
Shapes: D = 4096, I = 2048, E = 256, k = 6, balanced routing, block_m 128, 8K tokens.
Run: python -m experiments.probes.moe_prefill_glue   (GPU; on the CPU it only checks the variants agree)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_kernels import cupti_ms
from pallas_kernels import reference as ref
from pallas_kernels.moe import forced_balance, route_plan, take_rows

D, I, E, K, B = 4096, 2048, 256, 6, 128


def gather(x, row_token):
    return jnp.take(x, row_token, axis=0)


def gather_words(x, row_token):
    per = 4 // x.dtype.itemsize
    words = jax.lax.bitcast_convert_type(x.reshape(x.shape[0], -1, per), jnp.uint32)
    return jax.lax.bitcast_convert_type(jnp.take(words, row_token, axis=0), x.dtype).reshape(-1, x.shape[1])


def zq_f32(z):
    q, s = ref.act_quant(z, B)
    return q, s.T


def zq_f32_barrier(z):
    q, s = ref.act_quant(z, B)
    return q, jax.lax.optimization_barrier(s).T


def main() -> None:
    gpu = jax.default_backend() == "gpu"
    tokens = 8192 if gpu else 256
    rng = np.random.default_rng(0)
    ids = forced_balance(tokens, E, K, offset=3)
    plan = route_plan(ids, jnp.ones((tokens, K), jnp.float32), E, 128)
    p = plan.row_token.shape[0]
    x = jnp.asarray(rng.standard_normal((tokens, D), np.float32), jnp.bfloat16)
    xq, _ = jax.jit(lambda a: ref.act_quant(a, B))(x)
    z = jnp.asarray(rng.standard_normal((p, I), np.float32))
    live = plan.num_tiles * 128
    tiles = lambda a, rows: take_rows(a, rows, interpret=not gpu)  # noqa: E731 -- all rows: comparable
    cases = [("gather_fp8", gather, (xq, plan.row_token)), ("gather_fp8_u32", gather_words, (xq, plan.row_token)),
             ("gather_fp8_tiles", tiles, (xq, plan.row_token)),
             ("gather_bf16", gather, (x, plan.row_token)), ("gather_bf16_u32", gather_words, (x, plan.row_token)),
             ("gather_bf16_tiles", tiles, (x, plan.row_token)),
             ("gather_bf16_live", lambda a, rows: take_rows(a, rows, live, interpret=not gpu), (x, plan.row_token)),
             ("zq_f32", zq_f32, (z,)), ("zq_f32_barrier", zq_f32_barrier, (z,)),
             ("zq_bf16", zq_f32, (z.astype(jnp.bfloat16),))]
    outs = {}
    print(f"tokens {tokens}, routed rows P = {p} (ms, CUPTI median of 20)", flush=True)
    for name, fn, args in cases:
        f = jax.jit(fn)
        outs[name] = jax.tree.map(lambda a: np.asarray(a.astype(jnp.float32)), f(*args))
        t = float(np.median(cupti_ms(f, *args, iterations=20))) if gpu else float("nan")
        print(f"{name:>16} {t:8.4f}", flush=True)
    for a, b in (("gather_fp8", "gather_fp8_u32"), ("gather_fp8", "gather_fp8_tiles"),
                 ("gather_bf16", "gather_bf16_u32"), ("gather_bf16", "gather_bf16_tiles"), ("zq_f32", "zq_f32_barrier")):
        jax.tree.map(np.testing.assert_array_equal, outs[a], outs[b])


if __name__ == "__main__":
    main()
