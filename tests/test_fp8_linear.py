"""pallas_kernels.fp8_linear: FP8 linears from the stored bytes against the dequantising reference, on seeded random
inputs (interpret mode on CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import cuda_text
from pallas_kernels import reference as ref
from pallas_kernels.fp8_linear import fp8_linear, fp8_linear_reference
from pallas_kernels.moe import MgpuConfig, TritonConfig


def _weights(rng, g, n, k, block):
    w = rng.standard_normal((g, n, k)).astype(np.float32) * k ** -0.5
    w = w * np.exp2(rng.integers(-3, 4, (g, n // block, 1, k // block, 1))).repeat(block, 2).repeat(block, 4).reshape(
        g, n, k)   # block scales that differ
    q, s = jax.vmap(lambda a: ref.quantize_fp8_blocks(a, block))(jnp.asarray(w))
    return q, s


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("seed,g,m,block", [(0, 1, 5, 128), (1, 1, 33, 128), (2, 3, 17, 128), (3, 2, 9, 32)])
def test_triton_bf16_activations(seed, g, m, block):
    """bf16 activations, FP8 weights dequantised in registers: the float32 linear of the dequantised weight."""
    rng = np.random.default_rng(seed)
    k, n = 2 * block * 2, 2 * block
    w, s = _weights(rng, g, n, k, block)
    x = jnp.asarray(rng.standard_normal((g, m, k)), jnp.bfloat16)
    got = fp8_linear(x, w, s, backend="triton", out_dtype=jnp.float32,
                     config=TritonConfig(block_m=16, block_n_down=min(64, block), block_k_down=min(64, block)))
    assert got.shape == (g, m, n) and got.dtype == jnp.float32
    assert _rel(got, fp8_linear_reference(x, w, s)) < 2e-6


@pytest.mark.parametrize("seed,g,m,block", [(6, 1, 5, 128), (7, 3, 17, 32)])
def test_dequantised_path(seed, g, m, block):
    """backend="dequantised" (auto on a GPU above the swap tiles' loads and for 32-blocks): the weight as exact bf16,
    XLA's GEMM with float32 accumulation."""
    rng = np.random.default_rng(seed)
    w, s = _weights(rng, g, 2 * block, 4 * block, block)
    x = jnp.asarray(rng.standard_normal((g, m, 4 * block)), jnp.bfloat16)
    got = fp8_linear(x, w, s, backend="dequantised", out_dtype=jnp.float32)
    assert _rel(got, fp8_linear_reference(x, w, s)) < 2e-6
    with pytest.raises(ValueError, match="dequantised path takes bf16 activations"):
        fp8_linear(x, w, s, act_block=block, backend="dequantised")


@pytest.mark.parametrize("seed,m", [(4, 7), (5, 40)])
def test_triton_fp8_activations(seed, m):
    """act_block = B: the official FP8 GEMM (act_quant, FP8 x FP8 MMA, both scales on each block's partial)."""
    rng = np.random.default_rng(seed)
    w, s = _weights(rng, 1, 256, 512, 128)
    x = jnp.asarray(rng.standard_normal((1, m, 512)) * 3, jnp.bfloat16)
    got = fp8_linear(x, w, s, act_block=128, backend="triton", out_dtype=jnp.float32,
                     config=TritonConfig(block_m=16, block_n_down=64, block_k_down=128))
    assert _rel(got, fp8_linear_reference(x, w, s, act_block=128)) < 2e-6
    assert _rel(got, fp8_linear_reference(x, w, s)) > 1e-3     # the activations were rounded


def test_mgpu_row_tiles_fp8_x_fp8():
    """Prefill: the Mosaic GPU row tiles multiply FP8 x FP8 (interpreted with [G, K, N] weights on CPU)."""
    rng = np.random.default_rng(6)
    g, m, n, k = 2, 150, 256, 256
    w, s = _weights(rng, g, n, k, 128)
    x = jnp.asarray(rng.standard_normal((g, m, k)), jnp.bfloat16)
    cfg = MgpuConfig(block_m=128, block_n=64, block_k=128, block_n_down=128, block_k_down=128, compute_wgs=2)
    got = fp8_linear(x, jnp.swapaxes(w, 1, 2), s, act_block=128, backend="mgpu", config=cfg, out_dtype=jnp.float32,
                     weight_layout="in_out")
    assert _rel(got, fp8_linear_reference(x, w, s, act_block=128)) < 2e-6


def test_bad_inputs_raise():
    rng = np.random.default_rng(7)
    w, s = _weights(rng, 1, 128, 256, 128)
    x = jnp.ones((1, 4, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, w.astype(jnp.bfloat16), s)
    with pytest.raises(ValueError, match="act_block must be 0 or the weights' scale block 128"):
        fp8_linear(x, w, s, act_block=64)
    with pytest.raises(ValueError, match="does not match"):
        fp8_linear(jnp.ones((1, 4, 128), jnp.bfloat16), w, s)
    with pytest.raises(ValueError, match="FP8 x FP8"):
        fp8_linear(x, w, s, backend="mgpu")
    with pytest.raises(ValueError, match="swap tiles take bf16 activations"):
        fp8_linear(x.astype(jnp.float32), w, s, backend="swap")
    with pytest.raises(ValueError, match="swap tiles take bf16 activations"):
        fp8_linear(x, w, s, act_block=128, backend="swap")
    w64, s64 = _weights(rng, 1, 128, 128, 64)
    with pytest.raises(ValueError, match=r"scale blocks of 128 or 32 \(got 64\)"):
        fp8_linear(jnp.ones((1, 4, 128), jnp.bfloat16), w64, s64, backend="swap")
    with pytest.raises(ValueError, match="swap_ab=True"):
        fp8_linear(x, w, s, backend="swap", config=MgpuConfig())


def test_auto_choice_on_a_hopper_gpu(monkeypatch):
    """On an H200 "auto" (and with it the model's dense_impl="pallas") multiplies the largest weights from their bytes
    at decode / verify loads and leaves the rest to XLA's GEMM over the dequantised weight."""
    import pallas_kernels.fp8_linear as F
    from model.layers import fp8_kernel_runs

    monkeypatch.setattr(F, "on_gpu", lambda: True)
    monkeypatch.setattr(F, "on_hopper", lambda: True)
    bf16 = jnp.bfloat16
    assert F.choose_backend(1, 256, 32768, 1024, 128, 0, bf16) == "swap"           # wq_b, verify 64 x 4
    assert F.choose_backend(8, 32, 1024, 4096, 128, 0, bf16) == "swap"             # grouped wo_a, verify 8 x 4
    assert F.choose_backend(1, 257, 32768, 1024, 128, 0, bf16) == "dequantised"    # past the swap tiles' loads
    assert F.choose_backend(1, 32, 1024, 4096, 128, 0, bf16) == "dequantised"      # wq_a: XLA fuses the dequant
    assert F.choose_backend(1, 32, 32768, 1280, 32, 0, bf16) == "swap"             # V4.1's wq_b: scale rows
    assert F.choose_backend(1, 256, 2304, 5120, 32, 0, bf16) == "swap"             # V4.1's shared expert
    assert F.choose_backend(1, 32, 1280, 5120, 32, 0, bf16) == "dequantised"       # V4.1's wq_a
    assert F.choose_backend(1, 32, 32768, 1024, 128, 128, bf16) == "triton"        # FP8 x FP8 (quant_sim)
    assert F.choose_backend(1, 32, 32768, 1024, 128, 0, jnp.float32) == "triton"   # float32 activations
    w = jax.ShapeDtypeStruct((1, 32768, 1024), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((1, 256, 8), jnp.uint8)
    assert fp8_kernel_runs(256, w, s, 0, bf16) and not fp8_kernel_runs(8192, w, s, 0, bf16)
    assert fp8_kernel_runs(8192, w, s, 128, bf16)   # quant_sim at the weights' block: FP8 x FP8 on Triton
    assert not fp8_kernel_runs(8192, w, s, 64, bf16)   # at another block: rounded in-graph, then bf16 as above


GPU = jax.default_backend() == "gpu"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [32, 256, 1024])
def test_gpu_shared_expert_on_the_moe_kernels(rows):
    """V4-Flash's shared expert (4096 -> 2048 -> 4096, FP8 128-blocks) as one routed expert on the MoE kernels, at
    verify 8 / 64 / 256 x 4 rows, against the float32 SwiGLU of its dequantised weights."""
    from flax import nnx

    from model import ModelConfig
    from model.moe import MLP

    cfg = ModelConfig.preset("v4-flash")
    mlp = MLP(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    for w in (mlp.w1, mlp.w2, mlp.w3):
        w.quantise(128)
        w.fp8_kernel = True
    assert mlp.on_expert_kernels(rows)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, cfg.hidden_size)), jnp.bfloat16)
    got = nnx.jit(lambda m, x: m(x))(mlp, x)
    w1, w2, w3 = (ref.dequant_fp8_blocks(w.weight[...], w.scale[...]) for w in (mlp.w1, mlp.w2, mlp.w3))
    hi = jax.lax.Precision.HIGHEST
    xf = x.astype(jnp.float32)
    z = ref.clamped_swiglu(jnp.dot(xf, w1.T, precision=hi), jnp.dot(xf, w3.T, precision=hi), cfg.swiglu_limit)
    want = jnp.dot(z.astype(jnp.bfloat16).astype(jnp.float32), w2.T, precision=hi)
    assert _rel(got, want) < 1e-2


