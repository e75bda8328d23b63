"""Small building blocks: Linear, Embedding, RMSNorm, interleaved RoPE with YaRN, Hadamard.

Weights are stored `[out, in]` exactly as in the checkpoints, so loading is a rename.
Numerics (DESIGN.md): matmuls in the weight dtype; norms, RoPE rotation and anything marked
`fp32=True` in float32 (a Linear's inputs may be bf16 instead: the head with ModelConfig.head_dtype).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import invariant as inv
from pallas_kernels import reference as ref
from pallas_kernels.common import on_gpu

from .config import Yarn


class Table(nnx.Variable):
    """A non-trainable array loaded from the checkpoint (e.g. the hash-routing table `tid2eid`)."""


def normal_init(rngs: nnx.Rngs, shape, std: float, mean: float = 0.0, dtype=jnp.float32) -> jax.Array:
    return (mean + std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x @ W.T with W `[out, in]`; `fp32=True` computes in float32 (router, compressor, head), its operands
    cast to `input_dtype` first ("float32"; the head may take "bfloat16": ModelConfig.head_dtype).

    After `quantise(B)` (cfg.dense_weights="fp8", the tensors of quant_io.release_fp8) W is held as the
    release ships it: `weight` float8_e4m3fn [out, in] and `scale` UE8M0 exponent bytes uint8
    [ceil(out/B), ceil(in/B)]; each call dequantises it in-graph to the model dtype, then multiplies as usual, or
    with `fp8_kernel` (cfg.dense_impl="pallas", whole scale blocks) runs `pallas_kernels.fp8_linear` (on a GPU the
    largest weights at decode / verify loads multiplied from the stored bytes).
    `act_block` > 0 (cfg.quant_sim, the official FP8 GEMMs): the input is first rounded by act_quant per
    `act_block` values (`reference.fp8_fake_quant`), as the official FP8 GEMM rounds it.
    `batch_invariant` (cfg.batch_invariant): the product runs on fixed blocks of rows (`invariant.row_blocks`), or
    over all rows at once on tiles fixed whatever the rows (pallas_kernels/invariant_linear.py): with `fp8_kernel`
    the FP8 ones, with `invariant_kernel` (cfg.dense_impl="pallas": float32 linears of bf16 weights, e.g. the LM
    head) the bf16 ones.
    """

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 fp32: bool = False, input_dtype: str = "float32"):
        self.weight = nnx.Param(normal_init(rngs, (out_features, in_features), in_features ** -0.5, dtype=dtype))
        self.scale: nnx.Param | None = nnx.data(None)  # a Param once quantised
        self.dtype = dtype
        self.fp32 = fp32
        self.input_dtype = input_dtype
        self.act_block = 0
        self.fp8_kernel = False  # multiply the FP8-held weight from its bytes (pallas_kernels.fp8_linear)
        self.batch_invariant = False
        self.invariant_kernel = False  # under batch_invariant: bf16_invariant_linear instead of row blocks

    def quantise(self, block: int) -> None:
        """Hold the weight as FP8 E4M3 with one UE8M0 scale per `block` x `block` block (traceable)."""
        w, s = ref.quantize_fp8_blocks(self.weight[...], block)
        self.weight = nnx.Param(w)
        self.scale = nnx.Param(s)

    def dense_weight(self) -> jax.Array:
        """W [out, in] in the model dtype (dequantised when held FP8)."""
        if self.scale is None:
            return self.weight[...]
        return ref.dequant_fp8_blocks(self.weight[...], self.scale[...]).astype(self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("proj"):
            return self._project(x)

    def _project(self, x: jax.Array) -> jax.Array:
        if self.invariant_kernel:
            from pallas_kernels.invariant_linear import invariant_product

            if jnp.dtype(self.input_dtype) != jnp.float32:
                x = x.astype(self.input_dtype)
            return invariant_product(x, self.weight[...])
        if self.fp8_kernel:
            w, s = self.weight[...][None], self.scale[...][None]
            if fp8_kernel_runs(x.size // x.shape[-1], w, s, self.act_block, self.dtype, self.batch_invariant):
                y = fp8_kernel_linear(x.reshape(1, -1, x.shape[-1]), w, s, self.act_block, self.dtype,
                                      self.batch_invariant)
                return y.reshape(*x.shape[:-1], w.shape[1])
        w = self.dense_weight()
        if self.act_block:
            x = ref.fp8_fake_quant(x, self.act_block)

        def product(x):
            if self.fp32:
                return float32_linear(x, w, self.input_dtype)
            return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)
        return inv.row_blocks(product, x, lead=x.ndim - 1) if self.batch_invariant else product(x)


def per_batch_shard(per_shard, fn, batched: tuple, replicated: tuple = ()):
    """fn(*batched, *replicated) for a Pallas kernel: on a mesh once per batch shard through the runtime's runner
    `per_shard` (sharding.BatchParallel: GSPMD cannot split a pallas_call), on the whole batch where it is None."""
    return fn(*batched, *replicated) if per_shard is None else per_shard(fn, batched, replicated)


def _kernel_act_block(w: jax.Array, scale: jax.Array, act_block: int) -> int:
    """The act_quant block the FP8 kernels see: quant_sim's block where it is the weights' own (FP8 x FP8), else 0
    (the input is rounded in-graph first and multiplies as bf16)."""
    return act_block if act_block == w.shape[1] // scale.shape[1] else 0


def fp8_kernel_runs(rows: int, w: jax.Array, scale: jax.Array, act_block: int, dtype,
                    invariant: bool = False) -> bool:
    """Whether `fp8_kernel_linear` of `rows` rows per group over w [G, N, K] would run one of the FP8 kernels
    (pallas_kernels.fp8_linear's auto choice) rather than dequantise for XLA's GEMM, which the in-graph path does
    itself (and lays out better around a grouped projection). `invariant` (batch invariance): always, whatever
    the rows."""
    from pallas_kernels.fp8_linear import choose_backend

    if invariant:
        return True
    g, n, k = w.shape
    block = n // scale.shape[1]
    return choose_backend(g, rows, n, k, block, _kernel_act_block(w, scale, act_block), dtype) != "dequantised"


def fp8_kernel_linear(x: jax.Array, w: jax.Array, scale: jax.Array, act_block: int, dtype,
                      invariant: bool = False) -> jax.Array:
    """x [G, M, K] @ W_g^T on the FP8 kernels for FP8 weights w [G, N, K] with block scales [G, N/B, K/B]; act_block
    (quant_sim's act_quant) other than the weights' block B rounds the input here and multiplies bf16 activations.
    `invariant` (batch invariance, bf16 activations: ModelConfig refuses quant_sim with it): the fixed Triton
    tiles whatever M. -> [G, M, N] in dtype."""
    from pallas_kernels.fp8_linear import fp8_linear
    from pallas_kernels.invariant_linear import fp8_invariant_linear

    if invariant:
        return fp8_invariant_linear(x.astype(dtype), w, scale, dtype)
    kernel_block = _kernel_act_block(w, scale, act_block)
    if act_block and not kernel_block:
        x = ref.fp8_fake_quant(x, act_block)
    return fp8_linear(x.astype(dtype), w, scale, act_block=kernel_block, out_dtype=dtype)


def float32_linear(x: jax.Array, w: jax.Array, input_dtype: str = "float32") -> jax.Array:
    """x [..., in] @ w[out, in].T in float32 (the official fp32 linear of the upcast operands), x first cast to
    `input_dtype` when that is narrower than float32.

    Operands that are both bf16 (or both f16) multiply as they are: their products are exact in the float32
    accumulator, so the bf16 MMA with float32 accumulation is the float32 linear of the upcast operands (up to
    the order of the sums), without converting the weight every call nor the TF32 rounding XLA gives float32
    GEMMs on a GPU. Anything else is upcast to float32 first."""
    if jnp.dtype(input_dtype) != jnp.float32:
        x = x.astype(input_dtype)
    if x.dtype == w.dtype and jnp.finfo(w.dtype).bits == 16:
        return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w.astype(jnp.float32), preferred_element_type=jnp.float32)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.weight = nnx.Param(normal_init(rngs, (vocab, dim), 0.5, dtype=dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0)


def rms_normalize(x: jax.Array, eps: float, batch_invariant: bool = False) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) over the last axis, in float32 (batch_invariant: `invariant.rms_normalize`, the
    statistic a fixed pairwise tree of elementwise adds)."""
    if batch_invariant:
        return inv.rms_normalize(x, eps)
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """w * x / rms(x), computed in float32 (weight kept float32), cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (dim,), 0.1, mean=1.0))
        self.eps = eps
        self.batch_invariant = False  # cfg.batch_invariant: the statistic by a fixed tree of elementwise adds

    def __call__(self, x: jax.Array) -> jax.Array:
        return (self.weight[...] * rms_normalize(x, self.eps, self.batch_invariant)).astype(x.dtype)


