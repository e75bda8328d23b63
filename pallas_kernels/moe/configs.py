"""The tilings of the MoE grouped-GEMM kernels: `TritonConfig` and `MgpuConfig` (the values each regime gets
are the tuning table's, `tuning.py`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Tiles of the Triton kernels. All powers of two; block_m >= 16 (tl.dot)."""
    block_m: int = 16
    block_n: int = 64        # gate/up: columns of I per program
    block_k: int = 128       # gate/up: slice of D per step
    block_n_down: int = 64   # down: columns of D per program
    block_k_down: int = 128  # down: slice of I per step
    num_warps: int = 4
    num_stages: int = 4


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiles of the Mosaic GPU kernels. Row tiles: compute_wgs compute warpgroups per CTA (plus one TMA
    warpgroup), each owning block_m / compute_wgs rows (wgmma M, a multiple of 64); swap_ab: each owning
    block_n / compute_wgs weight rows."""
    block_m: int = 64          # rows per tile (route_plan's block_m)
    block_n: int = 128         # gate/up: gate and up each [block_m, block_n] f32 accumulators
    block_k: int = 64
    block_n_down: int = 256    # down: one [block_m, block_n_down] accumulator (<= 256)
    block_k_down: int = 64
    max_concurrent_steps: int = 4
    route_weight_in_kernel: bool = True   # False: apply the routing weight in the f32 combine
    # swap_ab: weights are wgmma's M operand and tokens its N (decode/verify tiles of 16..256 rows; FP8 and FP4
    # weights dequantised in registers). Then block_m = tokens per tile (multiple of 16), block_n / block_n_down =
    # weight rows per tile (multiples of 64); FP4 steps are whole 32-column scale groups (block_k % 32 == 0).
    swap_ab: bool = False
    # compute warpgroups per CTA: row tiles split the tile's rows, swap_ab the weight rows among them
    compute_wgs: int = 1
    # a dedicated TMA warpgroup feeds the compute ones (emit_pipeline_warp_specialized); False (compute_wgs=1
    # only): the compute warpgroup issues its own copies (emit_pipeline), which the swap_ab decode tiles prefer
    warp_specialized: bool = True
    # warp-specialised only: one CTA per SM loops over the (tile, block) items, overlapping an item's epilogue with
    # the next one's first copies; a tiling choice (faster for some prefill tilings, slower for others)
    persistent: bool = False

    def __post_init__(self):
        if not 1 <= self.compute_wgs <= 3:   # four compute warpgroups: an FP4 decode tile never finished on the H200
            raise ValueError(f"MgpuConfig: compute_wgs must be 1, 2 or 3 (4 did not finish on the H200), "
                             f"got {self.compute_wgs}")
        if self.persistent and not self.warp_specialized:
            raise ValueError("MgpuConfig: persistent CTAs need warp specialisation (a TMA warpgroup)")
        if not self.warp_specialized and self.compute_wgs != 1:
            raise ValueError(f"MgpuConfig: without warp specialisation one warpgroup computes, got "
                             f"compute_wgs={self.compute_wgs}")
