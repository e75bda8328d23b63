"""Batch-invariant formulations of the model's reductions (ModelConfig.batch_invariant, docs/batch_invariance.md).

XLA picks the code of a dot or a reduction from its operands' shapes: on the CPU a one-row product takes the
matrix-vector path and a row sum over 128 values is vectorised differently once there are 33 rows or more, so a
row's result depends on how many other rows share its op. The formulations here never let that happen: every
op that adds numbers together has a shape fixed by the weights and by the model's constants, never by the
batch, the chunk or the cache length.

* `row_blocks`: a per-row function run on consecutive blocks of ROWS rows in a loop (`lax.map`), so each op
  inside sees [ROWS, ...] whatever the number of rows; rows are padded to whole blocks, and optimization
  barriers around each block keep XLA from fusing its ops with whatever surrounds the loop (a loop of one
  trip is inlined, and a fusion with the caller's ops can change how an exp or a sum is emitted); on a mesh
  the blocks stay whole on every device (`whole_blocks`). A row's result does not depend on its block-mates
  nor on its place in the block (tests/test_batch_invariance.py).
* `rms_normalize`: x * rsqrt(mean(x^2) + eps) per row (`rms_scale`: the scale alone) with the sum of squares as
  a fixed pairwise tree of elementwise adds over halves of the row (`pairwise_sum`), between optimization
  barriers: elementwise arithmetic is the same per element whatever the shape, so no loop is needed (the RMS
  norms, V4's per-head query norm over rows x heads, the mHC kernels' statistic). The same way `softmax_pool`
  (the compressors' pooling of a block's slots: its maximum by `pairwise_max`, its sums by `weighted_sum`).
  XLA:CPU drops the optimization barriers before it fuses, so these rest on its emitting an elementwise op the
  same way per element whatever the shape; where a fused neighbour broke that (a max reduction beside an exp;
  the mHC collapses as weighted sums, fused with the ops around them, in float32 and on a mesh) the code keeps
  the reduction out (`pairwise_max`) or stays on `row_blocks`. The tests check each at many row counts.
* `sink_attention`: a block of query rows against its keys gathered per row in a canonical order (the
  window by absolute position, then the selected entries), plus optionally the compressed entries in
  blocks of ENTRY_BLOCK added one block after another: blocks past a row's visible entries add exact zeros,
  so the cache's length does not enter a row's sums.
* `indexer_scores`: the indexer's scores of a block of query rows, one block of INDEX_KEY_BLOCK keys at a time.
* `expert_slots`: the routed experts on fixed tiles of ROWS rows of one expert each (a loop over the live
  tiles): each (row, choice) output computed alone by fixed-shape GEMMs, returned per choice for the caller to
  add in expert-id order (`add_slots`), on one device or after any expert-parallel exchange.

Pure jnp, any backend. The guarantee is bitwise equality of a row's numbers across batches on one build of
jax / XLA and one kind of device; it says nothing across jax versions or device models, nor about how close
the numbers are to the default path's (close: the same products, summed in another order).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from . import reference as ref
from .moe.routing import route_plan

ROWS = 8  # rows per block of every per-row op, and per tile of the routed experts
ENTRY_BLOCK = 64  # compressed entries per block of the attention's sums
INDEX_KEY_BLOCK = 512  # index keys per block of the indexer's scores


def parse_blocks(text: str) -> tuple[int, int, int]:
    """"ROWS,ENTRY_BLOCK,INDEX_KEY_BLOCK" -> the three block sizes; ValueError naming the expected form otherwise."""
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or min(sizes) < 1:
        raise ValueError(f"takes three positive integers ROWS,ENTRY_BLOCK,INDEX_KEY_BLOCK, got {text!r}")
    return sizes


def set_blocks(blocks: tuple[int, int, int]) -> tuple[int, int, int]:
    """Replace the block sizes (ROWS, ENTRY_BLOCK, INDEX_KEY_BLOCK), read at trace time -> the previous ones."""
    global ROWS, ENTRY_BLOCK, INDEX_KEY_BLOCK
    previous = (ROWS, ENTRY_BLOCK, INDEX_KEY_BLOCK)
    ROWS, ENTRY_BLOCK, INDEX_KEY_BLOCK = blocks
    return previous


def row_blocks(fn: Callable, *args, lead: int = 1):
    """fn(*blocks) over consecutive blocks of ROWS rows. Every array leaf of `args` (None allowed) shares its
    first `lead` dims (the rows, e.g. [B, S]); fn gets [ROWS, ...] blocks of the flattened rows and must treat
    rows independently. -> fn's outputs with the rows' dims in front again."""
    leaves, tree = jax.tree.flatten(args)
    rows_shape = leaves[0].shape[:lead]
    m = 1
    for d in rows_shape:
        m *= d
    n = -(-m // ROWS)

    def split(x):
        x = x.reshape(m, *x.shape[lead:])
        x = jnp.pad(x, [(0, n * ROWS - m)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(n, ROWS, *x.shape[1:])

    def body(blocks):  # the barriers keep XLA from fusing a block's ops with the code around the loop
        out = fn(*jax.tree.unflatten(tree, jax.lax.optimization_barrier(blocks)))
        return jax.lax.optimization_barrier(out)

    out = whole_blocks(jax.lax.map(body, whole_blocks([split(x) for x in leaves])))
    return jax.tree.map(lambda y: y.reshape(n * ROWS, *y.shape[2:])[:m].reshape(*rows_shape, *y.shape[2:]), out)


def _pairwise(x: jax.Array, combine: Callable, axis: int) -> jax.Array:
    """x reduced over `axis` by elementwise `combine` only: the first half with the second, then the halves of that,
    an odd length carrying its last element to the next level. -> x with `axis` of size 1."""
    axis = axis % x.ndim
    while x.shape[axis] > 1:
        length, half = x.shape[axis], x.shape[axis] // 2
        pairs = combine(jax.lax.slice_in_dim(x, 0, half, axis=axis), jax.lax.slice_in_dim(x, half, 2 * half, axis=axis))
        x = jnp.concatenate([pairs, jax.lax.slice_in_dim(x, 2 * half, length, axis=axis)], axis) if length % 2 \
            else pairs
    return x


def pairwise_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Sum over `axis` (kept, of size 1) by a fixed tree of elementwise adds (`_pairwise`): each row's sum is one
    fixed sequence of float additions whatever the number of rows (no reduction op for XLA to emit by shape)."""
    return _pairwise(x, jnp.add, axis)


