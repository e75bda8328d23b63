"""Model configuration: `ModelConfig` (frozen, hashable, static under jit) and per-layer `LayerSpec`.

A layer's code path is chosen at trace time from its `LayerSpec`, never from traced values.
Readers accept both config.json styles of DeepSeek-V4-Flash:

* the official release (`compress_ratios` per layer incl. MTP slots, `num_hash_layers`,
  `rope_scaling`, `qk_rope_head_dim`, ...), and
* the HF transformers style (`layer_types`, `compress_rates`, `mlp_layer_types`,
  `rope_parameters` keyed `main` / `compress`, `partial_rotary_factor`, ...).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ATTENTION_KINDS = ("swa", "csa", "hca")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
HF_LAYER_TYPES = {
    "sliding_attention": "swa",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
HF_MLP_LAYER_TYPES = ("hash_moe", "moe")
SUPPORTED_MODEL_TYPES = ("deepseek_v4", "deepseek_v41", "deepseek_v41_text")
GENERATIONS = ("v4", "v41")
IMPLS = ("reference", "pallas")
# the window attention's kernel (pallas_kernels.attention.sparse_attention's impl): "pallas" = the faster of
# "triton" and "mgpu" (attention_mgpu: 64 x 512, bf16, Hopper) per call; the indexer's top-k kernel with any of them
ATTENTION_IMPLS = IMPLS + ("triton", "mgpu")
EXPERT_WEIGHTS = ("dense", "fp4")
DENSE_WEIGHTS = ("model", "fp8")
HEAD_DTYPES = ("float32", "bfloat16")
INDEX_KEY_FORMATS = ("model", "fp4")
# [V4.1] Engram tables: where they live, how they are held, how a split table's rows travel (model/engram.py)
ENGRAM_PLACEMENTS = ("device", "sharded", "host")
ENGRAM_TABLES = ("model", "fp8")
ENGRAM_EXCHANGES = ("all_to_all", "all_gather")
# config.json fields this architecture fixes: the readers raise on any other value instead of ignoring it
FIXED_FIELDS = {"tie_word_embeddings": (False,), "attention_bias": (False,), "mlp_bias": (False,),
                "hidden_act": ("silu",), "topk_method": ("noaux_tc",)}
FIXED_FIELDS_WHY = {"tie_word_embeddings": "a separate LM head, head.weight",
                    "attention_bias": "no bias in any attention projection",
                    "mlp_bias": "no bias in any expert projection",
                    "hidden_act": "clamped SwiGLU experts",
                    "topk_method": "the router's bias chooses experts only, the weights come from the scores"}


@dataclass(frozen=True)
class Yarn:
    """YaRN frequency interpolation (no magnitude scaling), used only on compressed layers."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class LayerSpec:
    """Static description of one block (backbone layer or MTP / DSpark slot).

    attention: [V4] "swa" (window only), "csa" (ratio-4 overlapping compressor + own lightning indexer
      top-k) or "hca" (own non-overlapping compressor, all entries attended); [V4.1] "swa", "full"
      (owns the compressor and the indexer; publishes global KV, index keys and top-k), "reindex" (own
      indexer over the latest source's keys) or "reuse" (reads the latest global KV and top-k).
    kv_source / topk_source: layer whose global KV / top-k this layer reads (itself when it owns them).
    """

    index: int
    attention: str
    compress_ratio: int
    overlap: bool
    indexer: bool
    hash_routed: bool
    rope_theta: float
    yarn: Yarn | None
    mtp: bool = False
    kv_source: int | None = None
    topk_source: int | None = None
    candidate_source: bool = False
    uses_candidates: bool = False
    engram: bool = False
    n_experts: int = 0
    n_experts_per_tok: int = 0

    @property
    def owns_kv(self) -> bool:
        return self.compress_ratio > 0 and self.kv_source == self.index


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    # One entry per backbone layer followed by one per MTP slot: 0 = SWA only, r = r-to-1 compression.
    compress_ratios: tuple[int, ...]
    rope_theta: float
    compress_rope_theta: float
    yarn: Yarn | None
    max_position_embeddings: int
    rms_norm_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    num_mtp_layers: int = 1
    csa_ratio: int = 4  # the ratio whose layers get the overlapping compressor and the indexer
    bos_token_id: int = 0
    eos_token_id: int = 1
    generation: str = "v4"
    # [V4.1] CSA2 roles (docs/model.md §0.2, §0.3), Engram, DSpark, router temperature.
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    engram_num_embeddings: tuple[int, ...] = ()
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_n_experts_per_tok: int = 0
    gate_temp: float = 1.0
    # [V4.1] Engram tables (ENGRAM_PLACEMENTS): "device" (a copy in every device's memory), "sharded" (rows split over
    # every device of the mesh, dp x ep x tp) or "host" (host memory, split alike over the devices' host memory on a
    # mesh; rows gathered on the host). engram_tables: held in the model dtype ("model") or as the release ships them
    # ("fp8": E4M3 rows + one UE8M0 byte per 32 values, dequantised per gathered row). engram_exchange: how a split
    # table's rows reach the tokens' devices (sharding.row_lookup: "all_to_all" of the requested ids and of the rows,
    # or "all_gather" of the ids and a reduce-scatter of the masked local rows).
    engram_placement: str = "device"
    engram_tables: str = "model"
    engram_exchange: str = "all_to_all"
    # Fake-quant steps of the official model (FP8 window KV, FP4 compressed KV / indexer q,k, and act_quant of
    # the inputs of its FP8 / FP4 GEMMs: the release's FP8 linears but wo_a, the routed experts): on for
    # fidelity to the trained model, off for exactness tests.
    quant_sim: bool = False
    # Implementations of the hot paths (pallas_kernels): "reference" (pure jnp, every backend) or "pallas";
    # attention also "triton" / "mgpu" to force one kernel (ATTENTION_IMPLS). Under batch_invariant, "pallas" and
    # "triton" run the Triton attention kernel's invariant launch and the indexer's scores on their kernel, each at
    # one fixed tiling; "mgpu" is refused there.
    attention_impl: str = "reference"
    moe_impl: str = "reference"
    # The release's FP8 projections (dense_weights="fp8"): "reference" dequantises each weight in-graph before an XLA
    # matmul; "pallas" runs pallas_kernels.fp8_linear's auto choice (on a GPU: the largest weights at decode / verify
    # loads multiplied from the stored bytes, dequantised in registers; the rest dequantised for XLA's GEMM; FP8 x
    # FP8 with act_quant'd inputs under quant_sim); shapes that are not whole scale blocks keep the reference path.
    dense_impl: str = "reference"
    # The hyper-connections (docs/model.md §2): "reference" (jnp: coefficients, Sinkhorn rounds, collapse and expand
    # as XLA ops) or "pallas" (pallas_kernels.mhc: two fused kernels per sublayer; hc_mult a power of two and
    # hidden_size a multiple of 16).
    mhc_impl: str = "reference"
    # How the routed experts' weights are held in memory: "dense" (the model dtype) or "fp4" (packed E2M1 +
    # UE8M0 per 32 values, as the official checkpoints ship them; dequantised inside the Pallas kernel, or
    # in-graph by the reference path).
    expert_weights: str = "dense"
    # How the tensors the release stores FP8 (quant_io.release_fp8: attention projections, indexer wq_b,
    # shared expert, Engram wkv, MTP / DSpark projections) are held: "model" (the model dtype) or "fp8" (E4M3 +
    # one UE8M0 byte per fp8_block x fp8_block block, as shipped; dequantised in-graph before each matmul).
    # Any width works: the scale grid is ceil(out/B) x ceil(in/B), edge blocks partial.
    dense_weights: str = "model"
    # The LM head GEMM's inputs: "float32" (the official model's fp32 linear; a bf16 hidden state and bf16 head
    # weight multiply as they are, their products exact in the float32 accumulator: layers.float32_linear) or
    # "bfloat16" (the hidden state rounded to bf16 first, f32 accumulation: the HF port's choice; the same numbers
    # in a bf16 model). Logits are float32 either way.
    head_dtype: str = "float32"
    # How the indexer's keys are cached: "model" (the cache dtype) or "fp4" (MXFP4 rows as the release stores
    # them: DI/2 packed E2M1 bytes + one UE8M0 byte per 32, 68 B at DI = 128; quantised on write, read by the
    # fused indexer kernel as stored). With quant_sim the keys are FP4 values already: the same numbers.
    index_key_format: str = "model"
    # How the backbone layers are held and run: True stacks consecutive layers of the same structure and runs each
    # such group as one scanned body (model/groups.py; the compiled step holds one body per distinct group,
    # whatever the depth); False (the default) holds and runs every layer on its own (the unrolled definition).
    # The same numbers either way (up to float rounding of the fused scan body); safetensors checkpoints load
    # into and save from both; combinations the stacked layout does not support raise.
    scan_layers: bool = False
    # Batch-invariant numerics (docs/batch_invariance.md): every reduction in an order fixed by the weight shapes
    # and the sequence's own rows, never by the batch's size or composition, so a sequence's logits are bitwise
    # the same alone, at any row of any batch, under any chunking of its prefill and on any (dp, ep) mesh (the
    # reference paths; pallas_kernels/invariant.py).
    batch_invariant: bool = False
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for f in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                  "engram_num_embeddings", "dspark_target_layer_ids"):
            object.__setattr__(self, f, tuple(int(r) for r in getattr(self, f)))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid ModelConfig ({self.name}): {msg}")

        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank",
                  "o_groups", "o_lora_rank", "sliding_window", "n_routed_experts", "n_experts_per_tok",
                  "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "index_n_heads",
                  "index_head_dim", "index_topk", "max_position_embeddings"):
            need(int(getattr(self, f)) > 0, f"{f} must be positive, got {getattr(self, f)}")
        need(self.generation in GENERATIONS, f"generation {self.generation!r} not in {GENERATIONS}")
        need(self.rope_head_dim % 2 == 0, f"rope_head_dim must be even, got {self.rope_head_dim}")
        need(0 < self.rope_head_dim <= self.head_dim,
             f"rope_head_dim {self.rope_head_dim} must be in (0, head_dim={self.head_dim}]")
        need(self.rope_head_dim <= self.index_head_dim,
             f"rope_head_dim {self.rope_head_dim} exceeds index_head_dim {self.index_head_dim}")
        need(self.num_heads % self.o_groups == 0,
             f"num_heads {self.num_heads} is not divisible by o_groups {self.o_groups}")
        need(self.n_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok {self.n_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        need(self.n_shared_experts == 1, f"n_shared_experts must be 1, got {self.n_shared_experts}")
        need(self.scoring_func in SCORING_FUNCS,
             f"scoring_func {self.scoring_func!r} not in {SCORING_FUNCS}")
        need(0 <= self.num_hash_layers <= self.num_layers,
             f"num_hash_layers {self.num_hash_layers} not in [0, num_layers={self.num_layers}]")
        need(self.num_mtp_layers >= 0, "num_mtp_layers must be >= 0")
        need(len(self.compress_ratios) == self.num_layers + self.num_mtp_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries, expected num_layers + "
             f"num_mtp_layers = {self.num_layers + self.num_mtp_layers}")
        for i, r in enumerate(self.compress_ratios):
            need(r >= 0, f"compress_ratios[{i}] = {r} is negative")
        for i in range(self.num_layers, len(self.compress_ratios)):
            need(self.compress_ratios[i] == 0, f"MTP slot {i} must be SWA only (ratio 0)")
        need(self.csa_ratio > 0, "csa_ratio must be positive")
        if self.generation == "v41":
            self._validate_v41(need)
        need(self.engram_placement in ENGRAM_PLACEMENTS,
             f"engram_placement must be one of {ENGRAM_PLACEMENTS}, got {self.engram_placement!r}")
        for f, allowed in (("attention_impl", ATTENTION_IMPLS), ("moe_impl", IMPLS), ("dense_impl", IMPLS),
                           ("mhc_impl", IMPLS)):
            need(getattr(self, f) in allowed, f"{f} must be one of {allowed}, got {getattr(self, f)!r}")
        if self.mhc_impl == "pallas":
            n = self.hc_mult
            need(n & (n - 1) == 0 and self.hidden_size % 16 == 0,
                 f"mhc_impl='pallas' needs hc_mult a power of two and hidden_size a multiple of 16 (got {n}, "
                 f"{self.hidden_size}): use 'reference'")
        need(self.dense_impl == "reference" or self.dense_weights == "fp8",
             "dense_impl='pallas' multiplies FP8-held projections: it needs dense_weights='fp8' (bf16 projections run "
             "on XLA's GEMMs)")
        if self.attention_impl == "mgpu":
            need((self.num_heads, self.head_dim) == (64, 512),
                 f"attention_impl='mgpu' needs 64 heads x 512 (got {self.num_heads} x {self.head_dim}): use 'pallas'")
        need(self.expert_weights in EXPERT_WEIGHTS,
             f"expert_weights must be one of {EXPERT_WEIGHTS}, got {self.expert_weights!r}")
        if self.expert_weights == "fp4":
            widths = {"hidden_size": self.hidden_size, "moe_intermediate_size": self.moe_intermediate_size}
            for n, v in widths.items():
                need(v % 32 == 0, f"expert_weights='fp4' needs {n} ({v}) to be a multiple of 32 (one scale "
                                  "per 32 values)")
        if self.quant_sim:  # act_quant rounds the official FP8 / FP4 GEMMs' inputs in whole blocks
            widths = {"hidden_size": self.hidden_size, "q_lora_rank": self.q_lora_rank,
                      "o_groups * o_lora_rank": self.o_groups * self.o_lora_rank,
                      "moe_intermediate_size": self.moe_intermediate_size}
            for n, v in widths.items():
                need(v % self.fp8_block == 0, f"quant_sim needs {n} ({v}) to be a multiple of the act_quant block "
                                              f"{self.fp8_block}")
        need(self.dense_weights in DENSE_WEIGHTS,
             f"dense_weights must be one of {DENSE_WEIGHTS}, got {self.dense_weights!r}")
        need(isinstance(self.scan_layers, bool), f"scan_layers must be True or False, got {self.scan_layers!r}")
        need(self.head_dtype in HEAD_DTYPES, f"head_dtype must be one of {HEAD_DTYPES}, got {self.head_dtype!r}")
        need(self.index_key_format in INDEX_KEY_FORMATS,
             f"index_key_format must be one of {INDEX_KEY_FORMATS}, got {self.index_key_format!r}")
        if self.index_key_format == "fp4":
            di = self.index_head_dim
            need(di >= 32 and di & (di - 1) == 0,
                 f"index_key_format='fp4' needs index_head_dim a power of two >= 32 (one scale per 32), got {di}")
        need(isinstance(self.batch_invariant, bool),
             f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if self.batch_invariant:
            need(self.attention_impl != "mgpu",
                 "batch_invariant=True runs the reference paths, whose reductions it fixes, and the MoE, FP8 linear, "
                 "mHC and attention kernels on fixed tilings; the Mosaic GPU attention kernel has no invariant "
                 "launch: got attention_impl='mgpu' (use 'pallas' or 'triton': the Triton kernel's invariant "
                 "launch; or 'reference')")
            need(not (self.dense_impl == "pallas" and self.quant_sim),
                 "batch_invariant=True with dense_impl='pallas' and quant_sim=True is not supported (the FP8 x FP8 "
                 "linears change their MMA with the row count): use dense_impl='reference' or quant_sim=False")
        if self.scan_layers:   # combinations the stacked layout has not been checked against: raise, never guess
            need(not self.batch_invariant, "scan_layers=True with batch_invariant=True is not supported (the "
                                           "invariance checks cover the unrolled layers): set one of them False")
            need(not (self.engram_layer_ids and self.engram_placement != "device"),
                 f"scan_layers=True with engram_placement={self.engram_placement!r} is not supported (split Engram "
                 "tables are checked on the unrolled layers): use engram_placement='device' or scan_layers=False")
        if self.yarn is not None:
            need(self.yarn.factor >= 1.0, f"yarn factor {self.yarn.factor} must be >= 1")

    def _validate_v41(self, need) -> None:
        n = self.num_layers
        need(self.num_hash_layers == 0, "V4.1 has no hash-routed layers (num_hash_layers must be 0)")
        srcs, idx = self.kv_source_layer_ids, self.index_source_layer_ids
        for name, ids in (("kv_source_layer_ids", srcs), ("index_source_layer_ids", idx),
                          ("engram_layer_ids", self.engram_layer_ids)):
            need(all(0 <= i < n for i in ids), f"{name} {list(ids)} must be backbone layers [0, {n})")
            need(list(ids) == sorted(set(ids)), f"{name} {list(ids)} must be strictly increasing")
        for i in srcs:
            need(self.compress_ratios[i] > 0, f"KV source layer {i} has compress ratio 0")
            need(i in idx, f"KV source layer {i} must also be an index source (it owns the index keys)")
        for i in range(n):
            r = self.compress_ratios[i]
            if r == 0:
                need(i not in idx, f"index source layer {i} has compress ratio 0")
                continue
            src = [s for s in srcs if s <= i]
            need(bool(src), f"layer {i} (ratio {r}) has no KV source at or before it in {list(srcs)}")
            need(self.compress_ratios[src[-1]] == r,
                 f"layer {i} has ratio {r} but its KV source {src[-1]} has ratio {self.compress_ratios[src[-1]]}")
            need(any(s <= i for s in idx), f"layer {i} (ratio {r}) has no index source at or before it")
        c = self.candidate_source_layer_id
        if c >= 0:
            need(c in srcs, f"candidate_source_layer_id {c} must be a KV source layer")
            need(self.candidate_topk_blocks > 0 and self.candidate_block_size > 0,
                 "candidate_topk_blocks and candidate_block_size must be positive with a candidate source")
        if self.engram_layer_ids and srcs:
            late = [i for i in self.engram_layer_ids if i > max(srcs)]
            need(not late, f"Engram layers {late} lie after the last KV source (layer {max(srcs)}): decoder-side "
                           f"bounded replay runs layers from {max(srcs) + 1} on only a tail of the rows, and an Engram "
                           "layer needs the hash ids of every row; Engram layers must be at or before the last KV "
                           "source")
        for f, allowed in (("engram_tables", ENGRAM_TABLES), ("engram_exchange", ENGRAM_EXCHANGES)):
            need(getattr(self, f) in allowed, f"{f} must be one of {allowed}, got {getattr(self, f)!r}")
        if self.engram_layer_ids:
            for f in ("engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
                      "engram_compressed_vocab_size"):
                need(getattr(self, f) > 0, f"{f} must be positive with Engram layers")
            need(len(self.engram_num_embeddings) in (0, len(self.engram_layer_ids)),
                 "engram_num_embeddings must list one table size per Engram layer")
            need(self.engram_tables == "model" or self.engram_head_dim % 32 == 0,
                 f"engram_tables='fp8' needs engram_head_dim ({self.engram_head_dim}) to be a multiple of 32 (one "
                 "scale per 32 values of a row)")
        if self.num_mtp_layers:
            need(self.dspark_block_size > 0, "V4.1 draft stages need dspark_block_size > 0")
            need(len(self.dspark_target_layer_ids) > 0 and all(0 <= i < n for i in self.dspark_target_layer_ids),
                 f"dspark_target_layer_ids {list(self.dspark_target_layer_ids)} must be backbone layers")

    # ------------------------------------------------------------------ derived
    @property
    def num_blocks(self) -> int:
        """Backbone layers plus MTP slots."""
        return self.num_layers + self.num_mtp_layers

    @property
    def fp8_block(self) -> int:
        """Edge B of the square FP8 weight-scale blocks: 128 (V4) or 32 (V4.1) (docs/model.md §14)."""
        return 128 if self.generation == "v4" else 32

    @property
    def act_quant_block(self) -> int:
        """Block of the act_quant rounding of FP8 / FP4 GEMM inputs under quant_sim (fp8_block), else 0."""
        return self.fp8_block if self.quant_sim else 0

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def layer_spec(self, index: int) -> LayerSpec:
        if not 0 <= index < self.num_blocks:
            raise ValueError(f"layer index {index} out of range [0, {self.num_blocks})")
        ratio = self.compress_ratios[index]
        mtp = index >= self.num_layers
        common = dict(index=index, compress_ratio=ratio, mtp=mtp,
                      rope_theta=self.compress_rope_theta if ratio > 0 else self.rope_theta,
                      yarn=self.yarn if ratio > 0 else None,
                      hash_routed=(not mtp) and index < self.num_hash_layers,
                      n_experts=self.dspark_n_routed_experts if mtp and self.dspark_n_routed_experts
                      else self.n_routed_experts,
                      n_experts_per_tok=self.dspark_n_experts_per_tok if mtp and self.dspark_n_experts_per_tok
                      else self.n_experts_per_tok)
        if self.generation == "v4":
            kind = "swa" if ratio == 0 else ("csa" if ratio == self.csa_ratio else "hca")
            own = index if ratio > 0 else None
            return LayerSpec(attention=kind, overlap=kind == "csa", indexer=kind == "csa", kv_source=own,
                             topk_source=index if kind == "csa" else None, **common)
        # V4.1, the generic rule of docs/model.md §0.3
        if ratio == 0 or mtp:
            return LayerSpec(attention="swa", overlap=False, indexer=False, engram=index in self.engram_layer_ids,
                             **common)
        kv_src = max(s for s in self.kv_source_layer_ids if s <= index)
        topk_src = max(s for s in self.index_source_layer_ids if s <= index)
        if index == kv_src:
            kind = "full"
        elif index == topk_src:
            kind = "reindex"
        else:
            kind = "reuse"
        c = self.candidate_source_layer_id
        return LayerSpec(attention=kind, overlap=False, indexer=kind in ("full", "reindex"), kv_source=kv_src,
                         topk_source=topk_src, candidate_source=index == c,
                         uses_candidates=kind == "reindex" and 0 <= c < index,
                         engram=index in self.engram_layer_ids, **common)

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        return tuple(self.layer_spec(i) for i in range(self.num_layers))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A table of layer -> attention mode, ratio, KV source, top-k source, routing, extras."""
        rows = [f"{'layer':>5} {'mode':>7} {'ratio':>5} {'kv from':>7} {'topk from':>9} {'router':>6} "
                f"{'rope':>7} extras"]
        for i in range(self.num_blocks):
            s = self.layer_spec(i)
            name = f"mtp.{i - self.num_layers}" if s.mtp else str(i)
            extras = [e for e, on in (("yarn", s.yarn is not None), ("engram", s.engram),
                                      ("candidate-source", s.candidate_source),
                                      ("uses-candidates", s.uses_candidates)) if on]
            dash = lambda v: "-" if v is None else str(v)  # noqa: E731
            rows.append(f"{name:>5} {s.attention:>7} {s.compress_ratio:>5} {dash(s.kv_source):>7} "
                        f"{dash(s.topk_source):>9} {'hash' if s.hash_routed else 'score':>6} "
                        f"{s.rope_theta:>7g} {' '.join(extras)}")
        return "\n".join(rows)

    def to_official_dict(self) -> dict:
        """The official-release style config.json of this config (readable by `from_hf`)."""
        d = {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1, "head_dim": self.head_dim, "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window, "compress_ratios": list(self.compress_ratios),
            "compress_rate_csa": self.csa_ratio, "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.n_experts_per_tok, "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size, "num_hash_layers": self.num_hash_layers,
            "routed_scaling_factor": self.routed_scaling_factor, "swiglu_limit": self.swiglu_limit,
            "scoring_func": self.scoring_func, "norm_topk_prob": self.norm_topk_prob,
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "num_nextn_predict_layers": self.num_mtp_layers, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id, "hidden_act": "silu", "tie_word_embeddings": False,
        }
        if self.yarn is not None:
            d["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.yarn)}
        if self.generation == "v41":
            d.update(architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41", gate_temp=self.gate_temp)
            del d["num_hash_layers"]
            for f in dataclasses.fields(self):
                if (f.name.startswith(("kv_source", "index_source", "candidate_", "engram_", "dspark_"))
                        and f.name not in ("engram_placement", "engram_tables", "engram_exchange")):
                    v = getattr(self, f.name)
                    d[f.name] = list(v) if isinstance(v, tuple) else v
            d["dspark_num_experts_per_tok"] = d.pop("dspark_n_experts_per_tok")
        return d

    def to_hf_dict(self) -> dict:
        """[V4] The HF-transformers style config (`DeepseekV4Config(**d)`, also readable by `from_hf`):
        per-layer `layer_types` with one `compress_rates` entry per type, `mlp_layer_types`,
        `partial_rotary_factor` and `rope_parameters` {main, compress}."""
        if self.generation != "v4":
            raise ValueError(f"{self.name}: HF transformers implements V4 only (DeepseekV4ForCausalLM)")
        types, rates = [], {}
        for i, r in enumerate(self.compress_ratios[:self.num_layers]):
            t = ("sliding_attention" if r == 0 else
                 "compressed_sparse_attention" if r == self.csa_ratio else "heavily_compressed_attention")
            if rates.setdefault(t, r) != r:
                raise ValueError(f"{self.name}: layer {i} has ratio {r} but another {t} layer has {rates[t]}; "
                                 "the HF config holds one rate per layer type")
            types.append(t)
        rates.pop("sliding_attention", None)
        d = self.to_official_dict()
        for k in ("compress_ratios", "compress_rate_csa", "num_hash_layers", "qk_rope_head_dim", "rope_scaling"):
            d.pop(k, None)
        compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta}
        if self.yarn is not None:
            compress = {"rope_type": "yarn", "rope_theta": self.compress_rope_theta,
                        **dataclasses.asdict(self.yarn), "attention_factor": 1.0}  # no YaRN logit scaling
        rot = self.rope_head_dim / self.head_dim
        d.update(layer_types=types, compress_rates=rates,
                 mlp_layer_types=["hash_moe"] * self.num_hash_layers + ["moe"] * (self.num_layers - self.num_hash_layers),
                 partial_rotary_factor=rot,
                 rope_parameters={"main": {"rope_type": "default", "rope_theta": self.rope_theta,
                                           "partial_rotary_factor": rot},
                                  "compress": {**compress, "partial_rotary_factor": rot}})
        return d

    # ------------------------------------------------------------------ presets
    @staticmethod
    def preset(name: str) -> "ModelConfig":
        """A named configuration (model/presets.py): tiny-v4, tiny-v41 (CPU tests), v4-flash, v41-flash, v4-flash-4l."""
        from .presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        return PRESETS[name]()

    # ------------------------------------------------------------------ readers
    @staticmethod
    def from_hf(path_or_dict: str | Path | dict) -> "ModelConfig":
        """Read an official or HF-transformers-style config.json (a path, a directory or a dict)."""
        if isinstance(path_or_dict, dict):
            raw, where = path_or_dict, "<dict>"
        else:
            p = Path(path_or_dict)
            if p.is_dir():
                p = p / "config.json"
            if not p.is_file():
                raise FileNotFoundError(f"config.json not found: {p}")
            try:
                raw = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}: not valid JSON ({e})") from e
            where = str(p)
        return _config_from_dict(raw, where)


def _config_from_dict(raw: dict, where: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; expected one of "
                         f"{SUPPORTED_MODEL_TYPES}")
    generation = "v4" if model_type == "deepseek_v4" else "v41"
    if isinstance(raw.get("text_config"), dict):  # V4.1 release: text fields nested, quantization at top
        raw = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"]}

    def get(*keys: str, default: Any = KeyError) -> Any:
        for k in keys:
            if k in raw and raw[k] is not None:
                return raw[k]
        if default is KeyError:
            raise ValueError(f"{where}: missing config field {keys[0]!r}")
        return default

    num_layers = int(get("num_hidden_layers", "n_layers"))
    head_dim = int(get("head_dim"))
    num_mtp = int(get("num_nextn_predict_layers", "n_mtp_layers", default=1))

    # Per-layer attention kinds / ratios.
    if "layer_types" in raw and raw["layer_types"] is not None:  # HF style
        rates = dict(get("compress_rates", default={}) or {})
        rates.setdefault("compressed_sparse_attention", 4)
        rates.setdefault("heavily_compressed_attention", 128)
        types = list(raw["layer_types"])
        if len(types) < num_layers:
            raise ValueError(f"{where}: layer_types has {len(types)} entries < num_hidden_layers {num_layers}")
        ratios = []
        for i, t in enumerate(types[:num_layers]):
            if t not in HF_LAYER_TYPES:
                raise ValueError(f"{where}: unknown layer type {t!r} at layer {i}; expected one of "
                                 f"{sorted(HF_LAYER_TYPES)}")
            ratios.append(0 if t == "sliding_attention" else int(rates[t]))
        ratios += [0] * num_mtp
        csa_ratio = int(rates["compressed_sparse_attention"])
    else:  # official style
        ratios = [int(r) for r in get("compress_ratios")]
        if len(ratios) < num_layers:
            raise ValueError(f"{where}: compress_ratios has {len(ratios)} entries < num_hidden_layers {num_layers}")
        ratios = ratios[:num_layers] + [0] * num_mtp  # trailing slots are MTP (always SWA)
        csa_ratio = int(get("compress_rate_csa", default=4))

    if raw.get("mlp_layer_types") is not None:
        mlp = list(raw["mlp_layer_types"])[:num_layers]
        for i, t in enumerate(mlp):
            if t not in HF_MLP_LAYER_TYPES:
                raise ValueError(f"{where}: unknown mlp layer type {t!r} at layer {i}")
        n_hash = sum(t == "hash_moe" for t in mlp)
        if mlp[:n_hash] != ["hash_moe"] * n_hash:
            raise ValueError(f"{where}: hash_moe layers must come first, got {mlp}")
    else:
        n_hash = int(get("num_hash_layers", "n_hash_layers", default=0))

    # RoPE: official `rope_scaling` (+ `qk_rope_head_dim`), HF `rope_parameters` {main, compress}.
    rope_theta = float(get("rope_theta", default=10000.0))
    compress_theta = float(get("compress_rope_theta", default=160000.0))
    yarn_raw = None
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        comp = rp["compress"]
        compress_theta = float(comp.get("rope_theta", compress_theta))
        if isinstance(rp.get("main"), dict):
            rope_theta = float(rp["main"].get("rope_theta", rope_theta))
        if comp.get("rope_type", comp.get("type")) == "yarn":
            yarn_raw = comp
    elif isinstance(rp, dict) and rp.get("rope_type", rp.get("type")) == "yarn":
        yarn_raw = rp
    elif isinstance(raw.get("rope_scaling"), dict):
        rs = raw["rope_scaling"]
        if rs.get("type", rs.get("rope_type")) == "yarn":
            yarn_raw = rs
        elif rs.get("type", rs.get("rope_type")) not in (None, "default"):
            raise ValueError(f"{where}: unsupported rope_scaling type {rs.get('type')!r}")
    yarn = None
    if yarn_raw is not None:
        yarn = Yarn(factor=float(yarn_raw["factor"]),
                    original_max_position_embeddings=int(yarn_raw["original_max_position_embeddings"]),
                    beta_fast=float(yarn_raw.get("beta_fast", 32)),
                    beta_slow=float(yarn_raw.get("beta_slow", 1)))

    if raw.get("qk_rope_head_dim") is not None:
        rope_dim = int(raw["qk_rope_head_dim"])
    elif raw.get("partial_rotary_factor") is not None:
        rope_dim = int(round(head_dim * float(raw["partial_rotary_factor"])))
    else:
        rope_dim = head_dim * 64 // 512

    v41 = {}
    if generation == "v41":
        v41 = dict(
            kv_source_layer_ids=tuple(get("kv_source_layer_ids", "kv_source_layers")),
            index_source_layer_ids=tuple(get("index_source_layer_ids", "index_source_layers")),
            candidate_source_layer_id=int(get("candidate_source_layer_id", "candidate_source_layer", default=-1)),
            candidate_topk_blocks=int(get("candidate_topk_blocks", default=0)),
            candidate_block_size=int(get("candidate_block_size", default=0)),
            engram_layer_ids=tuple(get("engram_layer_ids", default=())),
            engram_max_ngram_size=int(get("engram_max_ngram_size", default=0)),
            engram_vocab_size=int(get("engram_vocab_size", default=0)),
            engram_n_heads=int(get("engram_n_heads", default=0)),
            engram_head_dim=int(get("engram_head_dim", default=0)),
            engram_pad_token_id=int(get("engram_pad_token_id", "engram_pad_id", default=2)),
            engram_compressed_vocab_size=int(get("engram_compressed_vocab_size", default=0)),
            engram_num_embeddings=tuple(get("engram_num_embeddings", default=())),
            dspark_block_size=int(get("dspark_block_size", default=0)),
            dspark_noise_token_id=int(get("dspark_noise_token_id", default=0)),
            dspark_target_layer_ids=tuple(get("dspark_target_layer_ids", default=())),
            dspark_markov_rank=int(get("dspark_markov_rank", default=0)),
            dspark_n_routed_experts=int(get("dspark_n_routed_experts", default=0)),
            dspark_n_experts_per_tok=int(get("dspark_num_experts_per_tok", "dspark_n_activated_experts", default=0)),
            gate_temp=float(get("gate_temp", default=1.0)),
        )
        if raw.get("num_hash_layers") or raw.get("n_hash_layers"):
            raise ValueError(f"{where}: V4.1 has no hash-routed layers, but num_hash_layers is set")
        n_hash = 0
    for f, allowed in FIXED_FIELDS.items():
        if raw.get(f) is not None and raw[f] not in allowed:
            raise ValueError(f"{where}: {f}={raw[f]!r} is not supported (this model has {f}={allowed[0]!r}: "
                             f"{FIXED_FIELDS_WHY[f]})")
    if int(get("num_key_value_heads", default=1)) != 1:
        raise ValueError(f"{where}: num_key_value_heads must be 1 (shared-KV MQA)")
    eos = get("eos_token_id", default=1)
    return ModelConfig(
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size", "dim")),
        num_layers=num_layers,
        num_heads=int(get("num_attention_heads", "n_heads")),
        head_dim=head_dim,
        rope_head_dim=rope_dim,
        q_lora_rank=int(get("q_lora_rank")),
        o_groups=int(get("o_groups")),
        o_lora_rank=int(get("o_lora_rank")),
        sliding_window=int(get("sliding_window", "window_size")),
        compress_ratios=tuple(ratios),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        yarn=yarn,
        max_position_embeddings=int(get("max_position_embeddings", default=1 << 20)),
        rms_norm_eps=float(get("rms_norm_eps", "norm_eps", default=1e-6)),
        index_n_heads=int(get("index_n_heads")),
        index_head_dim=int(get("index_head_dim")),
        index_topk=int(get("index_topk")),
        n_routed_experts=int(get("n_routed_experts")),
        n_experts_per_tok=int(get("num_experts_per_tok", "n_activated_experts")),
        moe_intermediate_size=int(get("moe_intermediate_size", "moe_inter_dim")),
        num_hash_layers=n_hash,
        n_shared_experts=int(get("n_shared_experts", default=1)),
        routed_scaling_factor=float(get("routed_scaling_factor", "route_scale", default=1.0)),
        swiglu_limit=float(get("swiglu_limit", default=0.0)),
        scoring_func=str(get("scoring_func", "score_func", default="sqrtsoftplus")),
        norm_topk_prob=bool(get("norm_topk_prob", default=True)),
        hc_mult=int(get("hc_mult", default=4)),
        hc_sinkhorn_iters=int(get("hc_sinkhorn_iters", default=20)),
        hc_eps=float(get("hc_eps", default=1e-6)),
        num_mtp_layers=num_mtp,
        csa_ratio=csa_ratio,
        bos_token_id=int(get("bos_token_id", default=0)),
        eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
        generation=generation,
        name=str(raw.get("_name_or_path") or where),
        **v41,
    )
