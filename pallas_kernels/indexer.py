"""Lightning-indexer scoring fused with the first stage of top-k, Pallas (Triton lowering) (MODEL_SPEC 2.5).

score[b, t, j] = sum_h w[b, t, h] * ReLU(q[b, t, h] . k[b, j])  for visible j < (p_t + 1) // ratio,
-inf otherwise; then the k best entries per row (ties -> lower index in the reference).

Kernel: one program per (sequence, block of `rows_per_block` query rows, tile of `block_n` entries).
The key tile [block_n, DI] is read once and reused for every row of the block (decode: all S rows of a
sequence in one program, so each index key is read from HBM exactly once). Per row: one MMA
[HI, DI] x [DI, block_n] in fp32 accumulation, ReLU, head weights, sum over heads; the [HI, N]
per-head scores that the XLA path materialises never leave registers. Tiles beyond every row's
visible count are not computed. Keys may be bf16/f32 or float8_e4m3fn with one f32 scale per row
(`key_scale`, dequantised in-kernel after the dot: ReLU(s * c) = c * ReLU(s) needs c > 0).

Fused top-k (Triton cannot lower sort/top_k in a kernel, PALLAS_H200.md pitfall 4): the kernel also
writes the maximum of every group of `group` consecutive scores. The k best groups contain the k best
entries (a group outranked by k others holds no entry that beats its own maximum, so none of the top
k; exact ties aside), so top-k runs on two small problems: k of N/group group maxima, then k of
k*group candidates, instead of k of N. At N = 32K, k = 512, group = 8 that is 4096 + 4096 elements
instead of 32768 per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import reference as ref
from .common import next_pow2, on_gpu, pad_axis

# (rows_per_block, block_n, num_warps, num_stages)
DECODE_CONFIG = dict(rows_per_block=8, block_n=128, num_warps=4, num_stages=3)
PREFILL_CONFIG = dict(rows_per_block=8, block_n=256, num_warps=8, num_stages=3)  # q rows re-read per tile: wide tiles
GROUP = 8


def _check(cond, msg):
    if not cond:
        raise ValueError(f"indexer: {msg}")


def _scores_kernel(*refs, ratio, n, block_n, group, rows, has_scale, aligned):
    """q [rows, HI, DI]; w [rows, HI] f32; pos [rows]; keys [N, DI]; [scale [N]] ->
    scores [rows, block_n] f32, group maxima [rows, block_n // group] f32."""
    if has_scale:
        q_ref, w_ref, pos_ref, k_ref, sc_ref, s_ref, g_ref = refs
    else:
        q_ref, w_ref, pos_ref, k_ref, s_ref, g_ref = refs
        sc_ref = None
    t = pl.program_id(2)
    start = t * block_n
    cols = start + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    counts = [jnp.clip((pos_ref[r] + 1) // ratio, 0, n) for r in range(rows)]  # visible entries per row
    top = counts[0]
    for c in counts[1:]:
        top = jnp.maximum(top, c)

    @pl.when(start < top)
    def _compute():
        if aligned:  # N % block_n == 0: a plain aligned tile
            tile = pl.ds(pl.multiple_of(start, block_n), block_n)
            k = k_ref[tile, :]
            sc = sc_ref[tile] if has_scale else None
        else:       # ragged last tile: clamp rows (masked below)
            rc = jnp.minimum(cols, n - 1)
            k = k_ref[rc, :]
            sc = sc_ref[rc] if has_scale else None
        dt = q_ref.dtype
        k = k.astype(dt)
        for r in range(rows):
            s = lax.dot_general(q_ref[r], k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)  # [HI, block_n]
            if has_scale:
                s = s * sc.astype(jnp.float32)[None, :]
            s = jnp.maximum(s, 0.0) * w_ref[r].astype(jnp.float32)[:, None]
            row = jnp.where(cols < counts[r], s.sum(axis=0), -jnp.inf)
            s_ref[r, :] = row
            g_ref[r, :] = row.reshape(block_n // group, group).max(axis=1)

    @pl.when(start >= top)
    def _skip():
        for r in range(rows):  # per row: `rows` need not be a power of two
            s_ref[r, :] = jnp.full((block_n,), -jnp.inf, jnp.float32)
            g_ref[r, :] = jnp.full((block_n // group,), -jnp.inf, jnp.float32)


@functools.partial(jax.jit, static_argnames=(
    "ratio", "mode", "rows_per_block", "block_n", "num_warps", "num_stages", "group", "interpret"))
def indexer_scores(q, weights, keys, positions, *, ratio: int, key_scale=None, mode: str = "auto",
                   rows_per_block: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, group: int = GROUP, interpret: bool | None = None):
    """Fused indexer scores. q [B, T, HI, DI], weights [B, T, HI], keys [B, N, DI] (bf16/f32, or
    float8_e4m3fn with key_scale [B, N] f32), positions [B, T] int32.

    -> (scores [B, T, Np] float32 (-inf where not visible or j >= N; Np = N rounded up to block_n),
        group maxima [B, T, Np // group] float32).
    """
    _check(q.ndim == 4, f"q must be [B, T, HI, DI], got {q.shape}")
    b, t, hi, di = q.shape
    _check(weights.shape == (b, t, hi), f"weights must be {(b, t, hi)}, got {weights.shape}")
    _check(keys.ndim == 3 and keys.shape[0] == b and keys.shape[2] == di and keys.shape[1] > 0,
           f"keys must be [B, N>0, DI]=[{b}, N, {di}], got {keys.shape}")
    _check(positions.shape == (b, t), f"positions must be {(b, t)}, got {positions.shape}")
    _check(int(ratio) > 0, f"ratio must be positive, got {ratio}")
    n = keys.shape[1]
    if key_scale is not None:
        _check(key_scale.shape == (b, n), f"key_scale must be {(b, n)}, got {key_scale.shape}")
    elif keys.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
        raise ValueError(f"indexer: keys of dtype {keys.dtype} need key_scale (one scale per row)")
    if mode not in ("auto", "decode", "prefill"):
        raise ValueError(f"indexer: mode must be auto|decode|prefill, got {mode!r}")
    if mode == "auto":
        mode = "decode" if t <= 16 else "prefill"
    cfg = dict(DECODE_CONFIG if mode == "decode" else PREFILL_CONFIG)
    for k, v in (("rows_per_block", rows_per_block), ("block_n", block_n), ("num_warps", num_warps),
                 ("num_stages", num_stages)):
        if v is not None:
            cfg[k] = v
    bn = cfg["block_n"]
    _check(bn >= 16 and bn & (bn - 1) == 0, f"block_n must be a power of two >= 16, got {bn}")
    _check(group >= 1 and group & (group - 1) == 0 and bn % group == 0,
           f"group must be a power of two dividing block_n={bn}, got {group}")
    if interpret is None:
        interpret = not on_gpu()
    rows = max(1, min(cfg["rows_per_block"], t))
    while t % rows:  # rows per program must divide T (no ragged row blocks)
        rows -= 1

    # Triton: power-of-two tensors, MMA dims >= 16 -> zero-pad heads (weight 0) and head dim.
    hp, dp = max(16, next_pow2(hi)), max(16, next_pow2(di))
    dt = jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16
    q = pad_axis(pad_axis(q.astype(dt), 3, dp), 2, hp)
    weights = pad_axis(weights.astype(jnp.float32), 2, hp)
    keys = pad_axis(keys, 2, dp)
    npad = -(-n // bn) * bn
    grid = (b, t // rows, npad // bn)
    in_specs = [pl.BlockSpec((None, rows, hp, dp), lambda bi, ri, ti: (bi, ri, 0, 0)),
                pl.BlockSpec((None, rows, hp), lambda bi, ri, ti: (bi, ri, 0)),
                pl.BlockSpec((None, rows), lambda bi, ri, ti: (bi, ri)),
                pl.BlockSpec((None, n, dp), lambda bi, ri, ti: (bi, 0, 0))]
    args = [q, weights, positions.astype(jnp.int32), keys]
    if key_scale is not None:
        in_specs.append(pl.BlockSpec((None, n), lambda bi, ri, ti: (bi, 0)))
        args.append(key_scale.astype(jnp.float32))
    kern = functools.partial(_scores_kernel, ratio=int(ratio), n=n, block_n=bn, group=group, rows=rows,
                             has_scale=key_scale is not None, aligned=n % bn == 0)
    return pl.pallas_call(
        kern, grid=grid, in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, rows, bn), lambda bi, ri, ti: (bi, ri, ti)),
                   pl.BlockSpec((None, rows, bn // group), lambda bi, ri, ti: (bi, ri, ti))],
        out_shape=[jax.ShapeDtypeStruct((b, t, npad), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, npad // group), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret, name="indexer_scores",
    )(*args)


def grouped_topk(scores: jax.Array, group_max: jax.Array, k: int, n: int, group: int = GROUP) -> jax.Array:
    """Top-k entry indices from scores [..., Np] and their group maxima [..., Np // group].

    -> [..., min(k, n)] int32, best first, -1 where the score is -inf. Same set as
    `reference.topk_indices(scores[..., :n], k)` except between exactly tied scores.
    """
    kk = min(k, n)
    ngroups = group_max.shape[-1]
    if ngroups <= kk or kk * group >= n:  # two stages would not shrink the problem
        vals, idx = lax.top_k(scores[..., :n], kk)
    else:
        _, gidx = lax.top_k(group_max, kk)                                   # [..., kk] groups
        cand = jnp.take_along_axis(scores.reshape(*scores.shape[:-1], ngroups, group), gidx[..., None], axis=-2)
        vals, pos = lax.top_k(cand.reshape(*cand.shape[:-2], kk * group), kk)  # [..., kk]
        idx = jnp.take_along_axis(gidx, pos // group, axis=-1) * group + pos % group
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "ratio", "k", "mode", "rows_per_block", "block_n", "num_warps", "num_stages", "group", "interpret", "impl"))
def indexer_topk(q, weights, keys, positions, *, ratio: int, k: int, key_scale=None, mode: str = "auto",
                 rows_per_block: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, group: int = GROUP, interpret: bool | None = None,
                 impl: str = "pallas"):
    """Indexer scoring + top-k: the k best visible entries per query row.

    q [B, T, HI, DI], weights [B, T, HI] (already scaled), keys [B, N, DI] (optionally fp8 with
    key_scale [B, N]), positions [B, T] -> [B, T, min(k, N)] int32 (-1 = fewer visible entries).
    Matches `reference.indexer_topk` as a set per row, except between exactly tied scores
    (impl="reference" runs that reference).
    """
    _check(int(k) > 0, f"k must be positive, got {k}")
    if impl == "reference":
        return ref.indexer_topk(q, weights, keys, positions, ratio=ratio, k=k, key_scale=key_scale)
    _check(impl == "pallas", f"impl must be 'reference' or 'pallas', got {impl!r}")
    scores, gmax = indexer_scores(q, weights, keys, positions, ratio=ratio, key_scale=key_scale, mode=mode,
                                  rows_per_block=rows_per_block, block_n=block_n, num_warps=num_warps,
                                  num_stages=num_stages, group=group, interpret=interpret)
    return grouped_topk(scores, gmax, int(k), keys.shape[1], group)