# ----------------------------------------------------------------------------- RoPE

def rope_frequencies(rope_dim: int, theta: float, yarn: Yarn | None) -> tuple[float, ...]:
    """Per-pair angular frequencies omega_k, k < rope_dim/2 (a hashable tuple, static under jit).

    YaRN interpolates frequencies only (no magnitude factor): with
    c(beta) = R ln(orig / (2 pi beta)) / (2 ln theta), lo = max(floor(c(beta_fast)), 0),
    hi = min(ceil(c(beta_slow)), R - 1), ramp_k = clip((k - lo) / max(hi - lo, 1e-3), 0, 1),
    omega'_k = omega_k / factor * ramp_k + omega_k * (1 - ramp_k).
    """
    k = np.arange(rope_dim // 2, dtype=np.float64)
    freqs = 1.0 / theta ** (2.0 * k / rope_dim)
    if yarn is None or yarn.factor == 1.0:
        return tuple(freqs.tolist())

    def corr(beta: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (beta * 2 * math.pi)) / (
            2 * math.log(theta))

    lo = max(math.floor(corr(yarn.beta_fast)), 0)
    hi = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
    ramp = np.clip((k - lo) / max(hi - lo, 1e-3), 0.0, 1.0)
    return tuple((freqs / yarn.factor * ramp + freqs * (1.0 - ramp)).tolist())


def apply_rope(x: jax.Array, positions: jax.Array, freqs: tuple[float, ...], inverse: bool = False) -> jax.Array:
    """Rotate interleaved pairs of the LAST 2*len(freqs) channels of x by angle position*omega.

    x: [..., S, (heads,) dim] with positions [..., S] broadcast over any axes between S and dim
    (pass positions shaped to broadcast against x[..., 0]). inverse=True rotates by -angle.
    """
    rope_dim = 2 * len(freqs)
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)  # [..., R/2]
    if inverse:
        angle = -angle
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    rope = x[..., -rope_dim:].astype(jnp.float32)
    pairs = rope.reshape(*rope.shape[:-1], rope_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    rotated = rotated.reshape(rope.shape).astype(x.dtype)
    if on_gpu():
        # written over x's rope channels: XLA updates them in place where x's buffer is free, so only they move (a
        # concatenation rewrites all of x: V4 queries at prefill 2 x 4096, 0.35 against 0.57 ms a layer; the output
        # 0.09 against 0.31). Not on a CPU: XLA's CPU backend (jaxlib 0.10.2) miscompiles the in-place update in the
        # decode step (the golden V4.1 teacher-forced decode off by 8%, correct with the same update unjitted).
        return jax.lax.dynamic_update_slice_in_dim(x, rotated, x.shape[-1] - rope_dim, axis=-1)
    return jnp.concatenate([x[..., :-rope_dim], rotated], axis=-1)


def hadamard(x: jax.Array, batch_invariant: bool = False, fixed_tiles: bool = False) -> jax.Array:
    """Sylvester-order Walsh-Hadamard transform over the last axis, scaled by n^-1/2 (orthonormal). batch_invariant:
    on fixed blocks of rows, or (fixed_tiles: cfg.dense_impl="pallas") over all rows at once as the +-1 matrix on
    `bf16_invariant_linear`'s fixed tiles (its entries exact in bf16, the products exact in float32) scaled after."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two width, got {n}")
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if batch_invariant and fixed_tiles:
        from pallas_kernels.invariant_linear import invariant_product

        return (invariant_product(x, jnp.asarray(h.T, jnp.bfloat16)) * (1.0 / math.sqrt(n))).astype(x.dtype)
    h = jnp.asarray(h / math.sqrt(n), jnp.float32)

    def transform(x):
        return jnp.einsum("...i,ij->...j", x.astype(jnp.float32), h).astype(x.dtype)
    return inv.row_blocks(transform, x, lead=x.ndim - 1) if batch_invariant else transform(x)


# ----------------------------------------------------------------------------- fake-quant (docs/model.md §14)

_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _pow2_ceil(x: jax.Array) -> jax.Array:
    """2^ceil(log2 x) for x > 0, exact (frexp-based)."""
    m, e = jnp.frexp(x)
    return jnp.ldexp(jnp.ones_like(x), jnp.where(m == 0.5, e - 1, e))


def _blocks(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"fake-quant block {block} does not divide the last dim {x.shape[-1]}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _round_e2m1(v: jax.Array) -> jax.Array:
    """Nearest E2M1 value of |v| <= 6, ties to the even code; sign kept."""
    grid = jnp.asarray(_E2M1_GRID, jnp.float32)
    d = jnp.abs(jnp.abs(v)[..., None] - grid)
    idx = jnp.argmin(d, axis=-1)  # the lower code on a tie
    nxt = jnp.minimum(idx + 1, len(_E2M1_GRID) - 1)
    tie = jnp.take_along_axis(d, nxt[..., None], -1) == jnp.take_along_axis(d, idx[..., None], -1)
    idx = jnp.where((idx % 2 == 1) & tie[..., 0], nxt, idx)
    return jnp.sign(v) * grid[idx]


def fp4_fake_quant(x: jax.Array, block: int, e4m3_scale: bool = False) -> jax.Array:
    """Round to FP4 E2M1 per `block` values. UE8M0 scale 2^ceil(log2(max(amax, 6*2^-126) / 6)), or
    (e4m3_scale) an E4M3-rounded scale max(amax, 6*2^-9) / 6 (V4.1 compressed KV, block 16)."""
    b = _blocks(x, block)
    amax = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
    if e4m3_scale:
        scale = ref.fp8_values((jnp.maximum(amax, 6 * 2.0 ** -9) / 6).astype(jnp.float8_e4m3fn))
    else:
        scale = _pow2_ceil(jnp.maximum(amax, 6 * 2.0 ** -126) / 6)
    q = _round_e2m1(jnp.clip(b / scale, -6.0, 6.0)) * scale
    return q.reshape(x.shape).astype(x.dtype)
