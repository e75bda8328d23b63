"""Pure-jnp definitions of the hot paths. Every Pallas kernel is tested against these, and the
model calls them directly when `impl="reference"` (always available, any XLA backend).

Shapes: B batch, T query rows, N key rows (window and/or compressed entries), H heads,
Dh head dim (one shared KV vector per key, used as key and value), E experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def f32_dot_operands(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """Operands for a dot with float32 accumulation (`preferred_element_type=float32`). XLA:CPU has
    no BF16 x BF16 -> F32 dot, so there bf16 operands are upcast (the same products); other backends
    keep them as they are."""
    if jax.default_backend() != "cpu":
        return xs
    return tuple(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in xs)


def sink_attention(q: jax.Array, kv: jax.Array, mask: jax.Array, sink: jax.Array, scale: float) -> jax.Array:
    """Shared-KV MQA with a per-head sink in the softmax denominator.

    q [B, T, H, Dh], kv [B, N, Dh] (key == value), mask [B, T, N] bool (True = attend), sink [H].
    P[h, t, s] = exp(z) / (exp(sink_h) + sum_{s' valid} exp(z')), z = scale * q.k (float32).
    Returns o [B, T, H, Dh] in q's dtype; rows with no valid key return 0.
    """
    z = jnp.einsum("bthd,bnd->bhtn", *f32_dot_operands(q, kv), preferred_element_type=jnp.float32) * scale
    z = jnp.where(mask[:, None], z, NEG_INF)
    sink = sink.astype(jnp.float32)[None, :, None, None]
    m = jnp.maximum(jnp.max(z, axis=-1, keepdims=True), sink)
    p = jnp.exp(z - m)
    denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - m)
    p = p / denom
    o = jnp.einsum("bhtn,bnd->bthd", *f32_dot_operands(p.astype(kv.dtype), kv), preferred_element_type=jnp.float32)
    return o.astype(q.dtype)


def indexer_scores(q: jax.Array, weights: jax.Array, keys: jax.Array, visible: jax.Array) -> jax.Array:
    """Lightning-indexer scores: sum_h weights[h] * ReLU(q_h . k_j), -inf where not visible.

    q [B, T, HI, DI], weights [B, T, HI] (already scaled), keys [B, N, DI], visible [B, T, N] bool.
    Returns [B, T, N] float32.
    """
    s = jnp.einsum("bthd,bnd->bthn", q.astype(jnp.float32), keys.astype(jnp.float32))
    s = jnp.einsum("bthn,bth->btn", jax.nn.relu(s), weights.astype(jnp.float32))
    return jnp.where(visible, s, NEG_INF)


def topk_indices(scores: jax.Array, k: int) -> jax.Array:
    """Indices of the k best scores per row (ties -> lower index), -1 where the score is -inf.

    scores [..., N] -> [..., min(k, N)] int32.
    """
    k = min(k, scores.shape[-1])
    vals, idx = jax.lax.top_k(scores, k)
    return jnp.where(vals > NEG_INF, idx, -1).astype(jnp.int32)


def top_candidate_groups(group_max: jax.Array, reachable: jax.Array, topk_groups: int, group: int) -> jax.Array:
    """[V4.1] level-1 candidate selection on group scores (docs/model.md §7.2-7.4): group_max [B, T, G] (the maximum
    score of each group of `group` consecutive entries, -inf where none is reachable), reachable [B, T] entry
    counts -> keep [B, T, G] bool: the `topk_groups` best groups with a finite score, the group holding the
    newest reachable entry forced in."""
    b, t, g = group_max.shape
    newest = (reachable - 1) // group  # -1 when nothing is reachable: no group forced
    s = jnp.where(jnp.arange(g) == newest[..., None], jnp.inf, group_max)
    vals, idx = jax.lax.top_k(s, min(topk_groups, g))
    return jnp.zeros(s.shape, bool).at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], idx].set(
        vals > NEG_INF)


def indices_to_mask(indices: jax.Array, n: int) -> jax.Array:
    """[B, T, K] int indices (-1 = none) -> [B, T, n] bool membership mask."""
    b, t, _ = indices.shape
    slot = jnp.where(indices >= 0, indices, n)  # -1 -> out of range -> dropped
    bi = jnp.arange(b)[:, None, None]
    ti = jnp.arange(t)[None, :, None]
    return jnp.zeros((b, t, n), bool).at[bi, ti, slot].set(True, mode="drop")


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, L)) * clip(up, -L, L) (no clamp when L <= 0), float32."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def moe_experts(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w1: jax.Array, w2: jax.Array,
                w3: jax.Array, limit: float, act_block: int = 0) -> jax.Array:
    """Routed-expert SwiGLU block with the routing weight applied before the down projection.

    x [M, D], expert_ids [M, k] int, weights [M, k] float32, w1/w3 [E, I, D], w2 [E, D, I].
    Rows are sorted by expert and run through `jax.lax.ragged_dot` (experts with no rows cost nothing).
    act_block > 0: both GEMMs' inputs (x and the weighted SwiGLU output) pass through `fp8_fake_quant` with that
    block first, as the official model's FP8 / FP4 linears do (docs/model.md §14).
    Returns [M, D] float32 = sum_k w_k * W2_e (swiglu(W1_e x, W3_e x)).
    """
    m, k = expert_ids.shape
    num_experts = w1.shape[0]
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // k
    xs = jnp.take(x, token_of, axis=0)
    xs = (fp8_fake_quant(xs, act_block) if act_block else xs).astype(w1.dtype)
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    def grouped(lhs, w):  # [rows, K] x [E, out, K] -> [rows, out] float32
        lhs, w = f32_dot_operands(lhs, w)
        return jax.lax.ragged_dot(lhs, jnp.swapaxes(w, 1, 2), group_sizes, preferred_element_type=jnp.float32)

    z = clamped_swiglu(grouped(xs, w1), grouped(xs, w3), limit) * jnp.take(weights.reshape(-1), order)[:, None]
    y = grouped((fp8_fake_quant(z, act_block) if act_block else z).astype(w2.dtype), w2)
    return jnp.zeros((m, x.shape[-1]), jnp.float32).at[token_of].add(y)


# ------------------------------------------------------------------ quantised expert weights
# Layouts match pallas_kernels/formats.py (docs/model.md §14), stacked over experts (FP8 also unstacked: dense weights):
#   FP8: w float8_e4m3fn [(E,) out, in], scale [(E,) ceil(out/B), ceil(in/B)] (UE8M0: float8_e8m0fnu or the
#        uint8 exponent byte b, value 2^(b-127)); W[e,i,j] = w[e,i,j] * s[e, i//B, j//B].
#   FP4: w int8/uint8 [E, out, in/2] (E2M1 codes, low nibble = even column), scale [E, out, in/32] UE8M0;
#        W[e,i,j] = e2m1(code[e,i,j]) * s[e, i, j//32].

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e8m0_to_f32(scale: jax.Array) -> jax.Array:
    """UE8M0 scales (float8_e8m0fnu or uint8 exponent bytes b) -> float32 2^(b-127); b=255 -> NaN."""
    if scale.dtype == jnp.float8_e8m0fnu:
        scale = jax.lax.bitcast_convert_type(scale, jnp.uint8)
    if scale.dtype != jnp.uint8:
        raise ValueError(f"UE8M0 scales must be float8_e8m0fnu or uint8 exponent bytes, got {scale.dtype}")
    b = scale.astype(jnp.int32)
    v = jnp.ldexp(jnp.ones(b.shape, jnp.float32), b - 127)
    return jnp.where(b == 255, jnp.nan, v)


def dequant_fp8_blocks(w: jax.Array, scale: jax.Array) -> jax.Array:
    """FP8 E4M3 [..., out, in] + UE8M0 block scales [..., ceil(out/B), ceil(in/B)] -> float32 [..., out, in]
    (stacked experts, or one dense weight: model.layers.Linear with cfg.dense_weights="fp8").

    The block size B is inferred from the shapes (square blocks, as formats.infer_fp8_block)."""
    n, k = w.shape[-2:]
    block = fp8_block_size(w.shape, scale.shape)
    s = e8m0_to_f32(scale)
    s = jnp.repeat(jnp.repeat(s, block, axis=-2), block, axis=-1)[..., :n, :k]
    return w.astype(jnp.float32) * s


def fp8_block_size(w_shape, s_shape) -> int:
    """Smallest power-of-two square block B with s_shape == (..., ceil(out/B), ceil(in/B)); where several fit
    (a 1-block grid) they all dequantise alike."""
    *lead, n, k = w_shape
    b = 1
    while b <= max(n, k, 1) * 2:
        if tuple(s_shape) == (*lead, -(-n // b), -(-k // b)):
            return b
        b *= 2
    raise ValueError(f"FP8 scale {tuple(s_shape)} matches no square block grid of weight {tuple(w_shape)}")


def ue8m0_exponent(amax: jax.Array, qmax: float) -> jax.Array:
    """Exponent e of the power-of-two block scale 2^e = 2^ceil(log2(amax / qmax)) (exact, via frexp), clamped
    to the UE8M0 range [-127, 127]; 0 (scale 1) where amax is 0. int32, amax's shape. The rule of
    pallas_kernels.formats._pow2_scale_exponent; the stored byte is e + 127."""
    mant, ex = jnp.frexp(amax / jnp.float32(qmax))
    exp = jnp.where(mant == 0.5, ex - 1, ex)
    return jnp.clip(jnp.where(amax > 0, exp, 0), -127, 127)


FP8_E4M3_MAX = 448.0


def quantize_fp8_blocks(w: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """float [..., out, in] -> (float8_e4m3fn [..., out, in], UE8M0 exponent bytes uint8
    [..., ceil(out/B), ceil(in/B)]), traceable (random FP8 models are made under jit / eval_shape). Same rule as
    formats.quantize_fp8_blocks: scale 2^ceil(log2(amax / 448)) per B x B block (edge blocks partial),
    values cast round-to-nearest-even."""
    *lead, n, k = w.shape
    go, gi = -(-n // block), -(-k // block)
    w = w.astype(jnp.float32)
    pad = [(0, 0)] * len(lead) + [(0, go * block - n), (0, gi * block - k)]
    amax = jnp.max(jnp.pad(jnp.abs(w), pad).reshape(*lead, go, block, gi, block), axis=(-3, -1))
    exp = ue8m0_exponent(amax, FP8_E4M3_MAX)
    full = jnp.repeat(jnp.repeat(exp, block, axis=-2), block, axis=-1)[..., :n, :k]
    q = jnp.clip(jnp.ldexp(w, -full), -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q, (exp + 127).astype(jnp.uint8)


def act_quant(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """The official model's activation quantisation (docs/model.md §14 act_quant): per `block` values of the last
    axis, scale = 2^ceil(log2(max(amax, 1e-4) / 448)) and q = e4m3(clip(x / scale)) (round to nearest even).
    x [..., n] -> (q float8_e4m3fn [..., n], scale float32 [..., n / block])."""
    if x.shape[-1] % block:
        raise ValueError(f"act_quant: block {block} does not divide the last dim {x.shape[-1]}")
    b = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    exp = ue8m0_exponent(jnp.maximum(jnp.max(jnp.abs(b), axis=-1), 1e-4), FP8_E4M3_MAX)
    q = jnp.clip(jnp.ldexp(b, -exp[..., None]), -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(x.shape), jnp.ldexp(jnp.ones(exp.shape, jnp.float32), exp)


def fp8_values(q: jax.Array) -> jax.Array:
    """FP8 -> float32 where the FP8 array was just made in the same program. The optimization barrier keeps XLA
    from folding the f32 -> fp8 -> f32 convert pair away: on the GPU its excess-precision simplification
    removes it, silently skipping the rounding (seen on the H200; docs/kernels.md)."""
    return jax.lax.optimization_barrier(q).astype(jnp.float32)


def fp8_fake_quant(x: jax.Array, block: int) -> jax.Array:
    """x rounded through `act_quant` and back (FP8 values times their power-of-two scales), in x's dtype (exact
    in bf16 too: an E4M3 value times a power of two has 4 significant bits)."""
    q, scale = act_quant(x, block)
    blocks = fp8_values(q).reshape(*x.shape[:-1], -1, block) * scale[..., None]
    return blocks.reshape(x.shape).astype(x.dtype)


def check_fp4_scale(packed_shape, scale_shape, block: int = 32, what: str = "FP4 scale") -> None:
    """Raise unless `scale_shape` is packed [..., out, in/2]'s UE8M0 grid, one scale per `block` inputs."""
    *lead, n, kp = packed_shape
    want = (*lead, n, -(-2 * kp // block))
    if tuple(scale_shape) != want:
        raise ValueError(f"{what} {tuple(scale_shape)} does not match packed weight {tuple(packed_shape)}: "
                         f"one per {block} input columns is {want}")


def dequant_fp4_experts(packed: jax.Array, scale: jax.Array, block: int = 32) -> jax.Array:
    """Packed E2M1 [E, out, in/2] (int8/uint8, low nibble first) + UE8M0 [E, out, in/block] -> f32 [E, out, in]."""
    if packed.dtype not in (jnp.int8, jnp.uint8):
        raise ValueError(f"packed FP4 weights must be int8/uint8, got {packed.dtype}")
    check_fp4_scale(packed.shape, scale.shape, block)
    e, n, kp = packed.shape
    b = packed.astype(jnp.int32) & 0xFF
    codes = jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(e, n, 2 * kp)
    mag = jnp.asarray(E2M1_MAGNITUDES, jnp.float32)[codes & 7]
    vals = jnp.where(codes >= 8, -mag, mag)
    s = jnp.repeat(e8m0_to_f32(scale), block, axis=-1)[..., : 2 * kp]
    return vals * s


_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints between magnitudes; ties go to the even code


def quantize_fp4_experts(w: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """float [..., out, in] -> (packed int8 [..., out, in/2], UE8M0 exponent bytes uint8 [..., out, in/block]),
    traceable (random FP4 models are made under jit / eval_shape). Same rule as formats.quantize_fp4:
    scale 2^ceil(log2(amax / 6)) per block (amax floored at 6 * 2^-126), nearest E2M1 code, ties to even."""
    *lead, n, k = w.shape
    if k % block:
        raise ValueError(f"FP4 quantisation needs the last dimension ({k}) to be a multiple of {block}")
    w = w.astype(jnp.float32)
    blocks = w.reshape(*lead, n, k // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), jnp.float32(6.0 * 2.0 ** -126))
    exp = ue8m0_exponent(amax, 6.0)
    x = blocks * jnp.ldexp(jnp.ones_like(amax), -exp)[..., None]
    a = jnp.abs(x)
    mag = sum(((a > b) if c % 2 == 0 else (a >= b)).astype(jnp.int32) for c, b in enumerate(_E2M1_BOUNDS))
    codes = (mag | (jnp.signbit(x).astype(jnp.int32) << 3)).reshape(*lead, n, k)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(packed, jnp.int8), (exp + 127).astype(jnp.uint8)


def dequant_experts(w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Any expert weight format -> float32: dense (scale None), FP8 E4M3 (+ block scales), FP4 packed (+ /32)."""
    if scale is None:
        return w.astype(jnp.float32)
    if w.dtype == jnp.float8_e4m3fn:
        return dequant_fp8_blocks(w, scale)
    if w.dtype in (jnp.int8, jnp.uint8):
        return dequant_fp4_experts(w, scale)
    raise ValueError(f"scaled expert weights must be float8_e4m3fn or packed int8/uint8 FP4, got {w.dtype}")


def dense_experts(w1: jax.Array, w2: jax.Array, w3: jax.Array, scales, dtype) -> tuple[jax.Array, ...]:
    """Expert weights as stored (+ scales (s1, s2, s3), or None when dense) -> dense (w1, w2, w3) in `dtype`."""
    s1, s2, s3 = (None, None, None) if scales is None else scales
    return tuple(dequant_experts(w, s).astype(dtype) for w, s in ((w1, s1), (w2, s2), (w3, s3)))


def moe_experts_quantized(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w1: jax.Array, w2: jax.Array,
                          w3: jax.Array, limit: float, scales=None, act_block: int = 0) -> jax.Array:
    """`moe_experts` with quantised weights, as the float32 math of the dequantised weights.

    scales: None (dense) or (s1, s2, s3) matching w1, w2, w3 (FP8 block scales or FP4 per-32 scales).
    x is taken as float32 too, so this is the exact target the kernels are measured against.
    Returns [M, D] float32.
    """
    return moe_experts(x.astype(jnp.float32), expert_ids, weights, *dense_experts(w1, w2, w3, scales, jnp.float32),
                       limit, act_block)


# ----------------------------------------------------------------------------- sparse window attention
# The interface of `pallas_kernels.attention.sparse_attention`: keys are named by where they live
# (SWA ring with explicit positions, the chunk's own rows, the compressed store) instead of one dense
# [B, S, R_w + S + N] mask. `window_sparse_dense` builds that dense formulation for `sink_attention`;
# `window_sparse_attention` is the gather formulation (what XLA would run without a kernel). Both are
# equal (tests/test_kernels_attention.py); the kernel is tested against the latter.

def window_key_mask(q_pos: jax.Array, k_pos: jax.Array, window: int, floor: jax.Array | None) -> jax.Array:
    """[B, S] query positions x key positions (-1 = no key), [B, N] shared by a sequence's rows or [B, S, N] per
    row -> [B, S, N] bool: max(floor, q - W + 1) <= k <= q (docs/model.md §4; floor = bounded-replay start, 0 when
    None)."""
    k_pos = k_pos if k_pos.ndim == 3 else k_pos[:, None, :]
    delta = q_pos[:, :, None] - k_pos
    ok = (delta >= 0) & (delta < window) & (k_pos >= 0)
    if floor is not None:
        ok = ok & (k_pos >= floor[:, None, None])
    return ok


def compressed_mask(q_pos: jax.Array, n: int, ratio: int, comp_idx: jax.Array | None) -> jax.Array:
    """Entries a row may use: visible (j < (p+1)//ratio) and, for CSA, selected. -> [B, S, n] bool."""
    visible = jnp.arange(n)[None, None, :] < ((q_pos + 1) // ratio)[..., None]
    return visible if comp_idx is None else visible & indices_to_mask(comp_idx, n)


def _window_keys(self_kv, self_pos, ring_kv, ring_pos):
    if ring_kv is None:
        return self_kv, self_pos
    return jnp.concatenate([ring_kv, self_kv.astype(ring_kv.dtype)], 1), jnp.concatenate([ring_pos, self_pos], 1)


def window_sparse_dense(q_pos, self_kv, self_pos, *, window: int, ring_kv=None, ring_pos=None, comp_kv=None,
                        comp_idx=None, ratio: int = 0, window_floor=None) -> tuple[jax.Array, jax.Array]:
    """The dense formulation the model's reference path uses: (keys [B, R+S(+N), Dh], mask [B, S, R+S(+N)])
    for `sink_attention` (keys = concat(ring, own rows, compressed store))."""
    kv, kpos = _window_keys(self_kv, self_pos, ring_kv, ring_pos)
    mask = window_key_mask(q_pos, kpos, window, window_floor)
    if comp_kv is None:
        return kv, mask
    cmask = compressed_mask(q_pos, comp_kv.shape[1], ratio, comp_idx)
    return jnp.concatenate([kv, comp_kv.astype(kv.dtype)], 1), jnp.concatenate([mask, cmask], 2)


def query_norm(q: jax.Array, eps: float) -> jax.Array:
    """rsqrt(mean(q^2) + eps) over each query head's channels, float32: q [..., H, Dh] -> [..., H]. RoPE rotates
    channel pairs, so a head's norm is the same before and after it."""
    q = q.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(q * q, axis=-1) + eps)


def window_sparse_attention(q, q_pos, self_kv, self_pos, sink, *, scale: float, window: int, ring_kv=None,
                            ring_pos=None, comp_kv=None, comp_idx=None, ratio: int = 0,
                            window_floor=None, q_norm_eps: float | None = None) -> jax.Array:
    """Reference for `pallas_kernels.attention.sparse_attention` (same arguments; shapes there).
    q_norm_eps: each head's scores are those of its RMS-normalised query, scale * query_norm(q) * (q . k).

    CSA (comp_idx [B, S, K], -1 = empty, no duplicates per row): the K selected entries are gathered
    per row ([B, S, K, Dh]) and masked by visibility; HCA (comp_idx None): every visible entry.
    One softmax over window + compressed keys with the per-head sink, fp32 logits and accumulation,
    probabilities cast to the KV dtype before the value product (as `sink_attention`).
    Returns [B, S, H, Dh] in q's dtype; rows without a valid key return 0.
    """
    kv, kpos = _window_keys(self_kv, self_pos, ring_kv, ring_pos)
    kv = kv.astype(q.dtype)
    z = [jnp.einsum("bshd,bnd->bhsn", q, kv, preferred_element_type=jnp.float32)]
    m = [window_key_mask(q_pos, kpos, window, window_floor)]
    comp = None
    if comp_kv is not None:
        n = comp_kv.shape[1]
        comp_kv = comp_kv.astype(q.dtype)
        visible_count = jnp.clip((q_pos + 1) // ratio, 0, n)  # [B, S]
        if comp_idx is None:
            comp = comp_kv
            z.append(jnp.einsum("bshd,bnd->bhsn", q, comp, preferred_element_type=jnp.float32))
            m.append(jnp.arange(n)[None, None, :] < visible_count[..., None])
        else:
            idx = comp_idx.astype(jnp.int32)
            comp = jax.vmap(lambda c, i: c[jnp.clip(i, 0, n - 1)])(comp_kv, idx)  # [B, S, K, Dh]
            z.append(jnp.einsum("bshd,bskd->bhsk", q, comp, preferred_element_type=jnp.float32))
            m.append((idx >= 0) & (idx < visible_count[..., None]))
    z = jnp.concatenate(z, -1) * scale
    if q_norm_eps is not None:
        z = z * jnp.moveaxis(query_norm(q, q_norm_eps), -1, 1)[..., None]
    z = jnp.where(jnp.concatenate(m, -1)[:, None], z, NEG_INF)
    sink = sink.astype(jnp.float32)[None, :, None, None]
    mx = jnp.maximum(jnp.max(z, axis=-1, keepdims=True), sink)
    p = jnp.exp(z - mx)
    p = (p / (jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - mx))).astype(q.dtype)
    nw = kv.shape[1]
    # Batch dims lead every product: CPU XLA has no bf16 x bf16 -> f32 dot otherwise (GPU does not care).
    o = jnp.einsum("bhsn,bnd->bhsd", p[..., :nw], kv, preferred_element_type=jnp.float32).transpose(0, 2, 1, 3)
    if comp is not None:
        if comp_idx is None:
            oc = jnp.einsum("bhsn,bnd->bhsd", p[..., nw:], comp, preferred_element_type=jnp.float32)
            o = o + oc.transpose(0, 2, 1, 3)
        else:
            pc = p[..., nw:].transpose(0, 2, 1, 3)  # [B, S, H, K]
            o = o + jnp.einsum("bshk,bskd->bshd", pc, comp, preferred_element_type=jnp.float32)
    return o.astype(q.dtype)


# ----------------------------------------------------------------------------- indexer + top-k
def dequantize_rows(keys: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Index keys as stored -> float32 [B, N, DI]: keys [B, N, DI] (e.g. float8_e4m3fn) with one float32 scale
    per row [B, N] (or none); or MXFP4 rows uint8 [B, N, DI/2 + DI/32] (`quantize_index_keys`), scale None."""
    if keys.dtype == jnp.uint8:
        half = keys.shape[-1] * 16 // 17           # DI/2 packed bytes of the DI/2 + DI/32
        return dequant_fp4_experts(keys[..., :half], keys[..., half:])
    k = keys.astype(jnp.float32)
    return k if scale is None else k * scale.astype(jnp.float32)[..., None]


def quantize_rows_fp8(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, N, DI] -> (float8_e4m3fn keys, float32 scale [B, N]) with a power-of-two scale per row
    (amax / scale <= 448), so dequantisation is exact up to the fp8 rounding of the values."""
    k = keys.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(k), axis=-1), 1e-30)
    scale = jnp.exp2(jnp.ceil(jnp.log2(amax / 448.0)))
    return (k / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def mxfp4_row_bytes(di: int) -> int:
    """Bytes of one MXFP4 index-key row of di values (`quantize_index_keys`): di/2 packed E2M1 + di/32 UE8M0."""
    return di // 2 + di // 32


def quantize_index_keys(keys: jax.Array, fmt: str | None) -> tuple[jax.Array, jax.Array | None]:
    """Index keys [B, N, DI] -> (keys as stored, key_scale) for fmt None (as given, no scale), "fp8" (E4M3, one
    scale per row) or "fp4" (MXFP4 rows as the release stores them, 68 B at DI = 128: uint8 [B, N, DI/2 + DI/32],
    the packed E2M1 nibbles, low first, then one UE8M0 exponent byte per 32; no separate scale)."""
    if fmt is None:
        return keys, None
    if fmt == "fp8":
        return quantize_rows_fp8(keys)
    if fmt == "fp4":
        packed, scale = quantize_fp4_experts(keys.astype(jnp.float32), 32)
        return jnp.concatenate([jax.lax.bitcast_convert_type(packed, jnp.uint8), scale], axis=-1), None
    raise ValueError(f"index key format must be None, 'fp8' or 'fp4', got {fmt!r}")


def indexer_topk(q: jax.Array, weights: jax.Array, keys: jax.Array, positions: jax.Array, *, ratio: int,
                 k: int, key_scale: jax.Array | None = None) -> jax.Array:
    """Reference for `pallas_kernels.indexer.indexer_topk`: scores over the entries visible to each row
    (j < (p+1)//ratio) then the k best (ties -> lower index), -1 where fewer are visible.

    q [B, T, HI, DI], weights [B, T, HI], keys as `dequantize_rows` takes them (with key_scale),
    positions [B, T] -> [B, T, min(k, N)] int32.
    """
    n = keys.shape[1]
    visible = jnp.arange(n)[None, None, :] < ((positions + 1) // ratio)[..., None]
    return topk_indices(indexer_scores(q, weights, dequantize_rows(keys, key_scale), visible), k)
