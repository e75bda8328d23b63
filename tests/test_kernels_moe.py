"""Pallas MoE kernels (pallas_kernels/moe/) against pallas_kernels/reference.py.

CPU: Triton kernels in interpret mode, Mosaic GPU kernels in the MGPU interpreter (small shapes). GPU (`-m gpu`,
skipped elsewhere): the compiled kernels. The tuning table and the CUDA lowering at V4-Flash shapes:
tests/test_kernels_moe_lowering.py.

    timeout 300 pytest -q tests/test_kernels_moe.py --durations=10
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import cuda_text, rel_err, seed_of_test
from moe_tilings import FP8_ROWS, FP8_ROWS_3WG
from pallas_kernels import common as C
from pallas_kernels import moe as K
from pallas_kernels import reference as R

GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
skip_no_gpu = pytest.mark.skipif(not GPU, reason="needs a GPU")
E4, D4, I4 = 256, 4096, 2048            # V4-Flash expert shapes
LIMIT = 1.5                              # small clamp so that the clamp is exercised at unit-scale inputs


@pytest.fixture(autouse=True)
def _reset_mgpu_interpreter():
    # after an exception inside the Mosaic GPU interpreter its global state must be reset
    yield
    if not GPU:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
        gpu_callbacks.reset_gpu_interpret_mode_state()


def fresh_rng():
    """Seeded inputs, fixed per test (numpy: no jit compiles for the data); the seed is printed on failure."""
    seed = seed_of_test()
    print("seed", seed)
    return np.random.default_rng(seed)


def routing(rng, m, k, e, kind):
    """expert ids [m, k] (distinct per token) + weights [m, k]: uniform, skewed (some experts empty), balanced."""
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (m, k)), jnp.float32)
    if kind == "balanced":
        return K.forced_balance(m, e, k, offset=3), weights
    logits = rng.gumbel(size=(m, e))
    if kind == "skewed":   # experts 0..e/4 hot, the last quarter never chosen
        logits = np.where(np.arange(e) < e // 4, logits + 3.0, logits)
        logits = np.where(np.arange(e) >= e - e // 4, -np.inf, logits)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    return jnp.asarray(ids, jnp.int32), weights


def problem(rng, m, k, e, d, i, kind):
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    x = f32(m, d)
    w1, w3, w2 = f32(e, i, d) * d ** -0.5, f32(e, i, d) * d ** -0.5, f32(e, d, i) * i ** -0.5
    ids, w = routing(rng, m, k, e, kind)
    return x, ids, w, w1, w2, w3


def kernel(x, ids, w, w1, w2, w3, scales=None, **kw):
    """pallas_kernels.moe.moe_experts under one jit (eager dispatch would compile op by op)."""
    return jax.jit(lambda *a: K.moe_experts(*a, LIMIT, scales=scales, **kw))(x, ids, w, w1, w2, w3)


def reference(x, ids, w, w1, w2, w3, scales=None, act_block=0):
    """float32 reference: dense weights upcast, quantised ones dequantised."""
    if scales is None:
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        return jax.jit(lambda *a: R.moe_experts(*map(f32, a[:1]), *a[1:3], *map(f32, a[3:]), LIMIT, act_block))(
            x, ids, w, w1, w2, w3)
    return jax.jit(lambda *a: R.moe_experts_quantized(*a, LIMIT, scales, act_block))(x, ids, w, w1, w2, w3)


def weights_in_fp8_128(w1, w2, w3):
    q = lambda w: K.quantize_experts_fp8(np.asarray(w), 128)  # noqa: E731
    (a, sa), (b, sb), (c, sc) = q(w1), q(w2), q(w3)
    return a, b, c, (sa, sb, sc)


def weights_in(fmt, w1, w2, w3):
    """-> (w1, w2, w3, scales) in storage format."""
    if fmt == "bf16":
        return w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), w3.astype(jnp.bfloat16), None
    q = (lambda w: K.quantize_experts_fp8(np.asarray(w), 64)) if fmt == "fp8" else \
        (lambda w: K.quantize_experts_fp4(np.asarray(w)))
    (a, sa), (b, sb), (c, sc) = q(w1), q(w2), q(w3)
    return a, b, c, (sa, sb, sc)


# ------------------------------------------------------------------------------------------ routing plan


def test_forced_balance():
    ids = np.asarray(K.forced_balance(100, 8, 6, offset=5))
    counts = np.bincount(ids.ravel(), minlength=8)
    assert counts.max() - counts.min() <= 1 and counts.sum() == 600
    assert all(len(set(r)) == 6 for r in ids)          # k distinct experts per token
    with pytest.raises(ValueError):
        K.forced_balance(4, 4, 6)


@pytest.mark.parametrize("block_m", [16, 64])
def test_route_plan(block_m):
    m, k, e = 77, 3, 16
    ids, w = routing(fresh_rng(), m, k, e, "skewed")
    plan = jax.tree.map(np.asarray, K.route_plan(ids, w, e, block_m))
    ids, w = np.asarray(ids), np.asarray(w)
    gs = np.bincount(ids.ravel(), minlength=e)
    assert (plan.group_sizes == gs).all()
    n = int(plan.num_tiles)
    assert n == int(np.sum(-(-gs // block_m)))                        # empty experts own no tiles
    assert n <= K.max_tiles(m * k, e, block_m) == len(plan.tile_expert)
    assert (plan.tile_expert[n:] == -1).all() and (np.diff(plan.tile_expert[:n]) >= 0).all()
    assert set(plan.tile_expert[:n]) == set(np.nonzero(gs)[0])
    assert (plan.tile_rows[n:] == 0).all() and (plan.tile_rows[:n] > 0).all()
    for ex in range(e):                                               # an expert's tiles hold its rows, in order
        assert plan.tile_rows[plan.tile_expert == ex].sum() == gs[ex]
        assert (plan.tile_rows[plan.tile_expert == ex][:-1] == block_m).all()
    for t in range(m):                                                # every routed row lands once, right
        for j in range(k):
            p = plan.dest[t, j]
            assert plan.tile_expert[p // block_m] == ids[t, j]
            assert plan.row_token[p] == t and plan.row_weight[p] == np.float32(w[t, j])
    assert len(set(plan.dest.ravel())) == m * k
    assert plan.row_weight.sum() == pytest.approx(w.sum(), rel=1e-5)  # padding rows weigh 0


@pytest.mark.parametrize("shape", [(256, 48), (64, 16), (8, 200)])
def test_transpose_kernel(shape):
    """The swap path's materialised transpose (any R, C: tiles are gcd(dim, 64)), and its dispatch form: rows
    gathered (repeats, any order) and written transposed, the columns from `live` on left unwritten."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(K.transpose(a, interpret=not GPU)), np.asarray(a).T)
    rows = rng.integers(0, shape[0], 3 * 64)
    want = np.asarray(a)[rows].T
    np.testing.assert_array_equal(np.asarray(K.transpose(a, jnp.asarray(rows), interpret=not GPU)), want)
    got = np.asarray(K.transpose(a, jnp.asarray(rows), jnp.int32(64), interpret=not GPU))
    np.testing.assert_array_equal(got[:, :64], want[:, :64])


