"""The MoE kernels' tuning table, as data: which backend `moe_experts(backend="auto")` runs and which tiling
`config=None` gets, by weight format, load (routed rows per expert) and routing.

`TILINGS` maps (backend, formats, rows per expert, routing) to a config; `BACKENDS` maps (formats, rows per
expert) to a backend. Each lookup takes the first entry that matches, in table order, so an entry's
`max_rows` bounds the load from above and the entries before it bound it from below. Every entry carries one
line of why and the records (experiments/results/) that measured it; docs/kernels.md renders both tables
(tests/test_kernels_moe.py keeps them in sync).

Formats: "dense" (bf16 / f16 / f32 weights), "fp8" (FP8 weights, bf16 activations), "fp8xfp8" (FP8 weights
with FP8 activations of their scale block, act_quant), "fp4" (packed E2M1 weights). Routing: "any", or
"balanced192": forced balance with every expert at a multiple of 192 rows and not of 128 (8K tokens at top-6
of 256), which 192-row tiles fit exactly; under other routing they pad more than 128-row tiles.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from ..common import on_hopper
from .configs import MgpuConfig, TritonConfig

BACKEND_NAMES = ("triton", "mgpu")
FORMATS = ("dense", "fp8", "fp8xfp8", "fp4")
ROUTINGS = ("any", "balanced192")
INF = math.inf

# Triton multiplies FP8 x FP8 (act_quant'd activations) up to this many rows per expert; above it the bf16 MMA of
# the rounded activations is faster (bench_moe_20261130-053009, -054113)
TRITON_FP8_MMA_MAX_ROWS = 48


@dataclasses.dataclass(frozen=True)
class Tiling:
    """An entry of TILINGS: loads of at most `max_rows` rows per expert (above the entries before it) of these
    weight formats and routing get `config` on `backend`."""
    backend: str
    formats: tuple[str, ...]
    max_rows: float
    routing: str
    config: TritonConfig | MgpuConfig
    why: str
    records: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Backend:
    """An entry of BACKENDS: on a Hopper GPU with bf16 activations, these formats at at most `max_rows` rows per
    expert run on `backend`."""
    formats: tuple[str, ...]
    max_rows: float
    backend: str
    why: str
    records: tuple[str, ...]


TILINGS = (
    # ---- Mosaic GPU: decode / verify on the swap_ab tiles (weights as wgmma's M: one pass over them per tile)
    Tiling("mgpu", ("fp4",), 16, "any",
           MgpuConfig(block_m=16, block_n=64, block_k=256, block_n_down=64, block_k_down=256, max_concurrent_steps=4,
                      swap_ab=True, warp_specialized=False),
           "64 weight rows x 256-column steps (128-byte TMA rows, two CTAs an SM), one warpgroup issuing its own "
           "copies", ("bench_moe_20261201-073923", "bench_moe_20261201-161623")),
    Tiling("mgpu", ("fp4",), 32, "any",
           MgpuConfig(block_m=32, block_n=128, block_k=256, block_n_down=128, block_k_down=256,
                      max_concurrent_steps=4, swap_ab=True, compute_wgs=2, persistent=True),
           "verify: 32-token tiles, two compute warpgroups in persistent CTAs (they lose at 16-token decode tiles)",
           ("bench_moe_20261201-131940", "bench_moe_20261201-132002")),
    Tiling("mgpu", ("dense",), 16, "any",
           MgpuConfig(block_m=16, block_n=128, block_k=64, block_n_down=256, block_k_down=64, max_concurrent_steps=6,
                      swap_ab=True, warp_specialized=False),
           "bf16 decode on the swap tiles, one warpgroup issuing its own copies (auto takes Triton: faster)",
           ("bench_moe_20261130-150109", "bench_moe_20261201-161623")),
    Tiling("mgpu", ("fp8", "fp8xfp8"), 16, "any",
           MgpuConfig(block_m=16, block_n=128, block_k=128, block_n_down=128, block_k_down=128,
                      max_concurrent_steps=5, swap_ab=True, warp_specialized=False),
           "FP8 dequantised in registers, one 128-block per step; a TMA warpgroup made it slower",
           ("bench_moe_20261130-150046", "bench_moe_20261201-161623")),
    # ---- Mosaic GPU: prefill, warp-specialised (a TMA warpgroup feeding two or three compute warpgroups)
    Tiling("mgpu", ("fp8xfp8",), INF, "balanced192",
           MgpuConfig(block_m=192, block_n=64, block_k=128, block_n_down=128, block_k_down=128,
                      max_concurrent_steps=4, compute_wgs=3, persistent=True),
           "FP8 x FP8 row tiles of 192 rows (three compute warpgroups, no padding), persistent CTAs",
           ("bench_moe_20261130-182128", "bench_moe_20261201-162014")),
    Tiling("mgpu", ("fp8xfp8",), INF, "any",
           MgpuConfig(block_m=128, block_n=64, block_k=128, block_n_down=128, block_k_down=128,
                      max_concurrent_steps=6, compute_wgs=2, persistent=True),
           "FP8 x FP8 row tiles: 64 gate/up columns (partial and total float32 accumulators; 128 spill), persistent",
           ("bench_moe_20261130-174921", "bench_moe_20261201-144235")),
    Tiling("mgpu", ("fp4",), INF, "balanced192",
           MgpuConfig(block_m=192, block_n=128, block_k=128, block_n_down=128, block_k_down=128,
                      max_concurrent_steps=3, swap_ab=True, compute_wgs=2, persistent=True),
           "FP4 swap tiles of 192 tokens, 128-column steps (3 slots fit), persistent CTAs",
           ("bench_moe_20261201-160201", "bench_moe_20261201-161751")),
    Tiling("mgpu", ("fp8", "fp4"), INF, "any",
           MgpuConfig(block_m=128, block_n=128, block_k=128, block_n_down=128, block_k_down=128,
                      max_concurrent_steps=4, swap_ab=True, compute_wgs=2, persistent=True),
           "swap tiles of 128 tokens, weights dequantised in registers by two compute warpgroups, 128-column steps, "
           "persistent CTAs", ("bench_moe_20261130-144938", "bench_moe_20261201-160744")),
    Tiling("mgpu", ("dense",), INF, "balanced192",
           MgpuConfig(block_m=192, block_n=64, block_k=64, block_n_down=128, block_k_down=64, max_concurrent_steps=4,
                      compute_wgs=3, persistent=True),
           "row tiles of 192 rows, three compute warpgroups (152 registers a thread: 64-column steps), persistent",
           ("bench_moe_20261130-182205", "bench_moe_20261201-162502", "bench_moe_20261201-161751")),
    Tiling("mgpu", ("dense",), 64, "any", MgpuConfig(),
           "the dataclass defaults: not swept at these loads, where auto takes Triton", ()),
    Tiling("mgpu", ("dense",), INF, "any",
           MgpuConfig(block_m=128, block_n=128, block_k=64, block_n_down=256, block_k_down=64, max_concurrent_steps=4,
                      compute_wgs=2),
           "row tiles of 128 rows, two compute warpgroups, a CTA per item (persistent CTAs lost here)",
           ("bench_moe_20261201-125634", "bench_moe_20261201-125725", "bench_moe_20261201-144150")),
    # ---- Triton: any format; a tile of block_m rows per program
    Tiling("triton", FORMATS, 16, "any", TritonConfig(block_m=16),
           "decode: one tile holds all of an expert's rows, so each touched expert's weights stream once",
           ("bench_moe_20261201-161623",)),
    Tiling("triton", FORMATS, 48, "any", TritonConfig(block_m=32),
           "verify: one or two 32-row tiles per expert (not swept)", ()),
    Tiling("triton", FORMATS, 64, "any",
           TritonConfig(block_m=64, block_n=128, block_k=64, block_n_down=128, block_k_down=64, num_warps=4,
                        num_stages=3),
           "prefill tiles below half a 128-row tile", ("bench_moe_20261130-023739",)),
    Tiling("triton", FORMATS, INF, "any",
           TritonConfig(block_m=128, block_n=128, block_k=64, block_n_down=128, block_k_down=64, num_warps=8,
                        num_stages=3),
           "128-row tiles once a tile is at least half full (faster than 64-row tiles at 96 and 192 rows)",
           ("bench_moe_20261130-023739", "bench_moe_20261201-161751")),
)

BACKENDS = (
    Backend(("fp4",), INF, "mgpu",
            "registers decode E2M1 into wgmma's operand: faster than Triton at every load",
            ("bench_moe_20261201-161623", "bench_moe_20261201-161751")),
    Backend(("dense", "fp8", "fp8xfp8"), 64, "triton",
            "decode / verify: Triton's bf16 and FP8 x FP8 decode beat the swap kernels (FP8 with bf16 activations "
            "does not: open)", ("bench_moe_20261201-161623", "bench_moe_20261201-162014")),
    Backend(("dense", "fp8", "fp8xfp8"), INF, "mgpu",
            "prefill: the warp-specialised row / swap tiles beat Triton's", ("bench_moe_20261201-161751",
                                                                              "bench_moe_20261201-162014")),
)


def table_format(fmt: str, fp8_acts: bool = False) -> str:
    """The table's format key of a storage format ('dense' | 'fp8' | 'fp4') and whether FP8 activations of the
    weights' block meet FP8 weights."""
    if fmt not in ("dense", "fp8", "fp4"):
        raise ValueError(f"moe tuning: format must be 'dense', 'fp8' or 'fp4', got {fmt!r}")
    if fp8_acts and fmt != "fp8":
        raise ValueError(f"moe tuning: FP8 activations (fp8_acts) go with FP8 weights, got {fmt!r}")
    return "fp8xfp8" if fp8_acts else fmt


