"""Mixture of experts (docs/model.md §9): router (score / hash), clamped SwiGLU experts, shared expert.

Router in float32: s = f(W_g h) with f = sqrt(softplus) (or sigmoid / softmax). Score-routed layers
pick top-k of s + bias (bias only for choosing); hash layers pick tid2eid[token]. Weights are the
unbiased s of the chosen experts, normalised to sum 1, times routed_scaling_factor.
Expert: z = silu(min(W1 x, L)) * clip(W3 x, -L, L); routed z is scaled by its weight before W2.
The routed experts run as the layer's expert function (`MoE(experts=...)`, from the model's runtime:
model/runtime.py): `LocalExperts` on one device by default, an expert-parallel dispatch on a mesh.
cfg.batch_invariant: the router on fixed blocks of tokens, each token's choices sorted by expert id, the experts
on fixed tiles (the reference's, or the kernels' one tiling per weight format) returning each choice's output
(`per_slot`), added in expert-id order here (`invariant.add_slots`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import invariant as inv
from pallas_kernels import moe as pallas_moe
from pallas_kernels import reference as ref

from .config import LayerSpec, ModelConfig
from .layers import Linear, Table, normal_init


def score_function(name: str, logits: jax.Array) -> jax.Array:
    if name == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if name == "sigmoid":
        return jax.nn.sigmoid(logits)
    if name == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"unknown scoring function {name!r}")


TOP_K_SORT_ROWS = 512


def top_k_ids(scores: jax.Array, k: int) -> jax.Array:
    """Indices of the k largest of each row of finite scores [M, E], in lax.top_k's order (ties to the lower
    index). Past TOP_K_SORT_ROWS rows by argmax_rounds: XLA sorts whole rows for lax.top_k, which costs 0.068 ms
    at 8192 x 256 on the H200 against 0.022 for the rounds, while at 64 rows the sort wins (0.005 against 0.009;
    experiments/probes/router_precision.py)."""
    return argmax_rounds(scores, k) if scores.shape[0] > TOP_K_SORT_ROWS else jax.lax.top_k(scores, k)[1]


def argmax_rounds(scores: jax.Array, k: int) -> jax.Array:
    """top_k_ids by k rounds of argmax over [M, E], each taking the last round's pick out."""
    col = jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    ids = []
    for _ in range(k):
        ids.append(jnp.argmax(scores, axis=-1).astype(jnp.int32))
        scores = jnp.where(col == ids[-1][:, None], -jnp.inf, scores)
    return jnp.stack(ids, axis=-1)


