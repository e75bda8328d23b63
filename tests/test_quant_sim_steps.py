"""`quant_sim` block by block against the official model's quantisation steps (docs/model.md §14), written out
here in numpy from the spec, on hand-made inputs that sit on the rules' edges: amax clamps and floors,
power-of-two scale boundaries, round-to-nearest-even ties, saturation, zero blocks.

Rounding steps are compared exactly. The FP8 / FP4 GEMMs are compared with the official per-block
accumulation (partial sums of the quantised values, then times the activation's and the weight's block
scales) to float32 summation error. The sparse attention's bf16 probabilities are compared with the
official kernel's online softmax over chunks of 64 candidates, whose rounding points differ from ours (we
round the normalised probabilities, it rounds exp(z - running max)): within a stated bf16 bound.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from model.layers import Linear, fp4_fake_quant
from pallas_kernels import reference as ref

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ----------------------------------------------------------------------------- the official steps, in numpy

def official_act_quant(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block of the last axis: amax clamped at 1e-4, scale = 2^ceil(log2(amax / 448)), q = e4m3(clip(x /
    scale)) (round to nearest even). -> (q as float64 values, scale per block)."""
    b = x.astype(np.float64).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(-1), 1e-4)
    scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
    q = np.clip(b / scale[..., None], -448, 448).astype(np.float32).astype(E4M3).astype(np.float64)
    return q.reshape(x.shape), scale


def official_e2m1(v: np.ndarray) -> np.ndarray:
    """Nearest E2M1 value, ties to the even code (codes 0..7 are the magnitudes in order), sign kept."""
    a = np.abs(v)
    idx = np.argmin(np.abs(a[..., None] - E2M1), axis=-1)
    gap = np.abs(a[..., None] - E2M1)
    tie = np.sort(gap, -1)[..., 1] == np.sort(gap, -1)[..., 0]
    lo = np.argsort(gap, -1, kind="stable")[..., :2].min(-1)
    idx = np.where(tie, np.where(lo % 2 == 0, lo, lo + 1), idx)
    return np.sign(v) * E2M1[idx]


def official_fp4_ue8m0(x: np.ndarray, block: int = 32) -> np.ndarray:
    """FP4 sim (E8M0): per block scale 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), nearest E2M1, ties to even."""
    b = x.astype(np.float64).reshape(*x.shape[:-1], -1, block)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(b).max(-1), 6 * 2.0 ** -126) / 6))[..., None]
    return (official_e2m1(np.clip(b / scale, -6, 6)) * scale).reshape(x.shape)


def official_fp4_e4m3(x: np.ndarray, block: int = 16) -> np.ndarray:
    """[V4.1] main KV FP4 sim: per block scale e4m3(max(amax, 6 * 2^-9) / 6), no second-level scale."""
    b = x.astype(np.float64).reshape(*x.shape[:-1], -1, block)
    scale = (np.maximum(np.abs(b).max(-1), 6 * 2.0 ** -9) / 6).astype(np.float32).astype(E4M3).astype(np.float64)
    return (official_e2m1(np.clip(b / scale[..., None], -6, 6)) * scale[..., None]).reshape(x.shape)


def official_block_gemm(xq, sx, wq, sw, block_x: int, block_w: tuple[int, int]) -> np.ndarray:
    """y[m, o] = sum over input blocks k of (sum_{j in k} xq[m, j] wq[o, j]) * sx[m, k] * sw[o // Bo, j // Bi]:
    the official FP8 / FP4 GEMM's per-block accumulation (float64 here). `block_x`: the activation's block,
    `block_w` the weight scale's (rows, columns) block; the finer of the two column blocks sets the partials."""
    bo, bi = block_w
    step = min(block_x, bi)
    y = np.zeros((xq.shape[0], wq.shape[0]))
    for j in range(0, xq.shape[1], step):
        part = xq[:, j:j + step] @ wq[:, j:j + step].T
        y += part * sx[:, j // block_x][:, None] * np.repeat(sw[:, j // bi], bo)[: wq.shape[0]][None, :]
    return y


# ----------------------------------------------------------------------------- rounding steps: exact

def edge_activations(block: int) -> np.ndarray:
    """Rows of blocks on the act_quant rule's edges."""
    rng = np.random.default_rng(0)
    rows = []
    base = rng.standard_normal(block)
    rows.append(base * 448 / np.abs(base).max())             # amax exactly 448: scale 1
    rows.append(base * 448 * 1.0001 / np.abs(base).max())    # just above: scale 2
    rows.append(np.full(block, 3e-5) * np.sign(base))        # amax below the 1e-4 clamp
    rows.append(np.zeros(block))                             # zero block
    ties = np.resize([1.0625, 1.1875, -1.3125, 17.0, 18.0, 0.0], block)  # E4M3 midpoints (3 mantissa bits)
    ties[0] = 448.0                                          # scale 1: the ties are exact ties
    rows.append(ties)
    rows.append(rng.standard_normal(block) * 1e3)            # a large block (scale 4)
    return np.stack(rows).astype(np.float32)


def test_act_quant_matches_the_official_rule():
    for block in (128, 32, 64):  # V4 GEMM inputs, V4.1, the V4 window KV's nope dims
        x = edge_activations(block)
        q, scale = ref.act_quant(jnp.asarray(x), block)
        want_q, want_scale = official_act_quant(x, block)
        np.testing.assert_array_equal(np.asarray(scale, np.float64)[..., 0], want_scale[..., 0])
        np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32), np.float64), want_q)
        back = np.asarray(ref.fp8_fake_quant(jnp.asarray(x), block), np.float64)
        np.testing.assert_array_equal(back, (want_q.reshape(6, -1, block) * want_scale[..., None]).reshape(x.shape))