def test_dropped_ids_cost_nothing():
    """Ids outside [0, E) (an expert-parallel shard's rows for other shards' experts) get no tile and
    combine to 0; the kept rows give the reference's result over the kept rows."""
    m, k, e, d, i = 40, 3, 8, 128, 128
    rng = fresh_rng()
    x, ids, w, w1, w2, w3 = problem(rng, m, k, e, d, i, "uniform")
    drop = rng.uniform(size=(m, k)) < 0.4
    drop[0] = True                                                    # a token with every row dropped
    ids_d = jnp.where(drop, jnp.where(rng.uniform(size=(m, k)) < 0.5, -1, e), ids)
    plan = jax.tree.map(np.asarray, K.route_plan(ids_d, w, e, 16))
    kept = np.asarray(ids)[~drop]
    assert (plan.group_sizes == np.bincount(kept, minlength=e)).all()
    assert (plan.dest[drop] == len(plan.row_token)).all() and len(set(plan.dest[~drop])) == (~drop).sum()
    want = reference(x, ids, jnp.where(drop, 0.0, w), w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16),
                     w3.astype(jnp.bfloat16))
    got = kernel(x.astype(jnp.bfloat16), ids_d, w, *(a.astype(jnp.bfloat16) for a in (w1, w2, w3)),
                 backend="triton", config=K.default_config("triton", m * k, e), interpret=True)
    assert np.all(np.asarray(got)[0] == 0.0)
    assert rel_err(got, want) < 1e-2


def test_quantized_reference_matches_quant_io():
    from model import quant_io
    w = np.random.default_rng(0).normal(size=(2, 64, 96)).astype(np.float32)
    p, s = K.quantize_experts_fp4(w)
    want = np.stack([quant_io.dequant_fp4(np.asarray(p[i]), np.asarray(s[i])) for i in range(2)])
    assert np.array_equal(np.asarray(jax.jit(R.dequant_fp4_experts)(p, s)), want)
    q, s = K.quantize_experts_fp8(w, 32)
    want = np.stack([quant_io.dequant_fp8_blocks(np.asarray(q[i]), np.asarray(s[i]), 32) for i in range(2)])
    assert np.array_equal(np.asarray(jax.jit(R.dequant_fp8_blocks)(q, s.view(jnp.float8_e8m0fnu))), want)


def test_e2m1_decoder_covers_all_codes():
    """The in-kernel f16 bit trick against the table, for all 256 packed bytes."""
    b = jnp.arange(256, dtype=jnp.int32)
    b = jnp.where(b > 127, b - 256, b)                                 # as the kernel sees int8
    lo, hi = C.e2m1_pair(b)
    mags = np.array(R.E2M1_MAGNITUDES, np.float32)
    val = lambda c: np.where(c >= 8, -mags[c & 7], mags[c & 7])      # noqa: E731
    u = np.arange(256)
    assert np.array_equal(np.asarray(lo) * C.FP4_FOLD, val(u & 15))
    assert np.array_equal(np.asarray(hi) * C.FP4_FOLD, val(u >> 4))
    s = C.e8m0(jnp.array([0, 1, 100, 127, 254, 255]))
    assert np.array_equal(np.asarray(s)[:5], np.ldexp(1.0, np.array([-127, -126, -27, 0, 127])).astype(np.float32))
    assert np.isnan(np.asarray(s)[5])


def test_fp4_kernel_weights_decode_exactly():
    """FP4 weights as the swap kernels read them (fp4_kernel_weights: uint16 [E, out, in/4], each scale group's
    four 32-bit words with their bits permuted): the checkpoint's bytes come back (fp4_weight_bytes); the register
    decode (inline PTX, through its numpy model) of a thread's held word c gives operand columns 8w + 2c + l of
    the group (WGMMA layout) as the E2M1 values of the weights in their own order, times 2^-126; the PTX is
    the nine instructions the model describes. The PTX itself runs in the GPU tests."""
    import ml_dtypes
    rng = fresh_rng()
    e, out, groups = 2, 64, 4
    b = rng.integers(0, 256, (e, out, 16 * groups), dtype=np.uint8)          # [E, out, in/2]
    held = K.fp4_kernel_weights(jnp.asarray(b.view(np.int8)))
    assert held.dtype == jnp.uint16 and held.shape == (e, out, 8 * groups)
    assert K.fp4_logical_shape(held) == K.fp4_logical_shape(jnp.asarray(b)) == (e, out, 32 * groups)
    np.testing.assert_array_equal(np.asarray(K.fp4_weight_bytes(held)).view(np.uint8), b)
    words = K.e2m1_word_decode(np.asarray(held).view(np.uint32).reshape(e, out, groups, 4))  # 4 x [E, out, g, c]
    operand = np.zeros((e, out, groups, 32))
    for w, word in enumerate(words):
        vals = word.view(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64) * 2.0 ** 126
        for c in range(4):
            operand[..., 8 * w + 2 * c:8 * w + 2 * c + 2] = vals.reshape(e, out, groups, 4, 2)[..., c, :]
    mags = np.array(R.E2M1_MAGNITUDES, np.float64)
    nibbles = np.stack([b & 15, b >> 4], -1).reshape(e, out, 32 * groups)     # low nibble first
    assert all(len(np.unique(col)) == 16 for col in nibbles.reshape(-1, 32).T)   # every code at every position
    values = np.where(nibbles >= 8, -mags[nibbles & 7], mags[nibbles & 7])
    np.testing.assert_array_equal(operand.reshape(e, out, -1), values)
    assert K.E2M1_WORDS_PTX.count(";") - 1 == 9                               # instructions after the .reg line
    with pytest.raises(ValueError, match="in/2 a multiple of 16"):
        K.fp4_kernel_weights(jnp.zeros((2, 8, 24), jnp.int8))


