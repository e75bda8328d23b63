"""Block and Transformer (MODEL_SPEC 2.1, 2.2, 2.9, 2.11).

tokens -> embed -> n residual streams -> per block:
  mHC(attn) collapse -> attn_norm -> Attention -> expand; mHC(ffn) collapse -> ffn_norm -> MoE -> expand
-> hc_head collapse -> norm -> head -> float32 logits.
The MTP block (`mtp.0`) is a full block fed with W_e RMSNorm(embed(x_{p+1})) + W_h RMSNorm(X_p).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .attention import Attention
from .cache import Cache, LayerCache, Step, allocate, allocate_layer
from .config import LayerSpec, ModelConfig
from .layers import Embedding, Linear, RMSNorm
from .mhc import HyperConnection, HyperHead, collapse, expand, hc_coefficients, hc_head_collapse
from .moe import MoE

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs, dtype):
        self.hc_attn = HyperConnection(cfg.hc_mult, cfg.hidden_size, rngs=rngs)
        self.hc_ffn = HyperConnection(cfg.hc_mult, cfg.hidden_size, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
        self.attn = Attention(cfg, spec, rngs=rngs, dtype=dtype)
        self.ffn = MoE(cfg, spec, rngs=rngs, dtype=dtype)
        self.spec = spec
        self.norm_eps, self.hc_eps, self.sinkhorn_iters = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters

    def _coefficients(self, hc: HyperConnection, x: jax.Array):
        return hc_coefficients(hc.fn[...], hc.base[...], hc.scale[...], x, norm_eps=self.norm_eps,
                               hc_eps=self.hc_eps, sinkhorn_iters=self.sinkhorn_iters)

    def __call__(self, x: jax.Array, step: Step, tokens: jax.Array, cache: LayerCache
                 ) -> tuple[jax.Array, LayerCache]:
        """x [B, S, n, D] residual streams of the chunk `step` -> (same shape, updated layer cache)."""
        pre, post, comb = self._coefficients(self.hc_attn, x)
        a, cache = self.attn(self.attn_norm(collapse(x, pre)), step, cache)
        x = expand(x, a, post, comb)
        pre, post, comb = self._coefficients(self.hc_ffn, x)
        f = self.ffn(self.ffn_norm(collapse(x, pre)), tokens)
        return expand(x, f, post, comb), cache


class MTPBlock(Block):
    """MTP-1 [V4]: input streams W_e RMSNorm(embed(next token)) + W_h RMSNorm(X_i), a full block,
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
               cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        """residual [B, S, n, D] (backbone, before hc_head), next_embed [B, S, D] -> (normed [B, S, D], cache)."""
        e = self.e_proj(self.enorm(next_embed))
        x = self.h_proj(self.hnorm(residual)) + e[:, :, None, :]
        x, cache = super().__call__(x.astype(residual.dtype), step, next_tokens, cache)
        y = hc_head_collapse(self.hc_head.fn[...], self.hc_head.base[...], self.hc_head.scale[...], x,
                             norm_eps=self.norm_eps, hc_eps=self.hc_eps)
        return self.norm(y), cache


class Transformer(nnx.Module):
    """The V4 model. `model(tokens)` -> float32 logits [B, T, vocab] (full sequence, no cache)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype="float32"):
        dtype = resolve_dtype(dtype)
        self.config = cfg
        self.dtype = dtype
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, rngs=rngs, dtype=dtype)
        self.layers = nnx.List([Block(cfg, cfg.layer_spec(i), rngs=rngs, dtype=dtype)
                                for i in range(cfg.num_layers)])
        self.mtp = nnx.List([MTPBlock(cfg, cfg.layer_spec(cfg.num_layers + j), rngs=rngs, dtype=dtype)
                             for j in range(cfg.num_mtp_layers)])
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, rngs=rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, rngs=rngs, dtype=dtype, fp32=True)

    # ---------------------------------------------------------------- pieces
    def logits(self, y: jax.Array) -> jax.Array:
        """Normed final hidden [.., D] -> float32 logits [.., vocab]."""
        return self.head(y)

    def embed_streams(self, tokens: jax.Array) -> jax.Array:
        e = self.embed(tokens)
        return jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], self.config.hc_mult, e.shape[-1]))

    def final_hidden(self, residual: jax.Array) -> jax.Array:
        cfg = self.config
        y = hc_head_collapse(self.hc_head.fn[...], self.hc_head.base[...], self.hc_head.scale[...], residual,
                             norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
        return self.norm(y)

    def step(self, tokens: jax.Array, cache: Cache, n_new: jax.Array, last_only: bool = False
             ) -> tuple[jax.Array, Cache, jax.Array]:
        """Run a chunk: tokens [B, S] at positions lengths[b] + i, valid for i < n_new[b].

        -> (logits [B, S, V] float32 — or [B, 1, V] of each sequence's last valid row if `last_only` —,
        cache advanced by n_new, residual [B, S, n, D] before hc_head).
        Rows i >= n_new[b] are padding: computed, never written to the cache, outputs meaningless.
        """
        step = Step.make(cache.lengths, n_new, tokens.shape[1])
        x = self.embed_streams(tokens)
        layers = []
        for block, layer_cache in zip(self.layers, cache.layers):
            x, layer_cache = block(x, step, tokens, layer_cache)
            layers.append(layer_cache)
        cache = cache.replace(lengths=step.end, layers=tuple(layers))
        rows = x
        if last_only:
            last = jnp.maximum(step.n_new - 1, 0)[:, None, None, None]
            rows = jnp.take_along_axis(x, last, axis=1)
        return self.logits(self.final_hidden(rows)), cache, x

    def mtp_logits(self, residual: jax.Array, next_tokens: jax.Array, stage: int = 0) -> jax.Array:
        """MTP-1 over a full sequence from position 0: row t of `residual` with token x_{t+1} predicts
        x_{t+2}. -> [B, T, vocab] float32."""
        if stage >= len(self.mtp):
            raise ValueError(f"model has {len(self.mtp)} MTP stages; stage {stage} requested")
        b, t = next_tokens.shape
        cfg = self.config
        layer_cache = allocate_layer(cfg, cfg.num_layers + stage, b, t, residual.dtype)
        step = Step.make(jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32), t)
        y, _ = self.mtp[stage].hidden(residual, self.embed(next_tokens), step, next_tokens, layer_cache)
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

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens [B, T] from position 0 -> (logits [B, T, V] float32, residual [B, T, n, D])."""
        b, t = tokens.shape
        cache = allocate(self.config, b, t, self.dtype)
        logits, _, residual = self.step(tokens, cache, jnp.full((b,), t, jnp.int32))
        return logits, residual

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


def init_random(cfg: ModelConfig, seed: int = 0, dtype="float32") -> Transformer:
    """A model with random weights (norm weights 1 + 0.1 N, matrices N / sqrt(fan_in), ...)."""
    return Transformer(cfg, rngs=nnx.Rngs(params=seed), dtype=dtype)


def abstract_model(cfg: ModelConfig, dtype="bfloat16") -> Transformer:
    """Shapes only (no memory): `nnx.eval_shape` of the model."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0), dtype=dtype))


def parameter_count(model: Transformer) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