def pairwise_max(x: jax.Array, axis: int = -1) -> jax.Array:
    """Maximum over `axis` (kept) by elementwise maxima: exact in any order, but a reduction op would let XLA:CPU
    fuse it with the exp after it into one kernel whose exp it emits by shape."""
    return _pairwise(x, jnp.maximum, axis)


def weighted_sum(weights: jax.Array, x: jax.Array, axis: int) -> jax.Array:
    """sum_i weights_i x_i over `axis` in float32 (weights broadcast against x), the products formed apart (an
    optimization barrier, so that none fuses into an add) and added by `pairwise_sum`; `axis` dropped."""
    products = jax.lax.optimization_barrier(weights.astype(jnp.float32) * x.astype(jnp.float32))
    return jnp.squeeze(pairwise_sum(products, axis), axis)


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax over `axis` in float32, its maximum by `pairwise_max` and its sum by `pairwise_sum`, each stage
    between optimization barriers."""
    x = jax.lax.optimization_barrier(x.astype(jnp.float32))
    e = jax.lax.optimization_barrier(jnp.exp(x - pairwise_max(x, axis)))
    return jax.lax.optimization_barrier(e / pairwise_sum(e, axis))


def softmax_pool(a: jax.Array, g: jax.Array) -> jax.Array:
    """sum_s softmax_s(g) a_s over the slots axis -2: a, g [..., slots, width] -> [..., width] float32 (`softmax`,
    then `weighted_sum`)."""
    return weighted_sum(softmax(g, -2), a, -2)


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
    """rsqrt(mean(x^2) + eps) over the last axis in float32 -> [..., 1], the statistic by `pairwise_sum` of the
    squares, which are formed apart (an optimization barrier) so that no multiply fuses into the tree's adds."""
    x = jax.lax.optimization_barrier(x.astype(jnp.float32))
    squares = jax.lax.optimization_barrier(x * x)
    return jax.lax.rsqrt(pairwise_sum(squares) / x.shape[-1] + eps)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x * `rms_scale`(x) over the last axis in float32."""
    x = jax.lax.optimization_barrier(x.astype(jnp.float32))
    return jax.lax.optimization_barrier(x * rms_scale(x, eps))


def row_sequences(batch: int, rows: int) -> jax.Array:
    """[batch, rows] int32: each row's sequence (its batch index), for `row_blocks` functions that read their own
    sequence's keys from per-sequence arrays."""
    return jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, rows))