def fits_192_row_tiles(num_rows: int, num_experts: int, balanced: bool) -> bool:
    """The "balanced192" routing: forced balance with every expert at a multiple of 192 rows and not of 128."""
    rows_per_expert = num_rows / max(num_experts, 1)
    return (balanced and num_rows % max(num_experts, 1) == 0 and rows_per_expert % 192 == 0
            and rows_per_expert % 128 != 0)


def default_config(backend: str, num_rows: int, num_experts: int, fmt: str = "dense", fp8_acts: bool = False,
                   balanced: bool = False) -> TritonConfig | MgpuConfig:
    """The tiling TILINGS gives `backend` ("triton" | "mgpu") for num_rows routed rows over num_experts experts
    with weights in storage format `fmt`; fp8_acts: FP8 weights with FP8 activations of their block (act_quant);
    balanced: every expert holds exactly num_rows / num_experts rows (forced_balance, the benchmark mode)."""
    if backend not in BACKEND_NAMES:
        raise ValueError(f"moe default_config: backend must be one of {BACKEND_NAMES}, got {backend!r}")
    key = table_format(fmt, fp8_acts)
    rows_per_expert = num_rows / max(num_experts, 1)
    routing = "balanced192" if fits_192_row_tiles(num_rows, num_experts, balanced) else "any"
    for t in TILINGS:
        if t.backend == backend and key in t.formats and rows_per_expert <= t.max_rows and \
                t.routing in ("any", routing):
            return t.config
    raise AssertionError(f"moe tuning: no tiling for {backend} {key} at {rows_per_expert} rows per expert")


