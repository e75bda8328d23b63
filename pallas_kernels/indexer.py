"""Lightning-indexer scoring fused with the first stage of top-k, Pallas (Triton lowering) (docs/model.md §8).

score[b, t, j] = sum_h w[b, t, h] * ReLU(q[b, t, h] . k[b, j])  for visible j < (p_t + 1) // ratio,
-inf otherwise; then the k best entries per row (ties -> lower index in the reference).

Kernel: one program per (sequence, block of `rows_per_block` query rows, `tiles` x `block_n` entries), a
loop over its key tiles. Each key tile [block_n, DI] is read once and reused for every row of the block
(decode: all S rows of a sequence in one program, so each index key is read from HBM exactly once). Per row: one MMA
[block_n, DI] x [DI, HI] in fp32 accumulation, ReLU, head weights, sum over heads; the per-head scores
that the XLA path materialises ([HI, N]) never leave registers. Tiles beyond every row's
visible count are not computed. Keys may be bf16/f32 or float8_e4m3fn with one f32 scale per row
(`key_scale`, dequantised in-kernel after the dot: ReLU(s * c) = c * ReLU(s) needs c > 0).

Fused top-k (Triton cannot lower sort/top_k in a kernel, PALLAS_H200.md pitfall 4): the kernel also
writes the maximum of every group of `group` consecutive scores. The k best groups contain the k best
entries (a group outranked by k others holds no entry that beats its own maximum, so none of the top
k; exact ties aside), so top-k runs on two small problems: k of N/group group maxima, then k of
k*group candidates, instead of k of N. At N = 32K, k = 512, group = 8 that is 4096 + 4096 elements
instead of 32768 per row. On a GPU each of the two takes its k with the selection kernel (pallas_kernels/topk.py)
instead of XLA's sort.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import reference as ref
from .common import FP4_FOLD, fp4_tile, interpret_flag, next_pow2, on_gpu, pad_axis
from .topk import topk_select

# rows_per_block query rows share each key tile; a program loops over `tiles` key tiles of block_n entries
# (the H200 sweeps behind each: docs/kernels.md). One query row over bf16 keys (decode): a loop over 32 tiles of
# 64. More rows: one tile per program (the loop's pipelined query loads exceed SMEM at 4+ rows x 64 heads); FP8 /
# FP4 keys too (slower in the loop). Prefill: 128-key tiles, 4 warps.
DECODE_CONFIG = dict(rows_per_block=8, block_n=128, tiles=1, num_warps=4, num_stages=3)
ONE_ROW_CONFIG = dict(rows_per_block=1, block_n=64, tiles=32, num_warps=4, num_stages=3)
PREFILL_CONFIG = dict(rows_per_block=8, block_n=128, tiles=1, num_warps=4, num_stages=3)
GROUP = 8


def _check(cond, msg):
    if not cond:
        raise ValueError(f"indexer: {msg}")


def _scores_kernel(*refs, ratio, n, block_n, tiles, group, rows, key_format, aligned):
    """q [rows, HI, DI] (fp4: its even and odd columns, two refs [rows, HI, DI/2]); w [rows, HI] f32; pos [rows];
    keys [N, DI] (fp4: MXFP4 rows [N, DI/2 + DI/32], packed E2M1 then UE8M0 bytes); key_format "plain" |
    "row_scale" (+ scale [N] f32) | "fp4" -> scores [rows, tiles * block_n] f32, group maxima
    [rows, tiles * block_n // group] f32: `tiles` consecutive key tiles of block_n entries, in a loop that
    stops at the last tile any row sees (the rest are -inf). Per row and tile the MMA gives the per-head scores
    as [block_n, HI]: keys are the MMA's M, so the sum over heads runs along each thread's own accumulator row,
    not across warps (the [HI, block_n] orientation was slower on the H200)."""
    fp4 = key_format == "fp4"
    it = iter(refs)
    q_refs = (next(it), next(it)) if fp4 else (next(it),)
    w_ref, pos_ref, k_ref = next(it), next(it), next(it)
    sc_ref = next(it) if key_format == "row_scale" else None
    s_ref, g_ref = next(it), next(it)
    base = pl.program_id(2) * (tiles * block_n)
    counts = [jnp.clip((pos_ref[r] + 1) // ratio, 0, n) for r in range(rows)]  # visible entries per row
    top = counts[0]
    for c in counts[1:]:
        top = jnp.maximum(top, c)
    live = jnp.clip((top - base + block_n - 1) // block_n, 0, tiles)   # tiles holding a visible entry
    dt = q_refs[0].dtype

    def out_cols(i):   # tile i's columns of this program's output blocks
        return (pl.ds(pl.multiple_of(i * block_n, block_n), block_n),
                pl.ds(pl.multiple_of(i * (block_n // group), block_n // group), block_n // group))

    def compute(i, carry):
        start = base + i * block_n
        cols = start + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
        if aligned:  # N % block_n == 0: a plain aligned tile
            tile = pl.ds(pl.multiple_of(start, block_n), block_n)
        else:       # ragged last tile: clamp rows (masked below)
            tile = jnp.minimum(cols, n - 1)
        if fp4:   # [block_n, DI/2] each: the row's packed bytes, then its scale bytes
            half = q_refs[0].shape[-1]
            kt = tuple(v.astype(dt) for v in fp4_tile(k_ref[tile, pl.ds(0, half)],
                                                       k_ref[tile, pl.ds(half, half // 16)]))
        else:
            kt = (k_ref[tile, :].astype(dt),)
        sc = sc_ref[tile] if sc_ref is not None else None
        s_cols, g_cols = out_cols(i)
        for r in range(rows):
            s = sum(lax.dot_general(kp, q_ref[r], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                    for q_ref, kp in zip(q_refs, kt))                     # [block_n, HI]
            if key_format == "row_scale":
                s = s * sc.astype(jnp.float32)[:, None]
            elif fp4:
                s = s * FP4_FOLD
            s = jnp.maximum(s, 0.0) * w_ref[r].astype(jnp.float32)[None, :]
            row = jnp.where(cols < counts[r], s.sum(axis=1), -jnp.inf)
            s_ref[r, s_cols] = row
            g_ref[r, g_cols] = row.reshape(block_n // group, group).max(axis=1)
        return carry

    def skip(i, carry):
        s_cols, g_cols = out_cols(i)
        for r in range(rows):  # per row: `rows` need not be a power of two
            s_ref[r, s_cols] = jnp.full((block_n,), -jnp.inf, jnp.float32)
            g_ref[r, g_cols] = jnp.full((block_n // group,), -jnp.inf, jnp.float32)
        return carry

    if tiles == 1:   # no loop: a loop of one tile pipelines nothing and its staging buffers cost SMEM
        pl.when(live > 0)(functools.partial(compute, jnp.int32(0), None))
        pl.when(live == 0)(functools.partial(skip, jnp.int32(0), None))
    else:
        lax.fori_loop(0, live, compute, None)
        lax.fori_loop(live, tiles, skip, None)


@functools.partial(jax.jit, static_argnames=(
    "ratio", "mode", "rows_per_block", "block_n", "tiles", "num_warps", "num_stages", "group",
    "interpret"))
def indexer_scores(q, weights, keys, positions, *, ratio: int, key_scale=None, mode: str = "auto",
                   rows_per_block: int | None = None, block_n: int | None = None, tiles: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None,
                   group: int = GROUP, interpret: bool | None = None):
    """Fused indexer scores. q [B, T, HI, DI], weights [B, T, HI], keys [B, N, DI] (bf16/f32; or
    float8_e4m3fn with key_scale [B, N] f32; or MXFP4 rows as the release stores them, uint8 [B, N, DI/2 + DI/32]:
    packed E2M1 (low nibble first) then one UE8M0 exponent byte per 32 -- `reference.quantize_index_keys`),
    positions [B, T] int32.

    -> (scores [B, T, Np] float32 (-inf where not visible or j >= N; Np = N rounded up to one program's
        tiles x block_n entries),
        group maxima [B, T, Np // group] float32).
    Tiling (None: the mode's default): rows_per_block query rows per program, `tiles` key tiles of block_n
    entries per program (powers of two).
    """
    _check(q.ndim == 4, f"q must be [B, T, HI, DI], got {q.shape}")
    b, t, hi, di = q.shape
    _check(weights.shape == (b, t, hi), f"weights must be {(b, t, hi)}, got {weights.shape}")
    fp4 = keys.dtype == jnp.uint8
    kdi = ref.mxfp4_row_bytes(di) if fp4 else di
    _check(keys.ndim == 3 and keys.shape[0] == b and keys.shape[2] == kdi and keys.shape[1] > 0,
           f"keys must be [B, N>0, {'DI/2 + DI/32 (MXFP4 rows)' if fp4 else 'DI'}]=[{b}, N, {kdi}], got {keys.shape}")
    _check(positions.shape == (b, t), f"positions must be {(b, t)}, got {positions.shape}")
    _check(int(ratio) > 0, f"ratio must be positive, got {ratio}")
    n = keys.shape[1]
    if fp4:
        _check(di >= 32 and di & (di - 1) == 0, f"MXFP4 keys need DI a power of two >= 32, got DI={di}")
        _check(key_scale is None, "MXFP4 key rows carry their scales: key_scale must be None")
    elif key_scale is not None:
        _check(key_scale.shape == (b, n), f"key_scale must be {(b, n)}, got {key_scale.shape}")
    elif keys.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
        raise ValueError(f"indexer: keys of dtype {keys.dtype} need key_scale (one scale per row)")
    if mode not in ("auto", "decode", "prefill"):
        raise ValueError(f"indexer: mode must be auto|decode|prefill, got {mode!r}")
    if mode == "auto":
        mode = "decode" if t <= 16 else "prefill"
    key_format = "fp4" if fp4 else "plain" if key_scale is None else "row_scale"
    cfg = dict(PREFILL_CONFIG if mode == "prefill" else ONE_ROW_CONFIG if t == 1 and key_format == "plain"
               else DECODE_CONFIG)
    cfg["block_n"] = max(cfg["block_n"], group)   # a default tile holds whole groups (V4.1: candidate blocks)
    for k, v in (("rows_per_block", rows_per_block), ("block_n", block_n), ("tiles", tiles),
                 ("num_warps", num_warps), ("num_stages", num_stages)):
        if v is not None:
            cfg[k] = v
    bn = cfg["block_n"]
    _check(bn >= 16 and bn & (bn - 1) == 0, f"block_n must be a power of two >= 16, got {bn}")
    _check(cfg["tiles"] >= 1 and cfg["tiles"] & (cfg["tiles"] - 1) == 0,
           f"tiles must be a power of two >= 1, got {cfg['tiles']}")
    nt = min(cfg["tiles"], next_pow2(-(-n // bn)))   # short key lists: no program past the padded end
    _check(group >= 1 and group & (group - 1) == 0 and bn % group == 0,
           f"group must be a power of two dividing block_n={bn}, got {group}")
    rows = max(1, min(cfg["rows_per_block"], t))
    while t % rows:  # rows per program must divide T (no ragged row blocks)
        rows -= 1

    # Triton: power-of-two tensors, MMA dims >= 16 -> zero-pad heads (weight 0) and head dim.
    hp, dp = max(16, next_pow2(hi)), max(16, next_pow2(di))
    dt = jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16
    q = pad_axis(pad_axis(q.astype(dt), 3, dp), 2, hp)
    weights = pad_axis(weights.astype(jnp.float32), 2, hp)
    if not fp4:
        keys = pad_axis(keys, 2, dp)
    span = nt * bn                                   # entries per program
    npad = -(-n // span) * span
    grid = (b, t // rows, npad // span)
    qs = (q[..., 0::2], q[..., 1::2]) if fp4 else (q,)     # FP4: the columns each nibble of a byte meets
    in_specs = [pl.BlockSpec((None, rows, hp, qs[0].shape[-1]), lambda bi, ri, ti: (bi, ri, 0, 0)) for _ in qs]
    in_specs += [pl.BlockSpec((None, rows, hp), lambda bi, ri, ti: (bi, ri, 0)),
                 pl.BlockSpec((None, rows), lambda bi, ri, ti: (bi, ri)),
                 pl.BlockSpec((None, n, keys.shape[2]), lambda bi, ri, ti: (bi, 0, 0))]
    args = [*qs, weights, positions.astype(jnp.int32), keys]
    if key_scale is not None:
        in_specs.append(pl.BlockSpec((None, n), lambda bi, ri, ti: (bi, 0)))
        args.append(key_scale.astype(jnp.float32))
    kern = functools.partial(_scores_kernel, ratio=int(ratio), n=n, block_n=bn, tiles=nt, group=group, rows=rows,
                             key_format=key_format, aligned=n % bn == 0)
    return pl.pallas_call(
        kern, grid=grid, in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, rows, span), lambda bi, ri, ti: (bi, ri, ti)),
                   pl.BlockSpec((None, rows, span // group), lambda bi, ri, ti: (bi, ri, ti))],
        out_shape=[jax.ShapeDtypeStruct((b, t, npad), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, npad // group), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret_flag("triton", interpret), name="indexer_scores",
    )(*args)


def grouped_topk(scores: jax.Array, group_max: jax.Array, k: int, n: int, group: int = GROUP,
                 mask: jax.Array | None = None, select: str = "auto") -> jax.Array:
    """Top-k entry indices from scores [..., Np] and their group maxima [..., Np // group], in two small problems
    (see the module docstring): k of the group maxima, then k of the chosen groups' entries.

    -> [..., min(k, n)] int32, -1 where the score is -inf; the same set as
    `reference.topk_indices(scores[..., :n], k)` except between exactly tied scores. select: how each problem takes
    its k -- "sort": XLA's top-k (best first); "kernel": `topk.topk_select` (no sort; groups in position order,
    then entries in candidate order); "auto": the kernel on a GPU, the sorts elsewhere. mask [..., n] bool
    (optional): only entries inside it count; it must be constant on each group of `group` entries (whole groups in
    or out, as V4.1's candidate source publishes them) -- entries outside are never picked either way, but a group
    half in would rank by a maximum it may not own.
    """
    _check(select in ("auto", "sort", "kernel"), f"select must be 'auto', 'sort' or 'kernel', got {select!r}")
    kernel = select == "kernel" or (select == "auto" and on_gpu())

    def top(x: jax.Array, kk: int, width: int) -> jax.Array:   # k best of x[..., :width], -1 where -inf
        return topk_select(x, kk, width) if kernel else ref.topk_indices(x[..., :width], kk)

    kk = min(k, n)
    ngroups = group_max.shape[-1]
    if mask is not None:
        mask = pad_axis(mask, mask.ndim - 1, ngroups * group, False)
        group_max = jnp.where(mask.reshape(*mask.shape[:-1], ngroups, group).any(-1), group_max, -jnp.inf)
    if ngroups <= kk or kk * group >= n:  # two stages would not shrink the problem
        return top(scores if mask is None else jnp.where(mask, scores, -jnp.inf), kk, n)
    groups = top(group_max, kk, ngroups)                                             # [..., kk], -1: none left

    def take(a):   # [..., Np] -> the entries of the chosen groups [..., kk, group]
        return jnp.take_along_axis(a.reshape(*a.shape[:-1], ngroups, group), jnp.maximum(groups, 0)[..., None],
                                   axis=-2)
    keep = groups[..., None] >= 0 if mask is None else (groups[..., None] >= 0) & take(mask)
    cand = jnp.where(keep, take(scores), -jnp.inf).reshape(*groups.shape[:-1], kk * group)
    pos = top(cand, kk, kk * group)
    idx = jnp.take_along_axis(groups, jnp.maximum(pos, 0) // group, axis=-1) * group + pos % group
    return jnp.where(pos >= 0, idx, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "ratio", "k", "mode", "rows_per_block", "block_n", "tiles", "num_warps", "num_stages", "group",
    "interpret", "impl"))
def indexer_topk(q, weights, keys, positions, *, ratio: int, k: int, key_scale=None, mode: str = "auto",
                 rows_per_block: int | None = None, block_n: int | None = None, tiles: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 group: int = GROUP, interpret: bool | None = None, impl: str = "pallas"):
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
                                  rows_per_block=rows_per_block, block_n=block_n, tiles=tiles, num_warps=num_warps,
                                  num_stages=num_stages, group=group, interpret=interpret)
    return grouped_topk(scores, gmax, int(k), keys.shape[1], group)


@functools.partial(jax.jit, static_argnames=("ratio", "k", "publish_groups", "group", "interpret", "select"))
def indexer_select(q, weights, keys, positions, *, ratio: int, k: int, candidates=None, publish_groups: int = 0,
                   group: int = GROUP, key_scale=None, interpret: bool | None = None, select: str = "auto"):
    """A layer's indexer step on the fused kernel, V4.1's candidate layers included (docs/model.md §7.2-7.4).
    Shapes as `indexer_topk`; without candidates or publish_groups it is `indexer_topk` at default tiling.
    [V4.1] group = the candidate block size (the kernel's group maxima are the block scores);
    publish_groups > 0 (the candidate source): its own top-k is unrestricted, and it returns the candidate
    mask [B, T, N]: the publish_groups best groups (`reference.top_candidate_groups`). candidates [B, T, N]
    bool (a Reindex layer): only entries inside count (whole groups, as published). select: how the top-k takes
    its k (`grouped_topk`). -> (top-k indices [B, T, min(k, N)], the published mask or None)."""
    _check(not (publish_groups and candidates is not None), "a candidate source publishes, it is not restricted")
    if candidates is not None:
        _check(candidates.shape == positions.shape + (keys.shape[1],),
               f"candidates must be [B, T, N]={positions.shape + (keys.shape[1],)}, got {candidates.shape}")
    scores, gmax = indexer_scores(q, weights, keys, positions, ratio=ratio, key_scale=key_scale, group=group,
                                  interpret=interpret)
    n = keys.shape[1]
    published = None
    if publish_groups:
        keep = ref.top_candidate_groups(gmax, (positions + 1) // ratio, int(publish_groups), group)
        published = jnp.repeat(keep, group, axis=-1)[..., :n]
    return grouped_topk(scores, gmax, int(k), n, group, mask=candidates, select=select), published
