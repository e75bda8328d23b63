"""What the roofline charges per weight and cache format: the weight formats a floor knows (the release's and
this engine's), each matrix's class by its official name, its bytes per parameter, the MMA peak its GEMMs run
at, and the bytes of one cached entry per KV format."""

from __future__ import annotations

PHASES = ("prefill", "decode")
# Weight formats: name -> (the release's FP8 "dense" tensors held as, routed experts held as). The first three
# are the release's names, the others this engine's (bench_floor.weight_format: cfg.dense_weights /
# cfg.expert_weights).
# A floor charges each GEMM at the peak of the MMA its weights' format allows (gemm_peak): FP8 / FP4 weights
# with FP8 activations run FP8 MMA (Hopper has no FP4 MMA), BF16 weights the BF16 MMA.
WEIGHT_FORMATS = {
    "bf16": ("bf16", "bf16"),
    "fp8": ("fp8", "fp8"),
    "fp4-experts": ("fp8", "fp4"),
    "bf16-fp4-experts": ("bf16", "fp4"),
    "fp8-dense": ("fp8", "bf16"),
    "fp8-fp4-experts": ("fp8", "fp4"),
}
WEIGHT_DTYPES = tuple(WEIGHT_FORMATS)
KV_DTYPES = ("bf16", "fp8", "packed")
COMPONENTS = ("attn_proj", "attn_core", "indexer", "compressor", "moe_experts", "shared_expert", "router",
              "mhc", "head", "engram", "kv_write", "drafter")
BYTE_KINDS = ("weight_bytes", "kv_read_bytes", "kv_write_bytes", "other_bytes")


# ----------------------------------------------------------------------------------------------- formats

def matrix_class(name: str) -> str:
    """Tensor class of a weight matrix by its official module name ("attn.wq_a", "ffn.shared_experts.w1",
    "mtp.0.main_proj", ...): "dense" where the release stores it FP8 (model.quant_io.release_fp8, the rule
    the model's cfg.dense_weights="fp8" follows), else "bf16"."""
    from model.quant_io import release_fp8

    return "dense" if release_fp8(name + ".weight") else "bf16"


def bytes_per_param(cfg, cls: str, weight_dtype: str) -> float:
    """HBM bytes per logical parameter of a tensor class in a weight format (scales included).

    cls: "dense" (FP8 in the release), "expert" (routed; FP4 in the release), "bf16" (BF16 in the
    release), "fp32", "int" (tid2eid, int32), "table" (Engram rows: FP8 + one UE8M0 per 32).
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    fixed = {"bf16": 2.0, "fp32": 4.0, "int": 4.0, "table": 1.0 + 1.0 / 32}
    if cls in fixed:
        return fixed[cls]
    if cls not in ("dense", "expert"):
        raise ValueError(f"unknown tensor class {cls!r}")
    dense, expert = WEIGHT_FORMATS[weight_dtype]
    held = dense if cls == "dense" else expert
    return {"bf16": 2.0, "fp8": 1.0 + 1.0 / cfg.fp8_block ** 2, "fp4": 0.5 + 1.0 / 32}[held]


def gemm_peak(cls: str, weight_dtype: str, ceilings: dict) -> float:
    """The GEMM peak for a tensor class in a weight format: the FP4 peak where the class is held FP4 and the
    hardware has FP4 MMA (FP4 activations, as SGLang's W4A4 MegaMoE runs them), else the FP8 peak where it is
    held FP8 / FP4 (and for Engram rows, FP8 in every format), the BF16 peak for everything else."""
    if cls == "table":
        return ceilings["fp8_flops"]
    if cls in ("dense", "expert"):
        dense, expert = WEIGHT_FORMATS[weight_dtype]
        held = dense if cls == "dense" else expert
        if held == "fp4" and ceilings.get("fp4_flops"):
            return ceilings["fp4_flops"]
        if held in ("fp8", "fp4"):
            return ceilings["fp8_flops"]
    return ceilings["bf16_flops"]


def uniform_mma(weight_dtype: str) -> str:
    """The MMA of a format's quantised tensors: "fp8" when any class is held FP8 / FP4, else "bf16"."""
    return "fp8" if any(f in ("fp8", "fp4") for f in WEIGHT_FORMATS[weight_dtype]) else "bf16"


def kv_entry_bytes(cfg, kv_dtype: str) -> dict:
    """Bytes of one window row, one compressed (global) entry and one index key in a KV format."""
    from model.cache import packed_entry_bytes

    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    dh, di = cfg.head_dim, cfg.index_head_dim
    # index keys cached as MXFP4 rows (ModelConfig.index_key_format="fp4") whatever the KV format
    index = packed_entry_bytes(cfg, "index") if cfg.index_key_format == "fp4" else None
    if kv_dtype == "bf16":
        return {"window": 2.0 * dh, "comp": 2.0 * dh, "index": index or 2.0 * di}
    # FP8 rows: V4 keeps the RoPE dims in BF16 (FlashMLA 584 B row), V4.1 quantises all dims per 32.
    fp8_row = packed_entry_bytes(cfg, "comp") if cfg.generation == "v4" else dh + dh / 32
    if kv_dtype == "fp8":
        return {"window": fp8_row, "comp": fp8_row, "index": index or di + di / 32}
    return {"window": fp8_row, "comp": packed_entry_bytes(cfg, "comp"), "index": packed_entry_bytes(cfg, "index")}


def memory_estimate_args(kv_dtype: str):
    import jax.numpy as jnp

    return {"bf16": (jnp.bfloat16, False), "fp8": (jnp.float8_e4m3fn, False), "packed": (jnp.bfloat16, True)}[kv_dtype]
