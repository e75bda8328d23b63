"""Time the Pallas kernels against the XLA reference path and the closest built-ins.

    python -m experiments.bench_kernels                      # every family at the real shapes (H200)
    python -m experiments.bench_kernels --quick              # smoke run: small shapes, few repeats
    python -m experiments.bench_kernels --only attention_decode,indexer_decode --sweep   # + tile sweeps
    python -m experiments.bench_kernels --roofline-only      # bytes / FLOPs / floor of every case, no run

If one command may only run ~10 minutes, run the families one by one (`--only attention_decode`, ...);
`--sweep` adds tile grids only on the B>=64 CSA decode cases and the prefill cases.

Families live in FAMILIES (name -> function(opts) -> list of records); add one with `@family("name")`.
Each record: family, case, variant, shapes, timing (compile s, wall-clock median per call, CUPTI
kernel median per call on the GPU), the roofline of the work the kernel must do (bytes, FLOPs, floor
time), achieved GB/s or TFLOP/s against the BENCHMARKS.md ceilings, error against an fp32 reference,
and the speed-up over the baselines. Results: experiments/results/bench_kernels_<stamp>_<backend>.{json,md}.

Timing rules (BENCHMARKS.md 5): random inputs (never zeros), compile + first run reported separately,
warm-up, then >= 10 repeats; each repeat runs the op once on each of several input sets inside one jit
(rotating sets keep small decode problems from living in the 60 MB L2), the per-call time is the
repeat time / sets; the median over repeats is reported. On CPU the Pallas kernels run in interpret
mode: the numbers only prove the script works.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_report import revision, revision_label
from pallas_kernels import attention as pk_attn
from pallas_kernels import attention_mgpu as pk_attn_mgpu
from pallas_kernels import indexer as pk_idx
from pallas_kernels import reference as ref

# Practical ceilings measured on the H200 (BENCHMARKS.md 1) and the datasheet limits.
HBM_READ = 3.40e12        # B/s, jnp.sum over 4 GiB bf16
HBM_DATASHEET = 4.8e12
BF16_PEAK = 816e12        # FLOP/s, jnp.dot 8192^3 (CUPTI)
BF16_DATASHEET = 990e12
L2_BYTES = 60e6
MAX_VARIANT_BYTES = 60e9  # skip a variant whose intermediates would need more device memory than this

FAMILIES: dict[str, Callable[["Opts"], list[dict]]] = {}


def family(name: str):
    def register(fn):
        FAMILIES[name] = fn
        return fn
    return register


@dataclasses.dataclass
class Opts:
    quick: bool = False
    sweep: bool = False
    repeats: int = 10
    warmup: int = 2
    interpret: bool = False
    gpu: bool = False
    roofline_only: bool = False


# ----------------------------------------------------------------------------- timing
def cupti_ms(f, *args, iterations: int) -> list[float] | None:
    """CUPTI kernel time (ms) of every call of f (all kernels it launches), or None off-GPU."""
    from jax.experimental.mosaic.gpu import profiler
    _, ts = profiler.measure(f, iterations=iterations)(*args)
    if ts is None:
        return None
    return [float(t) for t in (ts if isinstance(ts, list) else [ts])]


def time_variant(fn: Callable, shared: tuple, sets: list[tuple], opts: Opts) -> tuple[dict, object]:
    """fn(*shared, *set) on every set inside one jit. -> (timing dict, output of set 0)."""
    n = len(sets)
    multi = jax.jit(lambda sh, ss: [fn(*sh, *s) for s in ss])
    t0 = time.perf_counter()
    outs = jax.block_until_ready(multi(shared, sets))
    first = time.perf_counter() - t0
    for _ in range(opts.warmup):
        jax.block_until_ready(multi(shared, sets))
    wall = []
    for _ in range(opts.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(multi(shared, sets))
        wall.append((time.perf_counter() - t0) / n)
    timing = {"compile_and_first_s": round(first, 3), "sets": n, "repeats": opts.repeats, "warmup": opts.warmup,
              "wall_us": round(statistics.median(wall) * 1e6, 2), "timer": "wall"}
    if opts.gpu:
        try:
            ts = cupti_ms(multi, shared, sets, iterations=opts.repeats)
            if ts:
                timing["cupti_us"] = round(statistics.median(ts) / n * 1e3, 2)
                timing["timer"] = "cupti"
        except Exception as e:  # noqa: BLE001 - CUPTI may be unavailable; wall clock still stands
            timing["cupti_error"] = short(e)
    return timing, outs[0]


def per_call_us(timing: dict) -> float:
    return timing.get("cupti_us", timing["wall_us"])


def n_sets_for(touched_bytes: float, cap: int) -> int:
    """Enough rotating input sets that repeated calls stream >= 4x L2 from HBM."""
    return int(min(cap, max(1, math.ceil(4 * L2_BYTES / max(touched_bytes, 1.0)))))


def short(e: BaseException) -> str:
    lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
    return " | ".join(lines[:3])[:400]


def rel_err(out, expect) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    expect = np.asarray(jnp.asarray(expect, jnp.float32), np.float64)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - expect) / max(np.linalg.norm(expect), 1e-30))


def set_overlap(out, expect) -> float:
    """Mean fraction of each row's reference top-k set found by `out` (-1 slots ignored)."""
    out, expect = np.asarray(out), np.asarray(expect)
    fr = []
    for a, e in zip(out.reshape(-1, out.shape[-1]), expect.reshape(-1, expect.shape[-1])):
        e = set(e[e >= 0].tolist())
        fr.append(1.0 if not e else len(set(a[a >= 0].tolist()) & e) / len(e))
    return float(np.mean(fr))


