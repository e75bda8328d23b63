"""Block and Transformer (docs/model.md §1.1, §2, §10, §11, §12.1, §12.2).

tokens -> ([V4.1] Engram hash ids) -> embed -> n residual streams -> per block:
  ([V4.1] Engram) mHC(attn) collapse -> attn_norm -> Attention -> expand;
  mHC(ffn) collapse -> ffn_norm -> MoE -> expand
-> final collapse ([V4] hc_head; [V4.1] the last block's FFN pre vector) -> norm -> head -> fp32 logits.
[V4] collapses each sublayer with its own pre vector; [V4.1] (single-pass mHC) with the previous
sublayer's. Draft slots: [V4] the MTP-1 block `mtp.0`; [V4.1] three DSpark stages `mtp.0-2`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.common import on_gpu

from . import quant_io
from .attention import Attention, Shared
from .cache import Cache, LayerCache, Step, allocate, allocate_layer, ring_gather, ring_write
from .config import LayerSpec, ModelConfig
from .engram import Engram, EngramHasher, engram_rows
from .groups import layer_groups, replay_cut, shared_roles, weights_key
from .layers import Embedding, Linear, RMSNorm
from .mhc import HyperConnection, HyperHead, collapse, hc_head_collapse, mix_in, mix_out, pre_vector
from .moe import MoE
from .runtime import Runtime
from .stack import Layers, LayerStack, stream_mean

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def _warn_if_interpreted(cfg: ModelConfig) -> None:
    """Kernel paths off a GPU run in Pallas interpret mode: say so (once per trace) rather than run slowly."""
    backend = jax.default_backend()
    if not on_gpu() and (cfg.attention_impl != "reference" or cfg.moe_impl != "reference"):
        warnings.warn(f"{cfg.name}: attention_impl={cfg.attention_impl!r}, moe_impl={cfg.moe_impl!r} on the {backend} "
                      "backend run the Pallas kernels in interpret mode (a correctness path, orders of magnitude "
                      "slower than 'reference')", stacklevel=3)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs, dtype,
                 hasher: EngramHasher | None = None):
        self.hc_attn = HyperConnection(cfg.hc_mult, cfg.hidden_size, rngs=rngs)
        self.hc_ffn = HyperConnection(cfg.hc_mult, cfg.hidden_size, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
        self.attn = Attention(cfg, spec, rngs=rngs, dtype=dtype)
        self.ffn = MoE(cfg, spec, rngs=rngs, dtype=dtype)
        self.engram = (Engram.from_hasher(hasher, spec.index, cfg.hidden_size, cfg.hc_mult, cfg.engram_head_dim,
                                          cfg.rms_norm_eps, rngs=rngs, dtype=dtype, placement=cfg.engram_placement,
                                          tables=cfg.engram_tables)
                       if spec.engram else None)
        self.spec = spec
        self.single_pass = cfg.generation == "v41"
        self.norm_eps, self.hc_eps, self.sinkhorn_iters = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        self.batch_invariant = cfg.batch_invariant
        self.mhc_impl = cfg.mhc_impl
        # the runner of the mHC kernels on a mesh (the runtime's, bound by Transformer._bind; None: the whole batch)
        self.per_shard = None

    def _mix_in(self, hc: HyperConnection, x: jax.Array, carried: jax.Array | None):
        return mix_in(hc, x, carried, impl=self.mhc_impl, norm_eps=self.norm_eps, hc_eps=self.hc_eps,
                      sinkhorn_iters=self.sinkhorn_iters, batch_invariant=self.batch_invariant,
                      per_shard=self.per_shard)

    def _mix_out(self, x: jax.Array, out: jax.Array, coef) -> jax.Array:
        return mix_out(x, out, coef, batch_invariant=self.batch_invariant, per_shard=self.per_shard)

    def sublayers(self, x: jax.Array, pre_prev: jax.Array | None, attend, tokens: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
        """mHC + attention sublayer (`attend`: normed input [B, S, D] -> output) + mHC + MoE sublayer.

        x [B, S, n, D]; `pre_prev` [B, S, n] is the previous sublayer's pre vector (V4.1 single-pass
        mHC collapses with it). -> (x, this block's FFN pre vector)."""
        n = x.shape[-2]
        with jax.named_scope("mhc"):
            h, coef = self._mix_in(self.hc_attn, x, pre_prev if self.single_pass else None)
        with jax.named_scope("attention"):
            a = attend(self.attn_norm(h))
        with jax.named_scope("mhc"):
            x = self._mix_out(x, a, coef)
            h, coef_ffn = self._mix_in(self.hc_ffn, x, pre_vector(coef, n) if self.single_pass else None)
        with jax.named_scope("moe"):
            f = self.ffn(self.ffn_norm(h), tokens)
        with jax.named_scope("mhc"):
            return self._mix_out(x, f, coef_ffn), pre_vector(coef_ffn, n)

    def __call__(self, x: jax.Array, step: Step, tokens: jax.Array, cache: LayerCache, shared: Shared,
                 pre_prev: jax.Array | None) -> tuple[jax.Array, LayerCache, Shared, jax.Array]:
        """x [B, S, n, D] residual streams of the chunk `step` -> (x, layer cache, shared, pre vector)."""
        out = {}

        def attend(h):
            a, out["cache"], out["shared"] = self.attn(h, step, cache, shared)
            return a

        x, pre = self.sublayers(x, pre_prev, attend, tokens)
        return x, out["cache"], out["shared"], pre


class MTPBlock(Block):
    """[V4] MTP-1: input streams W_e RMSNorm(embed(next token)) + W_h RMSNorm(X_i), a full block,
    then its own hc_head and norm before the shared head."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs, dtype):
        super().__init__(cfg, spec, rngs=rngs, dtype=dtype)
        d = cfg.hidden_size
        self.e_proj = Linear(d, d, rngs=rngs, dtype=dtype)
        self.h_proj = Linear(d, d, rngs=rngs, dtype=dtype)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, rngs=rngs)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, rngs=rngs)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, rngs=rngs)
        self.hc_head = HyperHead(cfg.hc_mult, d, rngs=rngs)

    def hidden(self, residual: jax.Array, next_embed: jax.Array, step: Step, next_tokens: jax.Array,
               cache: LayerCache) -> tuple[jax.Array, jax.Array, LayerCache]:
        """residual [B, S, n, D] (backbone streams before hc_head, or this block's own output streams when
        drafting recursively), next_embed [B, S, D] -> (normed hidden [B, S, D], output streams, cache)."""
        e = self.e_proj(self.enorm(next_embed))
        x = self.h_proj(self.hnorm(residual)) + e[:, :, None, :]
        x, cache, _, _ = super().__call__(x.astype(residual.dtype), step, next_tokens, cache, Shared(), None)
        y = hc_head_collapse(self.hc_head.fn[...], self.hc_head.base[...], self.hc_head.scale[...], x,
                             norm_eps=self.norm_eps, hc_eps=self.hc_eps, batch_invariant=self.batch_invariant)
        return self.norm(y), x, cache


class MarkovHead(nnx.Module):
    """[V4.1 DSpark] rank-r bigram logit bias: embed [V, r], head [V, r]."""

    def __init__(self, vocab: int, rank: int, *, rngs: nnx.Rngs, dtype):
        self.embed = Embedding(vocab, rank, rngs=rngs, dtype=dtype)
        self.head = Linear(rank, vocab, rngs=rngs, dtype=dtype, fp32=True)


class ConfidenceHead(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs, dtype):
        self.proj = Linear(dim, 1, rngs=rngs, dtype=dtype, fp32=True)


class DSparkBlock(Block):
    """[V4.1] a DSpark draft stage (`mtp.{s}`): a full SWA block; stage 0 also projects the target hidden
    rows (`main_proj`, `main_norm`), the last stage carries `norm`, the Markov and confidence heads.
    (Drafting itself comes with speculative decoding.)"""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, stage: int, *, rngs: nnx.Rngs, dtype):
        super().__init__(cfg, spec, rngs=rngs, dtype=dtype)
        d = cfg.hidden_size
        first, last = stage == 0, stage == cfg.num_mtp_layers - 1
        self.main_proj = Linear(d * len(cfg.dspark_target_layer_ids), d, rngs=rngs, dtype=dtype) if first else None
        self.main_norm = RMSNorm(d, cfg.rms_norm_eps, rngs=rngs) if first else None
        self.norm = RMSNorm(d, cfg.rms_norm_eps, rngs=rngs) if last else None
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, rngs=rngs, dtype=dtype) if last else None
        self.confidence_head = (ConfidenceHead(d + cfg.dspark_markov_rank, rngs=rngs, dtype=dtype)
                                if last else None)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One top-level module of the Transformer: `name` (`layers`, `mtp`: `index` in the list), the static
    description it is built from (`key`: pieces with equal keys build equal shapes, e.g. layers of one
    spec) and `make(rngs)`. `build` also holds the release's FP8 matrices as FP8 when the config asks
    (`fp8_block`), multiplies them from their bytes where they are whole scale blocks (`fp8_kernel`,
    cfg.dense_impl="pallas"), gives the official FP8 GEMMs their act_quant block under quant_sim (`act_block`) and
    sets cfg.batch_invariant on every Linear (fixed blocks of rows; with dense_impl="pallas" the float32 Linears of
    bf16 weights on fixed tiles instead, `invariant_kernel`), RMSNorm (a fixed tree) and Engram (`batch_invariant`)."""

    name: str
    index: int | None
    key: tuple
    make: Callable[[nnx.Rngs], nnx.Module | None]
    fp8_block: int | None
    act_block: int = 0
    fp8_kernel: bool = False
    batch_invariant: bool = False

    @property
    def path(self) -> str:
        return self.name if self.index is None else f"{self.name}.{self.index}"

    def build(self, rngs: nnx.Rngs) -> nnx.Module | None:
        module = self.make(rngs)
        if module is not None and self.batch_invariant:
            for _, sub in nnx.iter_modules(module):
                if isinstance(sub, (Linear, RMSNorm, Engram)):
                    sub.batch_invariant = True
                if isinstance(sub, Linear) and self.fp8_kernel and sub.fp32:   # dense_impl="pallas"
                    from pallas_kernels.invariant_linear import k_fits

                    sub.invariant_kernel = sub.weight[...].dtype == jnp.bfloat16 and k_fits(sub.weight.shape[1])
        if module is not None and (self.fp8_block or self.act_block):
            for path, sub in nnx.iter_modules(module):
                name = ".".join(map(str, (self.path, *path, "weight")))
                if not isinstance(sub, Linear):
                    continue
                if self.fp8_block and quant_io.release_fp8(name):  # random FP8 matrices: quantised here
                    sub.quantise(self.fp8_block)
                    sub.fp8_kernel = self.fp8_kernel and all(n % self.fp8_block == 0 for n in sub.weight.shape)
                if quant_io.official_fp8_gemm(name):
                    sub.act_block = self.act_block
        return module


def construction_plan(cfg: ModelConfig, dtype, hasher: EngramHasher | None) -> list[Piece]:
    """The Transformer's top-level modules in construction order: each draws its random weights from the one
    `nnx.Rngs` in turn, so building the pieces one by one in this order (model.sharded.init_random on a mesh or
    with scanned layers: one compiled program per distinct piece) gives the same weights as building the model
    at once."""
    dtype = resolve_dtype(dtype)
    piece = functools.partial(Piece, fp8_block=cfg.fp8_block if cfg.dense_weights == "fp8" else None,
                              act_block=cfg.act_quant_block, fp8_kernel=cfg.dense_impl == "pallas",
                              batch_invariant=cfg.batch_invariant)
    d, spec = cfg.hidden_size, cfg.layer_spec
    plan = [piece("embed", None, ("embed",), lambda r: Embedding(cfg.vocab_size, d, rngs=r, dtype=dtype))]
    plan += [piece("layers", i, ("layers", weights_key(spec(i))),
                   lambda r, s=spec(i): Block(cfg, s, rngs=r, dtype=dtype, hasher=hasher))
             for i in range(cfg.num_layers)]
    for j in range(cfg.num_mtp_layers):
        s = spec(cfg.num_layers + j)
        make = ((lambda r, s=s: MTPBlock(cfg, s, rngs=r, dtype=dtype)) if cfg.generation == "v4" else
                (lambda r, s=s, j=j: DSparkBlock(cfg, s, j, rngs=r, dtype=dtype)))
        plan.append(piece("mtp", j, ("mtp", j, weights_key(s)), make))
    plan.append(piece("hc_head", None, ("hc_head",), (lambda r: HyperHead(cfg.hc_mult, d, rngs=r))
                      if cfg.generation == "v4" else (lambda r: None)))
    plan.append(piece("norm", None, ("norm",), lambda r: RMSNorm(d, cfg.rms_norm_eps, rngs=r)))
    plan.append(piece("head", None, ("head",), lambda r: Linear(d, cfg.vocab_size, rngs=r, dtype=dtype, fp32=True,
                                                                input_dtype=cfg.head_dtype)))
    return plan


def group_layers(cfg: ModelConfig, blocks: list) -> Layers:
    """The backbone's blocks (in layer order) held as cfg's layer groups (model/groups.py): a group of one
    layer as its Block, a repeated group as a LayerStack of its blocks' arrays stacked."""
    members = []
    for g in layer_groups(cfg):
        if not g.stacked:
            members.append(blocks[g.start])
            continue
        taps = tuple(g.start + p in cfg.dspark_target_layer_ids for p in range(g.period))
        members.append(LayerStack(g, blocks[g.start:g.stop], shared_roles(cfg, g), taps))
    return Layers(cfg, layer_groups(cfg), members)


def engram_hasher(cfg: ModelConfig, token_map: np.ndarray | None = None,
                  placeholder_map: bool = False) -> EngramHasher | None:
    """The host-side n-gram hasher of a V4.1 config.

    token_map: raw id -> compressed id (`engram.token_map_from_texts` of the tokenizer). Without one,
    the identity map serves configs whose compressed vocab equals the vocab (random tiny models);
    `placeholder_map=True` allows `id mod compressed_vocab` for random-weight full-size models only.
    """
    if not cfg.engram_layer_ids:
        return None
    vc = cfg.engram_compressed_vocab_size
    if token_map is None and vc != cfg.vocab_size:
        if not placeholder_map:
            raise ValueError(f"{cfg.name}: Engram needs the tokenizer's compressed-token map (compressed vocab "
                             f"{vc} != vocab {cfg.vocab_size}); pass token_map=engram.token_map_from_texts(...)")
        token_map = np.arange(cfg.vocab_size, dtype=np.int64) % vc
    raw = {f: getattr(cfg, f) for f in ("engram_layer_ids", "engram_max_ngram_size", "engram_n_heads",
                                        "engram_vocab_size", "engram_pad_token_id",
                                        "engram_compressed_vocab_size", "vocab_size")}
    if cfg.engram_num_embeddings:
        raw["engram_num_embeddings"] = cfg.engram_num_embeddings
    return EngramHasher.from_config(raw, token_map)


class Transformer(nnx.Module):
    """The V4 / V4.1 model. `model(tokens)` -> float32 logits [B, T, vocab] (full sequence, no cache).

    runtime: how the layers run their experts and kernels (model/runtime.py; default: one device)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype="float32", token_map: np.ndarray | None = None,
                 placeholder_map: bool = False, runtime: Runtime | None = None):
        dtype = resolve_dtype(dtype)
        self.config = cfg
        self.dtype = dtype
        self.hasher = engram_hasher(cfg, token_map, placeholder_map)
        parts: dict[str, list] = {}
        for piece in construction_plan(cfg, dtype, self.hasher):
            parts.setdefault(piece.name, []).append(piece.build(rngs))
        self.embed, = parts["embed"]
        self.layers = group_layers(cfg, parts.get("layers", []))
        self.mtp = nnx.List(parts.get("mtp", []))
        self.hc_head, = parts["hc_head"]
        self.norm, = parts["norm"]
        self.head, = parts["head"]
        self._bind(Runtime() if runtime is None else runtime)

    # ---------------------------------------------------------------- runtime
    def _bind(self, runtime: Runtime) -> None:
        """Hand the runtime's parts to this model's own layers (at construction, or on a fresh copy)."""
        cfg = self.config
        self.runtime = runtime.check(cfg)
        impl, per_slot = cfg.moe_impl, cfg.batch_invariant
        bound = [(block, runtime.experts_for(block.spec.index, impl, per_slot)) for block in self.mtp]
        for group, member in self.layers.members():
            if not group.stacked:
                bound.append((member, runtime.experts_for(group.start, impl, per_slot)))
                continue
            for p, block in enumerate(member.period):
                bound.append((block, runtime.experts_for_group(group.layer_ids(p), impl, per_slot)))
        for block, experts in bound:
            block.attn.per_shard = block.per_shard = runtime.per_shard
            block.ffn.expert_fn = experts

    def with_runtime(self, runtime: Runtime) -> "Transformer":
        """A copy of this model (the same arrays, new modules) that runs with `runtime`; this one is unchanged."""
        model = nnx.merge(*nnx.split(self))
        model._bind(runtime)
        return model

    # ---------------------------------------------------------------- pieces
    def logits(self, y: jax.Array) -> jax.Array:
        """Normed final hidden [.., D] -> float32 logits [.., vocab] (inputs in cfg.head_dtype)."""
        return self.head(y)

    def embed_streams(self, tokens: jax.Array) -> jax.Array:
        e = self.embed(tokens)
        return jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], self.config.hc_mult, e.shape[-1]))

    def final_hidden(self, residual: jax.Array, pre: jax.Array) -> jax.Array:
        """Residual streams [.., n, D] (+ the last FFN pre vector [.., n]) -> normed hidden [.., D]."""
        cfg = self.config
        if self.hc_head is None:
            y = collapse(residual, pre, cfg.batch_invariant)
        else:
            y = hc_head_collapse(self.hc_head.fn[...], self.hc_head.base[...], self.hc_head.scale[...], residual,
                                 norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, batch_invariant=cfg.batch_invariant)
        return self.norm(y)

    def engram_ids(self, tokens: jax.Array, step: Step, cache: Cache) -> tuple[jax.Array, Cache]:
        """[V4.1] hash ids [B, S, L, C] int32 for the chunk (computed on the device) and the token-history ring."""
        hasher = self.hasher
        hist_len = hasher.history_len
        before = step.start[:, None] - hist_len + jnp.arange(hist_len, dtype=jnp.int32)[None, :]
        raw = ring_gather(cache.tokens[..., None], before)[..., 0]
        tmap = jnp.asarray(hasher.token_map, jnp.int32)
        history = jnp.where(before >= 0, jnp.take(tmap, jnp.clip(raw, 0, hasher.vocab_size - 1), axis=0),
                            hasher.pad_id)  # compressed ids; the pad id before the sequence starts
        ids = hasher.hash_ids_device(tokens, history)
        return ids, cache.replace(tokens=ring_write(cache.tokens[..., None], tokens[..., None], step)[..., 0])

    def step(self, tokens: jax.Array, cache: Cache, n_new: jax.Array, last_only: bool = False,
             replay_tail: int | None = None, floor: jax.Array | None = None, write_global: bool = True
             ) -> tuple[jax.Array, Cache, dict]:
        """Run a chunk: tokens [B, S] at positions lengths[b] + i, valid for i < n_new[b].

        -> (logits [B, S, V] float32 — or [B, 1, V] of each sequence's last valid row if `last_only` —,
        cache advanced by n_new, extras: `residual` [B, S, n, D] final streams before the collapse,
        `pre` [B, S, n] the last FFN pre vector, `topk` {layer: [B, S, K]} entry indices each indexer chose
        (-1 = none), [V4.1] `candidates` [B, S, N] the candidate mask, `main_hidden` [B, S, len(targets)*D]
        the DSpark inputs, `row_start` / `rows` [B] the position of the first returned row and how many are
        valid). Unused extras cost nothing under jit.
        Rows i >= n_new[b] are padding: computed, never written to the cache, outputs meaningless.

        [V4.1] replay_tail (decoder-side bounded replay, docs/model.md §15): layers after the last KV source
        run only on each sequence's last min(tail, n_new) rows, whose window is floored at the first kept
        position when rows were dropped; the returned rows (logits, extras) are those kept rows.
        floor [B] / write_global: see `Step` (encoder-side replay).
        """
        cfg = self.config
        _warn_if_interpreted(cfg)
        step = Step.make(cache.lengths, n_new, tokens.shape[1], floor, write_global)
        ids = rows = None
        if self.hasher is not None:
            with jax.named_scope("engram"):
                ids, cache = self.engram_ids(tokens, step, cache)
                rows = engram_rows([self.layers[i].engram.embed for i in self.hasher.layer_ids], ids,
                                   self.runtime.engram)
        with jax.named_scope("embed"):
            x = self.embed_streams(tokens)
        pre = jnp.zeros(x.shape[:-1], jnp.float32).at[..., 0].set(1.0)  # one-hot: streams start equal
        shared = Shared()
        layers, taps, topk = [], {}, {}
        cut = replay_cut(cfg) if replay_tail is not None else None
        if replay_tail is not None and cut is None:
            raise ValueError("decoder-side bounded replay needs a V4.1 config (KV-source layers)")
        if cache.groups != self.layers.groups:
            raise ValueError(f"the cache's layer groups {cache.groups} are not the model's {self.layers.groups}: "
                             "allocate it with the model's config (scan_layers)")
        for (group, member), layer_cache in zip(self.layers.members(), cache.layers):
            if group.start == cut:  # (groups never span the cut: model/groups.py)
                step, (x, pre, tokens), shared, taps = self._narrow(step, replay_tail, (x, pre, tokens), shared,
                                                                    taps)
            if group.stacked:
                x, pre, layer_cache, shared, group_topk, group_taps = member(x, pre, step, tokens, layer_cache,
                                                                             shared)
                topk.update(group_topk)
                taps.update(group_taps)
            else:
                i, block = group.start, member
                if block.engram is not None:
                    with jax.named_scope("engram"):
                        j = self.hasher.layer_index(i)
                        x = block.engram(x, ids[:, :, j], rows=rows[j])
                if i in cfg.dspark_target_layer_ids:
                    taps[i] = stream_mean(x, cfg.batch_invariant)
                x, layer_cache, shared, pre = block(x, step, tokens, layer_cache, shared, pre)
                if block.spec.indexer:
                    topk[i] = shared.topk
            layers.append(layer_cache)
        cache = cache.advanced(step.end, tuple(layers))
        extras = {"residual": x, "pre": pre, "topk": dict(sorted(topk.items())), "row_start": step.start,
                  "rows": step.n_new}
        if shared.candidates is not None:
            extras["candidates"] = shared.candidates
        if taps:
            extras["main_hidden"] = jnp.concatenate([taps[i] for i in sorted(taps)], axis=-1)
        rows, rows_pre = x, pre
        if last_only:
            last = jnp.maximum(step.n_new - 1, 0)[:, None]
            rows = jnp.take_along_axis(x, last[:, :, None, None], axis=1)
            rows_pre = jnp.take_along_axis(pre, last[:, :, None], axis=1)
        with jax.named_scope("head"):
            return self.logits(self.final_hidden(rows, rows_pre)), cache, extras

    @staticmethod
    def _narrow(step: Step, tail: int, rows: tuple, shared: Shared, taps: dict):
        """Keep each sequence's last min(tail, n_new) rows (decoder-side bounded replay)."""
        width = min(tail, step.positions.shape[1])
        keep = jnp.minimum(step.n_new, tail)
        first = step.n_new - keep  # rows dropped from the front
        idx = jnp.minimum(first[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :], step.positions.shape[1] - 1)

        def take(a):
            return None if a is None else jnp.take_along_axis(a, idx.reshape(*idx.shape, *[1] * (a.ndim - 2)), 1)

        floor = jnp.where(first > 0, step.start + first, step.floor)
        narrowed = Step.make(step.start + first, keep, width, jnp.maximum(floor, step.floor), step.write_global)
        shared = shared.replace(topk=take(shared.topk), candidates=take(shared.candidates))
        return narrowed, tuple(take(a) for a in rows), shared, {i: take(t) for i, t in taps.items()}

    def mtp_logits(self, residual: jax.Array, next_tokens: jax.Array, stage: int = 0) -> jax.Array:
        """[V4] MTP-1 over a full sequence from position 0: row t of `residual` with token x_{t+1}
        predicts x_{t+2}. -> [B, T, vocab] float32."""
        if self.config.generation != "v4":
            raise ValueError("mtp_logits is the V4 MTP-1 module; V4.1 drafts with DSpark")
        if stage >= len(self.mtp):
            raise ValueError(f"model has {len(self.mtp)} MTP stages; stage {stage} requested")
        b, t = next_tokens.shape
        cfg = self.config
        layer_cache = allocate_layer(cfg, cfg.num_layers + stage, b, t, residual.dtype)
        step = Step.make(jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32), t)
        y, _, _ = self.mtp[stage].hidden(residual, self.embed(next_tokens), step, next_tokens, layer_cache)
        return self.logits(y)

    # ---------------------------------------------------------------- full forward
    def check_tokens(self, tokens) -> jax.Array:
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be integers, got {tokens.dtype}")
        if tokens.shape[1] == 0:
            raise ValueError("tokens has zero length")
        if not isinstance(tokens, jax.core.Tracer):
            lo, hi = int(np.min(tokens)), int(np.max(tokens))
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.config.vocab_size}); got range [{lo}, {hi}]")
        return tokens.astype(jnp.int32)

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, dict]:
        """tokens [B, T] from position 0 -> (logits [B, T, V] float32, extras of `step`)."""
        b, t = tokens.shape
        cache = allocate(self.config, b, t, self.dtype)
        logits, _, extras = self.step(tokens, cache, jnp.full((b,), t, jnp.int32))
        return logits, extras

    def __call__(self, tokens) -> jax.Array:
        tokens = self.check_tokens(tokens)
        return _jit_forward(self, tokens)[0]