def test_e8m0_bf16_scales():
    """The swap kernels' bf16 scales: 2^(b - 127 + fold) for every UE8M0 byte bf16 can hold, NaN for b = 255 and
    for the exponent decode's scales above 2 (b > 128), never a wrong finite value."""
    b = jnp.arange(256, dtype=jnp.uint8)
    for fold in (0, 126):
        got = np.asarray(K.e8m0_bf16(b, fold).astype(jnp.float32), np.float64)
        want = np.exp2(np.arange(256) - 127.0 + fold)
        ok = (np.arange(256) < 255) & (np.arange(256) + fold <= 254)
        np.testing.assert_array_equal(got[ok], want[ok])
        assert np.all(np.isnan(got[~ok]))


def test_fp4_kernel_scales_round_trip():
    """FP4 scales as the model holds them (fp4_kernel_scales: bf16 [E, in/32, out] with the exponent decode's
    fold) give every UE8M0 byte that decode holds back exactly (fp4_scale_bytes), the rest as NaN / 255; the
    swap kernels' operand from either layout is the same array, for both decodes."""
    rng = fresh_rng()
    b = jnp.asarray(rng.permutation(np.arange(256)).reshape(1, 8, 32), jnp.uint8)   # [E, out, in/32]
    held = K.fp4_kernel_scales(b)
    assert held.dtype == jnp.bfloat16 and held.shape == (1, 32, 8)
    back = np.asarray(K.fp4_scale_bytes(held))
    ok = np.asarray(b) <= K.FP4_KERNEL_MAX_BYTE
    np.testing.assert_array_equal(back[ok], np.asarray(b)[ok])
    assert np.all(back[~ok] == 255)
    assert np.array_equal(np.asarray(K.fp4_scale_bytes(b.view(jnp.float8_e8m0fnu))), np.asarray(b))
    small = jnp.asarray(rng.integers(100, 129, (3, 64, 4)), jnp.uint8)
    w = jnp.asarray(rng.integers(-128, 128, (3, 64, 64)), jnp.int8)
    for hw, hs in ((w, small), (K.fp4_kernel_weights(w), K.fp4_kernel_scales(small))):
        ops = K.swap_operands("fp4", hw, hs)
        np.testing.assert_array_equal(np.asarray(ops[0]), np.asarray(K.fp4_kernel_weights(w)))
        np.testing.assert_array_equal(np.asarray(ops[1]).view(np.uint16),
                                      np.asarray(K.fp4_kernel_scales(small)).view(np.uint16))


def test_moe_experts_takes_held_fp4():
    """moe_experts gives the same result with FP4 weights and scales held as fp4_kernel_weights /
    fp4_kernel_scales as with the checkpoint's bytes (CPU: the Triton kernels, which read the bytes back), and
    the XLA reference path of the model too."""
    from model.moe import routed_experts
    rng = fresh_rng()
    x, ids, w, w1, w2, w3 = problem(rng, 24, 2, 8, 128, 64, "skewed")
    q1, q2, q3, sc = weights_in("fp4", w1, w2, w3)
    hw = tuple(K.fp4_kernel_weights(q) for q in (q1, q2, q3))
    held = tuple(K.fp4_kernel_scales(s) for s in sc)
    xb = x.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(kernel(xb, ids, w, *hw, held, backend="triton")),
                                  np.asarray(kernel(xb, ids, w, q1, q2, q3, sc, backend="triton")))
    got = routed_experts("reference", x, ids, w, *hw, LIMIT, scales=held)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference(x, ids, w, q1, q2, q3, sc)), rtol=1e-6,
                               atol=1e-6)


# ------------------------------------------------------------------------------- kernels vs reference


@pytest.mark.parametrize("fmt,kind,m,d", [
    ("bf16", "uniform", 150, 256),     # 900 rows: prefill tiles (block_m 64), rows not a tile multiple
    ("bf16", "skewed", 97, 128),       # 388 rows, block_m 32: hot experts span tiles, 2 experts empty
    ("fp8", "skewed", 21, 256),        # decode tiles (block_m 16)
    ("fp4", "uniform", 13, 256),       # decode tiles
    ("fp4", "balanced", 128, 256),     # forced balance, prefill tiles
])
def test_triton_matches_reference(fmt, kind, m, d):
    e, i, k = 8, 128, 6 if kind != "skewed" else 4
    x, ids, w, w1, w2, w3 = problem(fresh_rng(), m, k, e, d, i, kind)
    q1, q2, q3, sc = weights_in(fmt, w1, w2, w3)
    # bf16: against the float32 math of the same bf16 weights; FP8/FP4: the dequantised float32 reference
    want = reference(x, ids, w, q1, q2, q3, sc)
    cfg = K.default_config("triton", m * k, e)
    got = kernel(x.astype(jnp.bfloat16), ids, w, q1, q2, q3, sc, backend="triton", config=cfg, interpret=True)
    assert got.shape == (m, d) and got.dtype == jnp.float32
    assert rel_err(got, want) < 1e-2
    if kind == "skewed":
        assert int(np.sum(np.bincount(np.asarray(ids).ravel(), minlength=e) == 0)) >= 2


@pytest.mark.parametrize("rows", [24, 200])
def test_single_expert_tilings_match_reference(rows):
    """The shared expert's Hopper tilings (`single_expert_tiling`): one FP8 expert every row picks, against the
    reference (the Triton tiles in interpret mode; the Mosaic GPU swap tiles cross-lowered for CUDA)."""
    x, ids, w, w1, w2, w3 = problem(fresh_rng(), rows, 1, 1, 256, 256, "uniform")
    q1, q2, q3, sc = weights_in_fp8_128(w1, w2, w3)
    backend, cfg = K.single_expert_tiling(rows, hopper=True)
    assert K.single_expert_tiling(rows, hopper=False) == ("auto", None)
    args = (x.astype(jnp.bfloat16), ids, w, q1, q2, q3)
    if backend == "triton":
        got = kernel(*args, sc, backend=backend, config=cfg, interpret=True)
        assert rel_err(got, reference(x, ids, w, q1, q2, q3, sc)) < 1e-2
    else:
        text = cuda_text(lambda *a: K.moe_experts(*a, LIMIT, scales=sc, backend=backend, config=cfg,
                                                  interpret=False), *args)
        assert "mosaic_gpu" in text