def fp4_edges(block: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    mids = np.resize([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 6.0, 0.1], block)
    mids[0] = 6.0  # amax 6: scale 1, the midpoints are exact ties between codes
    return np.stack([mids, mids * 2.0 ** -3, mids * 1.5, rng.standard_normal(block),
                     np.full(block, 1e-40), np.zeros(block)]).astype(np.float32)


def test_fp4_sim_ue8m0_per_32_matches_the_official_rule():
    x = fp4_edges(32)
    got = np.asarray(fp4_fake_quant(jnp.asarray(x), 32), np.float64)
    np.testing.assert_array_equal(got, official_fp4_ue8m0(x, 32))
    np.testing.assert_array_equal(got[0, :8], [6.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0])  # ties to even codes


def test_fp4_sim_e4m3_per_16_matches_the_official_rule():
    x = fp4_edges(16)
    x = np.concatenate([x, (np.resize([6.375, 1.0, -2.0], 16))[None]], 0).astype(np.float32)  # amax/6 -> e4m3 tie
    got = np.asarray(fp4_fake_quant(jnp.asarray(x), 16, e4m3_scale=True), np.float64)
    np.testing.assert_array_equal(got, official_fp4_e4m3(x, 16))


# ----------------------------------------------------------------------------- GEMMs: per-block accumulation

def test_fp8_gemm_equals_the_official_per_block_accumulation():
    """A held-FP8 Linear under quant_sim (act_quant of the input per 128, FP8 weight with 128 x 128 UE8M0 block
    scales, [V4]) against the official FP8 GEMM: partial products per 128-block times both scales."""
    rng = np.random.default_rng(2)
    d_in, d_out, block = 384, 200, 128
    x = (rng.standard_normal((5, d_in)) * np.repeat([0.01, 3.0, 300.0], 128)).astype(np.float32)  # scales differ
    lin = Linear(d_in, d_out, rngs=nnx.Rngs(params=0), dtype=jnp.float32)
    lin.weight[...] = jnp.asarray(rng.standard_normal((d_out, d_in)) * np.repeat([1.0, 1e-3], [128, 256]),
                                  jnp.float32)
    lin.quantise(block)
    lin.act_block = block
    got = np.asarray(lin(jnp.asarray(x)), np.float64)
    xq, sx = official_act_quant(x, block)
    wq = np.asarray(lin.weight[...].astype(jnp.float32), np.float64)
    sw = 2.0 ** (np.asarray(lin.scale[...], np.float64) - 127)
    want = official_block_gemm(xq, sx, wq, sw, block, (block, block))
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


def test_fp4_expert_gemms_equal_the_official_per_block_accumulation():
    """A routed expert under quant_sim ([V4]: act_quant per 128 of both GEMMs' inputs; FP4 weights with one UE8M0
    scale per 32 inputs) against the official pipeline: each FP4 GEMM accumulates per 32-column block times the
    weight's and the activation's scales; clamped SwiGLU (a limit that binds) times the routing weight between.
    The SwiGLU output is checked to sit away from FP8 rounding boundaries (relative 1e-4), so float32 summation
    order cannot move an element across one."""
    rng = np.random.default_rng(3)
    d, inter, block, limit, route = 256, 128, 128, 2.0, 0.75
    x = (rng.standard_normal((4, d)) * np.repeat([0.05, 20.0], 128)).astype(np.float32)
    ws = [rng.standard_normal((1, o, i)).astype(np.float32) * np.repeat([1.0, 2.0 ** -6, 4.0, 0.5], i // 4)
          for o, i in ((inter, d), (d, inter), (inter, d))]  # w1, w2, w3
    held = [ref.quantize_fp4_experts(jnp.asarray(w)) for w in ws]
    dense = [np.asarray(ref.dequant_fp4_experts(p_, s_), np.float64)[0] for p_, s_ in held]
    scales = [2.0 ** (np.asarray(s_, np.float64)[0] - 127) for _, s_ in held]
    codes = [w / np.repeat(s_, 32, axis=-1) for w, s_ in zip(dense, scales)]  # the E2M1 values

    def fp4_gemm(a, i):
        aq, sa = official_act_quant(a, block)
        return official_block_gemm(aq, sa, codes[i], scales[i], block, (1, 32))

    g, u = fp4_gemm(x, 0), fp4_gemm(x, 2)
    gc = np.minimum(g, limit)
    z = (gc * 0.5 * (1 + np.tanh(gc / 2)) * np.clip(u, -limit, limit) * route).astype(np.float32)  # silu
    scaled = (np.abs(z.astype(np.float64)).reshape(4, -1, block) / official_act_quant(z, block)[1][..., None]).ravel()
    values = np.unique(np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64))
    values = values[np.isfinite(values) & (values >= 0)]
    midpoints = (values[1:] + values[:-1]) / 2
    scaled = scaled[scaled > 0]
    assert np.min(np.abs(scaled[:, None] - midpoints[None, :]) / scaled[:, None]) > 1e-4
    want = fp4_gemm(z, 1)
    got = np.asarray(ref.moe_experts(jnp.asarray(x), jnp.zeros((4, 1), jnp.int32), jnp.full((4, 1), route, jnp.float32),
                                     *(jnp.asarray(w[None], jnp.float32) for w in dense), limit, act_block=block),
                     np.float64)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


# ----------------------------------------------------------------------------- sparse attention probabilities

def official_online_softmax(q, kv, mask, sink, scale, chunk: int = 64) -> np.ndarray:
    """The official sparse kernel's numerics: online softmax over chunks of `chunk` candidates in float32
    (float64 here), the unnormalised probabilities exp(z - running max) rounded to bf16 before the value
    product, the sink in the denominator. q [T, H, Dh], kv [N, Dh] (bf16 values), mask [T, N]."""
    t_, h_, _ = q.shape
    out = np.zeros(q.shape)
    for t in range(t_):
        for h in range(h_):
            m, l, acc = sink[h], 1.0, np.zeros(kv.shape[1])  # the sink starts the running max and sum
            for c in range(0, kv.shape[0], chunk):
                keys = np.nonzero(mask[t, c:c + chunk])[0] + c
                if not len(keys):
                    continue
                z = (kv[keys] @ q[t, h]) * scale
                m_new = max(m, z.max())
                p = np.exp(z - m_new).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
                corr = np.exp(m - m_new)
                l = l * corr + np.exp(z - m_new).sum()
                acc = acc * corr + p @ kv[keys]
                m = m_new
            out[t, h] = acc / l
    return out


def test_bf16_probabilities_within_the_official_rounding():
    """bf16 q / kv; 150 candidates in three chunks of 64 whose maxima rise from chunk to chunk (the running max
    moves, as the online softmax sees it). Our path rounds the normalised probabilities to bf16, the official
    one exp(z - running max): both are within one bf16 rounding (2^-8 relative) of the exact float64 result,
    hence of each other within twice that; float32 probabilities (no rounding) are exact to 1e-6."""
    rng = np.random.default_rng(4)
    t_, h_, dh, n = 3, 2, 64, 150
    bf = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    q = bf(rng.standard_normal((t_, h_, dh)))
    kv = bf(rng.standard_normal((n, dh)) * np.linspace(0.5, 1.5, n)[:, None])
    mask = rng.random((t_, n)) < 0.8
    sink = np.array([0.3, -1.0])
    scale = dh ** -0.5
    official = official_online_softmax(q, kv, mask, sink, scale)
    z = np.einsum("thd,nd->htn", q, kv) * scale
    z = np.where(mask[None], z, -np.inf)
    mx = np.maximum(z.max(-1, keepdims=True), sink[:, None, None])
    p = np.exp(z - mx) / (np.exp(z - mx).sum(-1, keepdims=True) + np.exp(sink[:, None, None] - mx))
    exact = np.einsum("htn,nd->thd", p, kv)
    ours = np.asarray(ref.sink_attention(jnp.asarray(q[None], jnp.bfloat16), jnp.asarray(kv[None], jnp.bfloat16),
                                         jnp.asarray(mask[None]), jnp.asarray(sink, jnp.float32), scale)
                      .astype(jnp.float32), np.float64)[0]
    f32 = np.asarray(ref.sink_attention(jnp.asarray(q[None], jnp.float32), jnp.asarray(kv[None], jnp.float32),
                                        jnp.asarray(mask[None]), jnp.asarray(sink, jnp.float32), scale), np.float64)[0]
    bound = np.einsum("htn,nd->thd", p, np.abs(kv))  # sum_s P |v|: what one relative rounding of P can move
    assert np.all(np.abs(f32 - exact) <= 1e-6 * bound + 1e-7)
    # ours: P rounded (2^-9), the output rounded to bf16 (2^-9 of |o|)
    assert np.all(np.abs(ours - exact) <= 2 ** -9 * bound + 2 ** -8 * np.abs(exact) + 1e-6)
    assert np.all(np.abs(official - exact) <= 2 ** -9 * bound + 1e-9)
    assert np.all(np.abs(ours - official) <= 2 ** -8 * bound + 2 ** -8 * np.abs(exact) + 1e-6)
    assert np.abs(ours - exact).max() > 1e-5  # the rounding is really there
