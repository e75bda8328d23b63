"""Roofline accounting for one forward step on any GPU and mesh: bytes, FLOPs and bytes sent between GPUs by
component, the floors on a hardware profile, a calibrated estimate, and per-device memory (BENCHMARKS.md
sections 1 and 4; docs/model.md §4, §4.5, §5, §6, §7, §8, §9, §10, §13, §13.3, §13.7, §17.1).

  python -m experiments.roofline --preset v4-flash --phase decode --batch 64 --context 131072 \\
      --num-draft 3 --weights fp4-experts [--json out.json]
  python -m experiments.roofline --preset v4-flash --layers 4 --phase prefill --batch 2 --new-tokens 4096 \\
      --context 126976 --weights bf16
  python -m experiments.roofline --preset v41-flash --hardware gb300 --mesh 1,64,1 --phase decode \\
      --batch 16384 --context 131072 --num-draft 3 --redundant-experts 64 --forced-balance --json out.json

API: `roofline(cfg, phase, batch, context, new_tokens, weight_dtype, kv_dtype, mesh, forced_balance, ceilings,
drafter, transport, dispatch_dtype, redundant_experts)` returns a dict (JSON-ready) with per-device
`components` (bytes split into weights / KV read / KV write / other, FLOPs, time at each ceiling), `totals`
(the memory, compute and communication floors, `floor_s` and `floor_serial_s`, the bound and the component that
sets it), `communication` (bytes sent per device, over NVLink and beyond), `placement` (expert slots and
balance), `replication`, `memory` (weights + cache per device) and `params`; `with_estimate(res)` adds the
calibrated estimate and the record's `floor_ms` / `estimate_ms`. `experiments.layer_scaling.scale_layers(cfg, n)`
builds the same model with n layers keeping the layer pattern (`--layers n`).

What a step is
  * prefill: `batch` sequences each append `new_tokens` rows after `context` cached positions; logits
    only for each sequence's last row.
  * decode / verify: `new_tokens` = 1 + num_draft rows per sequence after `context` cached positions;
    logits for every row. The drafter's own cost is left out unless `drafter=True` (`--drafter`).

Model of the bytes (a floor: what a perfect kernel must move through HBM)
  * Weights: every dense tensor once per step (re-read per sequential drafter pass); routed experts:
    the expected number of *distinct* experts hit times one expert's bytes: forced balance
    min(E, picks), uniform random routing E * (1 - (1 - 1/E)^picks), picks = batch*rows*k of the EP
    group (batch/dp sequences). Formats as released (docs/model.md §14, §17): "bf16" = all 2 B;
    "fp8" = FP8 E4M3 + UE8M0 block scales (128x128 V4, 32x32 V4.1) for wq_a, wq_b, wkv, wo_a, wo_b,
    indexer wq_b, shared and routed experts, Engram wkv, MTP/DSpark projections; "fp4-experts" = the
    same with routed experts in packed E2M1 + UE8M0 per 32 (0.53 B/param). This engine's formats (its XLA
    and Pallas matmuls dequantise FP8 / FP4 weights to bf16 and multiply in bf16; the floor still charges
    the MMA the format allows, below):
    "bf16-fp4-experts" (`expert_weights="fp4"`: dense tensors bf16, routed experts FP4), "fp8-dense"
    (`dense_weights="fp8"`: the FP8 tensors as released, routed experts bf16) and "fp8-fp4-experts" (both:
    the release's bytes, bf16 MMA). Which tensors are FP8 is one rule, model.quant_io.release_fp8
    (`matrix_class`), the same the model's `dense_weights="fp8"` follows. Tensors the release keeps in
    BF16 stay BF16 in every mode (embed, head, compressors, router gate, indexer weights_proj, V4.1 wk,
    Markov heads), fp32 ones fp32 (mHC, ape, attn_sink, gate bias). wo_a counts as FP8 (the official
    code dequantises it to BF16 at load: +0.03 GB/layer if an engine does the same). Engram tables are
    FP8 rows (256 B + 8 scale bytes) in every mode (BF16 tables would not fit anywhere).
  * KV read per sequence (rows of one sequence share reads): its window union min(W - 1 + T, ctx + T)
    rows per layer, the selected compressed entries min(T * topk, visible) on CSA/Full/Reindex/Reuse
    layers (each query row has its own top-k; they may overlap, so this over-counts a little), all
    visible entries on HCA layers, all visible index keys per indexer layer (V4.1 Reindex layers with a
    candidate pool: at most T * candidate_topk_blocks * candidate_block_size). Our Pallas attention
    kernel today runs one program per query row and so reads window and HCA keys T times per sequence;
    the floor assumes a kernel that shares them across the rows of a sequence. Formats by `kv_dtype`:
    "bf16" (our cache today: 1024 B rows, 256 B index keys), "fp8" (FP8 rows + scales: V4 584 B
    FlashMLA row, V4.1 528 B; FP8 index keys 132 B), "packed" (the trained formats of docs/model.md §13.7:
    V4 584 B rows and 68 B MXFP4 keys; V4.1 528 B window rows, 288 B FP4 entries, 68 B keys).
  * KV written: each layer's own window rows (last min(T, W)), emitted compressed entries and index
    keys (decode: T / r per sequence on average; prefill: exact), and the fp32 compressor carry rows
    (docs/model.md §13.3; under "compressor").
  * Draft-stage weights count in the per-device memory when the step verifies drafts (or with
    `drafter=True`); the MTP / DSpark stages share the backbone's embedding and head.
  * Activations are assumed to stay on chip / be fused (not counted); so are indexer scores (a fused
    top-k) and the rows sent to other devices (counted apart, below).

Model of the FLOPs
  * 2 * params per row for every GEMM (rows: all new rows; head: last row per sequence in prefill,
    every row in decode); routed experts 6 * D * I per routed row; attention core 4 * H * Dh per key per
    query with keys = min(W, p + 1) + min(topk, visible(p)) (CSA / Full / Reindex / Reuse) or
    + visible(p) (HCA); indexer scores 2 * HI * DI per key per query over all visible keys (candidates
    only on V4.1 Reindex layers); mHC coefficient GEMM, collapse and expand; Engram wkv.
  * Compute time = sum over components of FLOPs / peak of that GEMM (`gemm_peak`): the FP4 peak for tensors
    held FP4 where the GPU has FP4 MMA (Blackwell), the FP8 peak for tensors held FP8 / FP4 (FP4 experts run
    FP8 MMA on Hopper, which has no FP4 tensor cores) and for Engram rows, the BF16 peak for BF16 tensors,
    the attention core (FlashMLA dequantises FP8 KV to BF16 on Hopper) and fp32 extras (mHC, compressor
    pooling: counted at the BF16 peak, a floor); indexer scores at the FP8 peak when the KV is FP8/packed,
    else BF16.

Ceilings: a hardware profile of experiments/hardware.py, `--hardware NAME` (h200: the best measured on our
H200, HBM 4.4 TB/s, bf16 790, FP8 1525 TFLOP/s, the default; h200-datasheet, h100, b200, b300, gb200, gb300:
the vendors'); `--bf16-tflops` etc. override one figure.

Mesh (dp, ep, tp): attention runs data-parallel over dp*ep devices (batch / (dp*ep) sequences per
device; `batch` is the global number of sequences), so every device of a tp group holds and reads its own
copy of the non-expert weights (`replication`); experts are sharded over ep ((E + R) / ep slots per device
with R redundant experts; each EP group serves batch / dp sequences), tp splits heads (wq_b, wo_a, wo_b,
attention core, indexer heads and wq_b), the shared expert, the routed experts' intermediate dim and the
head's vocab; the single MQA KV head is replicated over tp (every tp rank reads all KV). Everything is per
device; the busiest device's routed rows (roofline_mesh.expert_placement) set the experts' FLOPs.

Communication (experiments/roofline_mesh.py): the routed rows' dispatch and combine (`--transport all_to_all`,
tokens x top-k x hidden in `--dispatch-dtype`), or this engine's gather / reduce-scatter and replicate
transports, and the tp all-reduces; within an NVLink domain over NVLink, beyond it over the scale-out network.

Floors and overlap: memory and compute overlap within a kernel (their max); communication can overlap them
when micro-batches alternate (two-batch overlap), so `floor_s` = max(memory, compute, communication), the
lower bound, and `floor_serial_s` = max(memory, compute) + communication, a step whose layers wait for their
exchanges. The estimate (experiments/roofline_estimate.py) adds its terms: this engine runs them one after
another.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict

from experiments import roofline_mesh
from experiments.hardware import H200_MEASURED, PROFILES, profile
from experiments.layer_scaling import scale_layers
from experiments.roofline_formats import (BYTE_KINDS, COMPONENTS, KV_DTYPES, PHASES, WEIGHT_DTYPES, WEIGHT_FORMATS,
                                          bytes_per_param, gemm_peak, kv_entry_bytes, matrix_class,
                                          memory_estimate_args, uniform_mma)

# ----------------------------------------------------------------------------------------------- accounting

class _Acc:
    """Per-device accumulator: components -> parts -> {bytes by kind, flops (GEMM flops apart), compute seconds};
    bytes sent to other devices by (group, part); resident weights (memory) and parameter counts."""

    def __init__(self, cfg, weight_dtype, ceilings, tp):
        self.cfg, self.wd, self.ceil, self.tp = cfg, weight_dtype, ceilings, tp
        self.comp = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
        self.resident = defaultdict(float)      # bytes per device, by component
        self.params = defaultdict(float)        # logical parameters (whole model), by component
        self.active = 0.0                       # parameters used per token (docs/model.md §17.1 "active")
        self.group = None                       # when set ("drafter"), every add goes to that component
        self.count_resident = True
        self.sent = defaultdict(float)          # (group, part) -> bytes this device sends (roofline_mesh)
        self.layers_run = 0                     # blocks (layer passes) the step runs
        self.foreign_rows = 0.0                 # (row, choice) pairs of other devices handed to this one's experts
        self.placements = {}                    # experts per layer -> roofline_mesh.expert_placement

    def add(self, component, part, *, weight_bytes=0.0, kv_read_bytes=0.0, kv_write_bytes=0.0, other_bytes=0.0,
            flops=0.0, peak=None, gemm=False):
        if self.group:
            component, part = self.group, f"{component}.{part}"
        d = self.comp[component][part]
        d["weight_bytes"] += weight_bytes
        d["kv_read_bytes"] += kv_read_bytes
        d["kv_write_bytes"] += kv_write_bytes
        d["other_bytes"] += other_bytes
        d["flops"] += flops
        if gemm:
            d["gemm_flops"] += flops
        if flops:
            d["compute_s"] += flops / (peak or self.ceil["bf16_flops"])

    def send(self, traffic: dict):
        """Bytes this device sends to others, {(group, part): bytes} (roofline_mesh)."""
        for (group, part), nbytes in traffic.items():
            self.sent[(group, f"{self.group}.{part}" if self.group else part)] += nbytes

    def tensor(self, component, part, params, cls, rows=0.0, *, shard=1, touched=True, active=True,
               resident=True, flops_per_param_row=2.0):
        """A weight tensor of `params` logical parameters applied to `rows` rows (per device)."""
        bpp = bytes_per_param(self.cfg, cls, self.wd)
        if resident and self.count_resident:
            self.resident[component if not self.group else self.group] += params * bpp / shard
            self.params[component if not self.group else self.group] += params
            if active:
                self.active += params
        # a matrix applied to rows is a GEMM; norms (4 FLOPs per parameter and row) are not
        self.add(component, part, weight_bytes=params * bpp / shard if touched else 0.0,
                 flops=flops_per_param_row * params * rows / shard, peak=gemm_peak(cls, self.wd, self.ceil),
                 gemm=flops_per_param_row == 2.0)


@dataclasses.dataclass(frozen=True)
class _Step:
    phase: str
    batch: float            # global sequences
    seq_dev: float          # sequences per device (attention)
    seq_group: float        # sequences per EP group (batch / dp)
    T: int                  # new rows per sequence
    ctx: int                # cached positions before the step
    dp: int
    ep: int
    tp: int
    forced_balance: bool
    kv: dict                # entry bytes
    kv_dtype: str
    transport: str = "all_to_all"     # roofline_mesh.TRANSPORTS
    dispatch_dtype: str = "fp8"       # roofline_mesh.DISPATCH_DTYPES
    redundant: int = 0                # redundant expert slots per MoE layer


def _visible(p, r):
    """Compressed entries visible to a query at position p (docs/model.md §5, §6, §8): j < (p + 1) // r."""
    return (p + 1) // r


