"""Window + compressed sparse MQA at 64 heads x 512 with a per-head sink, Mosaic GPU (Hopper).

Same contract as `pallas_kernels.attention.sparse_attention` (docs/model.md §4, §5, §6, §8; shapes there), for the
V4 widths only: 64 query heads sharing one 512-wide bf16 key/value vector per key.

1. `key_list` (XLA) turns each query row's candidate keys -- its ring slots, the own rows in its window band,
   its selected compressed entries (CSA) or every compressed entry (HCA) -- into a compacted list of valid
   keys, each an int32 code `row * 4 + source` (source 0 ring, 1 own rows, 2 compressed; row in the source's
   flattened [B * rows, 512] view), padded past `count` with a valid dummy row that the kernel masks.
2. The kernel runs one program per query row (its 64 heads are wgmma's M) over the list in blocks of 64 keys:
   * a producer warpgroup gathers each block into a 2-stage SMEM ring by TMA, 8 copies of 128 B per key row
     (Hopper has no TMA gather; a stage is the wgmma-ready (8, 64)-tiled, 128B-swizzled [64, 512] layout, and
     a `plgpu.RefUnion` gives the same bytes a [.., 8 rows, 64] row view whose 1-row slices TMA accepts; the
     engine swizzles by address). Compiled, the copies are issued from `plgpu.inline_mgpu` by one lane of
     each of 4 warps, with ONE expect-tx per block: Pallas' `copy_gmem_to_smem` makes all 128 lanes arrive
     per copy and adds a warpgroup barrier per copy, which ran several times slower (docs/kernels.md);
   * two compute warpgroups split the head dim (a 64 x 512 f32 accumulator is 256 registers per thread: too
     many for one): warpgroup h computes the partial scores q[:, 256h:+256] k[:, 256h:+256]^T, the two
     exchange them through SMEM, both run the same online softmax (log2 units, from m = sink, l = 1: the
     sink joins the denominator) and each accumulates P v[:, 256h:+256]. Keys past `count` are masked; a row
     without keys returns exact zeros.
SMEM: q 64 KiB + KV 2 x 64 KiB + score exchange 32 KiB + barriers = 229,432 of 232,448 B; the codes are read
from GMEM (an SMEM copy would not fit: every buffer is 1 KiB-aligned).

Small batches split each row's key blocks over programs (`num_splits`, flash decoding; partials combined in
XLA with the sink).

CPU: the Mosaic GPU interpreter has no rules for inline_mgpu, RefUnion aliasing, transposed / register wgmma
operands or layout casts, so `interpret=True` runs the same program with Pallas copies into the tiled stage
and plain dots: it checks the key list, the barrier protocol, the exchange, the masks and the softmax; the
compiled path's gather and MMA forms are checked by lowering for CUDA and on the GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import reference as ref
from .common import interpret_flag

HEADS, DIM = 64, 512
HALF = DIM // 2          # head-dim columns per compute warpgroup
CHUNK = 64               # bf16 columns per 128-byte swizzle chunk
BLOCK = 64               # keys per block (wgmma N of the score product, K of the value product)
STAGES = 2
ISSUE_WARPS = 4          # producer warps issuing TMAs
RING, OWN, COMP = 0, 1, 2
LOG2E = math.log2(math.e)
NEG = -1e30   # finite start of a partial's running maximum (2^(NEG - m) == 0, never NaN)


def _check(cond, msg):
    if not cond:
        raise ValueError(f"sparse_attention_mgpu: {msg}")


# ----------------------------------------------------------------------------- key list (XLA)
def key_list(q_pos, self_pos, *, window: int, ring_pos=None, comp_idx=None, n_comp: int = 0, ratio: int = 0,
             window_floor=None):
    """Compacted valid keys per query row. q_pos / self_pos [B, S], ring_pos [B, R] | None, comp_idx [B, S, K]
    (CSA) | None (HCA over n_comp entries, or no compressed keys when n_comp == 0), window_floor [B] | None.

    -> (codes [B * S, L] int32, count [B * S] int32): codes[i, :count[i]] are the row's valid keys as
    `flat_row * 4 + source` (flat rows of ring_kv / self_kv / comp_kv reshaped to [B * rows, Dh]); the tail
    holds the row's own slot (a valid address, masked in the kernel). L is a multiple of BLOCK covering the
    most keys a row can have (its W window positions + its K selected or N visible entries)."""
    b, s = q_pos.shape
    band = min(window, s)                         # own rows s - band + 1 .. s can be in row s's window
    codes, valid = [], []
    if ring_pos is not None:
        r = ring_pos.shape[1]
        codes.append(jnp.broadcast_to((jnp.arange(b)[:, None, None] * r + jnp.arange(r)) * 4 + RING, (b, s, r)))
        valid.append(ref.window_key_mask(q_pos, ring_pos, window, window_floor))
    j = jnp.arange(s)[:, None] - band + 1 + jnp.arange(band)[None, :]                # [S, band] own row index
    jc = jnp.clip(j, 0, s - 1)
    codes.append(jnp.broadcast_to((jnp.arange(b)[:, None, None] * s + jc) * 4 + OWN, (b, s, band)))
    kpos = jnp.where(j[None] >= 0, self_pos[:, jc], -1)                            # [B, S, band]
    valid.append(ref.window_key_mask(q_pos, kpos, window, window_floor))
    n_sel = 0
    if n_comp:
        visible = jnp.clip((q_pos + 1) // ratio, 0, n_comp)                           # [B, S]
        if comp_idx is not None:
            idx = comp_idx.astype(jnp.int32)
            n_sel = idx.shape[2]
            valid.append((idx >= 0) & (idx < visible[..., None]))
        else:
            n_sel = n_comp
            idx = jnp.broadcast_to(jnp.arange(n_comp, dtype=jnp.int32), (b, s, n_comp))
            valid.append(idx < visible[..., None])
        codes.append((jnp.arange(b)[:, None, None] * n_comp + jnp.clip(idx, 0, n_comp - 1)) * 4 + COMP)
    codes = jnp.concatenate(codes, -1).astype(jnp.int32).reshape(b * s, -1)
    valid = jnp.concatenate(valid, -1).reshape(b * s, -1)
    width = min(codes.shape[1], window + n_sel)
    width = -(-width // BLOCK) * BLOCK
    # compaction in order: each valid key goes to its rank among the row's valid keys, a scatter (faster than a
    # stable argsort of the mask, which gives the same list)
    rank = jnp.cumsum(valid, axis=1, dtype=jnp.int32)                                  # [B * S, C]
    count = rank[:, -1]
    own = ((jnp.arange(b)[:, None] * s + jnp.arange(s)[None]) * 4 + OWN).reshape(b * s, 1)
    rows = jnp.broadcast_to(jnp.arange(b * s)[:, None], codes.shape)
    dest = jnp.where(valid, rank - 1, width + jnp.arange(codes.shape[1]))           # invalid: distinct, dropped
    picked = jnp.broadcast_to(own, (b * s, width)).at[rows, dest].set(
        codes, mode="drop", unique_indices=True)                     # the tail keeps the own-row dummy
    return picked, jnp.minimum(count, width)


# ----------------------------------------------------------------------------- kernel pieces
def _tiled(plgpu):
    """wgmma-ready SMEM layout of a [rows, 512] bf16 tile: (8, 64) tiles, 128-byte swizzle."""
    return (plgpu.TilingTransform((8, CHUNK)), plgpu.SwizzleTransform(128))


def _row_view(plgpu):
    """A [.., 8 rows, 64] view with the same byte order as `_tiled` whose 1-row slices are TMA destinations."""
    return (plgpu.TilingTransform((1, CHUNK)), plgpu.SwizzleTransform(128))


@functools.cache
def _barrier_address_primitive():
    """A primitive returning the int32 shared-memory address of barrier 0 of a Pallas Barrier group: Pallas
    cannot hand a Barrier to `inline_mgpu` (its lowering takes IR values; barriers are Python objects there),
    so the inline producer rebuilds a Mosaic GPU BarrierRef from this address. Compiled lowering only."""
    from jax._src import core as jax_core
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu import lowering as plow
    from jax.experimental import mosaic
    from jax.experimental.mosaic.gpu import utils as mu

    prim = jax_core.Primitive("barrier_smem_address")

    @prim.def_effectful_abstract_eval
    def _abstract(barrier):
        return jax_core.ShapedArray((), jnp.int32), {gpu_core._memory_effect}

    def _lower(ctx, barrier):
        bref = getattr(barrier, "barrier_ref", barrier)   # DialectBarrierRef -> BarrierRef
        ptr = mu.getelementptr(bref.base_address, [bref.offset], ir.IntegerType.get_signless(64))
        return llvm.ptrtoint(ir.IntegerType.get_signless(32), ptr)

    for sem in (mosaic.gpu.LoweringSemantics.Warpgroup, mosaic.gpu.LoweringSemantics.Lane):
        plow.register_lowering_rule(prim, sem)(_lower)
    return prim


def _inline_issue(plgpu, sources: tuple[int, ...]):
    """issue(*source_refs, row_view, codes, barrier_address, prog, blk, slot): the TMA gather of one block.
    All 128 producer lanes arrive once on full[slot] expecting the block's bytes; lane 0 of each of
    ISSUE_WARPS warps then issues 8 copies of 128 B per key of its share of the block's key tiles."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, scf
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mu

    tiles_per_warp = BLOCK // 8 // ISSUE_WARPS
    splat = plgpu.Layout.WG_SPLAT

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(sources) + (
        plgpu.RefType(_row_view(plgpu)), plgpu.RefType(), splat, splat, splat, splat))
    def issue(ctx, *args):
        srcs = args[:len(sources)]
        rows, codes, bar_addr, prog, blk, slot = args[len(sources):]
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        ci = lambda v: arith.constant(index, v)  # noqa: E731
        c32 = lambda v: arith.constant(i32, v)   # noqa: E731
        slot_i32 = slot.registers.item()
        slot = arith.index_cast(index, slot_i32)
        prog = arith.index_cast(index, prog.registers.item())
        blk = arith.index_cast(index, blk.registers.item())
        ptr = llvm.inttoptr(llvm.PointerType.get(address_space=3), bar_addr.registers.item())
        barrier = mu.BarrierRef(ptr, slot_i32, None, 1)                     # full[slot]
        barrier.arrive_expect_tx(BLOCK * DIM * 2 // 128)                   # x 128 lanes = the block's bytes
        warp = arith.remui(mu.warp_idx(sync=True), c32(4))                   # elect before any divergence
        issuer = arith.andi(mu.single_thread_predicate(mu.ThreadSubset.WARP),
                            arith.cmpi(arith.CmpIPredicate.ult, warp, c32(ISSUE_WARPS)))
        first = arith.muli(arith.index_cast(index, warp), ci(tiles_per_warp))
        with mu.when(issuer):
            loop = scf.ForOp(first, arith.addi(first, ci(tiles_per_warp)), ci(1))
            with ir.InsertionPoint(loop.body):
                rt = loop.induction_variable
                key0 = arith.addi(arith.muli(blk, ci(BLOCK)), arith.muli(rt, ci(8)))
                for r in range(8):
                    code = memref.load(codes, [prog, arith.addi(key0, ci(r))])
                    row = arith.index_cast(index, arith.shrui(code, c32(2)))
                    src = arith.andi(code, c32(3))
                    for ref_, sid in zip(srcs, sources):
                        with mu.when(arith.cmpi(arith.CmpIPredicate.eq, src, c32(sid))):
                            for ct in range(DIM // CHUNK):
                                ctx.async_copy(
                                    src_ref=ref_, dst_ref=mu.memref_slice(rows, (slot, rt, ci(ct), mu.ds(ci(r), 1))),
                                    gmem_slice=(mu.ds(row, 1), mu.ds(ci(ct * CHUNK), CHUNK)), swizzle=128,
                                    gmem_transform=(mgpu.TileTransform((1, CHUNK)),), barrier=barrier,
                                    arrive=False, predicate=None)
                scf.YieldOp([])

    return issue


def _kernel(rows: int, width: int, sources: tuple[int, ...], scale: float, splits: int, interpret,
            q_norm_eps: float | None = None):
    """f(q [rows, 64, 512] bf16, codes [rows, width] int32, count [rows] int32, sink [64] f32,
    *source_kv [n_i, 512] bf16) -> o [rows, 64, 512] bf16 (splits == 1: the sink folded in), or with key splits
    (program (r, p) takes the p-th share of row r's key blocks) the partials: o_p [rows, splits, 64, 512] bf16
    normalised by their own l_p, and lse_p = m_p + log2 l_p [rows, splits, 64, 64] f32 (column-broadcast: one
    [64, 64] tile is the smallest dense SMEM -> GMEM copy of a register vector), combined by `_combine`.
    q_norm_eps: each head's RMS normalisation folded into its scores: the two warpgroups add their halves' sums
    of squares through the exchange buffer before the first block."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    compiled = interpret is None
    dt = jnp.bfloat16
    c2 = scale * LOG2E   # scores in log2 units
    exchanged_before = q_norm_eps is not None   # the exchange buffer's first use precedes the key blocks

    def body(q_g, codes_g, count_g, sink_g, *refs):
        src_g = refs[:len(sources)]
        outs, (q_s, kv_u, exch, in_bar, full_bar, free_bar, xfull_bar, xfree_bar) = (
            refs[len(sources):-8], refs[-8:])
        kv_t, kv_rows = kv_u if compiled else (kv_u, None)    # two views of one stage ring (compiled)
        prog = lax.axis_index("r")
        split = lax.axis_index("p")
        wg = lax.axis_index("wg")
        total = (count_g[prog] + BLOCK - 1) // BLOCK           # the row's key blocks; this split's share:
        per = (total + splits - 1) // splits
        first = jnp.minimum(split * per, total)
        nblk = jnp.minimum(first + per, total) - first

        @pl.when(wg == 2)
        def _producer():
            if compiled:   # 2 x 232 + 40 registers x 128 threads <= 64K
                plgpu.set_max_registers(40, action="decrease")
            for h in range(2):
                plgpu.copy_gmem_to_smem(q_g.at[prog, :, pl.ds(h * HALF, HALF)], q_s.at[h], in_bar)
            if compiled:
                issue = _inline_issue(plgpu, sources)
                bar_addr = _barrier_address_primitive().bind(full_bar)

            @pl.loop(0, nblk)
            def _blocks(blk):
                slot = lax.rem(blk, STAGES)

                @pl.when(blk >= STAGES)
                def _():
                    plgpu.barrier_wait(free_bar.at[slot])

                if compiled:
                    issue(*src_g, kv_rows, codes_g, bar_addr, prog, first + blk, slot)
                    return

                @pl.loop(0, BLOCK)
                def _keys(j):   # interpreter: one Pallas copy per 128-byte chunk, each an arrival
                    code = codes_g[prog, (first + blk) * BLOCK + j]
                    for ref_, sid in zip(src_g, sources):
                        @pl.when(code % 4 == sid)
                        def _():
                            for ct in range(DIM // CHUNK):
                                plgpu.copy_gmem_to_smem(ref_.at[pl.ds(code // 4, 1), pl.ds(ct * CHUNK, CHUNK)],
                                                        kv_t.at[slot, pl.ds(j, 1), pl.ds(ct * CHUNK, CHUNK)],
                                                        full_bar.at[slot])

            for s_ in range(STAGES):   # observe each used slot's last release (the interpreter insists)
                @pl.when(nblk > s_)
                def _():
                    plgpu.barrier_wait(free_bar.at[s_])

        def compute(h):
            if compiled:
                plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(in_bar)
            qh = q_s.at[h]
            cast = plgpu.layout_cast if compiled else (lambda x, _: x)
            vec = plgpu.Layout.WGMMA.reduce(1)
            if compiled:
                cols = plgpu.broadcasted_iota(jnp.int32, (HEADS, BLOCK), 1, layout=plgpu.Layout.WGMMA)
            else:
                cols = lax.broadcasted_iota(jnp.int32, (HEADS, BLOCK), 1)
            if splits > 1:     # a partial starts empty; the sink joins once, in _combine
                m0, l0 = cast(jnp.full((HEADS,), NEG, jnp.float32), vec), cast(jnp.zeros((HEADS,), jnp.float32), vec)
            else:              # from m = sink, l = exp(sink - sink) = 1: the sink is in the denominator
                # straight from GMEM: an SMEM copy would cost 1 KiB of alignment we do not have
                m0 = plgpu.load(sink_g, (), layout=vec, optimized=False) if compiled else sink_g[...]
                m0, l0 = m0 * LOG2E, cast(jnp.ones((HEADS,), jnp.float32), vec)
            acc0 = cast(jnp.zeros((HEADS, HALF), jnp.float32), plgpu.Layout.WGMMA)
            count = count_g[prog]
            head_scale = None
            if q_norm_eps is not None:   # per head: c2 * rsqrt(mean(q^2) + eps), both halves' squares summed
                chunks = (qh.at[:, pl.ds(c * CHUNK, CHUNK)][...].astype(jnp.float32) for c in range(HALF // CHUNK))
                ss_h = functools.reduce(jnp.add, ((x * x).sum(axis=1) for x in chunks))
                exch[h] = lax.broadcast_in_dim(ss_h, (HEADS, BLOCK), [0])
                plgpu.barrier_arrive(xfull_bar)
                plgpu.barrier_wait(xfull_bar)
                ss_o = cast(exch[1 - h], plgpu.Layout.WGMMA).max(axis=1)
                plgpu.barrier_arrive(xfree_bar)
                ss = (ss_h + ss_o) if h == 0 else (ss_o + ss_h)                  # the same sum in both
                head_scale = c2 * lax.rsqrt(ss * (1 / DIM) + q_norm_eps)

            def step(blk, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(blk, STAGES)
                plgpu.barrier_wait(full_bar.at[slot])
                kh = kv_t.at[slot, :, pl.ds(h * HALF, HALF)]                   # [BLOCK, 256]
                if compiled:
                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, qh, plgpu.transpose_ref(kh, (1, 0)))
                        return acc_ref[...]
                    s_h = pl.run_scoped(qk, plgpu.ACC((HEADS, BLOCK), jnp.float32))
                else:
                    s_h = lax.dot_general(qh[...], kh[...], (((1,), (1,)), ((), ())),
                                          preferred_element_type=jnp.float32)

                @pl.when((blk > 0) | exchanged_before)
                def _():
                    plgpu.barrier_wait(xfree_bar)   # the other warpgroup has read exch[h]
                exch[h] = s_h
                plgpu.barrier_arrive(xfull_bar)
                plgpu.barrier_wait(xfull_bar)
                s_o = exch[1 - h]
                plgpu.barrier_arrive(xfree_bar)
                s = (s_h + s_o) if h == 0 else (s_o + s_h)                       # the same sum in both
                s = s * (c2 if head_scale is None else lax.broadcast_in_dim(head_scale, s.shape, [0]))
                s = jnp.where((first + blk) * BLOCK + cols < count, s, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dt)
                if compiled:
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, kh)
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                else:
                    acc = acc + lax.dot(p16, kh[...], preferred_element_type=jnp.float32)
                plgpu.barrier_arrive(free_bar.at[slot])
                return acc, m_new, l_i

            acc, m_i, l_i = lax.fori_loop(0, nblk, step, (acc0, m0, l0))

            @pl.when((nblk > 0) | exchanged_before)
            def _():
                plgpu.barrier_wait(xfree_bar)       # the last exchange's release (the interpreter insists)
            l_safe = jnp.maximum(l_i, 1e-30)        # an empty split: acc = 0 -> o_p = 0, lse_p = -inf
            qh[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dt)   # q half -> o staging
            plgpu.commit_smem()
            if splits == 1:
                plgpu.copy_smem_to_gmem(qh, outs[0].at[prog, :, pl.ds(h * HALF, HALF)])
            else:
                plgpu.copy_smem_to_gmem(qh, outs[0].at[prog, split, :, pl.ds(h * HALF, HALF)])
                if h == 0:   # the exchange buffer is free now: stage lse there
                    exch[0] = lax.broadcast_in_dim(m_i + jnp.log2(l_i), (HEADS, BLOCK), [0])
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(exch.at[0], outs[1].at[prog, split])
            plgpu.wait_smem_to_gmem(0)

        pl.when(wg == 0)(lambda: compute(0))
        pl.when(wg == 1)(lambda: compute(1))

    kv_tiled = plgpu.SMEM((STAGES, BLOCK, DIM), dt, transforms=_tiled(plgpu))
    kv_scratch = (plgpu.RefUnion(kv_tiled, plgpu.SMEM((STAGES, BLOCK // 8, DIM // CHUNK, 8, CHUNK), dt,
                                                      transforms=_row_view(plgpu)))
                  if compiled else kv_tiled)
    scratch = [
        plgpu.SMEM((2, HEADS, HALF), dt, transforms=_tiled(plgpu)),     # q halves, then the output staging
        kv_scratch,
        plgpu.SMEM((2, HEADS, BLOCK), jnp.float32),                      # partial-score exchange
        plgpu.Barrier(num_arrivals=2),                                    # q halves landed
        plgpu.Barrier(num_arrivals=1 if compiled else BLOCK * DIM // CHUNK, num_barriers=STAGES),  # stage full
        plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),              # stage free (2 compute warpgroups)
        plgpu.Barrier(num_arrivals=2),                                    # exchange written
        plgpu.Barrier(num_arrivals=2),                                    # exchange read
    ]
    out_type = (jax.ShapeDtypeStruct((rows, HEADS, DIM), dt) if splits == 1 else
                (jax.ShapeDtypeStruct((rows, splits, HEADS, DIM), dt),
                 jax.ShapeDtypeStruct((rows, splits, HEADS, BLOCK), jnp.float32)))
    return plgpu.kernel(
        body, out_type=out_type, grid=(rows, splits), grid_names=("r", "p"),
        num_threads=3, thread_name="wg", scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True,
            # the only reductions are row max / sum of [64, 64] WGMMA tiles (inside a warp); the default
            # 2 KiB of cross-warp scratch would not fit
            reduction_scratch_bytes=0),
        interpret=interpret)


def _combine(o_p: jax.Array, lse_p: jax.Array, sink: jax.Array) -> jax.Array:
    """Key-split partials o_p [R, P, H, D] (each normalised by its own l_p), lse_p [R, P, H, BLOCK] (log2 units,
    column-broadcast) and the sink [H] -> o [R, H, D] bf16:
    sum_p 2^(lse_p - M) o_p / (2^(sink log2 e - M) + sum_p 2^(lse_p - M)), M the largest exponent."""
    lse = lse_p[..., 0]
    s2 = sink.astype(jnp.float32) * LOG2E
    mx = jnp.maximum(lse.max(axis=1), s2[None])
    w = jnp.exp2(lse - mx[:, None])
    den = jnp.exp2(s2[None] - mx) + w.sum(axis=1)
    return ((w[..., None] * o_p.astype(jnp.float32)).sum(axis=1) / den[..., None]).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("scale", "window", "ratio", "num_splits", "interpret", "q_norm_eps"))
def sparse_attention_mgpu(q, q_pos, self_kv, self_pos, sink, *, scale: float, window: int, ring_kv=None,
                          ring_pos=None, comp_kv=None, comp_idx=None, ratio: int = 0, window_floor=None,
                          num_splits: int | None = None, interpret: bool | None = None,
                          q_norm_eps: float | None = None):
    """`attention.sparse_attention`'s contract at V4 widths (q [B, S, 64, 512] bf16, keys bf16), one program per
    query row and key split (also `sparse_attention(..., impl="mgpu")`). num_splits: each row's key blocks
    over that many programs, combined in XLA (None: `attention.auto_splits`, about one program per SM).
    interpret: None / False = compiled (a Hopper GPU), True = the Mosaic GPU CPU interpreter."""
    from .attention import _validate, auto_splits   # (attention imports this module at its top: import late)
    _validate(q, q_pos, self_kv, self_pos, sink, ring_kv, ring_pos, comp_kv, comp_idx, ratio, window_floor, window)
    b, s, h, d = q.shape
    _check((h, d) == (HEADS, DIM), f"needs {HEADS} heads x {DIM} (one wgmma M tile, two 256-column halves), "
                                   f"got {h} x {d}: use attention.sparse_attention")
    for name, x in (("q", q), ("self_kv", self_kv), ("ring_kv", ring_kv), ("comp_kv", comp_kv)):
        _check(x is None or x.dtype == jnp.bfloat16, f"{name} must be bfloat16, got {None if x is None else x.dtype}")
    n_comp = 0 if comp_kv is None else comp_kv.shape[1]
    i32 = lambda x: None if x is None else x.astype(jnp.int32)  # noqa: E731
    codes, count = key_list(i32(q_pos), i32(self_pos), window=window, ring_pos=i32(ring_pos), comp_idx=comp_idx,
                            n_comp=n_comp, ratio=ratio, window_floor=i32(window_floor))
    _check(max(b * (ring_kv.shape[1] if ring_kv is not None else 0), b * s, b * n_comp) < 1 << 29,
           "too many cache rows for the 29-bit row field of a key code")
    sources = [(OWN, self_kv.reshape(b * s, d))]
    if ring_kv is not None:
        sources.insert(0, (RING, ring_kv.reshape(-1, d)))
    if comp_kv is not None:
        sources.append((COMP, comp_kv.reshape(-1, d)))
    interpret = interpret_flag("mgpu", bool(interpret))
    splits = auto_splits(b * s, h, HEADS) if num_splits is None else int(num_splits)
    _check(splits >= 1, f"num_splits must be >= 1, got {splits}")
    kern = _kernel(b * s, codes.shape[1], tuple(sid for sid, _ in sources), float(scale), splits, interpret,
                   q_norm_eps)
    o = kern(q.reshape(b * s, h, d), codes, count, sink.astype(jnp.float32), *(x for _, x in sources))
    if splits > 1:
        o = _combine(*o, sink)
    return o.reshape(b, s, h, d)
