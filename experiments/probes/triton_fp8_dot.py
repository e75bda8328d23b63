"""Probe: is a Pallas-Triton FP8 x FP8 dot exact on this GPU? (sixth session: the MoE kernel's FP8 x FP8 path
passed in the CPU interpreter and missed the reference by 4.8% on the H200.)

One program per case computes a [M, K] . b -> [M, N] float32 with float8_e4m3fn operands holding small integers
(every product and partial sum exact in float32), in the orientations the MoE kernel could use:
  nt  a [M, K], b [N, K] (contract both minor dims; the MoE kernel's weight layout)
  nn  a [M, K], b [K, N]
  loop_nt  nt over K in 128-wide steps accumulated in a fori_loop (the kernel's shape of work)
  scaled   loop_nt with each step's product times the rows' scale s[:, step] read as a [M, 1] slice of a
           [M, K / 128] ref (how the kernel reads act_quant scales)
and reports max |got - want| / max |want| against numpy; "normal" repeats them with N(0, 1) values rounded
to the operand dtype (exact products, float32 sums: an imprecise accumulator shows as > 1e-6). Run: python -m experiments.probes.triton_fp8_dot
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl


def _dot(a, b, nt):
    dims = (((1,), (1,)), ((), ())) if nt else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def run(case: str, m: int, n: int, k: int, dtype, interpret: bool, values: str) -> float:
    rng = np.random.default_rng(0)
    draw = (lambda *s: rng.integers(-4, 5, s)) if values == "ints" else (lambda *s: rng.standard_normal(s))  # noqa
    a = np.asarray(jnp.asarray(draw(m, k), dtype).astype(jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(draw(n, k), dtype).astype(jnp.float32), np.float64)
    step = 128
    scale = np.exp2(rng.integers(-3, 4, (m, k // step))).astype(np.float32)
    if case == "scaled":
        want = sum((a[:, i * step:(i + 1) * step] @ b[:, i * step:(i + 1) * step].T) * scale[:, i:i + 1]
                   for i in range(k // step))
    else:
        want = a @ b.T
    nt = case != "nn"
    bb = b if nt else b.T.copy()

    def kernel(a_ref, b_ref, s_ref, o_ref):
        if case in ("loop_nt", "scaled"):
            def body(i, acc):
                k0 = pl.multiple_of(i * step, step)
                s = s_ref[:, pl.ds(i, 1)] if case == "scaled" else 1.0
                return acc + _dot(a_ref[:, pl.ds(k0, step)], b_ref[:, pl.ds(k0, step)], True) * s
            o_ref[...] = lax.fori_loop(0, k // step, body, jnp.zeros((m, n), jnp.float32))
        else:
            o_ref[...] = _dot(a_ref[...], b_ref[...], nt)

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32), interpret=interpret)(
        jnp.asarray(a, dtype), jnp.asarray(bb, dtype), jnp.asarray(scale))
    return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


def moe_gate_up(interpret: bool):
    """The MoE gate/up kernel on FP8 activations (FP8 x FP8) against the same kernel on the activations rounded
    by act_quant and held in bf16 (bf16 MMA): both compute the same exact products."""
    from pallas_kernels import moe as K
    from pallas_kernels import reference as R

    rng = np.random.default_rng(1)
    e, d, i, m, k = 4, 512, 256, 64, 2
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    w1, w3 = (jnp.asarray(rng.standard_normal((e, i, d)) * d ** -0.5, jnp.float32) for _ in range(2))
    (q1, s1), (q3, s3) = (K.quantize_experts_fp8(np.asarray(w), 128) for w in (w1, w3))
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(m)]), jnp.int32)
    plan = K.route_plan(ids, jnp.ones((m, k), jnp.float32), e, 64)
    for bm, bn, bk in ((64, 128, 128), (64, 64, 128), (64, 128, 64)):
        cfg = K.TritonConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=3)
        xq, xs = R.act_quant(x, 128)
        rows = lambda a: jnp.take(a, plan.row_token, axis=0)  # noqa: E731
        common = dict(fmt="fp8", limit=0.0, cfg=cfg, interpret=interpret, out_dtype=jnp.float32)
        z8 = K._gate_up_triton((rows(xq),), plan.row_weight, plan.tile_expert, q1, q3, s1, s3, x_scale=rows(xs),
                               **common)
        zb = K._gate_up_triton((rows(R.fp8_fake_quant(x, 128).astype(jnp.bfloat16)),), plan.row_weight,
                               plan.tile_expert, q1, q3, s1, s3, **common)
        used = jnp.repeat(plan.tile_expert >= 0, bm)[:, None]   # tiles without an expert are never written
        z8, zb = jnp.where(used, z8, 0.0), jnp.where(used, zb, 0.0)
        err = float(jnp.max(jnp.abs(z8 - zb)) / jnp.max(jnp.abs(zb)))
        print(f"moe gate/up FP8xFP8 vs rounded bf16, tiles ({bm}, {bn}, {bk}): rel err {err:.2e}", flush=True)


def moe_block(interpret: bool):
    """The whole block with act_block=128 and FP8 weights: Triton (FP8 x FP8) against the float32 reference."""
    from pallas_kernels import moe as K
    from pallas_kernels import reference as R

    rng = np.random.default_rng(2)
    e, d, i, m, k = 8, 512, 256, 64, 2
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    ws = [np.asarray(rng.standard_normal(s) * s[2] ** -0.5, np.float32) for s in ((e, i, d), (e, d, i), (e, i, d))]
    (q1, s1), (q2, s2), (q3, s3) = (K.quantize_experts_fp8(w, 128) for w in ws)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(m)]), jnp.int32)
    wts = jnp.asarray(rng.uniform(0.1, 1, (m, k)), jnp.float32)
    want = R.moe_experts_quantized(x.astype(jnp.float32), ids, wts, q1, q2, q3, 10.0, (s1, s2, s3), 128)
    for act in (128, 0):
        got = jax.jit(lambda *a: K.moe_experts(*a, 10.0, scales=(s1, s2, s3), backend="triton", act_block=act,
                                               interpret=interpret))(x, ids, wts, q1, q2, q3)
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        print(f"moe block, FP8 weights, act_block={act}: rel err vs the act_block=128 reference {err:.2e}",
              flush=True)


def fake_quant():
    """Is f32 -> fp8 -> f32 inside one jit a rounding? (XLA's GPU excess-precision pass may fold the pair.)"""
    from pallas_kernels import reference as R

    x = jnp.asarray(np.random.default_rng(3).standard_normal((64, 256)), jnp.float32)
    want = np.asarray(x).astype(jnp.float8_e4m3fn).astype(np.float32)        # ml_dtypes rounding, on the host
    pair = jax.jit(lambda v: v.astype(jnp.float8_e4m3fn).astype(jnp.float32))(x)
    kept = jax.jit(R.fp8_values)(x.astype(jnp.float8_e4m3fn))
    barrier = jax.jit(lambda v: R.fp8_values(v.astype(jnp.float8_e4m3fn)))(x)
    for name, got in (("convert pair in one jit", pair), ("fp8 made outside the jit", kept),
                      ("reference.fp8_values (barrier)", barrier)):
        print(f"f32 -> fp8 -> f32, {name}: equal to host rounding: {bool(np.array_equal(np.asarray(got), want))}",
              flush=True)


def main():
    interpret = jax.default_backend() != "gpu"
    fake_quant()
    moe_gate_up(interpret)
    moe_block(interpret)
    for values in ("ints", "normal"):
        for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
            for case in ("nt", "nn", "loop_nt", "scaled"):
                for m, n, k in ((64, 64, 128), (128, 128, 512)):
                    head = f"{values:6s} {jnp.dtype(dtype).name:14s} {case:8s} M={m} N={n} K={k}:"
                    try:
                        print(f"{head} rel err {run(case, m, n, k, dtype, interpret, values):.2e}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"{head} {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