def whole_blocks(tree):
    """On a mesh the partitioner may split a block's rows over devices, and a product of fewer rows runs other
    code (other bits): outside shard_map every block is kept whole on every device (replicated); inside one, or
    without a mesh, as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or mesh.manual_axes:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec()), tree)


def entry_blocks(x: jax.Array, fill=0, block: int | None = None) -> jax.Array:
    """[C, N, ...] per-row entries -> [ceil(N / block), C, block, ...] (padded with `fill`; block None:
    ENTRY_BLOCK)."""
    block = ENTRY_BLOCK if block is None else block
    c, n = x.shape[:2]
    nb = -(-n // block)
    x = jnp.pad(x, [(0, 0), (0, nb * block - n)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(c, nb, block, *x.shape[2:]), 1, 0)


def sink_attention(q: jax.Array, kv: jax.Array, ok: jax.Array, sink: jax.Array, scale: float,
                   blocks: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Shared-KV attention with a per-head sink (`reference.sink_attention`'s softmax) for a block of query rows.

    q [C, H, Dh]; kv [C, N, Dh] each row's own keys (key == value) with ok [C, N] (True = attended); blocks: more
    keys as (kv [nb, C, EB, Dh], ok [nb, C, EB]), added to the sums block after block. -> [C, H, Dh] q.dtype.
    Scores, softmax and accumulation in float32, probabilities cast to the key dtype before the value product."""
    def scores(k, valid):
        z = jnp.einsum("chd,cnd->chn", *ref.f32_dot_operands(q, k), preferred_element_type=jnp.float32) * scale
        return jnp.where(valid[:, None], z, ref.NEG_INF)

    sink = sink.astype(jnp.float32)[None, :]
    z = scores(kv, ok)
    m = jnp.maximum(jnp.max(z, axis=-1), sink)                       # [C, H]
    zb = None
    if blocks is not None:
        zb = jax.lax.map(lambda a: scores(*a), blocks)              # [nb, C, H, EB]
        m = jnp.maximum(m, jnp.max(zb, axis=(0, 3)))                # a maximum is exact in any order

    def block_sum(total, zi):
        return total + jnp.sum(jnp.exp(zi - m[..., None]), axis=-1), None

    denom = jnp.sum(jnp.exp(z - m[..., None]), axis=-1)
    if zb is not None:
        denom, _ = jax.lax.scan(block_sum, denom, zb)
    denom = denom + jnp.exp(sink - m)

    def values(p, k):
        p = (jnp.exp(p - m[..., None]) / denom[..., None]).astype(k.dtype)
        return jnp.einsum("chn,cnd->chd", *ref.f32_dot_operands(p, k), preferred_element_type=jnp.float32)

    o = values(z, kv)
    if zb is not None:
        o, _ = jax.lax.scan(lambda acc, a: (acc + values(*a), None), o, (zb, blocks[0]))
    return o.astype(q.dtype)


