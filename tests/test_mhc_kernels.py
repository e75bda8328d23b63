"""The mHC kernels (pallas_kernels/mhc.py) against the jnp reference (model/mhc.py) on fresh seeded inputs:
coefficients, collapse (own pre and a carried vector) and expand, float32 and bf16, interpreted on the CPU and
compiled on a GPU; their CUDA lowering at V4-Flash widths; and whole tiny models with mhc_impl="pallas" against
"reference"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import cuda_text, rel_err, seed_of_test, small_config
from model import ModelConfig, init_random
from model.mhc import hc_coefficients
from pallas_kernels import mhc as K
from pallas_kernels.common import lowering_for_hopper, split_bf16x3

GPU = jax.default_backend() == "gpu"
EPS = dict(norm_eps=1e-6, hc_eps=1e-6)


def _inputs(r, n, d, dtype, seed):
    rng = np.random.default_rng(seed)
    m = (2 + n) * n
    x = jnp.asarray(rng.normal(size=(r, n, d)), dtype)
    fn = jnp.asarray(rng.normal(size=(m, n * d)) * 0.05, jnp.float32)
    base = jnp.asarray(rng.normal(size=(m,)) * 0.2, jnp.float32)
    scale = jnp.asarray(rng.normal(size=(3,)) * 0.2 + 0.5, jnp.float32)
    carried = jnp.asarray(rng.uniform(0.1, 1.0, size=(r, n)), jnp.float32)
    f = jnp.asarray(rng.normal(size=(r, d)), dtype)
    return x, fn, base, scale, carried, f


def _coefficients64(x, fn, base, scale, iters):
    """docs/model.md §2.1-2.2 in float64 on the host (XLA's float32 einsum runs as TF32 on a GPU)."""
    n, eps = x.shape[1], EPS["hc_eps"]
    flat = np.asarray(x.astype(jnp.float32), np.float64).reshape(x.shape[0], -1)
    fn, base, scale = (np.asarray(a, np.float64) for a in (fn, base, scale))
    m = flat @ fn.T / np.sqrt(np.mean(flat ** 2, axis=1, keepdims=True) + EPS["norm_eps"])
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    pre = sig(m[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * sig(m[:, n:2 * n] * scale[1] + base[n:2 * n])
    c = (m[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(-1, n, n)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return pre, post, c


def _check_against_reference(r, n, d, dtype, iters, seed, carry, interpret=None):
    x, fn, base, scale, carried, f = _inputs(r, n, d, dtype, seed)
    if interpret is False:  # on the GPU: against float64 (the jnp path's float32 einsum is TF32 there)
        pre, post, comb = _coefficients64(x, fn, base, scale, iters)
    else:
        pre, post, comb = hc_coefficients(fn, base, scale, x, sinkhorn_iters=iters, **EPS)
    a = np.asarray(carried if carry else pre, np.float64)
    y_ref = np.einsum("rn,rnd->rd", a, np.asarray(x.astype(jnp.float32), np.float64))
    y, coef = K.mix_in(x, fn, base, scale, carried if carry else None, iters=iters, interpret=interpret, **EPS)
    assert coef.shape == (r, K.packed_width(n)) and y.shape == (r, d) and y.dtype == x.dtype
    # the coefficients are float32 either way: the kernel's skinny GEMM is the float32 one (bf16 x split fn). On
    # the GPU (tensor cores, float32 accumulation of n*D = 16384 products) it lands up to 1.8e-5 off float64 on
    # 0.1% of 8192 rows of an H200, where the CPU's float32 stays within 1.7e-6: still far inside the TF32 of
    # XLA's own float32 einsum there (~1e-3)
    loose = 5 if interpret is False else 1
    np.testing.assert_allclose(coef[:, :n], pre, rtol=2e-5 * loose, atol=2e-6 * loose)
    np.testing.assert_allclose(coef[:, n:2 * n], post, rtol=2e-5 * loose, atol=2e-6 * loose)
    np.testing.assert_allclose(coef[:, 2 * n:2 * n + n * n], comb.reshape(r, n * n), rtol=5e-5 * loose,
                               atol=5e-6 * loose)
    tol = 1e-6 if dtype == jnp.float32 else 8e-3      # bf16: one rounding of the output apart
    assert rel_err(y, y_ref) < tol
    out = K.mix_out(x, f, coef, interpret=interpret)
    assert out.shape == x.shape and out.dtype == x.dtype
    # against the expand in float64 on the host (XLA's float32 einsum in model/mhc.py runs as TF32 on a GPU)
    c = np.asarray(coef, np.float64)
    dt = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64)  # noqa: E731  model dtype
    want = (dt(c[:, n:2 * n])[:, :, None] * np.asarray(f.astype(jnp.float32), np.float64)[:, None, :]
            + np.einsum("rij,rid->rjd", dt(c[:, 2 * n:2 * n + n * n]).reshape(r, n, n),
                        np.asarray(x.astype(jnp.float32), np.float64)))
    assert rel_err(out, want) < (1e-6 if dtype == jnp.float32 else 4e-3)


@pytest.mark.parametrize("r,n,d,dtype,carry", [
    (40, 4, 64, jnp.float32, False),      # rows not a multiple of the row block: padded
    (32, 4, 128, jnp.bfloat16, True),     # bf16 streams, V4.1's carried collapse vector
    (16, 2, 48, jnp.float32, True),       # D not a power of two: 16-column chunks
    (24, 1, 32, jnp.bfloat16, False),     # one stream
])
def test_kernels_match_reference(r, n, d, dtype, carry):
    _check_against_reference(r, n, d, dtype, iters=20, seed=seed_of_test(), carry=carry)


def test_sinkhorn_rounds_follow_the_config():
    _check_against_reference(16, 4, 64, jnp.float32, iters=3, seed=seed_of_test(), carry=False)


def test_bf16x3_split_is_exact_to_float32():
    """The three bf16 terms of the skinny GEMM's fn sum back to it within float32 rounding, through jit."""
    w = jnp.asarray(np.random.default_rng(seed_of_test()).normal(size=(64, 256)) * 0.05, jnp.float32)
    parts = jax.jit(split_bf16x3)(w)
    total = sum(np.asarray(p.astype(jnp.float32), np.float64) for p in parts)
    np.testing.assert_allclose(total, np.asarray(w, np.float64), rtol=2 ** -23, atol=0)
    assert all(p.dtype == jnp.bfloat16 for p in parts)


@pytest.mark.parametrize("n,d,dtype", [
    (4, 64, jnp.bfloat16),     # nD 256: one K chunk
    (4, 512, jnp.float32),     # nD 2048: two chunks; float32 streams as three bf16 terms
    (2, 48, jnp.bfloat16),     # nD 96: zero-padded to one 128-deep K step
])
def test_invariant_coefficients_rows_alone_and_in_batch(n, d, dtype):
    """invariant=True (ModelConfig.batch_invariant): a row's packed coefficients are bitwise the same alone and at
    any place of a batch of 40, and the model's coefficients (float64) to float32 rounding."""
    x, fn, base, scale, _, _ = _inputs(40, n, d, dtype, seed_of_test())

    def run(rows):
        return np.asarray(K.coefficients(rows, fn, base, scale, iters=20, invariant=True, **EPS))
    full = run(x)
    for lo, hi in ((0, 1), (7, 8), (39, 40), (3, 21), (16, 40)):
        np.testing.assert_array_equal(run(x[lo:hi]), full[lo:hi], err_msg=f"rows {lo}:{hi} of 40")
    pre, post, comb = _coefficients64(x, fn, base, scale, 20)
    np.testing.assert_allclose(full[:, :n], pre, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(full[:, n:2 * n], post, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(full[:, 2 * n:2 * n + n * n], comb.reshape(40, n * n), rtol=5e-5, atol=5e-6)


def test_bad_shapes_raise():
    x, fn, base, scale, _, _ = _inputs(16, 4, 64, jnp.float32, 0)
    with pytest.raises(ValueError, match="n a power of two"):
        K.mix_in(x[:, :3], fn[:15, :192], base[:15], scale, iters=2, **EPS)
    with pytest.raises(ValueError, match="carried"):
        K.mix_in(x, fn, base, scale, jnp.ones((16, 3)), iters=2, **EPS)
    with pytest.raises(ValueError, match="fn"):
        K.mix_in(x, fn[:, :128], base, scale, iters=2, **EPS)
    with pytest.raises(ValueError, match="mhc_impl='pallas' needs hc_mult a power of two"):
        ModelConfig.preset("tiny-v4").replace(hc_mult=3, mhc_impl="pallas")


@pytest.mark.skipif(GPU, reason="CPU-only: cross-lowering for CUDA")
@pytest.mark.parametrize("rows,d,invariant", [(32, 4096, False), (256, 4096, False), (8192, 4096, False),
                                              (256, 5120, False), (32, 4096, True), (256, 5120, True)])
def test_lower_for_cuda_at_flash_widths(rows, d, invariant):
    """The three kernels lower for CUDA (Triton) at V4-Flash and V4.1-Flash widths (n = 4, D = 4096 / 5120) and
    decode / verify / prefill row counts, without a GPU; invariant: with the coefficient GEMM on fixed tiles (a
    fourth Triton kernel)."""
    n = 4
    sds = jax.ShapeDtypeStruct
    args = (sds((rows, n, d), jnp.bfloat16), sds((24, n * d), jnp.float32), sds((24,), jnp.float32),
            sds((3,), jnp.float32))

    def f(x, fn, base, scale, fout):
        y, coef = K.mix_in(x, fn, base, scale, iters=20, invariant=invariant, interpret=False, **EPS)
        return K.mix_out(x, fout, coef, interpret=False), y
    with lowering_for_hopper():   # the fixed tiles' GEMM chooses compiled code as on a GPU
        text = cuda_text(f, *args, sds((rows, d), jnp.bfloat16))
    assert text.count("__gpu$xla.gpu.triton") >= 3 + invariant


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_model_logits_match_reference(preset):
    """A whole small model (float32) with the kernels gives the reference logits (V4 two-pass, V4.1 single-pass).
    Three Sinkhorn rounds keep the interpreted run short (the kernel tests above run the model's 20)."""
    cfg = small_config(preset).replace(hc_sinkhorn_iters=3)
    model = init_random(cfg, seed=seed_of_test() % 1000, dtype="float32")
    fused = init_random(cfg.replace(mhc_impl="pallas"), seed=seed_of_test() % 1000, dtype="float32")
    tokens = np.random.default_rng(seed_of_test()).integers(0, cfg.vocab_size, size=(2, 12))
    assert rel_err(fused(tokens), model(tokens)) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("rows,d,dtype", [(32, 4096, jnp.bfloat16), (256, 4096, jnp.bfloat16),
                                          (8192, 4096, jnp.bfloat16), (96, 4096, jnp.float32),
                                          (256, 5120, jnp.bfloat16)])
def test_compiled_kernels_match_reference_on_gpu(rows, d, dtype):
    """Compiled at V4-Flash and V4.1-Flash widths, decode to prefill row counts, against float64 on the host."""
    _check_against_reference(rows, 4, d, dtype, iters=20, seed=seed_of_test(), carry=False, interpret=False)
    _check_against_reference(rows, 4, d, dtype, iters=20, seed=seed_of_test() + 1, carry=True, interpret=False)
