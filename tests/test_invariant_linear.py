"""pallas_kernels.invariant_linear: the linears of batch invariance on tiles fixed whatever the rows (interpret
mode on CPU): a row's output is bitwise the same alone and at any place of a batch of any size, and the linear
is the float32 one of its operands (FP8: of the dequantised weight) up to the order of its sums."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import cuda_text
from pallas_kernels import reference as ref
from pallas_kernels.fp8_linear import fp8_linear, fp8_linear_reference
from pallas_kernels.invariant_linear import bf16_invariant_linear, fp8_invariant_linear, k_fits

SLICES = ((3, 4), (0, 1), (69, 70), (5, 38), (30, 70))   # rows of a batch of 70: alone, first, last, spans


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _rows_alone_equal_rows_in_batch(run, x):
    full = np.asarray(run(x))
    for lo, hi in SLICES:
        np.testing.assert_array_equal(np.asarray(run(x[..., lo:hi, :])), full[..., lo:hi, :],
                                      err_msg=f"rows {lo}:{hi} of {x.shape[-2]}")
    return full


@pytest.mark.parametrize("g,block", [(1, 128), (2, 32)])
def test_fp8_rows_do_not_depend_on_the_batch(g, block):
    rng = np.random.default_rng(12 + block)
    k, n = 4 * block, 2 * block
    w, s = jax.vmap(lambda a: ref.quantize_fp8_blocks(a, block))(
        jnp.asarray(rng.standard_normal((g, n, k)) * k ** -0.5, jnp.float32))
    x = jnp.asarray(rng.standard_normal((g, 70, k)), jnp.bfloat16)
    full = _rows_alone_equal_rows_in_batch(lambda v: fp8_invariant_linear(v, w, s, jnp.float32), x)
    assert _rel(full, fp8_linear_reference(x, w, s)) < 2e-6
    with pytest.raises(ValueError, match="rows_fastest orders the Triton tiles only"):
        fp8_linear(x, w, s, backend="dequantised", rows_fastest=True)


@pytest.mark.parametrize("x_dtype,k_split,n", [(jnp.float32, 1, 320), (jnp.bfloat16, 1, 320), (jnp.float32, 2, 320),
                                               (jnp.bfloat16, 1, 8), (jnp.float32, 2, 96)])
def test_bf16_rows_do_not_depend_on_the_batch(x_dtype, k_split, n):
    """float32 inputs as three bf16 terms: the float32 linear (float64 reference) to float32 rounding; bf16 inputs
    one term; K in chunks added in order; N off the tiles (8, 96) padded."""
    rng = np.random.default_rng(21)
    w = jnp.asarray(rng.standard_normal((n, 256)) * 0.06, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((70, 256)), x_dtype)
    full = _rows_alone_equal_rows_in_batch(lambda v: bf16_invariant_linear(v, w, k_split=k_split), x)
    exact = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    assert full.dtype == np.float32 and np.abs(full - exact).max() <= 4e-6 * np.abs(exact).max()


def test_bf16_refuses_what_it_cannot_tile():
    x = jnp.ones((4, 256), jnp.float32)
    assert k_fits(256) and k_fits(64) and not k_fits(200) and not k_fits(8)
    with pytest.raises(ValueError, match="does not tile"):
        bf16_invariant_linear(jnp.ones((4, 200), jnp.float32), jnp.ones((64, 200), jnp.bfloat16))
    with pytest.raises(ValueError, match="cut into 3 K chunks does not tile"):
        bf16_invariant_linear(x, jnp.ones((64, 256), jnp.bfloat16), k_split=3)
    with pytest.raises(ValueError, match="a bf16 w"):
        bf16_invariant_linear(x, jnp.ones((64, 256), jnp.float32))


def test_lowers_for_cuda_at_v4_flash_shapes():
    """The LM head (129,280 x 4,096 bf16, float32 inputs) and wq_b (32,768 x 1,024 FP8 in 128-blocks) at 256 rows
    lower for CUDA as Triton kernels, from any host."""
    from pallas_kernels.common import lowering_for_hopper

    sds = jax.ShapeDtypeStruct
    with lowering_for_hopper():
        head = cuda_text(bf16_invariant_linear, sds((256, 4096), jnp.float32), sds((129280, 4096), jnp.bfloat16))
        wq_b = cuda_text(lambda x, w, s: fp8_invariant_linear(x, w, s, jnp.bfloat16), sds((1, 256, 1024), jnp.bfloat16),
                         sds((1, 32768, 1024), jnp.float8_e4m3fn), sds((1, 256, 8), jnp.uint8))
    assert "triton" in head and "triton" in wq_b
