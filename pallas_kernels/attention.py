"""Sparse + window MQA at head dim 512 with a per-head sink (docs/model.md §4-§8), Pallas (Triton lowering).
(`attention_mgpu` holds a Mosaic GPU kernel for the same contract at 64 heads x 512: `impl="mgpu"`;
`impl="pallas"` takes it where it measured faster, `impl="triton"` always this module's kernel.)

One query row of one sequence attends to the union of
  * its sliding window: keys at positions max(floor, p-W+1) <= k <= p, taken from the SWA ring
    (`ring_kv`/`ring_pos`, any slot order) and from the chunk's own rows (`self_kv`/`self_pos`);
  * compressed entries: the per-row selected indices `comp_idx` (CSA; -1 = empty slot), or all
    visible entries j < (p+1)//ratio (HCA, `comp_idx=None`). Selected indices are also masked by
    visibility, so the kernel never reads an entry the query must not see.
Every key is one shared Dh-wide vector used as key and value; all H heads share it (MQA). The
softmax denominator carries exp(sink_h); a row with no valid key returns exact zeros.

Layout of the computation: one program per (sequence b, query row s, block of `block_h` heads
[, key split]); inside, an online softmax (fp32 m, l, acc) runs over key blocks of `block_n` rows in
three phases (ring, own rows, compressed). Compressed rows are gathered inside the kernel by index
(`kv_ref[rows, :]` with an int vector), so nothing of size [B, S, N] is built. The phases use
dynamic trip counts: the ring is skipped when no ring position can be in the window, own rows are
read only from s-W+1..s, HCA entries only up to the row's visible count. With `num_splits > 1`
("flash decoding") the key blocks of a row are split across programs and combined in XLA.

Two launch configurations share the kernel body:
  * decode/verify (few rows, bandwidth-bound): small head blocks and more programs per KV byte;
  * prefill (many rows, compute-bound): 64-head blocks (M = 64 rows per MMA), larger key blocks.
Defaults follow PALLAS_H200.md (SMEM at Dh=512: 2*Dh*(num_stages*block_n + block_h) <= 232448 B).

Contract (checked where static): q [B, S, H, Dh]; q_pos [B, S] int32; self_kv [B, S, Dh] with
self_pos [B, S] (-1 = not a key, e.g. padding rows) whose valid positions increase strictly with s
(row s's window among own rows is then rows s-W+1..s); ring_kv [B, R, Dh], ring_pos [B, R] (-1 =
empty); comp_kv [B, N, Dh]; comp_idx [B, S, K] int32 without duplicate non-negative entries per row
(top-k output); window_floor [B] int32. Head dims that are not powers of two and fewer than 16
heads are zero-padded (correct, wasteful; the real model needs no padding).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import reference as ref
from .attention_mgpu import DIM as MGPU_DIM
from .attention_mgpu import HEADS as MGPU_HEADS
from .attention_mgpu import sparse_attention_mgpu
from .common import interpret_flag, next_pow2, on_hopper, pad_axis

NEG = -1e30  # finite start for running maxima of split partials: exp(NEG - m) == 0, never NaN

# (block_h, block_n, num_warps, num_stages). SMEM at Dh=512: 2*512*(s*bn + bh) bytes.
WIDE_CONFIG = dict(block_h=64, block_n=64, num_warps=8, num_stages=2)    # 197 KB; M = 64 rows per MMA
NARROW_CONFIG = dict(block_h=32, block_n=64, num_warps=4, num_stages=2)  # 164 KB; 2 head blocks share keys via L2
DECODE_MAX_ROWS = 16  # chunks up to this many rows use the decode configuration
SMS = 132  # H200 streaming multiprocessors
SMEM_LIMIT = 232448  # bytes of shared memory per block on the H200 (PALLAS_H200.md)
MGPU_MIN_ROWS = 64  # query rows (B x S) from which impl="pallas" takes the Mosaic GPU kernel (`pallas_backend`)
IMPLS = ("pallas", "triton", "mgpu", "reference")


def default_config(mode: str, rows: int, heads: int, csa: bool, head_dim: int = 512, itemsize: int = 2) -> dict:
    """Tiling by launch, the faster of an H200 sweep (docs/kernels.md): 32-head blocks once they fill two waves
    of SMs (CSA verify B64 x 4 rows, decode B256, CSA prefill); 64-head blocks (+ key splits) on fewer rows
    and on HCA prefill, whose aligned tiles are read once.
    Wider elements (float32 inputs: the model's parity mode) halve block_n, then block_h, until the tiles
    fit the SMEM (`smem_bytes` of the padded head dim)."""
    if mode == "prefill":
        cfg = dict(NARROW_CONFIG if csa else WIDE_CONFIG)
    else:
        narrow_programs = rows * -(-heads // NARROW_CONFIG["block_h"])
        cfg = dict(NARROW_CONFIG if csa and narrow_programs >= 2 * SMS else WIDE_CONFIG)
    return fit_smem(cfg, head_dim, itemsize)


def invariant_config(head_dim: int = 512, itemsize: int = 2) -> dict:
    """The one tiling of the batch-invariant launch (`sparse_attention(window_start=...)`): NARROW_CONFIG fitted to
    the SMEM, a function of the head dim and element width only, never of the rows or the mode. Its two key loops
    (the window phase, then the entries) each keep their own pipeline buffers (`smem_bytes(loops=2)`; at 512 x (32,
    64, 2 stages) the 295,424 bytes an H100 refused), so the stages give way first: they change no number, where
    block_n would change the blocks of the online softmax."""
    return fit_smem(dict(NARROW_CONFIG), head_dim, itemsize, loops=2, stages_first=True)


def fit_smem(cfg: dict, head_dim: int, itemsize: int, loops: int = 1, stages_first: bool = False) -> dict:
    """cfg with block_n, then block_h, halved until its tiles fit the SMEM (`smem_bytes` of the padded head dim, for
    `loops` pipelined key loops); stages_first: num_stages lowered to 1 before any block shrinks."""
    dp = max(16, next_pow2(head_dim))
    while smem_bytes(dp, cfg["block_h"], cfg["block_n"], cfg["num_stages"], itemsize, loops) > SMEM_LIMIT:
        if stages_first and cfg["num_stages"] > 1:
            cfg["num_stages"] -= 1
            continue
        key = "block_n" if cfg["block_n"] > 16 else "block_h"
        if cfg[key] == 16:
            break   # nothing left to shrink: the compile reports it
        cfg[key] //= 2
    return cfg


# ----------------------------------------------------------------------------- kernel
def _attn_kernel(*refs, scale, window, ratio, block_n, n_ring, n_self, n_comp, k_sel,
                 has_ring, has_comp, csa, num_splits, fold_sink, q_norm_eps, head_dim, canonical):
    """Refs (batch/row dims squeezed): q [bh, D]; qpos (); floor (); [start () if canonical]; self_kv [S, D];
    self_pos [S]; [ring_kv [R, D]; ring_pos [R]; ring_hi ()]; [comp_kv [N, D]; [comp_idx [Kp]]]; sink [bh];
    outputs: o [bh, D] (fold_sink) or acc [bh, D] f32, m [bh], l [bh]. canonical: the window as one phase over
    the row's W positions oldest first (`window_body`) instead of the ring and own-row phases."""
    it = iter(refs)
    q_ref, qpos_ref, floor_ref = next(it), next(it), next(it)
    start_ref = next(it) if canonical else None
    self_ref, spos_ref = next(it), next(it)
    ring_ref = rpos_ref = rhi_ref = comp_ref = idx_ref = None
    if has_ring:
        ring_ref, rpos_ref, rhi_ref = next(it), next(it), next(it)
    if has_comp:
        comp_ref = next(it)
        if csa:
            idx_ref = next(it)
    sink_ref = next(it)
    out_refs = list(it)

    s_row = pl.program_id(1)
    split = pl.program_id(3)
    q = q_ref[...]
    bh, d = q.shape
    score_scale = scale
    if q_norm_eps is not None:   # each head's RMS normalisation as a factor on its scores (padding adds zeros)
        qf = q.astype(jnp.float32)
        score_scale = (scale * lax.rsqrt(jnp.sum(qf * qf, axis=1) / head_dim + q_norm_eps))[:, None]
    qp = qpos_ref[...]
    lo = jnp.maximum(jnp.maximum(qp - (window - 1), floor_ref[...]), 0)  # window: lo <= k <= qp
    iota = lax.broadcasted_iota(jnp.int32, (block_n,), 0)

    def update(carry, k, ok):
        m, l, acc = carry
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * score_scale
        s = jnp.where(ok[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        acc = alpha[:, None] * acc + jnp.dot(p.astype(k.dtype), k, preferred_element_type=jnp.float32)
        return m_new, alpha * l + p.sum(axis=1), acc

    # -- block counts of the three phases (dynamic; canonical: the window's W slots in place of ring and own rows),
    # then this split's share
    nb_ring = 0
    if has_ring and not canonical:
        ring_live = rhi_ref[...] >= lo  # some ring position may fall in the window
        nb_ring = ring_live.astype(jnp.int32) * pl.cdiv(n_ring, block_n)
    self_lo = jnp.maximum(s_row - (window - 1), 0)  # own rows s-W+1..s (positions strictly increase)
    nb_self = pl.cdiv(window, block_n) if canonical else pl.cdiv(s_row + 1 - self_lo, block_n)
    nb_comp = 0
    count = 0
    if has_comp:
        count = jnp.clip((qp + 1) // ratio, 0, n_comp)  # entries visible to this row
        nb_comp = (k_sel // block_n) if csa else pl.cdiv(count, block_n)
    total = nb_ring + nb_self + nb_comp
    if num_splits == 1:
        g_lo, g_hi = 0, total
    else:
        per = pl.cdiv(total, num_splits)
        g_lo, g_hi = split * per, jnp.minimum((split + 1) * per, total)

    def phase_range(offset, nb):  # this split's block range inside a phase starting at block `offset`
        return (jnp.clip(g_lo - offset, 0, nb), jnp.clip(g_hi - offset, 0, nb))

    if fold_sink:  # start at m = sink, l = exp(sink - sink) = 1: the sink joins the denominator
        carry = (sink_ref[...].astype(jnp.float32), jnp.ones((bh,), jnp.float32),
                 jnp.zeros((bh, d), jnp.float32))
    else:
        carry = (jnp.full((bh,), NEG, jnp.float32), jnp.zeros((bh,), jnp.float32),
                 jnp.zeros((bh, d), jnp.float32))

    if has_ring and not canonical:
        def ring_body(i, c):
            rows = i * block_n + iota
            rc = jnp.minimum(rows, n_ring - 1)
            kp = rpos_ref[rc]
            ok = (rows < n_ring) & (kp >= lo) & (kp <= qp)
            return update(c, ring_ref[rc, :], ok)
        a, b = phase_range(0, nb_ring)
        carry = lax.fori_loop(a, b, ring_body, carry)

    def self_body(i, c):
        rows = self_lo + i * block_n + iota
        rc = jnp.minimum(rows, n_self - 1)
        kp = spos_ref[rc]
        ok = (rows <= s_row) & (kp >= lo) & (kp <= qp)
        return update(c, self_ref[rc, :], ok)

    def window_body(i, c):   # slots j of positions qp - W + 1 + j, blocks of block_n from the oldest
        j = i * block_n + iota
        kp = qp - (window - 1) + j
        start = start_ref[...]
        in_ring = kp < start                     # below the chunk: the ring; else the chunk's own row kp - start
        own = jnp.clip(kp - start, 0, n_self - 1)
        k, ok = self_ref[own, :], ~in_ring & (spos_ref[own] == kp)
        if has_ring:
            slot = jnp.maximum(kp, 0) % n_ring
            k = jnp.where(in_ring[:, None], ring_ref[slot, :], k)
            ok = ok | (in_ring & (rpos_ref[slot] == kp))
        return update(c, k, ok & (j < window) & (kp >= lo))
    a, b = phase_range(nb_ring, nb_self)
    carry = lax.fori_loop(a, b, window_body if canonical else self_body, carry)

    if has_comp:
        if csa:
            def comp_body(i, c):
                j = idx_ref[pl.ds(pl.multiple_of(i * block_n, block_n), block_n)]
                ok = (j >= 0) & (j < count)
                return update(c, comp_ref[jnp.clip(j, 0, n_comp - 1), :], ok)
        elif n_comp % block_n == 0:  # HCA, whole blocks: plain aligned tiles (never past N)
            def comp_body(i, c):
                start = pl.multiple_of(i * block_n, block_n)
                return update(c, comp_ref[pl.ds(start, block_n), :], start + iota < count)
        else:
            def comp_body(i, c):
                rows = i * block_n + iota
                return update(c, comp_ref[jnp.minimum(rows, n_comp - 1), :], rows < count)
        a, b = phase_range(nb_ring + nb_self, nb_comp)
        carry = lax.fori_loop(a, b, comp_body, carry)

    m, l, acc = carry
    if fold_sink:
        (o_ref,) = out_refs
        o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


# ----------------------------------------------------------------------------- wrapper
def _check(cond, msg):
    if not cond:
        raise ValueError(f"sparse_attention: {msg}")


def _validate(q, q_pos, self_kv, self_pos, sink, ring_kv, ring_pos, comp_kv, comp_idx, ratio, window_floor,
              window):
    _check(q.ndim == 4, f"q must be [B, S, H, Dh], got {q.shape}")
    b, s, h, d = q.shape
    _check(q_pos.shape == (b, s), f"q_pos must be {(b, s)}, got {q_pos.shape}")
    _check(self_kv.shape == (b, s, d), f"self_kv must be {(b, s, d)}, got {self_kv.shape}")
    _check(self_pos.shape == (b, s), f"self_pos must be {(b, s)}, got {self_pos.shape}")
    _check(sink.shape == (h,), f"sink must be [H]={h}, got {sink.shape}")
    _check(window > 0, f"window must be positive, got {window}")
    _check((ring_kv is None) == (ring_pos is None), "ring_kv and ring_pos go together")
    if ring_kv is not None:
        _check(ring_kv.ndim == 3 and ring_kv.shape[0] == b and ring_kv.shape[2] == d and ring_kv.shape[1] > 0,
               f"ring_kv must be [B, R>0, Dh]=[{b}, R, {d}], got {ring_kv.shape}")
        _check(ring_pos.shape == ring_kv.shape[:2], f"ring_pos must be {ring_kv.shape[:2]}, got {ring_pos.shape}")
    if comp_kv is not None:
        _check(comp_kv.ndim == 3 and comp_kv.shape[0] == b and comp_kv.shape[2] == d and comp_kv.shape[1] > 0,
               f"comp_kv must be [B, N>0, Dh]=[{b}, N, {d}], got {comp_kv.shape}")
        _check(int(ratio) > 0, f"ratio must be positive with comp_kv, got {ratio}")
        if comp_idx is not None:
            _check(comp_idx.ndim == 3 and comp_idx.shape[:2] == (b, s) and comp_idx.shape[2] > 0,
                   f"comp_idx must be [B, S, K>0]=[{b}, {s}, K], got {comp_idx.shape}")
            _check(jnp.issubdtype(comp_idx.dtype, jnp.integer), f"comp_idx must be integer, got {comp_idx.dtype}")
    else:
        _check(comp_idx is None, "comp_idx given without comp_kv")
    if window_floor is not None:
        _check(window_floor.shape == (b,), f"window_floor must be [B]={b}, got {window_floor.shape}")
    for name, x in (("q_pos", q_pos), ("self_pos", self_pos), ("ring_pos", ring_pos), ("window_floor", window_floor)):
        if x is not None:
            _check(jnp.issubdtype(x.dtype, jnp.integer), f"{name} must be integer, got {x.dtype}")


@functools.partial(jax.jit, static_argnames=(
    "scale", "window", "ratio", "mode", "block_h", "block_n", "num_warps", "num_stages", "num_splits",
    "interpret", "impl", "q_norm_eps"))
def sparse_attention(q, q_pos, self_kv, self_pos, sink, *, scale: float, window: int,
                     ring_kv=None, ring_pos=None, comp_kv=None, comp_idx=None, ratio: int = 0,
                     window_floor=None, mode: str = "auto", block_h: int | None = None,
                     block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     num_splits: int | None = None, interpret: bool | None = None, impl: str = "pallas",
                     q_norm_eps: float | None = None, window_start=None):
    """Window + compressed sparse MQA with sink. Shapes in the module docstring.

    mode: "decode", "prefill" or "auto" (decode when S <= DECODE_MAX_ROWS) picks the default tiling
    (`default_config`);
    block_* / num_* override it. num_splits > 1 splits each row's key blocks over programs
    (flash decoding, for small decode batches); None = `auto_splits` in decode mode, 1 in prefill.
    interpret: None = interpret unless on a GPU. impl="triton" runs this module's kernel, impl="mgpu" the
    Mosaic GPU kernel (`attention_mgpu`: 64 heads x 512, bf16, Hopper; tilings ignored, num_splits honoured),
    impl="pallas" the faster of the two for the call (`pallas_backend`), impl="reference"
    `reference.window_sparse_attention`.
    q_norm_eps: each query head RMS-normalised (no weight) before its scores, folded into them as a factor
    (`reference.query_norm`): V4 passes its rotated, unnormalised queries, so no pass over q precedes the kernel.
    window_start [B] int32 (the position of each sequence's first own row; ring keys lie below it): the
    batch-invariant launch (ModelConfig.batch_invariant). Each row then walks its keys in one canonical order
    whatever the batch, the chunking or the ring's size: its W window positions oldest first (each from the ring
    below window_start, else from its own rows), then its selected entries in top-k order (HCA: every entry in
    order), in blocks of block_n from the start of that order, on `invariant_config`'s tiling whatever the rows and
    without key splits; impl "mgpu", a tiling or num_splits > 1 beside it raise (the Triton kernel runs).
    Returns o [B, S, H, Dh] in q's dtype (fp32 accumulation).
    """
    _validate(q, q_pos, self_kv, self_pos, sink, ring_kv, ring_pos, comp_kv, comp_idx, ratio, window_floor,
              window)
    _check(q_norm_eps is None or q_norm_eps > 0, f"q_norm_eps must be positive or None, got {q_norm_eps}")
    tiling_given = any(v is not None for v in (block_h, block_n, num_warps, num_stages))
    canonical = window_start is not None
    if canonical:
        _check(impl in ("pallas", "triton") and not tiling_given and num_splits in (None, 1),
               f"the batch-invariant launch (window_start) runs the Triton kernel on invariant_config's tiling "
               f"without key splits: got impl={impl!r}, a tiling: {tiling_given}, num_splits={num_splits}")
        _check(window_start.shape == (q.shape[0],) and jnp.issubdtype(window_start.dtype, jnp.integer),
               f"window_start must be [B]={q.shape[0]} integer, got {window_start.shape} {window_start.dtype}")
        impl, num_splits = "triton", 1
    if impl == "reference":
        return ref.window_sparse_attention(q, q_pos, self_kv, self_pos, sink, scale=scale, window=window,
                                           ring_kv=ring_kv, ring_pos=ring_pos, comp_kv=comp_kv, comp_idx=comp_idx,
                                           ratio=ratio, window_floor=window_floor, q_norm_eps=q_norm_eps)
    if impl not in IMPLS:
        raise ValueError(f"sparse_attention: impl must be one of {IMPLS}, got {impl!r}")
    interpret = interpret_flag("triton", interpret)   # None -> a bool: the backend choice below reads it
    if impl == "pallas":
        impl = pallas_backend(q, (self_kv, ring_kv, comp_kv), tiling_given, interpret)
    if impl == "mgpu":
        return sparse_attention_mgpu(q, q_pos, self_kv, self_pos, sink, scale=scale, window=window, ring_kv=ring_kv,
                                     ring_pos=ring_pos, comp_kv=comp_kv, comp_idx=comp_idx, ratio=ratio,
                                     window_floor=window_floor, num_splits=num_splits, interpret=interpret,
                                     q_norm_eps=q_norm_eps)
    if mode not in ("auto", "decode", "prefill"):
        raise ValueError(f"sparse_attention: mode must be auto|decode|prefill, got {mode!r}")
    b, s, h, d = q.shape
    if mode == "auto":
        mode = "decode" if s <= DECODE_MAX_ROWS else "prefill"
    itemsize = jnp.dtype(q.dtype).itemsize
    cfg = invariant_config(d, itemsize) if canonical else default_config(mode, b * s, h, comp_idx is not None, d,
                                                                          itemsize)
    for k, v in (("block_h", block_h), ("block_n", block_n), ("num_warps", num_warps), ("num_stages", num_stages)):
        if v is not None:
            cfg[k] = v
    bh, bn = cfg["block_h"], cfg["block_n"]
    if num_splits is None:
        num_splits = auto_splits(b * s, h, bh) if mode == "decode" else 1
    _check(bh >= 16 and bh & (bh - 1) == 0, f"block_h must be a power of two >= 16, got {bh}")
    _check(bn >= 16 and bn & (bn - 1) == 0, f"block_n must be a power of two >= 16, got {bn}")
    _check(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")

    # Triton needs power-of-two tensors and MMA dims >= 16: pad head dim and head count with zeros.
    dp = max(16, next_pow2(d))
    bh = min(bh, max(16, next_pow2(h)))
    hp = -(-h // bh) * bh
    q = pad_axis(pad_axis(q, 3, dp), 2, hp)
    sink = pad_axis(sink.astype(jnp.float32), 0, hp)
    self_kv = pad_axis(self_kv, 2, dp).astype(q.dtype)
    i32 = lambda x: x.astype(jnp.int32)
    q_pos, self_pos = i32(q_pos), i32(self_pos)
    floor = jnp.zeros((b,), jnp.int32) if window_floor is None else i32(window_floor)

    grid = (b, s, hp // bh, num_splits)
    row = lambda bi, si, hi, pi: (bi, si)
    per_b = lambda shape: pl.BlockSpec((None, *shape), lambda bi, si, hi, pi: (bi,) + (0,) * len(shape))
    per_sequence = pl.BlockSpec((None,), lambda bi, si, hi, pi: (bi,))
    in_specs = [pl.BlockSpec((None, None, bh, dp), lambda bi, si, hi, pi: (bi, si, hi, 0)),
                pl.BlockSpec((None, None), row), per_sequence]
    args = [q, q_pos, floor]
    if canonical:
        in_specs.append(per_sequence)
        args.append(i32(window_start))
    in_specs += [per_b((s, dp)), per_b((s,))]
    args += [self_kv, self_pos]
    n_ring = n_comp = k_sel = 0
    if ring_kv is not None:
        n_ring = ring_kv.shape[1]
        ring_pos = i32(ring_pos)
        ring_hi = ring_pos.max(axis=1)  # newest ring position per sequence (-1 if empty)
        in_specs += [per_b((n_ring, dp)), per_b((n_ring,)), per_sequence]
        args += [pad_axis(ring_kv, 2, dp).astype(q.dtype), ring_pos, ring_hi]
    csa = comp_idx is not None
    if comp_kv is not None:
        n_comp = comp_kv.shape[1]
        in_specs.append(per_b((n_comp, dp)))
        args.append(pad_axis(comp_kv, 2, dp).astype(q.dtype))
        if csa:
            k_sel = -(-comp_idx.shape[2] // bn) * bn
            in_specs.append(pl.BlockSpec((None, None, k_sel), lambda bi, si, hi, pi: (bi, si, 0)))
            args.append(pad_axis(i32(comp_idx), 2, k_sel, -1))
    in_specs.append(pl.BlockSpec((bh,), lambda bi, si, hi, pi: (hi,)))
    args.append(sink)

    fold = num_splits == 1
    kern = functools.partial(
        _attn_kernel, scale=float(scale), window=int(window), ratio=int(ratio), block_n=bn, n_ring=n_ring,
        n_self=s, n_comp=n_comp, k_sel=k_sel, has_ring=ring_kv is not None, has_comp=comp_kv is not None,
        csa=csa, num_splits=num_splits, fold_sink=fold, q_norm_eps=q_norm_eps, head_dim=d, canonical=canonical)
    params = plt.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if fold:
        o = pl.pallas_call(
            kern, grid=grid, in_specs=in_specs,
            out_specs=pl.BlockSpec((None, None, bh, dp), lambda bi, si, hi, pi: (bi, si, hi, 0)),
            out_shape=jax.ShapeDtypeStruct((b, s, hp, dp), q.dtype),
            compiler_params=params, interpret=interpret, name="sparse_mqa_sink",
        )(*args)
        return o[:, :, :h, :d]
    acc, m, l = pl.pallas_call(
        kern, grid=grid, in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, bh, dp), lambda bi, si, hi, pi: (bi, si, pi, hi, 0)),
                   pl.BlockSpec((None, None, None, bh), lambda bi, si, hi, pi: (bi, si, pi, hi)),
                   pl.BlockSpec((None, None, None, bh), lambda bi, si, hi, pi: (bi, si, pi, hi))],
        out_shape=[jax.ShapeDtypeStruct((b, s, num_splits, hp, dp), jnp.float32),
                   jax.ShapeDtypeStruct((b, s, num_splits, hp), jnp.float32),
                   jax.ShapeDtypeStruct((b, s, num_splits, hp), jnp.float32)],
        compiler_params=params, interpret=interpret, name="sparse_mqa_sink_split",
    )(*args)
    # combine the splits with the sink: o = sum_p e^{m_p - M} acc_p / (e^{sink - M} + sum_p e^{m_p - M} l_p)
    mx = jnp.maximum(m.max(axis=2), sink[None, None, :])  # [B, S, Hp]
    w = jnp.exp(m - mx[:, :, None])
    den = jnp.exp(sink[None, None, :] - mx) + (w * l).sum(axis=2)
    o = (w[..., None] * acc).sum(axis=2) / den[..., None]
    return o[:, :, :h, :d].astype(q.dtype)


def sparse_attention_decode(q, q_pos, self_kv, self_pos, sink, **kw):
    """Decode/verify launch (few rows per sequence): `sparse_attention(..., mode="decode")`."""
    return sparse_attention(q, q_pos, self_kv, self_pos, sink, mode="decode", **kw)


def sparse_attention_prefill(q, q_pos, self_kv, self_pos, sink, **kw):
    """Prefill launch (many rows, 64-head MMA blocks): `sparse_attention(..., mode="prefill")`."""
    return sparse_attention(q, q_pos, self_kv, self_pos, sink, mode="prefill", **kw)


def smem_bytes(head_dim: int, block_h: int, block_n: int, num_stages: int, itemsize: int = 2, loops: int = 1) -> int:
    """Triton SMEM estimate from PALLAS_H200.md section 1.6 (bf16: itemsize 2; limit SMEM_LIMIT): the query block and
    num_stages key blocks for each of `loops` pipelined key loops (the batch-invariant launch has two)."""
    return itemsize * head_dim * (loops * num_stages * block_n + block_h) + 512


def pallas_backend(q: jax.Array, keys: tuple, tiling_given: bool, interpret: bool) -> str:
    """The kernel impl="pallas" runs: "mgpu" (attention_mgpu) for compiled bf16 calls at 64 heads x 512 on
    Hopper with >= MGPU_MIN_ROWS query rows and no Triton tiling asked for, else "triton": the faster of the two
    on the H200 at each launch (docs/kernels.md)."""
    b, s, h, d = q.shape
    fits = (h, d) == (MGPU_HEADS, MGPU_DIM) and all(x is None or x.dtype == jnp.bfloat16 for x in (q, *keys))
    if fits and not tiling_given and not interpret and b * s >= MGPU_MIN_ROWS and on_hopper():
        return "mgpu"
    return "triton"


def auto_splits(batch_rows: int, heads: int, block_h: int, sms: int = SMS) -> int:
    """Key splits for decode: about one program per SM (one 197-KB-SMEM program fits an SM), at most 4.

    Splits are not free at Dh=512: each writes an fp32 [block_h, Dh] partial that the combine re-reads
    (64 heads: 128 KB per row and split, vs ~640 KB of KV per row), so large batches use none.
    """
    programs = batch_rows * math.ceil(heads / block_h)
    return int(min(4, max(1, round(sms / max(programs, 1)))))