@pytest.mark.skipif(GPU, reason="CPU-only: cross-lowering for CUDA")
@pytest.mark.parametrize("g,n,k,m,block", [(1, 32768, 1024, 32, 128), (1, 32768, 1024, 256, 128),
                                           (1, 4096, 8192, 8, 128), (8, 1024, 4096, 256, 128),
                                           (1, 512, 4096, 100, 128), (1, 32768, 1280, 32, 32),
                                           (1, 32768, 1280, 256, 32), (1, 5120, 8192, 8, 32)])
def test_swap_tiles_lower_for_cuda(g, n, k, m, block):
    """The swap_ab tiles (FP8 dequantised into a register wgmma operand, which the Mosaic GPU interpreter lacks)
    lower for CUDA at V4-Flash's projection shapes (wq_b, wo_b, the grouped wo_a, wkv) and V4.1-Flash's (wq_b, wo_b:
    32 x 32 blocks, scale rows) at decode / verify loads."""
    sd = jax.ShapeDtypeStruct
    args = (sd((g, m, k), jnp.bfloat16), sd((g, n, k), jnp.float8_e4m3fn), sd((g, n // block, k // block), jnp.uint8))
    text = cuda_text(lambda x, w, s: fp8_linear(x, w, s, backend="swap", interpret=False), *args)
    assert text.count("mosaic_gpu") >= 1, "no Mosaic GPU kernel in the lowered module"


def test_config_needs_fp8_weights_for_the_kernels():
    from model import ModelConfig

    with pytest.raises(ValueError, match="dense_impl='pallas' multiplies FP8-held projections"):
        ModelConfig.preset("tiny-v4").replace(dense_impl="pallas")
    with pytest.raises(ValueError, match="dense_impl must be one of"):
        ModelConfig.preset("tiny-v4").replace(dense_weights="fp8", dense_impl="cuda")


@pytest.mark.parametrize("preset,quant_sim", [("tiny-v41", False), ("tiny-v4", True)])
def test_model_with_fp8_kernels_matches_the_reference_path(preset, quant_sim):
    """The float32 model with its FP8 projections multiplied from their bytes (grouped wo_a included; shapes that are
    not whole scale blocks keep the reference path; V4's shared expert as one routed expert on the MoE kernels) gives
    the reference path's logits; under quant_sim the official act_quant'd FP8 x FP8 GEMMs. The presets cut to one
    layer of each kind (tests/common.py: the same projections on the kernels and off them as the full presets, in
    half the compile time)."""
    from flax import nnx

    from common import small_v4, small_v41
    from model import init_random
    from model.moe import MLP

    cfg = {"tiny-v4": small_v4, "tiny-v41": small_v41}[preset]().replace(dense_weights="fp8", quant_sim=quant_sim)
    ref_model = init_random(cfg, seed=0, dtype="float32")
    kernel_model = init_random(cfg.replace(dense_impl="pallas"), seed=0, dtype="float32")
    on_kernels = [m for _, m in nnx.iter_modules(kernel_model) if getattr(m, "fp8_kernel", False)]
    assert len(on_kernels) > 10
    shared = [m for _, m in nnx.iter_modules(kernel_model) if isinstance(m, MLP)]
    # one routed expert on the MoE kernels where the scale blocks are 128 x 128 (V4; V4.1's 32 x 32: in-graph)
    assert shared and all(m.on_expert_kernels(6) == (cfg.fp8_block == 128) for m in shared)
    tokens = np.random.default_rng(8).integers(0, cfg.vocab_size, (1, 6))
    assert _rel(kernel_model(tokens), ref_model(tokens)) < 1e-5


# ----------------------------------------------------------------------------- on the GPU, at V4-Flash shapes

MGPU_ROW_TILES_OPEN = pytest.mark.xfail(strict=True, reason="Mosaic GPU row tiles at wq_b's shape: measured off the "
                                       "reference on an H200 (auto runs Triton)")


@pytest.mark.gpu
@pytest.mark.parametrize("m,act_block,backend", [(32, 0, "auto"), (256, 0, "auto"), (1024, 0, "auto"),
                                                 (5, 0, "swap"), (100, 0, "swap"), (1024, 0, "swap"),
                                                 (32, 128, "auto"), (4096, 128, "auto"),
                                                 pytest.param(4096, 128, "mgpu", marks=MGPU_ROW_TILES_OPEN)])
def test_gpu_fp8_linear_v4_shapes(m, act_block, backend):
    """wq_b-sized FP8 weights (32768 x 1024) at decode, verify and prefill loads, compiled."""
    rng = np.random.default_rng(9 + m)
    w, s = _weights(rng, 1, 32768, 1024, 128)
    x = jnp.asarray(rng.standard_normal((1, m, 1024)), jnp.bfloat16)
    got = jax.jit(lambda x, w, s: fp8_linear(x, w, s, act_block=act_block, backend=backend,
                                             out_dtype=jnp.float32))(x, w, s)
    assert _rel(got, fp8_linear_reference(x, w, s, act_block=act_block)) < 1e-5


def test_fp8_row_scales_repeat_each_block_over_its_rows():
    """The swap tiles' scale rows of 32 x 32 blocks: row n, group c holds 2^(S[n // 32, c] - 127) (NaN for byte
    255), so that each 32-column group of a weight row times its scale row is the dequantised weight."""
    from pallas_kernels.moe.mgpu_swap import fp8_row_scales
    rng = np.random.default_rng(12)
    w, s = _weights(rng, 2, 64, 96, 32)
    s = s.at[1, 0, 2].set(255)
    rows = np.asarray(fp8_row_scales(s), np.float32)            # [G, K/32, N]
    assert rows.shape == (2, 3, 64)
    want = np.array(jax.vmap(ref.dequant_fp8_blocks)(w, s))
    got = np.asarray(w, np.float32) * np.repeat(np.swapaxes(rows, 1, 2), 32, axis=2)
    assert np.isnan(got[1, :32, 64:]).all() and np.isnan(want[1, :32, 64:]).all()
    got[1, :32, 64:] = want[1, :32, 64:] = 0
    np.testing.assert_array_equal(got, want)


def test_swap_config_tile_tokens():
    """Above 128 rows the swap tiles hold 128 or (tile_tokens=256) 256 tokens; other sizes are refused."""
    from pallas_kernels.fp8_linear import swap_config
    assert swap_config(1024, 256).block_m == 256 and swap_config(1024, 128).block_m == 128
    assert swap_config(100, 256).block_m == 128 and swap_config(32, 256).block_m == 32
    with pytest.raises(ValueError, match="tile_tokens must be 128 or 256"):
        swap_config(1024, 64)


def test_swap_tiles_split_k_to_fill_the_gpu():
    """The swap tiles split K while a weight's tiles leave SMs idle, keeping whole steps (>= SPLIT_MIN_STEPS a split):
    one CTA an SM, wo_b (32 row blocks) 4 ways, the grouped wo_a (8 x 8) 2 ways, wq_b (256) not; twice as many CTAs
    where two share an SM (the tiles of up to 32 rows: wo_b 8 ways, wo_a 4 at V4-Flash's 32-row verify)."""
    from pallas_kernels.fp8_linear import swap_k_split
    assert swap_k_split(32, 8192, 128) == 4 and swap_k_split(64, 8192, 128) == 2
    assert swap_k_split(64, 4096, 128) == 2 and swap_k_split(256, 1024, 128) == 1
    assert swap_k_split(8, 1024, 128) == 1 and swap_k_split(8, 2048, 128) == 2 and swap_k_split(8, 1536, 128) == 1
    assert swap_k_split(32, 8192, 128, per_sm=2) == 8 and swap_k_split(64, 4096, 128, per_sm=2) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("g,n,k,m,block,tile_tokens", [
    # V4-Flash's wo_b and grouped wo_a at decode / verify loads, whose swap tiles split K (8, 2 and 4 ways)
    (1, 4096, 8192, 32, 128, 128), (1, 4096, 8192, 256, 128, 128), (8, 1024, 4096, 32, 128, 128),
    # V4.1-Flash's wq_b, wo_b (split over K) and grouped wo_a: 32 x 32 blocks as scale rows
    (1, 32768, 1280, 5, 32, 128), (1, 32768, 1280, 32, 32, 128), (1, 32768, 1280, 256, 32, 128),
    (1, 5120, 8192, 32, 32, 128), (1, 5120, 8192, 256, 32, 128), (8, 1024, 4096, 64, 32, 128),
    # tiles of 256 tokens (one pass over the weights per 256 rows), a ragged last tile among them
    (1, 32768, 1024, 256, 128, 256), (1, 32768, 1024, 1000, 128, 256), (8, 1024, 4096, 1024, 128, 256),
    (1, 32768, 1280, 1024, 32, 256)])
def test_gpu_swap_tiles(g, n, k, m, block, tile_tokens):
    """The swap tiles at the projections' shapes (swap_config(m, tile_tokens)), compiled, against the float32
    reference."""
    from pallas_kernels.fp8_linear import swap_config
    rng = np.random.default_rng(g + n + k + m + block + tile_tokens)
    w, s = _weights(rng, g, n, k, block)
    x = jnp.asarray(rng.standard_normal((g, m, k)), jnp.bfloat16)
    got = jax.jit(lambda x, w, s: fp8_linear(x, w, s, backend="swap", config=swap_config(m, tile_tokens),
                                             out_dtype=jnp.float32))(x, w, s)
    assert _rel(got, fp8_linear_reference(x, w, s)) < 1e-5


@pytest.mark.gpu
def test_gpu_grouped_fp8_linear():
    """The grouped output projection's shape (8 groups of 1024 x 4096), compiled."""
    rng = np.random.default_rng(10)
    w, s = _weights(rng, 8, 1024, 4096, 128)
    x = jnp.asarray(rng.standard_normal((8, 256, 4096)), jnp.bfloat16)
    for backend in ("triton", "swap"):
        got = jax.jit(lambda x, w, s: fp8_linear(x, w, s, backend=backend, out_dtype=jnp.float32))(x, w, s)
        assert _rel(got, fp8_linear_reference(x, w, s)) < 1e-5, backend


@pytest.mark.skipif(GPU, reason="CPU-only: cross-lowering for CUDA")
def test_a_repeated_projection_lowers_its_kernel_once():
    """Two projections of one shape (as in the scanned layer bodies, which all call wq_b's) lower one Mosaic GPU
    kernel, called twice: fp8_linear is jitted, and JAX lowers a jitted call once per module."""
    sd = jax.ShapeDtypeStruct
    x, w, s = sd((1, 32, 1024), jnp.bfloat16), sd((1, 32768, 1024), jnp.float8_e4m3fn), sd((1, 256, 8), jnp.uint8)
    project = functools.partial(fp8_linear, backend="swap", interpret=False)
    once = cuda_text(project, x, w, s).count("mosaic_gpu")
    twice = cuda_text(lambda x, w1, s1, w2, s2: project(x, w1, s1) + project(x, w2, s2), x, w, s, w, s)
    assert once >= 1 and twice.count("mosaic_gpu") == once
