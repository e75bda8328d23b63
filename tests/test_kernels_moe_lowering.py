"""The Pallas MoE kernels' tuning table (pallas_kernels/moe/tuning.py: its entries, the tilings it gives, its copy
in docs/kernels.md) and the CUDA lowering of every kernel at the real V4-Flash expert shapes (256 experts,
4096 -> 2048 -> 4096) from ShapeDtypeStructs: no GPU, no big arrays. Kernel numerics: tests/test_kernels_moe.py.
"""

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from common import cuda_text
from moe_tilings import FP8_ROWS, FP8_ROWS_3WG
from pallas_kernels import moe as K

GPU = jax.default_backend() == "gpu"
E4, D4, I4 = 256, 4096, 2048            # V4-Flash expert shapes


# ------------------------------------------------------------------------------------------ tuning table

# The tilings the decision tree gave before it became a table (pallas_kernels/moe/tuning.py), recorded from that
# code over a grid of loads: rows per expert TUNING_RPE x experts (256, 16) x format x routing, per backend.
TUNING_RPE = (0, 0.5, 1, 6, 16, 16.5, 24, 32, 33, 48, 49, 64, 65, 96, 128, 192, 256, 384, 576, 640)
_T = K.TritonConfig
_M = K.MgpuConfig
TUNING_CONFIGS = {
    "T16": _T(block_m=16),
    "T32": _T(block_m=32),
    "T64": _T(block_m=64, block_n=128, block_k=64, block_n_down=128, block_k_down=64, num_warps=4, num_stages=3),
    "T128": _T(block_m=128, block_n=128, block_k=64, block_n_down=128, block_k_down=64, num_warps=8, num_stages=3),
    "bf16_dec": _M(block_m=16, block_n=128, block_k=64, block_n_down=256, block_k_down=64, max_concurrent_steps=6,
                   swap_ab=True, warp_specialized=False),
    "defaults": _M(),
    "bf16_128": _M(block_m=128, block_n=128, block_k=64, block_n_down=256, block_k_down=64, max_concurrent_steps=4,
                   compute_wgs=2),
    "bf16_192": _M(block_m=192, block_n=64, block_k=64, block_n_down=128, block_k_down=64, max_concurrent_steps=4,
                   compute_wgs=3, persistent=True),
    "fp8_dec": _M(block_m=16, block_n=128, block_k=128, block_n_down=128, block_k_down=128, max_concurrent_steps=5,
                  swap_ab=True, warp_specialized=False),
    "swap_128": _M(block_m=128, block_n=128, block_k=128, block_n_down=128, block_k_down=128,
                   max_concurrent_steps=4, swap_ab=True, compute_wgs=2, persistent=True),
    "fp8x_128": _M(block_m=128, block_n=64, block_k=128, block_n_down=128, block_k_down=128, max_concurrent_steps=6,
                   compute_wgs=2, persistent=True),
    "fp8x_192": _M(block_m=192, block_n=64, block_k=128, block_n_down=128, block_k_down=128, max_concurrent_steps=4,
                   compute_wgs=3, persistent=True),
    "fp4_dec": _M(block_m=16, block_n=64, block_k=256, block_n_down=64, block_k_down=256, max_concurrent_steps=4,
                  swap_ab=True, warp_specialized=False),
    "fp4_ver": _M(block_m=32, block_n=128, block_k=256, block_n_down=128, block_k_down=256, max_concurrent_steps=4,
                  swap_ab=True, compute_wgs=2, persistent=True),
    "fp4_192": _M(block_m=192, block_n=128, block_k=128, block_n_down=128, block_k_down=128,
                  max_concurrent_steps=3, swap_ab=True, compute_wgs=2, persistent=True),
}
_TRITON_ROW = "T16 " * 5 + "T32 " * 5 + "T64 " * 2 + "T128 " * 8
TUNING_EXPECTED = {   # (backend, format, fp8_acts, balanced) -> one config name per TUNING_RPE entry
    **{("triton", f, a, b): _TRITON_ROW for f, a in (("dense", False), ("fp8", False), ("fp8", True), ("fp4", False))
       for b in (False, True)},
    ("mgpu", "dense", False, False): "bf16_dec " * 5 + "defaults " * 7 + "bf16_128 " * 8,
    ("mgpu", "dense", False, True): "bf16_dec " * 5 + "defaults " * 7 + "bf16_128 " * 3 + "bf16_192 bf16_128 "
                                     "bf16_128 bf16_192 bf16_128",
    ("mgpu", "fp8", False, False): "fp8_dec " * 5 + "swap_128 " * 15,
    ("mgpu", "fp8", False, True): "fp8_dec " * 5 + "swap_128 " * 15,
    ("mgpu", "fp8", True, False): "fp8_dec " * 5 + "fp8x_128 " * 15,
    ("mgpu", "fp8", True, True): "fp8_dec " * 5 + "fp8x_128 " * 10 + "fp8x_192 fp8x_128 fp8x_128 fp8x_192 fp8x_128",
    ("mgpu", "fp4", False, False): "fp4_dec " * 5 + "fp4_ver " * 3 + "swap_128 " * 12,
    ("mgpu", "fp4", False, True): "fp4_dec " * 5 + "fp4_ver " * 3 + "swap_128 " * 7 + "fp4_192 swap_128 swap_128 "
                                  "fp4_192 swap_128",
}


