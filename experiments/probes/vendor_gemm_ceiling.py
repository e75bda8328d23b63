"""Tool: the vendor's own GEMMs at the routed experts' shapes under forced balance -- the ceiling a grouped-GEMM
kernel is compared against (docs/kernels.md, MoE grouped GEMMs).

With forced balance at 8K tokens every one of the 256 experts holds exactly 192 rows, so the grouped GEMMs are
batched GEMMs, which XLA hands to cuBLAS(Lt):
  gate/up  [256, 192, 4096] x [256, 4096, 4096]   (w1 | w3 side by side: N = 2 x 2048)
  down     [256, 192, 2048] x [256, 2048, 4096]
in bf16 and in FP8 E4M3 (bf16 out, one scale per tensor: no per-128 block scales and no FP4 decode, so an upper
bound for what a block-scaled FP4 x FP8 kernel could reach), plus the dense 8192^3 GEMM behind the ceilings of
experiments/hardware.py. CUPTI ms (median of 20 calls, all kernels of the jitted call) and TFLOP/s; the two expert
GEMMs together are 2.474 TFLOP.
--torch times the same expert GEMMs as PyTorch's grouped GEMMs (CUTLASS on sm_90): torch._grouped_mm in bf16 and
torch._scaled_grouped_mm in FP8 with row-wise scales (with and without fast accumulation), the routed rows
[256 x 192, K] against [256, K, N]; CUDA-event ms, median of 20.
Run: python -m experiments.probes.vendor_gemm_ceiling [--dtypes bf16,fp8] [--torch]   (GPU; elsewhere it says so)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_kernels import cupti_ms

E, ROWS, D, I = 256, 192, 4096, 2048
CASES = {   # name: (lhs shape, rhs shape) -- batch dimension first where there is one
    "gate/up, 256 x 192 rows": ((E, ROWS, D), (E, D, 2 * I)),
    "down, 256 x 192 rows": ((E, ROWS, I), (E, I, D)),
    "dense 8192^3": ((8192, 8192), (8192, 8192)),
}
DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
EXPERT_TFLOP = 2.0 * E * ROWS * 3 * D * I / 1e12


def gemm(a: jax.Array, b: jax.Array) -> jax.Array:
    """[(B,) M, K] x [(B,) K, N] -> bf16 [(B,) M, N], float32 accumulation."""
    batch = ((0,), (0,)) if a.ndim == 3 else ((), ())
    return jax.lax.dot_general(a, b, (((a.ndim - 1,), (b.ndim - 2,)), batch), preferred_element_type=jnp.bfloat16)


def report(name: str, case: str, ms: float, tflop: float, lib: str = ""):
    print(f"{name:14s} {case:26s} {ms:8.3f} ms  {tflop / ms * 1e3:7.1f} TFLOP/s  {lib}", flush=True)


def experts_line(name: str, ms: float):
    print(f"{name:14s} {'experts (gate/up + down)':26s} {ms:8.3f} ms  {EXPERT_TFLOP / ms * 1e3:7.1f} TFLOP/s",
          flush=True)


def torch_main():
    import torch
    dev = torch.device("cuda")
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * ROWS
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")

    def event_ms(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return float(np.median(times))

    def grouped(a, b, scales, fast):
        if scales is None:
            return torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)
        return torch._scaled_grouped_mm(a, b, *scales, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast)

    for name, fp8, fast in (("bf16", False, False), ("fp8", True, False), ("fp8 fast", True, True)):
        total = 0.0
        for case, (k, n) in (("gate/up, 256 x 192 rows", (D, 2 * I)), ("down, 256 x 192 rows", (I, D))):
            a = torch.randn(E * ROWS, k, device=dev, dtype=torch.bfloat16)
            b = (torch.randn(E, n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5).transpose(-2, -1)  # K-major
            scales = None
            if fp8:   # row-wise scales of one: the FP8 values as they are
                a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
                scales = (torch.ones(E * ROWS, device=dev), torch.ones(E, n, device=dev))
            ms = event_ms(lambda: grouped(a, b, scales, fast))
            total += ms
            report(f"torch {name}", case, ms, 2.0 * E * ROWS * k * n / 1e12)
            del a, b
        experts_line(f"torch {name}", total)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bf16,fp8", help="comma list of: " + ", ".join(DTYPES))
    p.add_argument("--torch", action="store_true", help="PyTorch's grouped GEMMs instead of XLA's batched ones")
    args = p.parse_args(argv)
    if args.torch:
        import torch
        if not torch.cuda.is_available():
            print("vendor_gemm_ceiling --torch: needs a CUDA build of torch and a GPU")
            return
        torch_main()
        return
    if jax.default_backend() != "gpu":
        print("vendor_gemm_ceiling: needs a GPU (CUPTI)")
        return
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}")
    key = jax.random.PRNGKey(0)
    totals = {}
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for cname, (sa, sb) in CASES.items():
            ka, kb = jax.random.split(jax.random.fold_in(key, len(totals)))
            a = jax.random.normal(ka, sa, jnp.float32).astype(dtype)
            b = (jax.random.normal(kb, sb, jnp.float32) * sb[-2] ** -0.5).astype(dtype)
            compiled = jax.jit(gemm).lower(a, b).compile()   # timed, and read for the library XLA chose
            ms = float(np.median(cupti_ms(compiled, a, b, iterations=20)))
            totals[dname, cname] = ms
            hlo = compiled.as_text()
            lib = "cublas" if "cublas" in hlo else "triton" if "triton" in hlo else "other"
            report(f"XLA {dname}", cname, ms, 2.0 * np.prod(sa) * sb[-1] / 1e12, f"({lib})")
            del a, b
        experts_line(f"XLA {dname}", totals[dname, "gate/up, 256 x 192 rows"] + totals[dname, "down, 256 x 192 rows"])


if __name__ == "__main__":
    main()