def _sum_over_rows(step: _Step, f) -> float:
    """Sum of f(p) over the new rows' positions p = ctx .. ctx + T - 1 (one sequence)."""
    import numpy as np

    p = np.arange(step.ctx, step.ctx + step.T, dtype=np.int64)
    return float(np.sum(f(p)))


def _emitted(step: _Step, r: int) -> float:
    """Compressed entries completed in this step per sequence: exact in prefill, T / r on average in decode."""
    if step.phase == "decode":
        return step.T / r
    return float((step.ctx + step.T) // r - step.ctx // r)


def _layer(acc: _Acc, cfg, spec, step: _Step, *, window_extra: int = 0, kv_write: bool = True):
    """One block (attention + MoE + mHC) for `step`; `window_extra` adds keys per query (DSpark block keys)."""
    import numpy as np

    acc.layers_run += 1

    D, H, Dh, qr = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    G, orank, W = cfg.o_groups, cfg.o_lora_rank, cfg.sliding_window
    HI, DI, K = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    n, tp = cfg.hc_mult, step.tp
    T, ctx, S = step.T, step.ctx, step.seq_dev
    rows = S * T
    kvb = step.kv

    # ---- mHC (two sublayers) and the block's norms
    for sub in ("attn", "ffn"):
        acc.tensor("mhc", f"hc_{sub}_fn", (2 + n) * n * n * D + (2 + n) * n + 3, "fp32", rows)
        acc.add("mhc", f"hc_{sub}_mix", flops=rows * (4 * n * D + 2 * n * n * D))
        acc.tensor("mhc", f"{sub}_norm", D, "bf16", rows, flops_per_param_row=4.0)

    # ---- attention projections (every layer, all modes)
    acc.tensor("attn_proj", "wq_a", qr * D, matrix_class("attn.wq_a"), rows)
    acc.tensor("attn_proj", "wq_b", H * Dh * qr, matrix_class("attn.wq_b"), rows, shard=tp)
    acc.tensor("attn_proj", "wkv", Dh * D, matrix_class("attn.wkv"), rows)
    acc.tensor("attn_proj", "wo_a", G * orank * (H * Dh // G), matrix_class("attn.wo_a"), rows, shard=tp)
    acc.tensor("attn_proj", "wo_b", D * G * orank, matrix_class("attn.wo_b"), rows, shard=tp)
    acc.tensor("attn_proj", "norms_sink", qr + Dh, "bf16", rows, flops_per_param_row=4.0)
    acc.tensor("attn_proj", "attn_sink", H, "fp32", 0)
    if tp > 1:  # wo_b's partial sums over the heads' slices
        acc.send({("tp", "attn_all_reduce"): roofline_mesh.all_reduce_bytes(rows * D * 2.0, tp)})

    # ---- attention core: window + compressed candidates (docs/model.md §4, §4.5, §5, §6, §7, §8)
    r = spec.compress_ratio
    kind = spec.attention
    end = ctx + T
    win_keys = _sum_over_rows(step, lambda p: np.minimum(W, p + 1)) + window_extra * T
    win_read = min(W - 1 + T, end) + window_extra
    comp_keys, comp_read = 0.0, 0.0
    if r > 0:
        if kind == "hca":
            comp_keys = _sum_over_rows(step, lambda p: _visible(p, r))
            comp_read = _visible(end - 1, r)
        else:  # csa / full / reindex / reuse: top-k of the visible entries
            comp_keys = _sum_over_rows(step, lambda p: np.minimum(K, _visible(p, r)))
            comp_read = min(T * K, _visible(end - 1, r))
    acc.add("attn_core", f"window.{kind}", flops=4.0 * H * Dh * win_keys * S / tp,
            kv_read_bytes=win_read * kvb["window"] * S)
    if r > 0:
        acc.add("attn_core", f"compressed.{kind}", flops=4.0 * H * Dh * comp_keys * S / tp,
                kv_read_bytes=comp_read * kvb["comp"] * S)
    if kv_write:
        acc.add("kv_write", "window", kv_write_bytes=min(T, W) * kvb["window"] * S)

    # ---- indexer (V4 CSA; V4.1 Full and Reindex)
    if spec.indexer:
        acc.tensor("indexer", "wq_b", HI * DI * qr, matrix_class("attn.indexer.wq_b"), rows, shard=tp)
        acc.tensor("indexer", "weights_proj", HI * D, matrix_class("attn.indexer.weights_proj"), rows)
        cap = None
        if spec.uses_candidates:
            cap = cfg.candidate_topk_blocks * cfg.candidate_block_size
        keys = _sum_over_rows(step, (lambda p: _visible(p, r)) if cap is None
                              else (lambda p: np.minimum(cap, _visible(p, r))))
        read = _visible(end - 1, r) if cap is None else min(T * cap, _visible(end - 1, r))
        peak = acc.ceil["bf16_flops"] if step.kv_dtype == "bf16" else acc.ceil["fp8_flops"]
        acc.add("indexer", "scores", flops=2.0 * HI * DI * keys * S / tp, peak=peak,
                kv_read_bytes=read * kvb["index"] * S)

    # ---- compressors (the layers that own global KV) and the cache entries they emit
    if spec.owns_kv:
        emitted = _emitted(step, r)
        parts = [("main", Dh, True)]
        if cfg.generation == "v4" and spec.indexer:
            parts.append(("index", DI, True))
        for name, d, gated in parts:
            c = 2 if spec.overlap else 1
            if cfg.generation == "v41" and r == 1:
                acc.tensor("compressor", f"{name}.wkv", d * D, matrix_class("attn.compressor.wkv"), rows)        # no gate, no state
            else:
                acc.tensor("compressor", f"{name}.wkv", c * d * D, matrix_class("attn.compressor.wkv"), rows)
                acc.tensor("compressor", f"{name}.wgate", c * d * D, matrix_class("attn.compressor.wgate"), rows)
                if cfg.generation == "v4":
                    acc.tensor("compressor", f"{name}.ape", r * c * d, "fp32", 0)
                # fp32 carry: raw (a, g) rows of unfinished blocks written, pooled when a block closes
                row_bytes = 2 * c * d * 4
                carry_rows = (2 if spec.overlap else 1) * r
                # decode pools every closing block from the stored rows; prefill pools on chip and reads
                # only the rows left over from before the chunk
                carry_read = (emitted * carry_rows if step.phase == "decode" else min(carry_rows, ctx)) * row_bytes
                acc.add("compressor", f"{name}.carry", kv_write_bytes=min(T, carry_rows) * row_bytes * S,
                        kv_read_bytes=carry_read * S, flops=emitted * carry_rows * c * d * 6 * S)
            acc.tensor("compressor", f"{name}.norm", d, "bf16", 0)
        if cfg.generation == "v41" and spec.indexer:
            acc.tensor("compressor", "index.wk", DI * Dh, matrix_class("attn.indexer.wk"), 0)
            acc.tensor("compressor", "index.k_norm", DI, "bf16", 0)
            acc.add("compressor", "index.wk_apply", flops=2.0 * DI * Dh * emitted * S)
        if kv_write:
            acc.add("kv_write", "compressed", kv_write_bytes=emitted * kvb["comp"] * S)
            if spec.indexer:
                acc.add("kv_write", "index_keys", kv_write_bytes=emitted * kvb["index"] * S)

    # ---- Engram (V4.1, before the block; docs/model.md §10)
    if spec.engram:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        hd = cfg.engram_head_dim
        row_bytes = hd * bytes_per_param(cfg, "table", acc.wd)
        acc.add("engram", "table_rows", other_bytes=rows * cols * row_bytes)
        acc.tensor("engram", "wkv", (n + 1) * D * cols * hd, matrix_class("engram.wkv"), rows)
        acc.tensor("engram", "q_k_weight", 2 * n * D, "bf16", rows)
        acc.add("engram", "gate", flops=rows * n * D * 10)
        if acc.count_resident and not acc.group:
            idx = list(cfg.engram_layer_ids).index(spec.index)
            tab_rows = (cfg.engram_num_embeddings[idx] if cfg.engram_num_embeddings
                        else cols * cfg.engram_vocab_size)
            devices = step.dp * step.ep * step.tp
            acc.resident["engram"] += tab_rows * row_bytes / devices
            acc.params["engram"] += tab_rows * hd

    # ---- MoE: router, routed experts (distinct experts touched), shared expert (docs/model.md §9)
    E, k, I = spec.n_experts, spec.n_experts_per_tok, cfg.moe_intermediate_size
    acc.tensor("router", "gate", E * D, matrix_class("ffn.gate"), rows)
    if not spec.hash_routed:  # aux-loss-free selection bias ([V4.1] + the image bias_vl)
        acc.tensor("router", "bias", E * (2 if cfg.generation == "v41" else 1), "fp32", 0)
    if spec.hash_routed:
        acc.tensor("router", "tid2eid", cfg.vocab_size * k, "int", 0, touched=False, active=False)
        acc.add("router", "tid2eid_rows", other_bytes=rows * k * 4)
    picks = step.seq_group * T * k                      # routed rows of one EP group
    place = roofline_mesh.expert_placement(E, step.redundant, step.ep, picks, step.forced_balance)
    acc.placements.setdefault(E, place)
    ebytes = 3 * D * I * bytes_per_param(cfg, "expert", acc.wd)
    # the mean device's touched slots; the busiest device's routed rows (imbalance) set the expert FLOPs
    acc.add("moe_experts", "routed", weight_bytes=place["touched_per_device"] * ebytes / tp,
            flops=6.0 * D * I * picks / step.ep / tp * place["imbalance"], peak=gemm_peak("expert", acc.wd, acc.ceil),
            gemm=True)
    acc.comp["moe_experts"]["routed"]["experts_touched_per_device"] += (
        place["touched_per_device"] if not acc.group else 0.0)
    acc.send(roofline_mesh.moe_traffic(rows, D, k, step.ep, tp, step.transport, step.dispatch_dtype,
                                       place["imbalance"]))
    acc.foreign_rows += roofline_mesh.foreign_row_choices(rows, k, step.ep, step.transport)
    if acc.count_resident:
        key = acc.group or "moe_experts"
        acc.resident[key] += place["slots_per_device"] * ebytes / tp
        acc.params[key] += E * 3 * D * I
        acc.active += k * 3 * D * I
    acc.tensor("shared_expert", "w1_w3_w2", 3 * D * I, matrix_class("ffn.shared_experts.w1"), rows, shard=tp)


def _head(acc: _Acc, cfg, step: _Step, head_rows: float, *, hc_head: bool, shared: bool = False):
    """Final collapse, norm and LM head; `shared`: the head weights belong to the backbone (drafters)."""
    D, V, n, tp = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult, step.tp
    if hc_head:
        acc.tensor("head", "hc_head_fn", n * n * D + n + 1, "fp32", head_rows)
    acc.tensor("head", "norm", D, "bf16", head_rows, flops_per_param_row=4.0)
    acc.tensor("head", "head", V * D, matrix_class("head"), head_rows, shard=tp, resident=not shared)
    if tp > 1:  # the vocabulary slices' logits
        acc.send({("tp", "head_all_gather"): roofline_mesh.all_gather_bytes(head_rows * V * 2.0, tp)})


def _embed(acc: _Acc, cfg, step: _Step, rows: float):
    D, V = cfg.hidden_size, cfg.vocab_size
    acc.tensor("head", "embed", V * D, matrix_class("embed"), 0, shard=step.tp, touched=False, active=False)
    acc.add("head", "embed_rows", other_bytes=rows * D * 2)


def _drafter(acc: _Acc, cfg, step: _Step, num_draft: int):
    """The drafter's work in one decode step (into the "drafter" component).

    [V4] MTP-1: num_draft sequential passes of one row per sequence through e_proj/h_proj, the MTP block
    and the head (weights re-read every pass). [V4.1 / DSpark] one pass: main_proj on the T committed
    rows, every stage on a block of dspark_block_size rows (window of context keys + the block's own
    keys), the head on the block rows and the Markov head (block_size sequential GEMVs)."""
    D, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    S = step.seq_dev
    active = acc.active  # "active per token" stays the backbone's
    acc.group = "drafter"
    slots = range(cfg.num_layers, cfg.num_blocks)
    if cfg.generation == "v4":
        for i in range(num_draft):
            acc.count_resident = i == 0
            one = dataclasses.replace(step, T=1, ctx=step.ctx + i)
            acc.tensor("mtp", "e_proj", D * D, matrix_class("mtp.0.e_proj"), S)
            acc.tensor("mtp", "h_proj", D * D, matrix_class("mtp.0.h_proj"), S * n)
            acc.tensor("mtp", "norms", 3 * D, "bf16", S, flops_per_param_row=4.0)
            for s in slots:
                _layer(acc, cfg, cfg.layer_spec(s), one)
            _head(acc, cfg, one, S, hc_head=True, shared=True)
    else:
        beta = cfg.dspark_block_size
        acc.tensor("dspark", "main_proj", D * 3 * D, matrix_class("mtp.0.main_proj"), S * step.T)
        acc.tensor("dspark", "main_norm", D, "bf16", S * step.T, flops_per_param_row=4.0)
        block = dataclasses.replace(step, T=beta)
        for s in slots:
            # context keys for the committed rows: this stage's wkv on main_x (written to its ring)
            acc.add("dspark", "context_kv", flops=2.0 * cfg.head_dim * D * S * step.T,
                    kv_write_bytes=step.T * step.kv["window"] * S)
            _layer(acc, cfg, cfg.layer_spec(s), block, window_extra=beta, kv_write=False)
        _head(acc, cfg, block, S * beta, hc_head=False, shared=True)
        r = cfg.dspark_markov_rank
        acc.tensor("dspark", "markov_embed", V * r, matrix_class("mtp.2.markov_head.embed"), 0, touched=False)
        acc.add("dspark", "markov_embed_rows", other_bytes=S * beta * r * 2)
        acc.count_resident = True
        acc.tensor("dspark", "markov_head", V * r, matrix_class("mtp.2.markov_head.head"), S * beta)
        # sequential: block_size GEMVs over the [V, r] head (66 MB, larger than L2), re-read each time
        acc.add("dspark", "markov_head_rereads", weight_bytes=(beta - 1) * V * r * 2)
        acc.tensor("dspark", "confidence", D + r, matrix_class("mtp.2.confidence_head.proj"), S * beta)
    acc.group = None
    acc.count_resident = True
    acc.active = active


def roofline(cfg, phase: str = "decode", batch: int = 1, context: int = 0, new_tokens: int = 1,
             weight_dtype: str = "bf16", kv_dtype: str = "bf16", mesh=(1, 1, 1), forced_balance: bool = False,
             ceilings: dict | None = None, drafter: bool = False, transport: str = "all_to_all",
             dispatch_dtype: str = "fp8", redundant_experts: int = 0) -> dict:
    """Bytes, FLOPs and bytes sent of one step by component, per device, and the floors on `ceilings`.

    cfg: a ModelConfig. phase: "prefill" | "decode". batch: global sequences. context: cached positions per
    sequence before the step. new_tokens: prefill chunk per sequence, or 1 + num_draft rows in decode.
    weight_dtype: one of WEIGHT_FORMATS ("bf16", "fp8", "fp4-experts", ...). kv_dtype: "bf16" | "fp8" | "packed".
    mesh: (dp, ep, tp). forced_balance: routing forced to perfect balance (else uniform random). ceilings: a
    hardware profile (experiments/hardware.py; default the H200 as measured). drafter: add the drafter's cost
    (decode, new_tokens - 1 drafts). transport / dispatch_dtype: how routed rows move between devices
    (roofline_mesh.TRANSPORTS / DISPATCH_DTYPES). redundant_experts: extra expert slots per MoE layer (the
    drafter's too). Returns a JSON-ready dict (see the module docstring).
    """
    from model.cache import memory_estimate

    ceilings = dict(ceilings or H200_MEASURED)
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    dp, ep, tp = (int(x) for x in mesh)
    if min(dp, ep, tp) < 1:
        raise ValueError(f"mesh (dp, ep, tp) must be positive, got {mesh}")
    if batch < 1 or new_tokens < 1 or context < 0:
        raise ValueError(f"need batch >= 1, new_tokens >= 1, context >= 0 (got {batch}, {new_tokens}, {context})")
    if transport not in roofline_mesh.TRANSPORTS:
        raise ValueError(f"transport must be one of {roofline_mesh.TRANSPORTS}, got {transport!r}")
    if dispatch_dtype not in roofline_mesh.DISPATCH_DTYPES:
        raise ValueError(f"dispatch_dtype must be one of {tuple(roofline_mesh.DISPATCH_DTYPES)}, "
                         f"got {dispatch_dtype!r}")
    if redundant_experts < 0:
        raise ValueError(f"redundant_experts must be >= 0, got {redundant_experts}")
    for name, E in (("backbone", cfg.n_routed_experts), ("drafter", cfg.dspark_n_routed_experts)):
        if E and (E + redundant_experts) % ep:
            extra = f" + {redundant_experts} redundant" if redundant_experts else ""
            raise ValueError(f"ep={ep} does not divide the {name}'s {E}{extra} expert slots")
    notes = []
    if batch % (dp * ep):
        notes.append(f"batch {batch} is not a multiple of dp*ep = {dp * ep}: fractional sequences per device")

    step = _Step(phase=phase, batch=batch, seq_dev=batch / (dp * ep), seq_group=batch / dp, T=int(new_tokens),
                 ctx=int(context), dp=dp, ep=ep, tp=tp, forced_balance=bool(forced_balance),
                 kv=kv_entry_bytes(cfg, kv_dtype), kv_dtype=kv_dtype, transport=transport,
                 dispatch_dtype=dispatch_dtype, redundant=int(redundant_experts))
    acc = _Acc(cfg, weight_dtype, ceilings, tp)
    rows = step.seq_dev * step.T
    _embed(acc, cfg, step, rows)
    for i in range(cfg.num_layers):
        _layer(acc, cfg, cfg.layer_spec(i), step)
    head_rows = step.seq_dev if phase == "prefill" else rows
    _head(acc, cfg, step, head_rows, hc_head=cfg.generation == "v4")
    # draft-stage weights are resident whenever speculative decoding is used; counted in memory only
    # unless the drafter's step cost is requested.
    if drafter and phase == "decode" and cfg.num_mtp_layers and new_tokens > 1:
        _drafter(acc, cfg, step, new_tokens - 1)
    else:
        saved = acc.comp, acc.sent, acc.layers_run, acc.foreign_rows
        acc.comp, acc.sent = defaultdict(lambda: defaultdict(lambda: defaultdict(float))), defaultdict(float)
        if cfg.num_mtp_layers:
            _drafter(acc, cfg, dataclasses.replace(step, T=1), 1)
        acc.comp, acc.sent, acc.layers_run, acc.foreign_rows = saved

    # ---- totals
    hbm = ceilings["hbm_Bps"]
    components = {}
    for name in COMPONENTS:
        if name not in acc.comp:
            continue
        parts = {}
        tot = defaultdict(float)
        for part, d in acc.comp[name].items():
            rec = {k: float(d.get(k, 0.0)) for k in BYTE_KINDS + ("flops", "gemm_flops", "compute_s")}
            rec["bytes"] = sum(rec[k] for k in BYTE_KINDS)
            if "experts_touched_per_device" in d:
                rec["experts_touched_per_device"] = float(d["experts_touched_per_device"])
            parts[part] = rec
            for k2, v in rec.items():
                tot[k2] += v
        tot = dict(tot)
        tot["memory_s"] = tot["bytes"] / hbm
        tot["floor_s"] = max(tot["memory_s"], tot["compute_s"])
        tot["parts"] = parts
        components[name] = tot
    totals = {k: sum(c[k] for c in components.values()) for k in BYTE_KINDS + ("bytes", "flops", "compute_s")}
    totals["memory_s"] = totals["bytes"] / hbm
    comm = roofline_mesh.link_time(acc.sent, (dp, ep, tp), ceilings)
    comm["parts"] = {f"{group}.{part}": b for (group, part), b in sorted(acc.sent.items())}
    comm["foreign_row_choices"] = acc.foreign_rows
    totals["comm_s"] = comm["comm_s"]
    terms = {"memory": totals["memory_s"], "compute": totals["compute_s"], "communication": comm["comm_s"]}
    totals["bound"] = max(terms, key=terms.get)
    totals["floor_s"] = max(terms.values())                                   # every term overlapped
    totals["floor_serial_s"] = max(totals["memory_s"], totals["compute_s"]) + comm["comm_s"]
    totals["floor_component"] = _floor_component(components, comm, totals["bound"])
    totals["layers_run"] = acc.layers_run
    totals["rows_per_device"] = rows
    totals["rows_per_s_at_floor"] = rows / totals["floor_s"]
    totals["arithmetic_intensity"] = totals["flops"] / totals["bytes"]
    # the FLOP rate a kernel would need to hit the memory floor, and the bandwidth to hit the compute floor
    totals["flops_at_uniform_peak_s"] = totals["flops"] / (
        ceilings[uniform_mma(weight_dtype) + "_flops"])

    # ---- memory per device
    kv_np_dtype, packed = memory_estimate_args(kv_dtype)
    max_len = step.ctx + step.T
    m = memory_estimate(cfg, max_len, kv_np_dtype, packed=packed)
    cache = m["bytes_per_sequence_at_max_len"] * step.seq_dev
    # draft-stage weights are resident when the step verifies drafts (or the drafter is costed)
    draft_w = acc.resident.get("drafter", 0.0)
    with_draft = bool(drafter) or (phase == "decode" and new_tokens > 1)
    weights = sum(v for k, v in acc.resident.items() if with_draft or k != "drafter")
    memory = {
        "weights_bytes": weights,
        "weights_by_component": dict(acc.resident),
        "draft_weights_bytes": draft_w,
        "draft_weights_included": with_draft,
        "cache_bytes": cache,
        "cache_bytes_per_sequence": m["bytes_per_sequence_at_max_len"],
        "cache_max_len": max_len,
        "total_bytes": weights + cache,
        "capacity_bytes": ceilings["hbm_capacity_bytes"],
        "fits": weights + cache <= ceilings["hbm_capacity_bytes"],
    }
    params = {
        "total": sum(acc.params.values()),
        "backbone": sum(v for k, v in acc.params.items() if k != "drafter"),
        "by_component": dict(acc.params),
        "active_per_token": acc.active,  # backbone, head included, embedding excluded
    }
    if cfg.generation == "v41" and phase == "prefill" and cfg.candidate_source_layer_id >= 0:
        notes.append("decoder-side bounded replay (docs/model.md §15.1) not modelled: every layer runs on all rows")
    if cfg.engram_layer_ids and cfg.engram_placement == "device":
        notes.append("Engram tables counted in HBM, column-sharded over all dp*ep*tp devices")
    # data-parallel attention: every device of a tp group holds and reads the same non-expert weights
    dense_read = totals["weight_bytes"] - components.get("moe_experts", {}).get("weight_bytes", 0.0)
    replication = {
        "dense_weight_bytes_per_device": dense_read,
        "replicas": dp * ep,
        "share_of_step_bytes": dense_read / totals["bytes"] if totals["bytes"] else 0.0,
        "expert_replicas": dp,
    }
    return {
        "config": cfg.name, "generation": cfg.generation, "layers": cfg.num_layers, "phase": phase,
        "batch": batch, "context": context, "new_tokens": new_tokens, "weight_dtype": weight_dtype,
        "kv_dtype": kv_dtype, "mesh": {"dp": dp, "ep": ep, "tp": tp}, "forced_balance": bool(forced_balance),
        "drafter": bool(drafter), "transport": transport, "dispatch_dtype": dispatch_dtype,
        "redundant_experts": int(redundant_experts), "ceilings": ceilings, "kv_entry_bytes": step.kv,
        "components": components, "totals": totals, "communication": comm, "overlap": OVERLAP_RULES,
        "placement": {str(E): p for E, p in acc.placements.items()}, "replication": replication,
        "memory": memory, "params": params, "notes": notes,
    }


OVERLAP_RULES = {
    "memory/compute": "overlap (max): a kernel streams its operands while it multiplies",
    "communication": "overlappable (max in floor_s) when another micro-batch computes while one's rows travel "
                     "(two-batch overlap); serial (added, floor_serial_s) when each layer waits for its exchange",
    "estimate": "serial: this engine runs its collectives between kernels, so estimate = sum of the terms",
}


def _floor_component(components: dict, comm: dict, bound: str) -> str:
    """The component that contributes most to the binding term (communication: the largest exchange)."""
    if bound == "communication":
        return max(comm["parts"], key=comm["parts"].get)
    key = "memory_s" if bound == "memory" else "compute_s"
    return max(components, key=lambda n: components[n][key])


# ----------------------------------------------------------------------------------------------- record

def with_estimate(res: dict) -> dict:
    """`res` with its calibrated estimate (experiments/roofline_estimate.py) and the record's headline figures
    `floor_ms` / `estimate_ms` (None, with a note, where no record calibrates the step's phase and format)."""
    from experiments import roofline_estimate

    fmt = WEIGHT_FORMATS[res["weight_dtype"]][1]
    try:
        cal = roofline_estimate.calibrate(res["phase"], fmt)
        est = roofline_estimate.estimate(res, cal)
    except ValueError as e:
        res["notes"].append(f"no estimate: {e}")
        est = None
    else:
        est["calibration"] = {k: cal[k] for k in ("groups", "comm", "foreign_byte_equivalent", "gap_per_layer_s")}
        est["calibration"]["records"] = [f"{r['record']}#{r['index']}" for r in cal["records"] + cal["mesh_records"]]
    res["estimate"] = est
    res["floor_ms"] = res["totals"]["floor_s"] * 1e3
    res["estimate_ms"] = est["estimate_s"] * 1e3 if est else None
    return res


def _git_revision() -> str | None:
    from experiments.bench_report import revision

    return revision()[0]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v4-flash", help="ModelConfig preset (default v4-flash)")
    p.add_argument("--config", help="a config.json instead of a preset")
    p.add_argument("--layers", type=int, help="scale to N backbone layers keeping the layer pattern")
    p.add_argument("--phase", choices=PHASES, default="decode")
    p.add_argument("--batch", type=int, default=1, help="sequences (global; per device = batch / (dp*ep))")
    p.add_argument("--context", type=int, default=0, help="cached positions per sequence before the step")
    p.add_argument("--new-tokens", type=int, default=4096, help="prefill: new rows per sequence (default 4096)")
    p.add_argument("--num-draft", type=int, default=0, help="decode: draft rows verified per sequence")
    p.add_argument("--weights", choices=WEIGHT_DTYPES, default="bf16")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16")
    p.add_argument("--mesh", default="1,1,1", help="dp,ep,tp (default 1,1,1)")
    p.add_argument("--forced-balance", action="store_true", help="routing forced to perfect balance (DeepInfer "
                   "benchmark mode); default uniform random routing")
    p.add_argument("--drafter", action="store_true", help="add the drafter's cost to a decode step")
    p.add_argument("--accepted", type=float, help="accepted tokens per decode step for tokens/s (default 3.25 "
                   "with 3 drafts, else 1 + num_draft)")
    p.add_argument("--hardware", choices=tuple(PROFILES), default="h200",
                   help="hardware profile (experiments/hardware.py; default the H200 as measured here)")
    p.add_argument("--transport", choices=roofline_mesh.TRANSPORTS, default="all_to_all",
                   help="how routed rows move between devices (experiments/roofline_mesh.py; default all_to_all)")
    p.add_argument("--dispatch-dtype", choices=tuple(roofline_mesh.DISPATCH_DTYPES), default="fp8",
                   help="all_to_all: dtype of the dispatched rows (default fp8 with 128-value scales)")
    p.add_argument("--redundant-experts", type=int, default=0, metavar="N",
                   help="extra expert slots per MoE layer (replicas of the most loaded experts)")
    p.add_argument("--hbm-tbps", type=float)
    p.add_argument("--bf16-tflops", type=float)
    p.add_argument("--fp8-tflops", type=float)
    p.add_argument("--fp4-tflops", type=float)
    p.add_argument("--json", help="write the record to this file")
    return p.parse_args(argv)


def roofline_of_args(args: argparse.Namespace) -> dict:
    """The roofline of parsed command-line arguments (parse_args)."""
    from model import ModelConfig

    cfg = ModelConfig.from_hf(args.config) if args.config else ModelConfig.preset(args.preset)
    if args.layers:
        cfg = scale_layers(cfg, args.layers)
    ceil = profile(args.hardware)
    for key, val in (("hbm_Bps", args.hbm_tbps), ("bf16_flops", args.bf16_tflops), ("fp8_flops", args.fp8_tflops),
                     ("fp4_flops", args.fp4_tflops)):
        if val:
            ceil[key] = val * 1e12
            ceil["sources"][key] = "overridden on the command line"
            ceil["name"] += f" ({key} overridden)"
    try:
        mesh = tuple(int(x) for x in args.mesh.split(","))
        assert len(mesh) == 3
    except (ValueError, AssertionError):
        raise SystemExit(f"--mesh must be dp,ep,tp, got {args.mesh!r}")
    new = args.new_tokens if args.phase == "prefill" else 1 + args.num_draft
    return roofline(cfg, args.phase, args.batch, args.context, new, args.weights, args.kv_dtype, mesh,
                    args.forced_balance, ceil, drafter=args.drafter, transport=args.transport,
                    dispatch_dtype=args.dispatch_dtype, redundant_experts=args.redundant_experts)


def main(argv=None) -> dict:
    from experiments.roofline_report import markdown

    args = parse_args(argv)
    res = with_estimate(roofline_of_args(args))
    res["command"] = "python -m experiments.roofline " + " ".join(sys.argv[1:] if argv is None else argv)
    res["revision"] = _git_revision()
    print(markdown(res, args.accepted))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