def test_tuning_table_gives_the_decision_trees_tilings():
    for (backend, fmt, acts, balanced), names in TUNING_EXPECTED.items():
        for e in (256, 16):
            got = [K.default_config(backend, int(r * e), e, fmt, fp8_acts=acts, balanced=balanced) for r in TUNING_RPE]
            assert got == [TUNING_CONFIGS[n] for n in names.split()], (backend, fmt, acts, balanced, e)
    # the backends: Mosaic GPU on Hopper with bf16 activations, for FP4 at every load and past 64 rows per expert
    for fmt, mgpu_from in (("dense", 65), ("fp8", 65), ("fp4", 0)):
        for acts in (False, True) if fmt == "fp8" else (False,):
            got = [K.choose_backend(fmt, jnp.bfloat16, r, fp8_acts=acts, hopper=True) for r in TUNING_RPE]
            assert got == ["mgpu" if r >= mgpu_from else "triton" for r in TUNING_RPE], (fmt, acts)
            for dtype, hopper in ((jnp.bfloat16, False), (jnp.float16, True), (jnp.float32, True)):
                assert {K.choose_backend(fmt, dtype, r, fp8_acts=acts, hopper=hopper) for r in TUNING_RPE} == \
                    {"triton"}, (fmt, dtype, hopper)


def test_tuning_table_entries_are_valid():
    from pallas_kernels.moe import tuning as T
    results = Path(__file__).resolve().parents[1] / "experiments" / "results"
    for t in T.TILINGS:
        assert t.backend in T.BACKEND_NAMES and set(t.formats) <= set(T.FORMATS) and t.routing in T.ROUTINGS, t
        assert isinstance(t.config, K.TritonConfig if t.backend == "triton" else K.MgpuConfig), t
        assert t.max_rows > 0 and t.why and "\n" not in t.why, t
        for r in t.records:
            assert (results / f"{r}.md").is_file() and (results / f"{r}.json").is_file(), r
    for b in T.BACKENDS:
        assert b.backend in T.BACKEND_NAMES and set(b.formats) <= set(T.FORMATS) and b.why, b
        for r in b.records:
            assert (results / f"{r}.md").is_file(), r
    for backend in T.BACKEND_NAMES:   # every (backend, format) ends in a catch-all entry; every format has a backend
        for fmt in T.FORMATS:
            assert any(t.backend == backend and fmt in t.formats and t.max_rows == T.INF and t.routing == "any"
                       for t in T.TILINGS), (backend, fmt)
            assert any(fmt in b.formats and b.max_rows == T.INF for b in T.BACKENDS), fmt
    # no entry is shadowed: each one is some load's first match (the configs differ, so the grid shows it)
    assert len({t.config for t in T.TILINGS}) == len(T.TILINGS)
    assert {t.config for t in T.TILINGS} == set(TUNING_CONFIGS.values())
    with pytest.raises(ValueError, match="backend must be one of"):
        K.default_config("auto", 64, 8)
    with pytest.raises(ValueError, match="go with FP8 weights"):
        K.default_config("mgpu", 64, 8, "fp4", fp8_acts=True)
    with pytest.raises(ValueError, match="format must be"):
        K.choose_backend("int8", jnp.bfloat16, 4.0)


