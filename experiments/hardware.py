"""Hardware profiles every floor uses: one table, each figure with its source.

A profile is a dict (JSON-ready):

  name                 what it describes
  hbm_Bps              HBM streaming bandwidth per GPU, bytes/s
  hbm_capacity_bytes   HBM per GPU, bytes
  bf16_flops           dense (no 2:4 sparsity) MMA peaks per GPU, FLOP/s, by operand format;
  fp8_flops            `fp4_flops` is 0 where the GPU has no FP4 MMA (Hopper)
  fp4_flops
  nvlink_Bps           NVLink bandwidth per GPU in one direction, bytes/s (a GPU sends and receives at once)
  nvlink_domain        GPUs one NVLink domain joins (an HGX board: 8; an NVL72 rack: 72)
  scaleout_Bps         network bandwidth per GPU beyond the NVLink domain, one direction, bytes/s
  sources              {figure: where it comes from}; "uncertain" marks figures the sources disagree on

Vendors quote peaks "with sparsity" (twice the dense rate), links as bidirectional totals or in Gb/s, and
rack systems as totals over 72 GPUs: the table keeps the published figure and converts it (`dense`,
`per_direction`, `gbit`, `per_gpu`), so each entry reads like its datasheet.

`H200_MEASURED` (`--hardware h200`, the default) is the best figure any code reached on our H200 (ours or a
library's: a floor our own kernel beats is not a floor); its links are the datasheet's (not measured here).
`H200_DATASHEET` is the vendor's. Records report floors at both, side by side.
"""

from __future__ import annotations

NVL72 = 72                  # GPUs of one GB200 / GB300 NVL72 rack
HGX = 8                     # GPUs of one HGX board


def dense(with_sparsity: float) -> float:
    """A peak quoted with 2:4 sparsity -> the dense peak."""
    return with_sparsity / 2


def per_direction(bidirectional: float) -> float:
    """A link bandwidth quoted as the two directions' total -> one direction."""
    return bidirectional / 2


def gbit(gbit_per_s: float) -> float:
    """A network port's Gb/s -> bytes/s."""
    return gbit_per_s * 1e9 / 8


def per_gpu(rack_total: float, gpus: int = NVL72) -> float:
    """A rack system's total -> one GPU's share."""
    return rack_total / gpus


FIELDS = ("hbm_Bps", "hbm_capacity_bytes", "bf16_flops", "fp8_flops", "fp4_flops", "nvlink_Bps", "nvlink_domain",
          "scaleout_Bps")


def _profile(name: str, **figures: tuple[float, str]) -> dict:
    """A profile from (value, source) pairs, one per field of FIELDS."""
    missing = sorted(set(FIELDS) - set(figures))
    if missing:
        raise ValueError(f"profile {name!r} lacks {missing}")
    prof: dict = {"name": name}
    prof.update({k: float(v) for k, (v, _) in figures.items()})
    prof["nvlink_domain"] = int(prof["nvlink_domain"])
    prof["sources"] = {k: src for k, (_, src) in figures.items()}
    return prof


_H200_LINKS = {
    "nvlink_Bps": (per_direction(900e9), "H200 SXM datasheet: NVLink 900 GB/s (both directions)"),
    "nvlink_domain": (HGX, "HGX H200: 8 GPUs on NVLink switches"),
    "scaleout_Bps": (gbit(400), "HGX H200 reference design: one ConnectX-7 400 Gb/s NIC per GPU"),
}