def test_act_quant_rule():
    """reference.act_quant: power-of-two scales 2^ceil(log2(max(amax, 1e-4) / 448)) per block, the block's
    largest value lands in [224, 448], values round to E4M3; fp8_fake_quant is exact in bf16."""
    rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((5, 256)) * rng.uniform(1e-3, 1e3, (5, 1)), jnp.float32)
    x = x.at[4, :64].set(0.0)                                     # an all-zero block: scale from the 1e-4 floor
    q, s = R.act_quant(x, 64)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (5, 4)
    s = np.asarray(s)
    assert np.all(np.exp2(np.round(np.log2(s))) == s)
    amax = np.abs(np.asarray(x)).reshape(5, 4, 64).max(-1)
    np.testing.assert_array_equal(s, np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-4) / 448))))
    qmax = np.abs(np.asarray(q.astype(jnp.float32))).reshape(5, 4, 64).max(-1)
    assert np.all((qmax[amax > 0] >= 224) & (qmax[amax > 0] <= 448)) and np.all(qmax[amax == 0] == 0)
    fake = R.fp8_fake_quant(x, 64)
    assert rel_err(fake, x) < 0.05
    np.testing.assert_array_equal(np.asarray(fake.astype(jnp.bfloat16), np.float32), np.asarray(fake))
    with pytest.raises(ValueError, match="does not divide"):
        R.act_quant(x, 96)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_act_quant_rows_kernel(dtype):
    """The Triton act_quant of the FP8 row tiles' SwiGLU output is bit-identical to reference.act_quant on the
    live rows (scales transposed), including amax exactly at and one ulp above 448 * 2^k (where the exponent
    steps), all-zero blocks, and huge and tiny rows; rows past live_rows are not written."""
    rng = fresh_rng()
    p, n, live = 256, 384, 192
    x = rng.standard_normal((p, n)) * np.exp2(rng.integers(-30, 30, (p, 1)))
    x[0, :128] = 0.0
    x[1:4] = rng.standard_normal((3, n))        # below the values set next: they are the first blocks' amax
    x[1, 5], x[2, 7] = 448.0 * 2.0 ** -3, np.nextafter(np.float32(448.0 * 2.0 ** 5), np.float32(np.inf))
    x[3, 9] = -np.nextafter(np.float32(448.0), np.float32(0))
    x = jnp.asarray(x.astype(np.float32), dtype)
    q, st = K.act_quant_rows(x, 128, jnp.int32(live), interpret=not GPU)
    want_q, want_s = R.act_quant(x[:live], 128)
    assert q.dtype == jnp.float8_e4m3fn and st.shape == (n // 128, p)
    np.testing.assert_array_equal(np.asarray(st)[:, :live], np.asarray(want_s).T)
    np.testing.assert_array_equal(np.asarray(q[:live]).view(np.uint8), np.asarray(want_q).view(np.uint8))
    with pytest.raises(ValueError, match="must tile"):
        K.act_quant_rows(x[:, :100], 128, jnp.int32(live), interpret=not GPU)


@pytest.mark.parametrize("dtype,cols", [(jnp.float8_e4m3fn, 256), (jnp.bfloat16, 64), (jnp.bfloat16, 3),
                                        (jnp.float32, 16)])
def test_take_rows_gathers_words(dtype, cols):
    """take_rows (narrow rows gathered as uint32 words) equals jnp.take, falls back to elements for odd widths,
    and leaves the 64-row tiles from `live` on unwritten."""
    rng = fresh_rng()
    a = jnp.asarray(rng.standard_normal((50, cols)), jnp.float32).astype(dtype)
    f32 = lambda v: np.asarray(v.astype(jnp.float32))  # noqa: E731
    idx = jnp.asarray(rng.integers(0, 50, 77), jnp.int32)
    np.testing.assert_array_equal(f32(K.take_rows(a, idx, interpret=not GPU)), f32(jnp.take(a, idx, axis=0)))
    idx = jnp.asarray(rng.integers(0, 50, 192), jnp.int32)
    got = f32(K.take_rows(a, idx, jnp.int32(128), interpret=not GPU))
    np.testing.assert_array_equal(got[:128], f32(jnp.take(a, idx[:128], axis=0)))


@pytest.mark.parametrize("fmt,act_block,kind,m", [
    ("fp8", 64, "uniform", 40),       # FP8 weights, same block: FP8 x FP8 MMA (verify tiles)
    ("fp8", 64, "skewed", 21),        # ... decode tiles
    ("fp8", 64, "uniform", 150),      # prefill loads: rounded activations, bf16 MMA
    ("fp8", 32, "uniform", 40),       # another block than the weights': rounded activations, bf16 MMA
    ("fp4", 32, "balanced", 64),
    ("bf16", 128, "uniform", 30),
])
def test_triton_act_quant_matches_reference(fmt, act_block, kind, m):
    """act_block: the GEMM inputs rounded as the official model does, against reference(act_block=)."""
    e, d, i, k = 8, 256, 128, 4
    x, ids, w, w1, w2, w3 = problem(fresh_rng(), m, k, e, d, i, kind)
    x = x.astype(jnp.bfloat16)   # the reference rounds the kernel's own input (FP8 rounding amplifies any change)
    q1, q2, q3, sc = weights_in(fmt, w1, w2, w3)
    want = reference(x.astype(jnp.float32), ids, w, q1, q2, q3, sc, act_block=act_block)
    got = kernel(x, ids, w, q1, q2, q3, sc, backend="triton", interpret=True, act_block=act_block)
    assert rel_err(got, want) < 1e-2
    # the rounding is real: without it the same kernel lands further from this reference
    plain = kernel(x, ids, w, q1, q2, q3, sc, backend="triton", interpret=True)
    assert rel_err(got, want) < rel_err(plain, want)


# The default run keeps one case of each property: one compute warpgroup (rows, swap_ab), two compute warpgroups and
# persistent CTAs together (rows_2wg_persistent, swap_ab_2wg_persistent); two warpgroups in a CTA per item (the
# interpreter's slowest cases, 20-30 s each) run on request (-m slow).
@pytest.mark.parametrize("variant", ["rows", "rows_weight_in_combine", pytest.param("rows_2wg", marks=pytest.mark.slow),
                                     "rows_2wg_persistent", "swap_ab", pytest.param("swap_ab_2wg", marks=pytest.mark.slow),
                                     "swap_ab_2wg_persistent", "swap_ab_act_quant"])
def test_mgpu_matches_reference(variant):
    """Mosaic GPU kernels in the MGPU interpreter. Its wgmma has neither a transposed SMEM operand nor a
    register operand: the row-tile kernels take the weights as [E, in, out] here (the model's [E, out, in]
    layout is covered by the lowering test and on GPU); the swap_ab kernels run the model's layout as is
    (bf16; their FP8 register-dequant path is covered by lowering and on GPU)."""
    e, d, i, m, k = 4, 128, 128, 64, 2
    x, ids, w, w1, w2, w3 = problem(fresh_rng(), m, k, e, d, i, "skewed")
    bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
    act = 64 if variant.endswith("act_quant") else 0   # float32 SwiGLU output, rounded to FP8 between kernels
    want = reference(bf(x).astype(jnp.float32), ids, w, bf(w1), bf(w2), bf(w3), act_block=act)
    if variant.startswith("swap_ab"):
        wgs = 2 if "2wg" in variant else 1    # 2: each compute warpgroup owns 64 of 128 weight rows
        # 2wg: two compute warpgroups of 64 weight rows and a TMA warpgroup; 1: the decode default, one warpgroup
        # issuing its own copies; persistent: three CTAs (the interpreter's "SMs") loop over the items
        cfg = K.MgpuConfig(block_m=16, block_n=64 * wgs, block_k=64, block_n_down=64 * wgs, block_k_down=64,
                           max_concurrent_steps=2, swap_ab=True, compute_wgs=wgs, warp_specialized=wgs > 1,
                           persistent=variant.endswith("persistent"))
        got = kernel(bf(x), ids, w, bf(w1), bf(w2), bf(w3), backend="mgpu", config=cfg, interpret=True,
                     act_block=act)
    else:
        # rows_2wg: two compute warpgroups of 64 rows per 128-row tile; skewed routing leaves some tiles'
        # second warpgroup all padding (it skips its wgmmas). rows_weight_in_combine also runs without a TMA
        # warpgroup.
        in_combine, wgs = variant == "rows_weight_in_combine", 2 if "2wg" in variant else 1
        cfg = K.MgpuConfig(block_m=64 * wgs, block_n=64, block_k=64, block_n_down=64, block_k_down=64,
                           max_concurrent_steps=2, route_weight_in_kernel=not in_combine, compute_wgs=wgs,
                           warp_specialized=not in_combine, persistent=variant.endswith("persistent"))
        t = lambda a: jnp.swapaxes(bf(a), 1, 2)  # noqa: E731
        got = kernel(bf(x), ids, w, t(w1), t(w2), t(w3), backend="mgpu", config=cfg, interpret=True,
                     weight_layout="in_out")
    assert rel_err(got, want) < 1e-2


FP8_ROWS_CONFIG = dict(block_m=128, compute_wgs=2, block_n=64, block_k=128, block_n_down=64, block_k_down=128,
                       max_concurrent_steps=2)


def _fp8_rows_problem():
    e, d, i, m, k = 4, 256, 256, 64, 2
    x, ids, w, w1, w2, w3 = problem(fresh_rng(), m, k, e, d, i, "skewed")
    q1, q2, q3, sc = weights_in_fp8_128(w1, w2, w3)
    x = x.astype(jnp.bfloat16)
    want = reference(x.astype(jnp.float32), ids, w, q1, q2, q3, sc, act_block=128)
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    return (x, ids, w, t(q1), t(q2), t(q3), sc), want


def test_mgpu_fp8_rows_match_reference():
    """FP8 x FP8 Mosaic GPU row tiles in the MGPU interpreter (weights as [E, in, out], see above): act_quant'd
    activations, 128-block FP8 weights, per-block promotion into register totals, two compute warpgroups
    (skewed routing: some all padding)."""
    args, want = _fp8_rows_problem()
    cfg = K.MgpuConfig(**FP8_ROWS_CONFIG)
    got = kernel(*args, backend="mgpu", config=cfg, interpret=True, weight_layout="in_out", act_block=128)
    assert rel_err(got, want) < 1e-2
    with pytest.raises(ValueError, match="act_block must be the weights' scale block"):
        kernel(*args, backend="mgpu", config=cfg, interpret=True, weight_layout="in_out", act_block=64)
    with pytest.raises(ValueError, match="without warp specialisation"):
        kernel(*args, backend="mgpu", interpret=True, weight_layout="in_out", act_block=128,
               config=dataclasses.replace(cfg, block_m=64, compute_wgs=1, warp_specialized=False))


@pytest.mark.slow
def test_mgpu_fp8_rows_persistent_match_reference():
    """The FP8 row tiles above in persistent CTAs (~35 s in the interpreter; persistent CTAs are in the default
    run with bf16 tiles, test_mgpu_matches_reference)."""
    args, want = _fp8_rows_problem()
    cfg = K.MgpuConfig(**FP8_ROWS_CONFIG, persistent=True)
    got = kernel(*args, backend="mgpu", config=cfg, interpret=True, weight_layout="in_out", act_block=128)
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("quant_sim", [False, True])
def test_moe_layer_pallas_matches_reference(quant_sim):
    """model/moe.py MoE block with cfg.moe_impl='pallas' against 'reference' (router, shared expert, combine);
    quant_sim: both round the expert GEMMs' inputs (act_quant, block 128)."""
    from flax import nnx

    from model import ModelConfig
    from model.moe import MoE
    cfg = ModelConfig.preset("tiny-v4").replace(quant_sim=quant_sim)
    spec = cfg.layer_spec(cfg.num_layers - 1)                         # a score-routed layer
    h = jnp.asarray(fresh_rng().standard_normal((2, 40, cfg.hidden_size)), jnp.float32)
    tok = jnp.zeros((2, 40), jnp.int32)
    outs = {}
    for impl in ("reference", "pallas"):
        layer = MoE(cfg.replace(moe_impl=impl), spec, rngs=nnx.Rngs(0), dtype=jnp.float32)
        assert layer.act_block == (128 if quant_sim else 0)
        outs[impl] = nnx.jit(lambda mod, a, b: mod(a, b))(layer, h, tok)
    # float32 weights: tight; with act_quant an ulp of accumulation order can flip one FP8 rounding
    assert rel_err(outs["pallas"], outs["reference"]) < (1e-3 if quant_sim else 1e-4)


@pytest.mark.parametrize("rows", [40, 1000])
def test_router_top_k_ids_match_lax_top_k(rows):
    """The gate's top-k (a row sort up to TOP_K_SORT_ROWS rows, argmax rounds past it) picks lax.top_k's ids in
    its order, ties to the lower index: scores on a coarse grid tie often."""
    from model.moe import TOP_K_SORT_ROWS, top_k_ids
    assert (rows > TOP_K_SORT_ROWS) == (rows == 1000)
    scores = jnp.asarray(np.round(fresh_rng().standard_normal((rows, 256)) * 4) / 4, jnp.float32)
    got = jax.jit(top_k_ids, static_argnums=1)(scores, 6)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.lax.top_k(scores, 6)[1]))


