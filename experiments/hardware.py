"""Hardware ceilings every floor uses: one table of profiles, each figure with its source.

A profile is a dict: `hbm_Bps` (HBM streaming), `bf16_flops` / `fp8_flops` (dense MMA peaks), `hbm_capacity_bytes`.
`H200_MEASURED` is the best figure any code reached on our H200 (ours or a library's: a floor our own kernel beats
is not a floor); `H200_DATASHEET` the vendor's. Records report floors at both, side by side.
"""

from __future__ import annotations

H200_MEASURED = {
    "name": "H200 best measured",
    "hbm_Bps": 4.4e12,              # our bf16 MoE decode kernel streams 4.37 TB/s (experiments/bench_moe.py, CUPTI)
    "bf16_flops": 790e12,           # 8192^3 bf16: jnp.dot 790, jax's hopper_matmul_mgpu 791, PyTorch 769-798
    "fp8_flops": 1525e12,           # 8192^3 e4m3 through cuBLAS (XLA with --xla_gpu_enable_triton_gemm=false)
    "hbm_capacity_bytes": 139 * 2 ** 30,  # what jax reports on the H200 we use
    "source": "BENCHMARKS.md section 1 (measured on the lent H200, jax 0.11.2)",
}
H200_DATASHEET = {
    "name": "H200 datasheet",
    "hbm_Bps": 4.8e12,
    "bf16_flops": 989e12,
    "fp8_flops": 1979e12,
    "hbm_capacity_bytes": 141e9,
    "source": "NVIDIA H200 SXM datasheet (dense, no sparsity)",
}
CEILINGS = {"measured": H200_MEASURED, "datasheet": H200_DATASHEET}