@nnx.jit
def _jit_forward(model: Transformer, tokens: jax.Array):
    return model.forward(tokens)


@nnx.jit(static_argnames="last_only", donate_argnames="cache")
def _jit_step(model: Transformer, tokens: jax.Array, cache: Cache, n_new: jax.Array, last_only: bool):
    logits, cache, _ = model.step(tokens, cache, n_new, last_only)
    return logits, cache


def prefill(model: Transformer, cache: Cache, tokens, lengths) -> tuple[jax.Array, Cache]:
    """Append a chunk of prompt tokens to every sequence (chunked prefill from any cached length).

    tokens [B, S] (padded), lengths [B] = valid tokens of each row (0 leaves a sequence untouched).
    -> (logits of each sequence's last new token [B, V] float32, updated cache). The cache is donated.
    """
    tokens = model.check_tokens(tokens)
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (tokens.shape[0],):
        raise ValueError(f"lengths must have shape ({tokens.shape[0]},) to match tokens {tokens.shape}, "
                         f"got {lengths.shape}")
    if cache.batch != tokens.shape[0]:
        raise ValueError(f"cache holds {cache.batch} sequences, tokens have {tokens.shape[0]}")
    _check_room(cache, lengths)
    logits, cache = _jit_step(model, tokens, cache, lengths, True)
    return logits[:, 0], cache