def test_errors_are_clear():
    x = jnp.zeros((4, 128), jnp.bfloat16)
    ids, w = jnp.zeros((4, 2), jnp.int32), jnp.ones((4, 2), jnp.float32)
    w13, w2 = jnp.zeros((8, 128, 128), jnp.bfloat16), jnp.zeros((8, 128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="does not match"):
        K.moe_experts(x[:, :64], ids, w, w13, w2, w13, 1.0)
    with pytest.raises(ValueError, match="needs its scale"):
        K.moe_experts(x, ids, w, w13.astype(jnp.float8_e4m3fn), w2, w13, 1.0)
    q = jnp.zeros((8, 128, 128), jnp.float8_e4m3fn)
    s = jnp.zeros((8, 1, 1), jnp.uint8)
    with pytest.raises(ValueError, match="act_block must be the weights' scale block"):   # FP8 rows: FP8 x FP8 only
        K.moe_experts(x, ids, w, q, q, q, 1.0, scales=(s, s, s), backend="mgpu", config=K.MgpuConfig())
    p4, s4 = jnp.zeros((8, 128, 64), jnp.int8), jnp.zeros((8, 128, 4), jnp.uint8)
    with pytest.raises(ValueError, match="mgpu row-tile kernels"):
        K.moe_experts(x, ids, w, p4, p4, p4, 1.0, scales=(s4, s4, s4), backend="mgpu", config=K.MgpuConfig())
    swap = lambda bm, bk: K.MgpuConfig(block_m=bm, block_n=64, block_k=bk, block_n_down=64,  # noqa: E731
                                       block_k_down=bk, swap_ab=True)
    for cfg in (swap(64, 32), swap(16, 16)):   # K must fill the activation tile's swizzle / a scale group
        with pytest.raises(ValueError, match="FP4 with block_m=.. needs block_k a multiple of"):
            K.moe_experts(x, ids, w, p4, p4, p4, 1.0, scales=(s4, s4, s4), backend="mgpu", config=cfg,
                          interpret=False)
    with pytest.raises(ValueError, match="FP8 with block_m=64 needs block_k a multiple of 64"):
        K.moe_experts(x, ids, w, q, q, q, 1.0, scales=(s, s, s), backend="mgpu", config=swap(64, 32),
                      interpret=False)
    with pytest.raises(ValueError, match="Mosaic GPU interpreter"):
        K.moe_experts(x, ids, w, p4, p4, p4, 1.0, scales=(s4, s4, s4), backend="mgpu", config=swap(16, 64),
                      interpret=True)
    with pytest.raises(ValueError, match="compute_wgs must be 1, 2 or 3"):
        K.MgpuConfig(compute_wgs=4)
    with pytest.raises(ValueError, match="without warp specialisation one warpgroup computes"):
        K.MgpuConfig(compute_wgs=2, warp_specialized=False)
    with pytest.raises(ValueError, match="persistent CTAs need warp specialisation"):
        K.MgpuConfig(warp_specialized=False, persistent=True)
    with pytest.raises(ValueError, match="one per 32 input columns"):
        s8 = jnp.zeros((8, 128, 8), jnp.uint8)                         # one scale per 16 columns
        K.moe_experts(x, ids, w, p4, p4, p4, 1.0, scales=(s8, s8, s8))
    # held FP4 (fp4_kernel_weights / fp4_kernel_scales) is checked from its shapes, no conversion back
    h4, hs4 = K.fp4_kernel_weights(p4), K.fp4_kernel_scales(s4)
    with pytest.raises(ValueError, match="one per 32 input columns"):
        K.moe_experts(x, ids, w, h4, h4, h4, 1.0, scales=(hs4, hs4, hs4[:, :2]))
    with pytest.raises(ValueError, match="does not match expert input dim 128"):
        K.moe_experts(x[:, :64], ids, w, h4, h4, h4, 1.0, scales=(hs4, hs4, hs4))


# --------------------------------------------------------------------------------------------- GPU only


@gpu
@skip_no_gpu
@pytest.mark.parametrize("backend,fmt,tiles", [("triton", "bf16", None), ("triton", "fp8", None),
                                               ("triton", "fp4", None), ("mgpu", "bf16", "rows"),
                                               ("mgpu", "bf16", "rows_2wg"), ("mgpu", "bf16", "swap"),
                                               ("mgpu", "fp8", "swap"), ("mgpu", "fp4", "swap"),
                                               ("mgpu", "fp8", "swap_2wg"), ("mgpu", "fp4", "swap_2wg"),
                                               ("mgpu", "bf16", "balanced192"), ("mgpu", "fp4", "balanced192"),
                                               ("mgpu", "fp4", "swap_held"), ("mgpu", "bf16", "persistent"),
                                               ("mgpu", "fp8", "persistent")])
@pytest.mark.parametrize("kind,m", [("uniform", 64), ("skewed", 1000), ("balanced", 2048)])
def test_gpu_compiled_matches_reference(backend, fmt, tiles, kind, m):
    e, d, i, k = 32, 1024, 512, 6
    x, ids, w, w1, w2, w3 = problem(fresh_rng(), m, k, e, d, i, kind)
    # FP8 as the V4 checkpoints ship it: 128x128 scale blocks
    q1, q2, q3, sc = weights_in_fp8_128(w1, w2, w3) if fmt == "fp8" else weights_in(fmt, w1, w2, w3)
    want = reference(x, ids, w, q1, q2, q3, sc)
    if tiles == "swap_held":   # FP4 as the model holds it (the other FP4 cases convert per call), at
        # default_config's tiles (decode: its 32-token tiles too)
        q1, q2, q3, sc = *(K.fp4_kernel_weights(q) for q in (q1, q2, q3)), tuple(K.fp4_kernel_scales(s) for s in sc)
        cfgs = [K.default_config("mgpu", m * k, e, "fp4")] + \
            ([K.default_config("mgpu", 24 * e, e, "fp4")] if m * k <= 16 * e else [])
    elif tiles in ("swap", "swap_2wg"):   # 2wg: two compute warpgroups of 64 rows each
        bk, wgs = 64 if fmt == "fp4" else 128, 2 if tiles == "swap_2wg" else 1
        cfgs = [K.MgpuConfig(block_m=16 if m * k < 16 * e else 64, block_n=64 * wgs, block_k=bk,
                             block_n_down=128, block_k_down=bk, swap_ab=True, compute_wgs=wgs,
                             warp_specialized=wgs > 1)]   # 1: as the decode defaults, no TMA warpgroup
    elif tiles == "rows_2wg":   # two compute warpgroups of 64 rows (skewed / uniform: some all padding)
        cfgs = [K.MgpuConfig(block_m=128, compute_wgs=2, block_n=128, block_n_down=128)]
    elif tiles == "persistent":   # prefill tiles in persistent CTAs: bf16 row tiles (2 WGs), FP8 swap_ab (2 WGs)
        cfgs = [dataclasses.replace(K.default_config(backend, 128 * e, e, "dense" if fmt == "bf16" else fmt),
                                    persistent=True)]
    elif tiles == "balanced192":   # default_config's 192-row tiles for 192 rows per expert (three compute WGs)
        cfgs = [K.default_config(backend, 192 * e, e, "dense" if fmt == "bf16" else fmt, balanced=True)]
        assert cfgs[0].block_m == 192, cfgs
    else:
        cfgs = [K.MgpuConfig() if backend == "mgpu" else K.default_config(backend, m * k, e)]
    for cfg in cfgs:
        got = kernel(x.astype(jnp.bfloat16), ids, w, q1, q2, q3, sc, backend=backend, config=cfg)
        assert rel_err(got, want) < 1e-2, cfg


@gpu
@skip_no_gpu
@pytest.mark.parametrize("backend,fmt,cfg", [("triton", "fp8", None), ("mgpu", "fp4", None), ("triton", "fp4", None),
                                             ("mgpu", "fp8", FP8_ROWS), ("mgpu", "fp8", FP8_ROWS_3WG),
                                             ("auto", "fp8", None)])
@pytest.mark.parametrize("kind,m", [("uniform", 64), ("balanced", 2048)])
def test_gpu_act_quant_matches_reference(backend, fmt, cfg, kind, m):
    """act_block=128 compiled: Triton FP8 x FP8 MMA (128x128-block FP8 weights); the Mosaic GPU FP4 swap
    kernels' float32 SwiGLU output; Triton FP4 with rounded bf16 activations; the Mosaic GPU FP8 x FP8 row
    tiles (auto: at 2048 tokens they are the default, Triton's FP8 MMA at 64)."""
    e, d, i, k = 32, 1024, 512, 6
    x, ids, w, w1, w2, w3 = problem(fresh_rng(), m, k, e, d, i, kind)
    x = x.astype(jnp.bfloat16)
    q1, q2, q3, sc = weights_in_fp8_128(w1, w2, w3) if fmt == "fp8" else weights_in(fmt, w1, w2, w3)
    want = reference(x.astype(jnp.float32), ids, w, q1, q2, q3, sc, act_block=128)
    got = kernel(x, ids, w, q1, q2, q3, sc, backend=backend, act_block=128, config=cfg)
    assert rel_err(got, want) < 1e-2


@gpu
@skip_no_gpu
def test_gpu_fp8_rounding_survives_jit():
    """XLA's GPU excess-precision simplification folds an f32 -> fp8 -> f32 convert pair made in one program;
    reference.fp8_values (an optimization barrier) keeps the rounding, so every FP8 fake-quant does."""
    x = jnp.asarray(fresh_rng().standard_normal((64, 256)), jnp.float32)
    want = np.asarray(x).astype(jnp.float8_e4m3fn).astype(np.float32)           # host (ml_dtypes) rounding
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: R.fp8_values(v.astype(jnp.float8_e4m3fn)))(x)),
                                  want)
    q, s = R.act_quant(x, 128)
    host = np.asarray(q.astype(jnp.float32)).reshape(64, 2, 128) * np.asarray(s)[..., None]
    np.testing.assert_array_equal(np.asarray(jax.jit(R.fp8_fake_quant, static_argnums=1)(x, 128)),
                                  host.reshape(64, 256))


