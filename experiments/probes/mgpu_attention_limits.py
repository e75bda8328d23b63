"""Probe: where does pallas_kernels.attention_mgpu's time go -- key list, HBM gather, or the kernel's own work?

The Mosaic GPU attention kernel measured 96.4 us for CSA decode at B256 (62% of HBM on the bytes it must read,
target 70%) and 1316 us for CSA prefill of 4K rows (261 TFLOP/s, target 300). Variants, CUPTI time per call
of the same inputs (V4-Flash shapes at 128K context, as experiments/bench_kernels.py builds them):
  whole        sparse_attention(impl="mgpu"): key list (XLA) + kernel (+ the split combine)
  key_list     the XLA key compaction alone
  kernel       the Pallas kernel on precomputed codes (what the kernel itself costs)
  kernel_l2    the same launch with every program's codes pointing at the same 64 rows of one sequence:
               the gather hits L2, so the time left is the kernel's issue, MMA, softmax and sync work
  kernel_empty count = 0 for every row: launch, q in, o out (64 + 64 KiB per row)
Reading: kernel ~ kernel_l2 -> not HBM-bound (issue / compute); kernel >> kernel_l2 -> gather-latency / bandwidth.
Run: python -m experiments.probes.mgpu_attention_limits   (GPU; on the CPU: a small interpreted smoke run)
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_kernels import attention_sets, cupti_ms
from pallas_kernels import attention_mgpu as am
from pallas_kernels.attention import auto_splits, sparse_attention

H, D, RING, W, K, CTX = 64, 512, 136, 128, 512, 131072
CASES = (("csa decode B64", 64, 1, True), ("csa decode B256", 256, 1, True), ("csa verify B64x4", 64, 4, True),
         ("hca verify B256x4", 256, 4, False), ("csa prefill 4K", 1, 4096, True), ("hca prefill 4K", 1, 4096, False))


def variants(b, s, csa, comp, sink, q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx, interpret):
    ratio = 4 if csa else 128
    kw = dict(scale=D ** -0.5, window=W, ratio=ratio)
    whole = jax.jit(lambda *a: sparse_attention(*a[:5], ring_kv=a[5], ring_pos=a[6], comp_kv=a[7], comp_idx=a[8],
                                                impl="mgpu", interpret=interpret, **kw))
    whole_args = (q, q_pos, self_kv, self_pos, sink, ring_kv, ring_pos, comp, idx)
    klist = jax.jit(lambda qp, sp, rp, ix: am.key_list(qp, sp, window=W, ring_pos=rp, comp_idx=ix,
                                                      n_comp=comp.shape[1], ratio=ratio))
    codes, count = klist(q_pos, self_pos, ring_pos, idx)
    splits = auto_splits(b * s, H, am.HEADS)
    srcs = (ring_kv.reshape(-1, D), self_kv.reshape(b * s, D), comp.reshape(-1, D))
    kern = am._kernel(b * s, codes.shape[1], (am.RING, am.OWN, am.COMP), float(D ** -0.5), splits,
                      am.interpret_flag("mgpu", interpret))
    run = jax.jit(lambda q, c, n, sink, *srcs: kern(q.reshape(b * s, H, D), c, n, sink, *srcs))  # no constants
    l2_rows = jnp.arange(codes.shape[1], dtype=jnp.int32) % min(am.BLOCK, srcs[0].shape[0])
    l2_codes = jnp.broadcast_to(l2_rows * 4 + am.RING, codes.shape)
    return {"whole": (whole, whole_args), "key_list": (klist, (q_pos, self_pos, ring_pos, idx)),
            "kernel": (run, (q, codes, count, sink, *srcs)), "kernel_l2": (run, (q, l2_codes, count, sink, *srcs)),
            "kernel_empty": (run, (q, codes, jnp.zeros_like(count), sink, *srcs))}, codes.shape[1], splits


def main() -> None:
    gpu = jax.default_backend() == "gpu"
    cases = CASES if gpu else (("csa smoke", 2, 3, True),)
    print("| case | list width | splits | " + " | ".join(("whole", "key_list", "kernel", "kernel_l2", "kernel_empty"))
          + " | (us, CUPTI) |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    for name, b, s, csa in cases:
        ctx = CTX if gpu else 400
        ratio = 4 if csa else 128
        shared, sets = attention_sets(jax.random.key(b * 10 + s), b=b, s=s, h=H, d=D, ring=RING if gpu else 20,
                                      n=ctx // ratio, k=K if gpu else 16, ratio=ratio, start=ctx - s, csa=csa,
                                      n_sets=1)
        vs, width, splits = variants(b, s, csa, *shared, *sets[0], interpret=not gpu)
        outs = {}
        for v, (f, args) in vs.items():
            outs[v] = jax.block_until_ready(f(*args))
        np.testing.assert_allclose(np.asarray(outs["kernel"] if splits == 1 else am._combine(*outs["kernel"],
                                                                                           shared[1]), np.float32),
                                   np.asarray(outs["whole"], np.float32).reshape(b * s, H, D), rtol=1e-2, atol=1e-3)
        times = [f"{statistics.median(cupti_ms(f, *args, iterations=10)) * 1e3:.1f}" if gpu else "-"
                 for f, args in vs.values()]
        print(f"| {name} | {width} | {splits} | " + " | ".join(times) + " |", flush=True)


if __name__ == "__main__":
    main()