def decode(model: Transformer, cache: Cache, tokens) -> tuple[jax.Array, Cache]:
    """One new token per sequence (tokens [B] -> logits [B, V]) or a few (tokens [B, k] -> [B, k, V],
    causal within the k rows, as speculative verification needs). The cache is donated."""
    tokens = jnp.asarray(tokens)
    single = tokens.ndim == 1
    tokens = model.check_tokens(tokens[:, None] if single else tokens)
    if cache.batch != tokens.shape[0]:
        raise ValueError(f"cache holds {cache.batch} sequences, tokens have {tokens.shape[0]}")
    n_new = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    _check_room(cache, n_new)
    logits, cache = _jit_step(model, tokens, cache, n_new, False)
    return (logits[:, 0] if single else logits), cache


def _check_room(cache: Cache, n_new: jax.Array) -> None:
    end = np.asarray(cache.lengths) + np.asarray(n_new)
    if end.max() > cache.max_len:
        raise ValueError(f"cache of max_len {cache.max_len} cannot hold {int(end.max())} positions; "
                         "allocate a longer cache")


@contextlib.contextmanager
def _fast_tracing():
    """jax builds an error-message string (walking every traced op) each time flax reads a tracer's
    sharding while advancing the RNG counter, which makes tracing the model's construction quadratic in
    its size (v4-flash: 48 s -> 2 s without it; jax-ml/jax PR 40041). The message is never shown."""
    try:
        from jax._src.interpreters import partial_eval as pe
        cls = pe.DynamicJaxprTracer
        original = cls.__dict__.get("_origin_msg")
    except (ImportError, AttributeError):  # internals moved: just slower
        original = None
    if original is None:
        yield
        return
    cls._origin_msg = lambda self: ""
    try:
        yield
    finally:
        cls._origin_msg = original


def abstract_model(cfg: ModelConfig, dtype="bfloat16", token_map: np.ndarray | None = None,
                   runtime: Runtime | None = None) -> Transformer:
    """Shapes only (no memory): `nnx.eval_shape` of the model."""
    with _fast_tracing():
        return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0), dtype=dtype, token_map=token_map,
                                                  placeholder_map=True, runtime=runtime))


def parameter_count(model: Transformer, include_drafts: bool = True) -> int:
    """Logical parameters of the model (FP4 experts: two per packed int8 byte; the uint8 UE8M0 scales of FP4
    experts and FP8 dense weights are not counted); `include_drafts=False` leaves out the MTP / DSpark stages."""
    def count(module) -> int:
        total = 0
        for x in jax.tree.leaves(nnx.state(module, nnx.Param)):
            if x.dtype == jnp.uint8:  # UE8M0 scale bytes
                continue
            n = int(np.prod(x.shape))
            total += 2 * n if x.dtype == jnp.int8 else n
        return total

    return count(model) - (0 if include_drafts else count(model.mtp))