class Gate(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs, dtype):
        e, k = spec.n_experts, spec.n_experts_per_tok
        self.weight = nnx.Param(normal_init(rngs, (e, cfg.hidden_size), cfg.hidden_size ** -0.5, dtype=dtype))
        if spec.hash_routed:
            # k distinct experts per token id, as the released table has.
            keys = jax.random.uniform(rngs.params(), (cfg.vocab_size, e))
            self.tid2eid = Table(jnp.argsort(keys, axis=-1)[:, :k].astype(jnp.int32))
            self.bias = None
        else:
            self.tid2eid = None
            self.bias = nnx.Param(normal_init(rngs, (e,), 0.3))
        self.cfg = cfg
        self.k = k

    def __call__(self, h: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """h [M, D], tokens [M] -> (expert ids [M, k] int32, weights [M, k] float32); under cfg.batch_invariant
        each token's choices in increasing expert id, routed on fixed blocks of tokens, or (cfg.dense_impl="pallas"
        and a bf16 weight) all tokens at once with the logits on fixed tiles (`route`'s fixed_tiles)."""
        if not self.cfg.batch_invariant:
            return self.route(h, tokens)
        if self.cfg.dense_impl == "pallas" and self.weight[...].dtype == jnp.bfloat16:
            return inv.sort_choices(*self.route(h, tokens, fixed_tiles=True))
        return inv.row_blocks(lambda h, t: inv.sort_choices(*self.route(h, t)), h, tokens)

    def route(self, h: jax.Array, tokens: jax.Array, fixed_tiles: bool = False) -> tuple[jax.Array, jax.Array]:
        """The router: h [M, D], tokens [M] -> (expert ids [M, k] int32, weights [M, k] float32). fixed_tiles
        (batch invariance over all rows at once): the logits by `invariant_product`, the scores between
        optimization barriers (elementwise, or `invariant.softmax`: pairwise maximum and sum), the
        weights' sum by `invariant.pairwise_sum`: no op whose code XLA picks by the number of tokens."""
        cfg = self.cfg
        # IEEE float32 logits, as the official gate (torch's fp32 linear of the upcast operands, no TF32): bf16 / f16
        # operands multiply as they are, their products exact in the float32 accumulator; float32 ones ask for
        # HIGHEST, as XLA runs float32 GEMMs as TF32 on the GPU (8K tokens, H200: 0.35 ms against 0.05, and TF32
        # changed 0.15% of the tokens' expert sets; experiments/probes/router_precision.py)
        w = self.weight[...]
        if fixed_tiles:
            from pallas_kernels.invariant_linear import invariant_product

            logits = jax.lax.optimization_barrier(invariant_product(h, w))
        elif h.dtype == w.dtype and jnp.finfo(h.dtype).nmant <= 11:
            logits = jnp.einsum("md,ed->me", h, w, preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("md,ed->me", h.astype(jnp.float32), w.astype(jnp.float32),
                                precision=jax.lax.Precision.HIGHEST)
        scaled = logits / cfg.gate_temp
        if fixed_tiles and cfg.scoring_func == "softmax":
            scores = inv.softmax(scaled)
        else:
            scores = score_function(cfg.scoring_func, scaled)
        if fixed_tiles:
            scores = jax.lax.optimization_barrier(scores)
        if self.tid2eid is not None:
            ids = jnp.take(self.tid2eid[...], tokens, axis=0).astype(jnp.int32)
        else:
            ids = top_k_ids(scores + self.bias[...], self.k)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if cfg.norm_topk_prob and (cfg.generation == "v4" or self.k > 1):
            # V4 normalises without an epsilon; V4.1 adds 1e-20 (and skips k = 1), as trained
            eps = 0.0 if cfg.generation == "v4" else 1e-20
            total = inv.pairwise_sum(weights) if fixed_tiles else jnp.sum(weights, axis=-1, keepdims=True)
            weights = weights / (total + eps)
        return ids, weights * cfg.routed_scaling_factor


def random_experts(keys: jax.Array, shape: tuple[int, int], std: float, fp4: bool, dtype):
    """One N(0, std^2) [out, in] matrix per key -> dense [E, out, in] in dtype, or FP4 (packed, scales) made
    one expert at a time (lax.map) so peak memory is one float32 expert, not all of them."""
    def draw(key):
        return std * jax.random.normal(key, shape, jnp.float32)
    if fp4:
        return jax.lax.map(lambda key: ref.quantize_fp4_experts(draw(key)), keys)
    return jax.vmap(draw)(keys).astype(dtype), None


class Experts(nnx.Module):
    """Stacked routed experts: w1, w3 [E, I, D] (gate, up), w2 [E, D, I] (down).

    cfg.expert_weights "fp4": E2M1 weights and their UE8M0 scales held as the Mosaic GPU kernels stream them:
    w1, w3 uint16 [E, I, D/4], w2 [E, D, I/4] (`pallas_moe.fp4_kernel_weights`: the checkpoint's packed bytes,
    each 32-bit word's bits permuted for the register decode) and s1, s3 bf16 [E, D/32, I], s2 [E, I/32, D]
    (`pallas_moe.fp4_kernel_scales`); `fp4_weight_bytes` / `fp4_scale_bytes` give the checkpoint's bytes back.
    Random weights are the FP4 quantisation of the dense random ones. Each expert
    draws from its own key and FP4 experts are made one at a time, so no float32 [E, out, in] tensor is ever
    held (V4.1's w1 would be 18 GB)."""

    def __init__(self, cfg: ModelConfig, n_experts: int, *, rngs: nnx.Rngs, dtype):
        e, i, d = n_experts, cfg.moe_intermediate_size, cfg.hidden_size
        fp4 = cfg.expert_weights == "fp4"
        for name, shape, fan_in in (("w1", (i, d), d), ("w2", (d, i), i), ("w3", (i, d), d)):
            keys = jax.random.split(rngs.params(), e)
            w, scale = random_experts(keys, shape, fan_in ** -0.5, fp4, dtype)
            setattr(self, name, nnx.Param(pallas_moe.fp4_kernel_weights(w) if fp4 else w))
            if fp4:
                setattr(self, "s" + name[1], nnx.Param(pallas_moe.fp4_kernel_scales(scale)))
        self.fp4 = fp4

    def stored(self) -> tuple[jax.Array, jax.Array, jax.Array, tuple | None]:
        """(w1, w2, w3, scales): the weights as held (scales None when dense)."""
        scales = (self.s1[...], self.s2[...], self.s3[...]) if self.fp4 else None
        return self.w1[...], self.w2[...], self.w3[...], scales


# decode / verify loads (up to verify 256 x 4) of the shared expert run on the MoE kernels when its weights are held
# FP8 and multiplied from their bytes; prefill keeps XLA's GEMMs on the in-graph dequantised weights
SHARED_KERNEL_MAX_ROWS = 1024
SHARED_KERNEL_BLOCK = 128


class MLP(nnx.Module):
    """The shared expert (same clamped SwiGLU, weight 1).

    With its three projections on the FP8 kernels (cfg.dense_impl="pallas") in 128-blocks it runs, up to
    SHARED_KERNEL_MAX_ROWS rows, as one routed expert that every row picks with weight 1
    (`pallas_kernels.moe.moe_experts`, bf16 activations on the tiling of `single_expert_tiling`): the SwiGLU fused
    between the two GEMMs (on the float32 products, which the reference path rounds to bf16 first), the FP8 weights
    dequantised in registers, none of them copied into HBM as bf16.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype):
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = Linear(d, i, rngs=rngs, dtype=dtype)
        self.w2 = Linear(i, d, rngs=rngs, dtype=dtype)
        self.w3 = Linear(d, i, rngs=rngs, dtype=dtype)
        self.limit = cfg.swiglu_limit

    def on_expert_kernels(self, rows: int) -> bool:
        """Whether `rows` rows run as one routed expert on the MoE kernels: FP8 weights on the kernels in 128 x 128
        scale blocks (V4's; the Mosaic GPU swap tiles take no smaller ones, so V4.1's 32 x 32 keep the in-graph
        dequantisation), at most SHARED_KERNEL_MAX_ROWS rows, never under batch invariance (a choice by rows: the
        three projections then run on the FP8 linears' fixed tiles)."""
        ws = (self.w1, self.w2, self.w3)
        if not all(w.fp8_kernel for w in ws) or rows > SHARED_KERNEL_MAX_ROWS or self.w1.batch_invariant:
            return False
        return all(ref.fp8_block_size(w.weight.shape, w.scale.shape) == SHARED_KERNEL_BLOCK for w in ws)

    def __call__(self, x: jax.Array) -> jax.Array:
        rows = x.size // x.shape[-1]
        if self.on_expert_kernels(rows):
            flat = x.reshape(rows, x.shape[-1])
            ids, weights = jnp.zeros((rows, 1), jnp.int32), jnp.ones((rows, 1), jnp.float32)
            ws = [w.weight[...][None] for w in (self.w1, self.w2, self.w3)]
            scales = tuple(w.scale[...][None] for w in (self.w1, self.w2, self.w3))
            plain = not self.w1.act_block and jnp.dtype(self.w1.dtype) == jnp.dtype(jnp.bfloat16)
            backend, config = pallas_moe.single_expert_tiling(rows) if plain else ("auto", None)
            y = pallas_moe.moe_experts(flat, ids, weights, *ws, self.limit, scales=scales, backend=backend,
                                       config=config, act_block=self.w1.act_block, compute_dtype=self.w1.dtype)
            return y.astype(x.dtype).reshape(x.shape)
        z = ref.clamped_swiglu(self.w1(x), self.w3(x), self.limit)
        return self.w2(z.astype(x.dtype))


def routed_experts(impl: str, x, ids, weights, w1, w2, w3, limit: float, scales=None, act_block: int = 0,
                   balanced: bool = False, per_slot: bool = False) -> jax.Array:
    """The routed-expert block on one device: "pallas" (grouped-GEMM kernel, quantised weights dequantised
    inside) or "reference" (jnp; quantised weights dequantised in-graph). act_block > 0: both GEMMs' inputs
    rounded by act_quant (cfg.quant_sim). balanced: ids are forced_balance's (the kernels' tiles may fit the
    equal row counts). x [M, D] -> [M, D] float32; per_slot (cfg.batch_invariant: the reference on fixed tiles,
    `invariant.expert_slots`, or the kernels on one tiling per weight format, `tuning.invariant_tiling`): each
    choice's output unsummed, [M, k, D] float32."""
    if impl == "pallas":
        return pallas_moe.moe_experts(x, ids, weights, w1, w2, w3, limit, scales=scales, act_block=act_block,
                                      balanced=balanced, per_slot=per_slot)
    if scales is not None:
        w1, w2, w3 = ref.dense_experts(*(pallas_moe.fp4_weight_bytes(w) for w in (w1, w2, w3)),
                                       tuple(pallas_moe.fp4_scale_bytes(s) for s in scales), x.dtype)
    if per_slot:
        return inv.expert_slots(x, ids, weights, w1, w2, w3, limit, act_block)
    return ref.moe_experts(x, ids, weights, w1, w2, w3, limit, act_block)


@dataclasses.dataclass(frozen=True)
class LocalExperts:
    """`routed_experts` of one implementation as a static, hashable expert function (the contract of
    `sharding.expert_parallel.ExpertFn`): what a layer runs on one device, and on each shard of a mesh.
    per_slot (cfg.batch_invariant): each choice's output unsummed, [M, k, D]."""

    impl: str = "reference"
    per_slot: bool = False

    def __call__(self, x, ids, weights, w1, w2, w3, limit: float, scales=None, act_block: int = 0,
                 balanced: bool = False) -> jax.Array:
        return routed_experts(self.impl, x, ids, weights, w1, w2, w3, limit, scales=scales, act_block=act_block,
                              balanced=balanced, per_slot=self.per_slot)


class MoE(nnx.Module):
    """experts: the routed-expert function (an `ExpertFn`, static); None: LocalExperts(cfg.moe_impl)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, rngs: nnx.Rngs, dtype, experts=None):
        self.gate = Gate(cfg, spec, rngs=rngs, dtype=dtype)
        self.experts = Experts(cfg, spec.n_experts, rngs=rngs, dtype=dtype)
        self.shared_experts = MLP(cfg, rngs=rngs, dtype=dtype)
        self.limit = cfg.swiglu_limit
        self.impl = cfg.moe_impl
        self.act_block = cfg.act_quant_block   # the official FP4 expert GEMMs round their inputs (quant_sim)
        self.batch_invariant = cfg.batch_invariant
        self.expert_fn = LocalExperts(cfg.moe_impl, cfg.batch_invariant) if experts is None else experts

    def route(self, h: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """h [B, T, D], tokens [B, T] -> expert ids, weights [B, T, k]."""
        ids, w = self.gate(h.reshape(-1, h.shape[-1]), tokens.reshape(-1))
        return ids.reshape(*h.shape[:-1], -1), w.reshape(*h.shape[:-1], -1)

    def __call__(self, h: jax.Array, tokens: jax.Array) -> jax.Array:
        """h [B, T, D], tokens [B, T] -> [B, T, D]."""
        with jax.named_scope("router"):
            ids, w = self.route(h, tokens)
        x = h.reshape(-1, h.shape[-1])
        w1, w2, w3, scales = self.experts.stored()
        with jax.named_scope("experts"):
            routed = self.expert_fn(x, ids.reshape(x.shape[0], -1), w.reshape(x.shape[0], -1), w1, w2, w3,
                                    self.limit, scales=scales, act_block=self.act_block)
            if self.batch_invariant:  # per choice, in expert-id order
                routed = inv.add_slots(routed)
        with jax.named_scope("shared_expert"):
            out = routed + self.shared_experts(x).astype(jnp.float32)
        return out.astype(h.dtype).reshape(h.shape)