@gpu
@skip_no_gpu
def test_gpu_fp4_half_codes():
    """FP4 weights made only of the codes 0 and +-0.5 (the swap kernels' register decode makes 0.5 a bf16
    subnormal), with small scales: a decoder that lost them would return zeros."""
    rng = fresh_rng()
    e, d, i, k, m = 8, 256, 128, 2, 24
    x, ids, w, *_ = problem(rng, m, k, e, d, i, "uniform")
    nib = lambda *s: rng.choice(np.array([0, 1, 9]), s)  # noqa: E731
    packed = lambda *s: jnp.asarray((nib(*s) | nib(*s) << 4).astype(np.uint8).view(np.int8))  # noqa: E731
    scale = lambda *s: jnp.asarray(rng.integers(120, 128, s), jnp.uint8)  # noqa: E731
    w1, w3, w2 = packed(e, i, d // 2), packed(e, i, d // 2), packed(e, d, i // 2)
    sc = (scale(e, i, d // 32), scale(e, d, i // 32), scale(e, i, d // 32))
    cfg = K.MgpuConfig(block_m=16, block_n=64, block_k=64, block_n_down=64, block_k_down=64, swap_ab=True)
    got = kernel(x.astype(jnp.bfloat16), ids, w, w1, w2, w3, sc, backend="mgpu", config=cfg)
    assert rel_err(got, reference(x, ids, w, w1, w2, w3, sc)) < 1e-2


@gpu
@skip_no_gpu
@pytest.mark.parametrize("backend,tokens", [("triton", 64), ("mgpu", 1024)])
def test_gpu_v4_flash_shapes(backend, tokens):
    """Full expert shapes (4.3 GB of bf16 weights), checked on the rows of a few experts."""
    k = 6
    ks = jax.random.split(jax.random.key(seed_of_test()), 4)
    x = jax.random.normal(ks[0], (tokens, D4), jnp.bfloat16)
    w13 = jax.random.normal(ks[1], (E4, I4, D4), jnp.bfloat16) * D4 ** -0.5
    w2 = jax.random.normal(ks[2], (E4, D4, I4), jnp.bfloat16) * I4 ** -0.5
    ids, w = routing(fresh_rng(), tokens, k, E4, "uniform")
    got = jax.jit(lambda *a: K.moe_experts(*a, 10.0, backend=backend))(x, ids, w, w13, w2, w13)
    rows = np.arange(min(tokens, 16))
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    want = R.moe_experts(f32(x[rows]), ids[rows], w[rows], f32(w13), f32(w2), f32(w13), 10.0)
    assert rel_err(got[rows], want) < 1e-2


@gpu
@skip_no_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_router_picks_the_float32_top_k(dtype):
    """The gate's logits are IEEE float32 on the GPU too (the official gate's): bf16 operands multiply exactly into
    float32, float32 ones ask for HIGHEST (XLA's GPU default is TF32). At V4-Flash widths its top-6 of 256 equals
    the host's float64 choice wherever the 6th and 7th scores are not tied within float32 rounding. (On the H200
    TF32 changed 12 of 8192 tokens' sets with float32 operands: docs/kernels.md,
    experiments/probes/router_precision.py.)"""
    from flax import nnx

    from model import ModelConfig
    from model.moe import Gate
    cfg = ModelConfig.preset("v4-flash")
    spec = next(cfg.layer_spec(i) for i in range(cfg.num_layers) if not cfg.layer_spec(i).hash_routed)
    gate = Gate(cfg, spec, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype))
    h = jnp.asarray(fresh_rng().standard_normal((4096, cfg.hidden_size)), dtype)
    ids = np.asarray(nnx.jit(lambda g, a: g(a, jnp.zeros(a.shape[0], jnp.int32))[0])(gate, h))
    logits = np.asarray(h, np.float64) @ np.asarray(gate.weight[...], np.float64).T / cfg.gate_temp
    scores = np.sqrt(np.logaddexp(0.0, logits)) + np.asarray(gate.bias[...], np.float64)
    assert cfg.scoring_func == "sqrtsoftplus"
    order = np.sort(scores, axis=1)[:, ::-1]
    clear = order[:, spec.n_experts_per_tok - 1] - order[:, spec.n_experts_per_tok] > 1e-5 * np.abs(order[:, 0])
    want = np.sort(np.argsort(-scores, axis=1)[:, :spec.n_experts_per_tok], axis=1)
    agree = np.all(np.sort(ids, axis=1) == want, axis=1)
    assert clear.mean() > 0.9 and agree[clear].all(), (clear.mean(), (~agree[clear]).sum())


@gpu
@skip_no_gpu
def test_gpu_model_pallas_moe_matches_reference():
    """The whole tiny model with cfg.moe_impl='pallas' against 'reference', compiled. In float32: in bf16
    the two paths' different (equally valid) rounding grows through the layers (5% on random weights,
    each 7% from float32), so an end-to-end bf16 comparison says nothing about the kernels."""
    from model import ModelConfig, init_random
    cfg = ModelConfig.preset("tiny-v4")
    tok = jnp.asarray(fresh_rng().integers(2, cfg.vocab_size, (2, 48)), jnp.int32)
    with jax.default_matmul_precision("highest"):   # XLA's float32 GEMMs are TF32 by default on the GPU: 1.6e-2
        logits = {impl: init_random(cfg.replace(moe_impl=impl), seed=0, dtype="float32")(tok)
                  for impl in ("reference", "pallas")}
    assert rel_err(logits["pallas"], logits["reference"]) < 1e-3


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_per_slot_rows_do_not_depend_on_the_load(fmt):
    """moe_experts(per_slot=True) (batch invariance): one tiling per format (invariant_tiling) whatever the load, so
    a row's per-choice outputs alone equal its own inside a heavier batch, where its experts' other rows put it in
    another tile at another place, bitwise; the outputs added in order match the reference."""
    e, d, i, k = 8, 128, 128, 2
    x, ids, w, w1, w2, w3 = problem(fresh_rng(), 70, k, e, d, i, "skewed")
    q1, q2, q3, sc = weights_in(fmt, w1, w2, w3)
    xb = x.astype(jnp.bfloat16)
    backend, config = K.invariant_tiling("fp4" if fmt == "fp4" else "dense", jnp.bfloat16)
    assert (backend, config) == K.invariant_tiling("fp4" if fmt == "fp4" else "dense", jnp.bfloat16)
    slots = kernel(xb, ids, w, q1, q2, q3, sc, per_slot=True)
    assert slots.shape == (70, k, d) and slots.dtype == jnp.float32
    want = reference(x.astype(jnp.bfloat16).astype(jnp.float32), ids, w, q1, q2, q3, sc)
    assert rel_err(slots[:, 0] + slots[:, 1], want) < 1e-2
    for row in (0, 37, 69):
        alone = kernel(xb[row:row + 1], ids[row:row + 1], w[row:row + 1], q1, q2, q3, sc, per_slot=True)
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(slots[row]))
    with pytest.raises(ValueError, match="per_slot takes both backend and config"):
        kernel(xb, ids, w, q1, q2, q3, sc, per_slot=True, backend="triton")