def _markdown_tilings():
    from pallas_kernels.moe import tuning as T
    rows = ["| backend | formats | rows per expert <= | routing | tiling (fields off the defaults) | why | records |",
            "|---|---|---|---|---|---|---|"]
    for t in T.TILINGS:
        default = type(t.config)()
        fields = [f"{f.name}={getattr(t.config, f.name)}" for f in dataclasses.fields(t.config)
                  if getattr(t.config, f.name) != getattr(default, f.name)]
        rows.append(f"| {t.backend} | {', '.join(t.formats)} | {t.max_rows:g} | {t.routing} | "
                    f"{' '.join(fields) or '(defaults)'} | {t.why} | {', '.join(t.records) or '(none)'} |")
    rows += ["", "| formats | rows per expert <= | backend | why | records |", "|---|---|---|---|---|"]
    rows += [f"| {', '.join(b.formats)} | {b.max_rows:g} | {b.backend} | {b.why} | {', '.join(b.records)} |"
             for b in T.BACKENDS]
    return "\n".join(rows)


def test_tuning_table_matches_docs():
    """docs/kernels.md shows the tuning table rendered from the data (on a mismatch, paste the rendering)."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "kernels.md").read_text()
    rendered = _markdown_tilings()
    assert rendered in docs, "docs/kernels.md's MoE tuning tables differ from the data; rendered:\n" + rendered


# ------------------------------------------------------------------ lowering for CUDA at V4-Flash shapes


def v4_flash_args(fmt, tokens, k=6, layout="out_in"):
    sd = jax.ShapeDtypeStruct
    e, d, i = E4, D4, I4
    if fmt == "bf16":
        a, b = ((e, d, i), (e, i, d)) if layout == "in_out" else ((e, i, d), (e, d, i))
        w13, w2, sc = sd(a, jnp.bfloat16), sd(b, jnp.bfloat16), None
    elif fmt == "fp8":
        w13, w2 = sd((e, i, d), jnp.float8_e4m3fn), sd((e, d, i), jnp.float8_e4m3fn)
        s13, s2 = sd((e, i // 128, d // 128), jnp.uint8), sd((e, d // 128, i // 128), jnp.uint8)
        sc = (s13, s2, s13)
    elif layout == "held":   # FP4 held as fp4_kernel_weights / fp4_kernel_scales
        w13, w2 = sd((e, i, d // 4), jnp.uint16), sd((e, d, i // 4), jnp.uint16)
        s13, s2 = sd((e, d // 32, i), jnp.bfloat16), sd((e, i // 32, d), jnp.bfloat16)
        sc = (s13, s2, s13)
    else:
        w13, w2 = sd((e, i, d // 2), jnp.int8), sd((e, d, i // 2), jnp.int8)
        s13, s2 = sd((e, i, d // 32), jnp.uint8), sd((e, d, i // 32), jnp.uint8)
        sc = (s13, s2, s13)
    return (sd((tokens, d), jnp.bfloat16), sd((tokens, k), jnp.int32), sd((tokens, k), jnp.float32),
            w13, w2, w13), sc


SWAP_DECODE = K.MgpuConfig(block_m=16, block_n=128, block_k=64, block_n_down=128, block_k_down=64,
                           max_concurrent_steps=6, swap_ab=True)
SWAP_DECODE_FP8 = K.MgpuConfig(block_m=16, block_n=128, block_k=128, block_n_down=128, block_k_down=128,
                               max_concurrent_steps=5, swap_ab=True)
SWAP_PREFILL = K.MgpuConfig(block_m=128, block_n=64, block_k=128, block_n_down=128, block_k_down=128,
                            swap_ab=True)


@pytest.mark.skipif(GPU, reason="CPU-only: cross-lowering for CUDA")
@pytest.mark.parametrize("backend,fmt,tokens,layout,cfg", [
    ("triton", "bf16", 64, "out_in", None),       # decode: 384 rows
    ("triton", "bf16", 256, "out_in", None),      # decode: 1536 rows
    ("triton", "fp8", 64, "out_in", None),
    ("triton", "fp4", 256, "out_in", None),
    ("triton", "fp8", 8192, "out_in", None),      # quantised prefill (Triton first version)
    ("triton", "fp4", 8192, "out_in", None),
    ("mgpu", "bf16", 8192, "out_in", None),       # prefill: 49152 rows, the model's layout
    ("mgpu", "bf16", 8192, "in_out", None),
    ("mgpu", "bf16", 64, "out_in", SWAP_DECODE),  # swapped operands, decode tiles of 16 tokens
    ("mgpu", "fp8", 256, "out_in", SWAP_DECODE_FP8),  # FP8 dequantised in registers
    ("mgpu", "fp4", 256, "out_in", SWAP_DECODE),      # FP4 decoded in registers, whole scale groups per step
    ("mgpu", "fp4", 256, "held", None),               # FP4 as the model holds it (fp4_kernel_weights / _scales)
    ("mgpu", "fp4", 64, "out_in", None),
    ("mgpu", "fp4", 1024, "out_in", None),            # verify B256 x 4 rows: 24 rows per expert, 32-token tiles
    ("mgpu", "fp4", 8192, "out_in", None),            # default_config: FP4 prefill on the swap kernels
    ("mgpu", "fp8", 8192, "out_in", SWAP_PREFILL),
    ("mgpu", "bf16", 256, "out_in", None),        # default_config: decode -> swap_ab
    ("mgpu", "fp8", 64, "out_in", None),
])
def test_lower_for_cuda_v4_flash(backend, fmt, tokens, layout, cfg):
    args, sc = v4_flash_args(fmt, tokens, layout=layout)
    cfg = cfg or K.default_config(backend, tokens * 6, E4, "dense" if fmt == "bf16" else fmt)

    def f(x, ids, w, w1, w2, w3, sc):
        return K.moe_experts(x, ids, w, w1, w2, w3, 10.0, scales=sc, backend=backend, config=cfg,
                             interpret=False, weight_layout="out_in" if layout == "held" else layout)

    t0 = time.time()
    text = cuda_text(f, *args, sc)
    target = "mosaic_gpu" if backend == "mgpu" else "__gpu$xla.gpu.triton"
    assert text.count(target) >= 2, f"no {backend} kernels in the lowered module"
    assert time.time() - t0 < 30


@pytest.mark.skipif(GPU, reason="CPU-only: cross-lowering for CUDA")
@pytest.mark.parametrize("fmt,layout", [("fp4", "held"), ("bf16", "out_in")])
@pytest.mark.parametrize("tokens", [8, 8192])
def test_lower_per_slot_for_cuda_v4_flash(fmt, layout, tokens):
    """Batch invariance's expert tiling (invariant_tiling, per-choice outputs): one tiling per format on Hopper at
    any load (FP4: the 32-token swap tiles; bf16: Triton's 32-row tiles), lowered at V4-Flash shapes."""
    name = "dense" if fmt == "bf16" else fmt
    backend, cfg = K.invariant_tiling(name, jnp.bfloat16, hopper=True)
    assert (backend, cfg.block_m) == (("mgpu", 32) if fmt == "fp4" else ("triton", 32))
    args, sc = v4_flash_args(fmt, tokens, layout=layout)
    f = lambda *a: K.moe_experts(*a[:6], 10.0, scales=a[6], backend=backend, config=cfg,  # noqa: E731
                                 interpret=False, per_slot=True)
    out = jax.eval_shape(f, *args, sc)
    assert out.shape == (tokens, 6, D4) and out.dtype == jnp.float32
    text = cuda_text(f, *args, sc)
    assert text.count("mosaic_gpu" if backend == "mgpu" else "__gpu$xla.gpu.triton") >= 2


@pytest.mark.skipif(GPU, reason="CPU-only: cross-lowering for CUDA")
@pytest.mark.parametrize("fmt,act", [("bf16", 0), ("fp4", 0), ("fp8", 128)])
def test_lower_balanced_192_row_tiles(fmt, act):
    """Forced-balance routing at 8K tokens (192 rows per expert): 192-row tiles, three compute warpgroups for
    the row tiles (bf16, FP8 x FP8), 192-token tiles for the FP4 swap kernels; random routing keeps 128."""
    args, sc = v4_flash_args(fmt, 8192)
    f = lambda *a: K.moe_experts(*a[:6], 10.0, scales=a[6], interpret=False, act_block=act,  # noqa: E731
                                 backend="mgpu", balanced=True)
    text = cuda_text(f, *args, sc)
    assert text.count("mosaic_gpu") >= 2
    name = "dense" if fmt == "bf16" else fmt
    assert K.default_config("mgpu", 49152, E4, name, fp8_acts=act > 0, balanced=True).block_m == 192
    # persistent CTAs where they measured faster (the tuning table); the bf16 128-row tiles keep a CTA per item
    assert K.default_config("mgpu", 49152, E4, name, fp8_acts=act > 0, balanced=True).persistent
    assert K.default_config("mgpu", 49152, E4, name, fp8_acts=act > 0).persistent == (fmt != "bf16")
    assert K.default_config("mgpu", 49152, E4, name, fp8_acts=act > 0).block_m == 128
    assert K.default_config("mgpu", 24576, E4, name, fp8_acts=act > 0, balanced=True).block_m == 128


@pytest.mark.skipif(GPU, reason="CPU-only: cross-lowering for CUDA")
@pytest.mark.parametrize("backend,fmt,tokens,cfg", [("triton", "fp8", 8192, None), ("triton", "fp8", 64, None),
                                                    ("mgpu", "fp4", 256, None), ("mgpu", "fp4", 8192, None),
                                                    ("mgpu", "fp8", 8192, FP8_ROWS), ("mgpu", "fp8", 8192, None)])
def test_lower_act_quant_for_cuda_v4_flash(backend, fmt, tokens, cfg):
    """act_block=128 at V4-Flash shapes: FP8 x FP8 dots in Triton and in the Mosaic GPU row tiles (FP8
    weights), float32 SwiGLU output from the Mosaic GPU swap kernels (FP4 weights)."""
    args, sc = v4_flash_args(fmt, tokens)
    f = lambda *a: K.moe_experts(*a[:6], 10.0, scales=a[6], backend=backend, interpret=False,  # noqa: E731
                                 act_block=128, config=cfg)
    text = cuda_text(f, *args, sc)
    assert text.count("mosaic_gpu" if backend == "mgpu" else "__gpu$xla.gpu.triton") >= 2


@pytest.mark.skipif(GPU, reason="CPU-only: cross-lowering for CUDA")
def test_mgpu_smem_budget_is_checked_at_lowering():
    args, _ = v4_flash_args("bf16", 8192)
    cfg = K.MgpuConfig(block_m=128, block_n=256, block_k=128)        # two 128x256 fp32 accs: too big
    f = lambda *a: K.moe_experts(*a, 10.0, backend="mgpu", config=cfg, interpret=False)  # noqa: E731
    with pytest.raises(Exception, match="shared memory"):
        cuda_text(f, *args)


@pytest.mark.skipif(GPU, reason="CPU-only: cross-lowering for CUDA")
def test_a_repeated_expert_block_lowers_its_kernels_once():
    """Two expert blocks of one shape (the scanned layer bodies) lower their Mosaic GPU kernels once: moe_experts
    is jitted, and JAX lowers a jitted call once per module."""
    args, sc = v4_flash_args("fp4", 256)
    block = lambda *a: K.moe_experts(*a[:6], 10.0, scales=a[6], backend="mgpu", interpret=False)  # noqa: E731
    once = cuda_text(block, *args, sc).count("mosaic_gpu")
    twice = cuda_text(lambda *a: block(*a[:7]) + block(a[7], *a[1:7]), *args, sc, args[0])
    assert once >= 2 and twice.count("mosaic_gpu") == once