def roofline(bytes_: float, flops: float) -> dict:
    t_mem, t_mma = bytes_ / HBM_READ, flops / BF16_PEAK
    return {"bytes": int(bytes_), "flops": int(flops), "intensity_flop_per_byte": round(flops / max(bytes_, 1), 1),
            "floor_us": round(max(t_mem, t_mma) * 1e6, 2), "bound": "memory" if t_mem >= t_mma else "compute"}


def achieved(us: float, line: dict) -> dict:
    s = us * 1e-6
    gbs, tfs = line["bytes"] / s / 1e9, line["flops"] / s / 1e12
    return {"GBps": round(gbs, 1), "TFLOPps": round(tfs, 1),
            "frac_hbm_read": round(gbs * 1e9 / HBM_READ, 3), "frac_bf16_peak": round(tfs * 1e12 / BF16_PEAK, 3),
            "frac_of_floor": round(line["floor_us"] / us, 3)}


def run_variants(fam: str, case: str, shape: dict, line: dict, variants: list[tuple], shared: tuple,
                 sets: list[tuple], check: Callable, opts: Opts, baselines=("xla_dense", "xla_gather")) -> list[dict]:
    """variants: (name, fn, note, est_bytes_of_intermediates, sets_cap). check(out) -> error fields."""
    recs = []
    for name, fn, note, mem, touched in variants:
        rec = {"family": fam, "case": case, "variant": name, "shape": shape, "roofline": line, "note": note}
        if mem > MAX_VARIANT_BYTES:
            rec["skipped"] = f"needs ~{mem / 1e9:.0f} GB of intermediates (> {MAX_VARIANT_BYTES / 1e9:.0f} GB)"
        else:
            try:
                ns = n_sets_for(touched, len(sets))
                timing, out = time_variant(fn, shared, sets[:ns], opts)
                rec["timing"] = timing
                rec.update(achieved(per_call_us(timing), line))
                if name.startswith("builtin") or name == "xla_topk_only":
                    rec["err_note"] = "different work: output not comparable"
                else:
                    rec.update(check(out))
            except Exception as e:  # noqa: BLE001 - a variant that does not run is a result too
                rec["error"] = short(e)
                if os.environ.get("BENCH_TRACEBACK"):
                    traceback.print_exc()
        recs.append(rec)
        print(fmt_record(rec), flush=True)
    times = {r["variant"]: per_call_us(r["timing"]) for r in recs if "timing" in r}
    for r in recs:
        if "timing" in r:
            for b in baselines:
                if b in times and b != r["variant"]:
                    r[f"speedup_vs_{b}"] = round(times[b] / per_call_us(r["timing"]), 2)
    return recs


def roofline_record(fam: str, case: str, shape: dict, line: dict) -> dict:
    rec = {"family": fam, "case": case, "variant": "roofline", "shape": shape, "roofline": line, "note": "",
           "skipped": "--roofline-only"}
    print(f"  {case:<34} floor {line['floor_us']:.1f} us ({line['bound']}-bound): {line['bytes'] / 1e6:.1f} MB, "
          f"{line['flops'] / 1e9:.1f} GFLOP, {line['intensity_flop_per_byte']} FLOP/B", flush=True)
    return rec


def fmt_record(r: dict) -> str:
    head = f"  {r['case']:<34} {r['variant']:<28}"
    if "skipped" in r:
        return head + " skipped: " + r["skipped"]
    if "error" in r:
        return head + " ERROR: " + r["error"][:160]
    t = r["timing"]
    err = r.get("rel_err", r.get("topk_overlap", ""))
    return (head + f" {per_call_us(t):>10.1f} us ({t['timer']})  {r['GBps']:>8.1f} GB/s  {r['TFLOPps']:>7.1f} TF/s"
            f"  floor {r['roofline']['floor_us']:.1f} us  err {err}")