def choose_backend(fmt: str, compute_dtype, rows_per_expert: float = 0.0, *, fp8_acts: bool = False,
                   hopper: bool | None = None) -> str:
    """The backend BACKENDS gives a load of `rows_per_expert` with weights in storage format `fmt`. Mosaic GPU only
    on Hopper (`hopper`; None: the default device) with bfloat16 activations; elsewhere, and in the CPU
    interpreters (which have no register wgmma operand), Triton serves all."""
    key = table_format(fmt, fp8_acts)
    if jnp.dtype(compute_dtype) != jnp.dtype(jnp.bfloat16) or not (on_hopper() if hopper is None else hopper):
        return "triton"
    for b in BACKENDS:
        if key in b.formats and rows_per_expert <= b.max_rows:
            return b.backend
    raise AssertionError(f"moe tuning: no backend for {key} at {rows_per_expert} rows per expert")


# batch invariance takes the table's verify tiling at every load (moe_experts(per_slot=True))
INVARIANT_ROWS_PER_EXPERT = 32


def invariant_tiling(fmt: str, compute_dtype, fp8_acts: bool = False, hopper: bool | None = None
                     ) -> tuple[str, TritonConfig | MgpuConfig]:
    """(backend, config) of a weight format under batch invariance: the tables' choice at INVARIANT_ROWS_PER_EXPERT
    rows per expert whatever the load, so which tile a row lands in and how many rows share it never change its
    K loop (FP4 on Hopper: the 32-token swap tiles; elsewhere Triton's 32-row tiles)."""
    backend = choose_backend(fmt, compute_dtype, INVARIANT_ROWS_PER_EXPERT, fp8_acts=fp8_acts, hopper=hopper)
    return backend, default_config(backend, INVARIANT_ROWS_PER_EXPERT, 1, fmt, fp8_acts=fp8_acts)


def single_expert_tiling(rows: int, hopper: bool | None = None) -> tuple[str, TritonConfig | MgpuConfig | None]:
    """(backend, config) for one FP8 expert in 128 x 128 blocks (bf16 activations) that all `rows` rows pick, as the
    shared expert runs (model/moe.py `MLP`): the table's decode tiles spread one expert's GEMMs over few programs, so
    on Hopper narrower column tiles take more SMs. V4-Flash's shared expert on an H200 (`python -m
    experiments.probes.shared_expert`, probe_shared_expert_20261204_gpu_h200), us per call at 32 / 256 / 1024 rows:
    XLA on the in-graph dequantised weights 57.7 / 81.1 / 126.8, the table's choice 66.7 / 91.0 / 126.8, Triton
    32-column tiles 43.2 / 156.7 / 544.7, Mosaic GPU swap tiles of 64 tokens x 64 weight rows 53.9 / 69.6 / 230.6.
    ("auto", None): the table's choice."""
    if not (on_hopper() if hopper is None else hopper):
        return "auto", None
    if rows <= 64:
        return "triton", TritonConfig(block_m=16, block_n=32, block_k=256, block_n_down=32, block_k_down=256)
    if rows <= 256:
        return "mgpu", MgpuConfig(block_m=64, block_n=64, block_k=128, block_n_down=64, block_k_down=128,
                                  max_concurrent_steps=5, swap_ab=True, warp_specialized=False)
    return "auto", None
