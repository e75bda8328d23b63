"""Routed-expert SwiGLU block as grouped GEMMs in Pallas (docs/model.md §9 experts, §14 FP8/FP4 weights).

    experts.py        moe_experts, the entry point: dispatch, the two grouped GEMMs, combine
    routing.py        the routing plan (route_plan, RoutePlan, max_tiles) and forced_balance
    layouts.py        the weight storage formats, the FP4 held-word and kernel-scale layouts and their conversions
    configs.py        TritonConfig, MgpuConfig
    tuning.py         the tuning table as data: default_config, choose_backend, single_expert_tiling,
                      invariant_tiling
    triton_gemm.py    the Triton grouped GEMMs (every format)
    mgpu_pipeline.py  the warp-specialised Mosaic GPU skeleton both orientations run
    mgpu_rows.py      Mosaic GPU row tiles (prefill: dense, FP8 x FP8)
    mgpu_swap.py      Mosaic GPU swap_ab tiles (decode / verify, and FP8 / FP4 prefill)
    row_kernels.py    the small Triton kernels: transpose, take_rows, act_quant_rows

Backends: "triton" (every format; block_m >= 16), "mgpu" (Mosaic GPU: TMA + wgmma, Hopper), "auto" (the tuning
table's choice). On a CPU both run in their interpreters (tests); `interpret=None` chooses that automatically. The
MGPU interpreter has no transposed-SMEM or register wgmma operand: row-tile kernels are interpreted with weights
given as [E, in, out] (`weight_layout="in_out"`), swap_ab kernels with bf16 weights; the rest is checked by
lowering for CUDA at V4-Flash shapes, and on the GPU. docs/kernels.md describes the design and its measurements.
"""

from .configs import MgpuConfig, TritonConfig
from .experts import moe_experts
from .layouts import (E2M1_WORDS_PTX, FP4_FIELD_BITS, FP4_GROUP, FP4_KERNEL_FOLD, FP4_KERNEL_MAX_BYTE,
                      FP4_WORD_SHIFTS, e2m1_word_decode, e8m0_bf16, expert_bytes, fp4_held_bit, fp4_kernel_scales,
                      fp4_kernel_weights, fp4_logical_shape, fp4_scale_bytes, fp4_weight_bytes, is_fp4_kernel_layout,
                      logical_shape, quantize_experts_fp4, quantize_experts_fp8, swap_operands, weight_format)
from .routing import RoutePlan, forced_balance, max_tiles, route_plan
from .row_kernels import act_quant_rows, take_rows, transpose
from .tuning import BACKENDS, TILINGS, choose_backend, default_config, invariant_tiling, single_expert_tiling

__all__ = [
    "BACKENDS", "E2M1_WORDS_PTX", "FP4_FIELD_BITS", "FP4_GROUP", "FP4_KERNEL_FOLD", "FP4_KERNEL_MAX_BYTE",
    "FP4_WORD_SHIFTS", "MgpuConfig", "RoutePlan", "TILINGS", "TritonConfig", "act_quant_rows", "choose_backend",
    "default_config", "e2m1_word_decode", "e8m0_bf16", "expert_bytes", "forced_balance", "fp4_held_bit",
    "fp4_kernel_scales", "fp4_kernel_weights", "fp4_logical_shape", "fp4_scale_bytes", "fp4_weight_bytes",
    "invariant_tiling", "is_fp4_kernel_layout", "logical_shape", "max_tiles", "moe_experts", "quantize_experts_fp4",
    "quantize_experts_fp8", "route_plan", "single_expert_tiling", "swap_operands", "take_rows", "transpose",
    "weight_format",
]