def rnd(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


# ----------------------------------------------------------------------------- attention inputs
def attention_sets(key, *, b, s, h, d, ring, n, k, ratio, start, csa, n_sets):
    """Shared compressed store + per-set (q, q_pos, self_kv, self_pos, ring_kv, ring_pos, comp_idx)."""
    keys = jax.random.split(key, n_sets + 2)
    comp = rnd(keys[0], (b, n, d))
    sink = jax.random.normal(keys[1], (h,), jnp.float32)
    starts = jnp.full((b,), start, jnp.int32)
    q_pos = starts[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
    from model.cache import ring_positions
    ring_pos = ring_positions(starts, ring)
    visible = jnp.arange(n)[None, None] < ((q_pos + 1) // ratio)[..., None]
    sets = []
    for i in range(n_sets):
        ks = jax.random.split(keys[i + 2], 4)
        idx = None
        if csa:  # k distinct visible entries per row, as the indexer would pick them
            idx = jax.lax.top_k(jnp.where(visible, jax.random.uniform(ks[3], (b, s, n)), -1.0), k)[1]
            idx = jnp.where(jnp.take_along_axis(visible, idx, -1), idx, -1).astype(jnp.int32)
        sets.append((rnd(ks[0], (b, s, h, d)), q_pos, rnd(ks[1], (b, s, d)), q_pos, rnd(ks[2], (b, ring, d)),
                     ring_pos, idx))
    jax.block_until_ready(sets)
    return (comp, sink), sets


def attention_variants(*, b, s, h, d, ring, n, k, w, ratio, csa, mode, opts, start, must_bytes, sweep=False):
    scale = d ** -0.5
    kern_kw = dict(scale=scale, window=w, ratio=ratio)

    def pallas(cfg):
        def f(comp, sink, q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx):
            return pk_attn.sparse_attention(q, q_pos, self_kv, self_pos, sink, ring_kv=ring_kv, ring_pos=ring_pos,
                                            comp_kv=comp, comp_idx=idx, mode=mode, interpret=opts.interpret,
                                            **kern_kw, **{"impl": "triton", **cfg})
        return f

    def xla_gather(comp, sink, q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx):
        return ref.window_sparse_attention(q, q_pos, self_kv, self_pos, sink, ring_kv=ring_kv, ring_pos=ring_pos,
                                           comp_kv=comp, comp_idx=idx, **kern_kw)

    def xla_dense(comp, sink, q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx):
        # what model/attention.py does with attention_impl="reference": concat keys + dense mask
        keys, mask = ref.window_sparse_dense(q_pos, self_kv, self_pos, window=w, ring_kv=ring_kv, ring_pos=ring_pos,
                                             comp_kv=comp, comp_idx=idx, ratio=ratio)
        return ref.sink_attention(q, keys, mask, sink, scale)

    kv_rows = ring + s + n
    dense_mem = b * s * h * kv_rows * 4 * 3 + b * kv_rows * d * 2
    sel = k if csa else n
    gather_mem = b * s * h * (ring + s + sel) * 4 * 3 + (b * s * sel * d * 2 if csa else 0)
    variants = []
    cfg = pk_attn.default_config(mode, b * s, h, csa)
    cfg["num_splits"] = pk_attn.auto_splits(b * s, h, cfg["block_h"]) if mode == "decode" else 1
    variants.append(("triton", pallas({}), f"default {mode} config {cfg}", 0, must_bytes))
    if (h, d) == (pk_attn_mgpu.HEADS, pk_attn_mgpu.DIM) and opts.gpu:
        variants.append(("mgpu", pallas(dict(impl="mgpu")), "Mosaic GPU kernel (attention_mgpu: inline-TMA row "
                         "gather, two compute warpgroups), one program per query row", 0, must_bytes))
    if sweep:
        # (block_h, block_n, num_warps, num_stages, num_splits); results/bench_kernels_20261130-080535_gpu.* has
        # a wider grid (3-4 stages, 16-head and 32-key blocks: all slower)
        grid = ([(32, 64, 4, 2, 1), (32, 64, 4, 2, 2), (64, 64, 8, 2, 1), (64, 64, 8, 2, 2), (32, 32, 4, 3, 1)]
                if mode == "decode" else [(64, 64, 8, 2, 1), (32, 64, 4, 2, 1), (64, 32, 8, 3, 1)])
        for bh, bn, nw, ns, sp in grid:
            if pk_attn.smem_bytes(d, bh, bn, ns) > pk_attn.SMEM_LIMIT:
                continue
            cfg = dict(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns, num_splits=sp)
            variants.append((f"triton_bh{bh}_bn{bn}_w{nw}_s{ns}_p{sp}", pallas(cfg), "sweep", 0, must_bytes))
    variants.append(("xla_gather", xla_gather, "pure-jnp gather formulation (reference.window_sparse_attention)",
                     gather_mem, must_bytes))
    variants.append(("xla_dense", xla_dense, "model reference path: concat keys + [B,S,R+S+N] mask + sink_attention",
                     dense_mem, b * n * d * 2))
    return variants


def builtin_variants(*, b, s, h, d, ring, k, w, opts):
    """Closest built-ins on pre-gathered keys (window + selected rows contiguous, no sink): they cannot
    express per-row index sets or the sink, so they time only the dense core on the same bytes."""
    n_keys = w + k

    def gathered(comp, sink, q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx):
        g = jax.vmap(lambda c, i: c[jnp.maximum(i, 0)])(comp, idx[:, 0])  # [B, K, D] (row 0's selection)
        return jnp.concatenate([ring_kv[:, :w], g], axis=1)              # [B, W + K, D]

    def dpa(impl):
        def f(comp, sink, q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx):
            kv = gathered(comp, sink, q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx)[:, :, None, :]
            return jax.nn.dot_product_attention(q, kv, kv, scale=d ** -0.5, implementation=impl)
        return f

    def pallas_mqa(block_h, block_k, k_splits):
        from jax.experimental.pallas.ops.gpu import decode_attention

        def f(comp, sink, q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx):
            kv = gathered(comp, sink, q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx)
            return decode_attention.mqa(q[:, 0], kv, kv, sm_scale=d ** -0.5, block_h=block_h, block_k=block_k,
                                        k_splits=k_splits, interpret=opts.interpret)[:, None]
        return f

    must = b * n_keys * d * 2
    note = "built-in on pre-gathered [B, W+K, D] keys (gather included), no sink, no per-row masks"
    bk = 64 if n_keys % 64 == 0 else 16
    return [("builtin_dpa_cudnn", dpa("cudnn"), note, 0, must),
            ("builtin_dpa_xla", dpa("xla"), note, 0, must),
            ("builtin_pallas_decode_mqa", pallas_mqa(16, bk, max(1, n_keys // (2 * bk))), note, 0, must)]


def attention_check(sets, shared, *, scale, w, ratio, nb=8):
    """fp32 reference on the first `nb` sequences of input set 0 (keeps the fp32 copies small)."""
    comp, sink = shared
    first = lambda x: None if x is None else x[:nb]
    q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx = (first(x) for x in sets[0])
    up = lambda x: x.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):  # an fp32 reference, not TF32
        expect = jax.jit(functools.partial(ref.window_sparse_attention, scale=scale, window=w, ratio=ratio))(
            up(q), q_pos, up(self_kv), self_pos, sink, ring_kv=up(ring_kv), ring_pos=ring_pos,
            comp_kv=up(comp[:nb]), comp_idx=idx)

    def check(out):
        if out.shape[1:] != expect.shape[1:]:
            return {"rel_err": None, "err_note": f"shape {out.shape} (not comparable)"}
        return {"rel_err": round(rel_err(out[:nb], expect), 5)}
    return check


def attention_roofline(*, b, s, h, d, w, sel_per_row, k_idx, comp_distinct):
    """HBM bytes it must move: distinct window rows (W + S - 1 per sequence), distinct compressed rows
    (`comp_distinct` per sequence: min(S*K, N) for CSA with unrelated rows, the visible count for HCA),
    q read + o written, indices. FLOPs: QK^T and PV over the keys each row attends (W + selected)."""
    kv_rows = b * ((w + s - 1) + comp_distinct)
    bytes_ = kv_rows * d * 2 + 2 * b * s * h * d * 2 + b * s * k_idx * 4
    flops = 4 * b * s * h * d * (w + sel_per_row)
    return roofline(bytes_, flops)


@family("attention_decode")
def bench_attention_decode(opts: Opts) -> list[dict]:
    """Decode/verify at V4-Flash shapes: 128K context (32K CSA entries / 1K HCA), window 128 (+8 ring
    slack), 512 selected entries, 64 heads x 512, bf16; batch 8..256, 1 or 4 (verify) rows."""
    if opts.quick:
        h, d, ring, w, k, ctx, cases = 16, 64, 24, 16, 16, 256, [(2, 1, True), (2, 4, True), (2, 1, False)]
    else:
        h, d, ring, w, k, ctx = 64, 512, 136, 128, 512, 131072
        cases = [(b, s, True) for b in (8, 64, 256) for s in (1, 4)] + [(64, 1, False), (256, 4, False)]
    recs = []
    for b, s, csa in cases:
        ratio = 4 if csa else 128
        n = ctx // ratio
        start = ctx - s
        sel = k if csa else n
        line = attention_roofline(b=b, s=s, h=h, d=d, w=w, sel_per_row=sel, k_idx=k if csa else 0,
                                  comp_distinct=min(s * k, n) if csa else n)
        shape = dict(B=b, S=s, H=h, Dh=d, ring=ring, window=w, N=n, K=k if csa else None, ratio=ratio, context=ctx,
                     dtype="bfloat16", kind="CSA" if csa else "HCA")
        case = f"{'csa' if csa else 'hca'}_B{b}_S{s}"
        print(f"[attention_decode] {case}: roofline {line}", flush=True)
        if opts.roofline_only:
            recs.append(roofline_record("attention_decode", case, shape, line))
            continue
        n_sets = n_sets_for(line["bytes"], 4 if opts.quick else 24)
        shared, sets = attention_sets(jax.random.key(b * 10 + s), b=b, s=s, h=h, d=d, ring=ring, n=n, k=k,
                                      ratio=ratio, start=start, csa=csa, n_sets=n_sets)
        variants = attention_variants(b=b, s=s, h=h, d=d, ring=ring, n=n, k=k, w=w, ratio=ratio, csa=csa,
                                      mode="decode", opts=opts, start=start, must_bytes=line["bytes"],
                                      sweep=opts.sweep and (opts.quick or b >= 64) and csa)
        if csa and s == 1:
            variants += builtin_variants(b=b, s=s, h=h, d=d, ring=ring, k=k, w=w, opts=opts)
        check = attention_check(sets, shared, scale=d ** -0.5, w=w, ratio=ratio)
        recs += run_variants("attention_decode", case, shape, line, variants, shared, sets, check, opts)
    return recs


@family("attention_prefill")
def bench_attention_prefill(opts: Opts) -> list[dict]:
    """Prefill: 4K new tokens ending at 128K context, one sequence, CSA (512 selected) and HCA (all
    visible of 1K entries); FLOPs counted on the work actually required (selected entries only)."""
    if opts.quick:
        h, d, ring, w, k, ctx, s = 16, 64, 24, 16, 16, 512, 48
    else:
        h, d, ring, w, k, ctx, s = 64, 512, 136, 128, 512, 131072, 4096
    recs = []
    for csa in (True, False):
        ratio = 4 if csa else 128
        n = ctx // ratio
        start = ctx - s
        # HCA: row p sees (p+1)//128 entries; average over the chunk
        sel = k if csa else float(np.mean((np.arange(start, ctx) + 1) // ratio))
        line = attention_roofline(b=1, s=s, h=h, d=d, w=w, sel_per_row=sel, k_idx=k if csa else 0,
                                  comp_distinct=min(s * k, n) if csa else (ctx + 1) // ratio)
        shape = dict(B=1, S=s, H=h, Dh=d, ring=ring, window=w, N=n, K=k if csa else None, ratio=ratio, context=ctx,
                     dtype="bfloat16", kind="CSA" if csa else "HCA")
        case = f"{'csa' if csa else 'hca'}_S{s}_ctx{ctx}"
        print(f"[attention_prefill] {case}: roofline {line}", flush=True)
        if opts.roofline_only:
            recs.append(roofline_record("attention_prefill", case, shape, line))
            continue
        shared, sets = attention_sets(jax.random.key(7 + csa), b=1, s=s, h=h, d=d, ring=ring, n=n, k=k, ratio=ratio,
                                      start=start, csa=csa, n_sets=1)
        variants = attention_variants(b=1, s=s, h=h, d=d, ring=ring, n=n, k=k, w=w, ratio=ratio, csa=csa,
                                      mode="prefill", opts=opts, start=start, must_bytes=line["bytes"],
                                      sweep=opts.sweep)
        variants += prefill_builtins(s=s, h=h, d=d, opts=opts)
        check = attention_check(sets, shared, scale=d ** -0.5, w=w, ratio=ratio)
        recs += run_variants("attention_prefill", case, shape, line, variants, shared, sets, check, opts)
    return recs


def prefill_builtins(*, s, h, d, opts):
    """Dense causal attention over the chunk's own rows at the same head dim (not the same work: a
    throughput peer; FLOP/s is reported against our roofline, so compare wall time with care)."""
    def dpa(impl):
        def f(comp, sink, q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx):
            kv = self_kv[:, :, None, :]
            return jax.nn.dot_product_attention(q, kv, kv, is_causal=True, implementation=impl)
        return f

    def mha(comp, sink, q, q_pos, self_kv, self_pos, ring_kv, ring_pos, idx):
        from jax.experimental.pallas.ops.gpu import attention
        kv = jnp.broadcast_to(self_kv[:, :, None, :], q.shape)
        bs = attention.BlockSizes(block_q=64 if s % 64 == 0 else 16, block_k=32 if s % 32 == 0 else 16)
        return attention.mha(q, kv, kv, None, sm_scale=d ** -0.5, causal=True, block_sizes=bs,
                             interpret=opts.interpret)
    note = "built-in dense causal attention over the S own rows (different work; shown for scale)"
    return [("builtin_dpa_cudnn_causal", dpa("cudnn"), note, 0, 0),
            ("builtin_pallas_mha_causal", mha, note, s * h * d * 2 * 3, 0)]


# ----------------------------------------------------------------------------- indexer
def indexer_sets(key, *, b, t, hi, di, n, start, n_sets, quant):
    ks = jax.random.split(key, n_sets * 3)
    pos = jnp.full((b,), start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    sets = []
    for i in range(n_sets):
        keys, scale = ref.quantize_index_keys(rnd(ks[3 * i + 2], (b, n, di)), quant)
        sets.append((rnd(ks[3 * i], (b, t, hi, di)),
                     jax.random.normal(ks[3 * i + 1], (b, t, hi), jnp.float32) * (hi * di) ** -0.5, keys, pos, scale))
    jax.block_until_ready(sets)
    return (), sets


def indexer_variants(*, b, t, n, k, ratio, mode, opts, key_bytes, quant, sweep=False):
    def pallas(cfg):
        def f(q, w, keys, pos, scale):
            return pk_idx.indexer_topk(q, w, keys, pos, ratio=ratio, k=k, key_scale=scale, mode=mode,
                                       interpret=opts.interpret, **cfg)
        return f

    def pallas_scores_only(q, w, keys, pos, scale):
        return pk_idx.indexer_scores(q, w, keys, pos, ratio=ratio, key_scale=scale, mode=mode,
                                     interpret=opts.interpret)[0]

    def pallas_single_topk(q, w, keys, pos, scale):
        sc, _ = pk_idx.indexer_scores(q, w, keys, pos, ratio=ratio, key_scale=scale, mode=mode,
                                      interpret=opts.interpret)
        return ref.topk_indices(sc[..., :n], k)

    def xla_reference(q, w, keys, pos, scale):
        if t <= 64:
            return ref.indexer_topk(q, w, keys, pos, ratio=ratio, k=k, key_scale=scale)
        # prefill: the [B, T, HI, N] fp32 intermediate of the reference would not fit; same math in row chunks
        chunk = 256 if t % 256 == 0 else t
        qs = q.reshape(b, t // chunk, chunk, *q.shape[2:]).swapaxes(0, 1)
        ws = w.reshape(b, t // chunk, chunk, -1).swapaxes(0, 1)
        ps = pos.reshape(b, t // chunk, chunk).swapaxes(0, 1)
        out = jax.lax.map(lambda a: ref.indexer_topk(a[0], a[1], keys, a[2], ratio=ratio, k=k, key_scale=scale),
                          (qs, ws, ps))
        return out.swapaxes(0, 1).reshape(b, t, -1)

    def xla_bf16_scores(q, w, keys, pos, scale):
        kf = keys if scale is None else ref.dequantize_rows(keys, scale).astype(jnp.bfloat16)
        s = jnp.einsum("bthd,bnd->bthn", q, kf.astype(q.dtype), preferred_element_type=jnp.float32)
        s = jnp.einsum("bthn,bth->btn", jax.nn.relu(s), w)
        visible = jnp.arange(n)[None, None, :] < ((pos + 1) // ratio)[..., None]
        return ref.topk_indices(jnp.where(visible, s, -jnp.inf), k)

    def xla_topk_only(q, w, keys, pos, scale):
        # the selection alone on ready scores (lax.top_k): the built-in the fused top-k replaces
        s = jax.random.normal(jax.random.key(0), (b, t, n), jnp.float32)
        return jax.lax.top_k(s, min(k, n))[1]

    inter = 2 * b * t * 64 * n * 4  # [B, T, HI, N] fp32 of the XLA formulation (einsum out + ReLU)
    v = [("pallas", pallas({}), f"fused scores + two-stage top-k (group {pk_idx.GROUP}), default {mode} config",
          0, key_bytes),
         ("pallas_scores_only", pallas_scores_only, "kernel alone (scores + group maxima), no selection", 0, key_bytes),
         ("pallas_scores+lax_top_k", pallas_single_topk, "kernel + one lax.top_k over N", 0, key_bytes)]
    if sweep:
        # rows per program are clamped to T
        for rows, bn, tiles, nw, ns in ((8, 128, 1, 4, 3), (8, 64, 16, 4, 3), (8, 64, 32, 4, 3), (8, 128, 8, 4, 3),
                                        (8, 64, 1, 4, 3), (8, 128, 1, 8, 3), (8, 256, 1, 8, 3)):
            v.append((f"pallas_r{rows}_bn{bn}_t{tiles}_w{nw}_s{ns}",
                      pallas(dict(rows_per_block=rows, block_n=bn, tiles=tiles, num_warps=nw, num_stages=ns)),
                      "sweep", 0, key_bytes))
    v += [("xla_reference", xla_reference, "reference.indexer_topk: fp32 einsums + lax.top_k"
           + (" (row chunks of 256)" if t > 64 else ""), inter if t <= 64 else b * 256 * 64 * n * 4, key_bytes),
          ("xla_bf16", xla_bf16_scores, "XLA bf16 einsum (fp32 acc) + lax.top_k", inter, key_bytes),
          ("xla_topk_only", xla_topk_only, "lax.top_k alone on [B,T,N] fp32 scores (selection cost)", 0,
           b * t * n * 4)]
    if quant:
        v = [x for x in v if x[0] in ("pallas", "pallas_scores_only", "xla_reference")]
    return v


def indexer_check(sets, *, ratio, k, nb=8, rows=64):
    """fp32 reference top-k on the first `nb` sequences x `rows` query rows of input set 0."""
    q, w, keys, pos, scale = sets[0]
    with jax.default_matmul_precision("highest"):  # an fp32 reference, not TF32
        expect = jax.jit(functools.partial(ref.indexer_topk, ratio=ratio, k=k))(
            q[:nb, :rows], w[:nb, :rows], keys[:nb], pos[:nb, :rows], key_scale=None if scale is None else scale[:nb])

    def check(out):
        if out.ndim != 3 or out.shape[2] != expect.shape[2]:
            return {"topk_overlap": None}
        return {"topk_overlap": round(set_overlap(out[:nb, :rows], expect), 5)}
    return check


KEY_ENTRY_BYTES = {None: lambda di: 2 * di, "fp8": lambda di: di + 4, "fp4": ref.mxfp4_row_bytes}
KEY_FORMATS = {None: "bfloat16", "fp8": "float8_e4m3fn+row scale", "fp4": "MXFP4 (packed E2M1 + UE8M0 per 32)"}


def indexer_roofline(*, b, t, hi, di, n, quant):
    key_bytes = b * n * KEY_ENTRY_BYTES[quant](di)
    bytes_ = key_bytes + b * t * hi * (di * 2 + 4) + b * t * n * 4 * (1 + 1 / pk_idx.GROUP)
    return roofline(bytes_, 2 * b * t * n * hi * di), key_bytes


def _indexer_family(opts: Opts, name: str, cases, mode: str) -> list[dict]:
    recs = []
    hi, di, k = (16, 64, 16) if opts.quick else (64, 128, 512)
    for b, t, ctx, quant in cases:
        ratio = 4
        n = ctx // ratio
        line, key_bytes = indexer_roofline(b=b, t=t, hi=hi, di=di, n=n, quant=quant)
        shape = dict(B=b, T=t, HI=hi, DI=di, N=n, K=k, ratio=ratio, context=ctx, keys=KEY_FORMATS[quant])
        case = f"B{b}_T{t}_N{n}{'_' + quant if quant else ''}"
        print(f"[{name}] {case}: roofline {line}; index-key bytes {key_bytes}", flush=True)
        if opts.roofline_only:
            recs.append(roofline_record(name, case, shape, line))
            continue
        n_sets = n_sets_for(key_bytes, 8)
        shared, sets = indexer_sets(jax.random.key(b + t), b=b, t=t, hi=hi, di=di, n=n, start=ctx - t,
                                    n_sets=n_sets, quant=quant)
        variants = indexer_variants(b=b, t=t, n=n, k=k, ratio=ratio, mode=mode, opts=opts, key_bytes=key_bytes,
                                    quant=quant, sweep=opts.sweep and not quant and (opts.quick or b in (1, 64, 256)))
        rs = run_variants(name, case, shape, line, variants, shared, sets, indexer_check(sets, ratio=ratio, k=k), opts,
                          baselines=("xla_reference", "xla_bf16"))
        for r in rs:  # the indexer target's metric: HBM bandwidth on index-key bytes
            if "timing" in r:
                r["key_GBps"] = round(key_bytes / (per_call_us(r["timing"]) * 1e-6) / 1e9, 1)
                r["key_frac_hbm_read"] = round(r["key_GBps"] * 1e9 / HBM_READ, 3)
        recs += rs
    return recs


@family("indexer_decode")
def bench_indexer_decode(opts: Opts) -> list[dict]:
    """Indexer + top-512 at 128K context (32K entries x 128 dims, 64 heads), 1 or 4 rows per sequence."""
    cases = ([(2, 1, 2048, None), (2, 4, 2048, "fp8"), (2, 1, 2048, "fp4")] if opts.quick else
             [(8, 1, 131072, None), (64, 1, 131072, None), (64, 4, 131072, None), (256, 1, 131072, None),
              (64, 1, 131072, "fp8"), (64, 1, 131072, "fp4"), (256, 1, 131072, "fp4")])
    return _indexer_family(opts, "indexer_decode", cases, "decode")


@family("indexer_prefill")
def bench_indexer_prefill(opts: Opts) -> list[dict]:
    """Indexer + top-512 for a 4K-token chunk ending at 128K context (compute-bound: 2.2 TFLOP)."""
    cases = [(1, 32, 2048, None)] if opts.quick else [(1, 4096, 131072, None), (1, 4096, 131072, "fp4")]
    return _indexer_family(opts, "indexer_prefill", cases, "prefill")


# ----------------------------------------------------------------------------- report
def environment() -> dict:
    dev = jax.devices()[0]
    rev, dirty = revision()
    return {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), "-m", "experiments.bench_kernels", *sys.argv[1:]]),
            "git_revision": rev, "git_dirty": dirty,
            "backend": jax.default_backend(), "device": getattr(dev, "device_kind", str(dev)),
            "compute_capability": getattr(dev, "compute_capability", None), "jax": jax.__version__,
            "ceilings": {"hbm_read_Bps": HBM_READ, "hbm_datasheet_Bps": HBM_DATASHEET, "bf16_peak_flops": BF16_PEAK,
                         "bf16_datasheet_flops": BF16_DATASHEET, "source": "BENCHMARKS.md section 1"}}


def markdown(env: dict, recs: list[dict]) -> str:
    out = [f"# bench_kernels {env['date_utc']}", "",
           f"`{env['command']}` — {revision_label(env)}, "
           f"{env['device']} ({env['backend']}), jax {env['jax']}. Ceilings: HBM read {HBM_READ / 1e12:.2f} TB/s, "
           f"bf16 {BF16_PEAK / 1e12:.0f} TFLOP/s (measured, BENCHMARKS.md). Times: median per call "
           "(CUPTI kernel time where available, else wall clock).", ""]
    fam = None
    for r in recs:
        if r["family"] != fam:
            fam = r["family"]
            out += ["", f"## {fam}", "",
                    "| case | variant | µs | floor µs | GB/s | TFLOP/s | % HBM | % bf16 | err / overlap | vs XLA | note |",
                    "|---|---|---|---|---|---|---|---|---|---|---|"]
        line = r["roofline"]
        if "timing" not in r:
            why = r.get("skipped") or ("ERROR " + r.get("error", ""))
            out.append(f"| {r['case']} | {r['variant']} | — | {line['floor_us']} | | | | | | | {why[:150]} |")
            continue
        err = r.get("rel_err", r.get("topk_overlap"))
        vs = r.get("speedup_vs_xla_dense") or r.get("speedup_vs_xla_reference")
        vs2 = r.get("speedup_vs_xla_gather") or r.get("speedup_vs_xla_bf16")
        vs_s = "/".join(f"{x}x" for x in (vs, vs2) if x)
        gbs = r.get("key_GBps", r["GBps"])
        frac = r.get("key_frac_hbm_read", r["frac_hbm_read"])
        out.append(f"| {r['case']} | {r['variant']} | {per_call_us(r['timing']):.1f} | {line['floor_us']} | {gbs} | "
                   f"{r['TFLOPps']} | {100 * frac:.0f} | {100 * r['frac_bf16_peak']:.0f} | {err} | {vs_s} | "
                   f"{r['note'][:80]} |")
    out += ["", "vs XLA: speed-up over the model's dense reference path / over the pure-jnp gather formulation "
            "(attention), over reference.indexer_topk / the bf16 XLA path (indexer). Indexer GB/s and % HBM are on "
            "index-key bytes (the indexer target's metric); attention GB/s on the bytes the kernel must read."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, 3 repeats: a smoke run (also on CPU)")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile configurations")
    p.add_argument("--roofline-only", action="store_true", help="print the roofline of every case; run nothing")
    p.add_argument("--only", default="", help=f"comma-separated families: {','.join(FAMILIES)}")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 10, quick 3)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    opts = Opts(quick=a.quick, sweep=a.sweep, repeats=a.repeats or (3 if a.quick else 10),
                warmup=1 if a.quick else 2, interpret=not gpu, gpu=gpu, roofline_only=a.roofline_only)
    names = [x for x in a.only.split(",") if x] or list(FAMILIES)
    unknown = [x for x in names if x not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; known: {list(FAMILIES)}")
    env = environment()
    print(json.dumps(env), flush=True)
    if not gpu:
        print("note: no GPU — Pallas kernels run in interpret mode; timings are not meaningful", flush=True)
    recs = []
    for name in names:
        t0 = time.time()
        try:
            recs += FAMILIES[name](opts)
        except Exception as e:  # noqa: BLE001 - keep the other families' results
            recs.append({"family": name, "case": "-", "variant": "-", "roofline": roofline(0, 0), "note": "",
                         "error": short(e)})
            traceback.print_exc()
        print(f"[{name}] done in {time.time() - t0:.0f} s", flush=True)
    if a.roofline_only:
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    tag = f"{'quick_' if a.quick else ''}{env['backend']}"
    (out / f"bench_kernels_{stamp}_{tag}.json").write_text(json.dumps({"env": env, "records": recs}, indent=1))
    md = markdown(env, recs)
    (out / f"bench_kernels_{stamp}_{tag}.md").write_text(md)
    print(md)
    print(f"wrote {out}/bench_kernels_{stamp}_{tag}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