H200_MEASURED = _profile(
    "H200 best measured",
    hbm_Bps=(4.4e12, "our bf16 MoE decode kernel streams 4.37 TB/s (experiments/bench_moe.py, CUPTI); "
                     "BENCHMARKS.md section 1"),
    hbm_capacity_bytes=(139 * 2 ** 30, "what jax reports on the H200 we use"),
    bf16_flops=(790e12, "8192^3 bf16: jnp.dot 790, jax's hopper_matmul_mgpu 791, PyTorch 769-798 (BENCHMARKS.md 1)"),
    fp8_flops=(1525e12, "8192^3 e4m3 through cuBLAS (XLA with --xla_gpu_enable_triton_gemm=false; BENCHMARKS.md 1)"),
    fp4_flops=(0.0, "Hopper has no FP4 MMA"),
    **{k: (v, src + " (not measured here)") for k, (v, src) in _H200_LINKS.items()},
)
H200_DATASHEET = _profile(
    "H200 datasheet",
    hbm_Bps=(4.8e12, "NVIDIA H200 SXM datasheet: 4.8 TB/s"),
    hbm_capacity_bytes=(141e9, "NVIDIA H200 SXM datasheet: 141 GB HBM3e"),
    bf16_flops=(989e12, "NVIDIA H200 SXM datasheet: BF16 1,979 TFLOPS with sparsity"),
    fp8_flops=(1979e12, "NVIDIA H200 SXM datasheet: FP8 3,958 TFLOPS with sparsity"),
    fp4_flops=(0.0, "Hopper has no FP4 MMA"),
    **_H200_LINKS,
)
H100 = _profile(
    "H100 SXM datasheet",
    hbm_Bps=(3.35e12, "NVIDIA H100 SXM datasheet: 3.35 TB/s"),
    hbm_capacity_bytes=(80e9, "NVIDIA H100 SXM datasheet: 80 GB HBM3"),
    bf16_flops=(dense(1979e12), "NVIDIA H100 SXM datasheet: BF16 1,979 TFLOPS with sparsity"),
    fp8_flops=(dense(3958e12), "NVIDIA H100 SXM datasheet: FP8 3,958 TFLOPS with sparsity"),
    fp4_flops=(0.0, "Hopper has no FP4 MMA"),
    nvlink_Bps=(per_direction(900e9), "NVIDIA H100 SXM datasheet: NVLink 900 GB/s (both directions)"),
    nvlink_domain=(HGX, "HGX H100: 8 GPUs on NVLink switches"),
    scaleout_Bps=(gbit(400), "DGX / HGX H100: one ConnectX-7 400 Gb/s NIC per GPU"),
)
B200 = _profile(
    "B200 (HGX B200) datasheet",
    hbm_Bps=(per_gpu(64e12, HGX), "NVIDIA HGX B200 datasheet: 64 TB/s HBM3e per 8 GPUs (uncertain: some per-GPU "
                                  "tables give 7.7 TB/s)"),
    hbm_capacity_bytes=(per_gpu(1.44e12, HGX), "NVIDIA HGX B200 datasheet: 1.4 TB per 8 GPUs (B200-SXM-180GB)"),
    bf16_flops=(dense(per_gpu(36e15, HGX)), "NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS per 8 GPUs with sparsity"),
    fp8_flops=(dense(per_gpu(72e15, HGX)), "NVIDIA HGX B200 datasheet: FP8/FP6 72 PFLOPS per 8 GPUs with sparsity"),
    fp4_flops=(per_gpu(72e15, HGX), "NVIDIA HGX B200 datasheet: FP4 72 PFLOPS per 8 GPUs dense (9 PF per GPU)"),
    nvlink_Bps=(per_direction(1.8e12), "NVIDIA HGX B200 datasheet: NVLink 5 1.8 TB/s GPU-to-GPU (both directions)"),
    nvlink_domain=(HGX, "HGX B200: 8 GPUs on NVLink 5 switches"),
    scaleout_Bps=(per_direction(per_gpu(0.8e12, HGX)), "NVIDIA HGX B200 datasheet: networking 0.8 TB/s per 8 GPUs "
                                                       "(one 400 Gb/s ConnectX-7 per GPU)"),
)
B300 = _profile(
    "B300 (HGX B300) datasheet",
    hbm_Bps=(per_gpu(64e12, HGX), "NVIDIA HGX B300 datasheet: up to 8 TB/s per GPU (64 TB/s per 8 GPUs)"),
    hbm_capacity_bytes=(288e9, "NVIDIA HGX B300 datasheet: 288 GB HBM3e per GPU (2.3 TB per 8)"),
    bf16_flops=(dense(per_gpu(36e15, HGX)), "NVIDIA HGX B300 datasheet: FP16/BF16 36 PFLOPS per 8 GPUs with sparsity"),
    fp8_flops=(dense(per_gpu(72e15, HGX)), "NVIDIA HGX B300 datasheet: FP8/FP6 72 PFLOPS per 8 GPUs with sparsity"),
    fp4_flops=(per_gpu(108e15, HGX), "NVIDIA HGX B300 datasheet: FP4 108 PFLOPS per 8 GPUs dense (uncertain: "
                                     "secondary per-GPU tables give 13-14 PF dense)"),
    nvlink_Bps=(per_direction(1.8e12), "NVIDIA HGX B300 datasheet: NVLink 5 1.8 TB/s GPU-to-GPU (both directions)"),
    nvlink_domain=(HGX, "HGX B300: 8 GPUs on NVLink 5 switches"),
    scaleout_Bps=(gbit(800), "NVIDIA HGX B300 datasheet: one ConnectX-8 800 Gb/s SuperNIC per GPU"),
)
GB200_NVL72 = _profile(
    "GB200 NVL72 datasheet (per GPU)",
    hbm_Bps=(per_gpu(576e12), "NVIDIA GB200 NVL72 datasheet: HBM3e 576 TB/s per rack"),
    hbm_capacity_bytes=(per_gpu(13.4e12), "NVIDIA GB200 NVL72 datasheet: up to 13.4 TB HBM3e per rack (186 GB "
                                          "per GPU)"),
    bf16_flops=(dense(per_gpu(360e15)), "NVIDIA GB200 NVL72 datasheet: FP16/BF16 360 PFLOPS per rack with sparsity "
                                        "(uncertain: a per-GPU table gives 2.25 PF dense)"),
    fp8_flops=(dense(per_gpu(720e15)), "NVIDIA GB200 NVL72 datasheet: FP8/FP6 720 PFLOPS per rack with sparsity "
                                       "(uncertain: a per-GPU table gives 4.5 PF dense)"),
    fp4_flops=(dense(per_gpu(1440e15)), "NVIDIA GB200 NVL72 datasheet: FP4 1,440 PFLOPS per rack with sparsity "
                                        "(uncertain: a per-GPU table gives 9 PF dense)"),
    nvlink_Bps=(per_direction(per_gpu(130e12)), "NVIDIA GB200 NVL72 datasheet: NVLink 130 TB/s per rack "
                                                "(1.8 TB/s per GPU, both directions)"),
    nvlink_domain=(NVL72, "GB200 NVL72: one NVLink domain of 72 GPUs"),
    scaleout_Bps=(gbit(400), "GB200 NVL72 compute trays: one ConnectX-7 400 Gb/s NIC per GPU (uncertain: "
                             "deployments differ)"),
)
GB300_NVL72 = _profile(
    "GB300 NVL72 datasheet (per GPU)",
    hbm_Bps=(per_gpu(576e12), "NVIDIA GB300 NVL72 datasheet: HBM3e 576 TB/s per rack (8 TB/s per GPU)"),
    hbm_capacity_bytes=(per_gpu(20e12), "NVIDIA GB300 NVL72 datasheet: up to 20 TB HBM3e per rack (288 GB "
                                        "nominal per GPU; ~279 GB usable)"),
    bf16_flops=(dense(per_gpu(360e15)), "NVIDIA GB300 NVL72 datasheet: FP16/BF16 360 PFLOPS per rack with sparsity"),
    fp8_flops=(dense(per_gpu(720e15)), "NVIDIA GB300 NVL72 datasheet: FP8/FP6 720 PFLOPS per rack with sparsity "
                                       "(360 PF dense)"),
    fp4_flops=(per_gpu(1080e15), "NVIDIA GB300 NVL72 datasheet: FP4 1,440 PFLOPS with sparsity, 1,080 dense "
                                 "per rack"),
    nvlink_Bps=(per_direction(per_gpu(130e12)), "NVIDIA GB300 NVL72 datasheet: NVLink 130 TB/s per rack "
                                                "(1.8 TB/s per GPU, both directions)"),
    nvlink_domain=(NVL72, "GB300 NVL72: one NVLink domain of 72 GPUs"),
    scaleout_Bps=(gbit(800), "GB300 NVL72: 72 ConnectX-8 800 Gb/s SuperNICs, one per GPU"),
)

PROFILES = {
    "h200": H200_MEASURED,
    "h200-datasheet": H200_DATASHEET,
    "h100": H100,
    "b200": B200,
    "b300": B300,
    "gb200": GB200_NVL72,
    "gb300": GB300_NVL72,
}


def profile(name: str) -> dict:
    """A copy of the profile `name` (a key of PROFILES)."""
    if name not in PROFILES:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(PROFILES)}")
    prof = dict(PROFILES[name])
    prof["sources"] = dict(prof["sources"])
    return prof