def indexer_scores(q: jax.Array, weights: jax.Array, keys: jax.Array) -> jax.Array:
    """`reference.indexer_scores` (no visibility mask) of a block of query rows, one key block at a time.
    q [C, HI, DI], weights [C, HI], keys [C, N, DI] (each row's own) -> [C, N] float32."""
    def block(k):
        s = jnp.einsum("chd,cnd->chn", q.astype(jnp.float32), k.astype(jnp.float32))
        return jnp.einsum("chn,ch->cn", jax.nn.relu(s), weights.astype(jnp.float32))

    s = jax.lax.map(block, entry_blocks(keys, block=INDEX_KEY_BLOCK))  # [nb, C, INDEX_KEY_BLOCK]
    return jnp.moveaxis(s, 0, 1).reshape(q.shape[0], -1)[:, :keys.shape[1]]


def sort_choices(ids: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's k routing choices [M, k] in increasing expert id (the order `add_slots` adds them in)."""
    order = jnp.argsort(ids, axis=-1, stable=True)
    return jnp.take_along_axis(ids, order, axis=-1), jnp.take_along_axis(weights, order, axis=-1)


def add_slots(y: jax.Array) -> jax.Array:
    """[M, k, D] per-choice outputs -> [M, D], added left to right (choice 0 first)."""
    out = y[:, 0]
    for j in range(1, y.shape[1]):
        out = out + y[:, j]
    return out


def expert_slots(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w1: jax.Array, w2: jax.Array,
                 w3: jax.Array, limit: float, act_block: int = 0) -> jax.Array:
    """`reference.moe_experts` per choice, on fixed tiles: x [M, D], expert_ids / weights [M, k], dense w1/w3
    [E, I, D], w2 [E, D, I] -> [M, k, D] float32, row m's choice j = w W2_e swiglu(W1_e x, W3_e x) (0 for ids
    outside [0, E)). The routed rows are laid out by expert in tiles of ROWS rows (`moe.routing.route_plan`);
    one loop iteration per live tile runs [ROWS, D] x [D, I] and [ROWS, I] x [I, D] products of that tile's
    expert, so a row's numbers depend on its expert's weights and nothing else."""
    m, k = expert_ids.shape
    plan = route_plan(expert_ids, weights, w1.shape[0], ROWS)
    tiles = plan.tile_expert.shape[0]

    def tile(t, out):
        e = jnp.maximum(plan.tile_expert[t], 0)
        rows = jax.lax.dynamic_slice_in_dim(plan.row_token, t * ROWS, ROWS)
        wts = jax.lax.dynamic_slice_in_dim(plan.row_weight, t * ROWS, ROWS)
        xs = jnp.take(x, rows, axis=0)
        xs = (ref.fp8_fake_quant(xs, act_block) if act_block else xs).astype(w1.dtype)

        def product(a, w):  # [ROWS, K] x [out, K] -> [ROWS, out] float32
            return jnp.einsum("rk,ok->ro", *ref.f32_dot_operands(a, w[e]), preferred_element_type=jnp.float32)

        z = ref.clamped_swiglu(product(xs, w1), product(xs, w3), limit) * wts[:, None]
        y = product((ref.fp8_fake_quant(z, act_block) if act_block else z).astype(w2.dtype), w2)
        return jax.lax.dynamic_update_slice_in_dim(out, y, t * ROWS, axis=0)

    out0 = _zeros_varying_as((tiles * ROWS, x.shape[-1]), x, expert_ids, weights, w1, w2, w3)
    out = jax.lax.fori_loop(0, plan.num_tiles, tile, out0)
    return jnp.take(out, plan.dest.reshape(-1), axis=0, mode="fill", fill_value=0.0).reshape(m, k, -1)


def _zeros_varying_as(shape: tuple[int, ...], *operands: jax.Array) -> jax.Array:
    """float32 zeros of `shape` that vary over every mesh axis any operand varies over: inside a shard_map a loop's
    carry must have its body's type, which the operands make varying (an exact zero added per operand)."""
    out = jnp.zeros(shape, jnp.float32)
    for a in operands:
        out = out + jnp.zeros_like(a, shape=(), dtype=jnp.float32)
    return out
