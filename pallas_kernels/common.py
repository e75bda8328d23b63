"""What the kernel wrappers share: the backend query behind `interpret=None` (and `lowering_for_hopper`, which
answers as a Hopper GPU on any host, for lowering a step for CUDA from a CPU), the zero padding that
brings head counts and head dims to the power-of-two sizes the Triton lowering needs, the in-kernel decoders
of UE8M0 scales and packed FP4 (E2M1) tiles (MoE experts, indexer keys), the three-bf16-term split of float32
operands (`split_bf16x3`: float32 linears on bf16 MMAs) and the MoE kernels' SwiGLU epilogue."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax


_FOR_HOPPER = False   # inside `lowering_for_hopper()`


@contextlib.contextmanager
def lowering_for_hopper():
    """Within: the wrappers choose their kernels as on a Hopper GPU (compiled, not interpreted) whatever the host,
    so that a CPU machine can lower a whole step for CUDA (`.lower(lowering_platforms=("cuda",))`) and time it.
    jax's caches are cleared on entry and exit: a trace made on one side must not serve the other."""
    global _FOR_HOPPER
    before = _FOR_HOPPER
    jax.clear_caches()
    _FOR_HOPPER = True
    try:
        yield
    finally:
        _FOR_HOPPER = before
        jax.clear_caches()


def on_gpu() -> bool:
    """True where jax's default backend is a GPU (compile the kernels); elsewhere they are interpreted."""
    return _FOR_HOPPER or jax.default_backend() == "gpu"


def on_hopper() -> bool:
    """True where the first device is a Hopper GPU (compute capability 9.x: wgmma, TMA; Mosaic GPU kernels)."""
    if _FOR_HOPPER:
        return True
    d = jax.devices()[0]
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9")


def interpret_flag(backend: str, interpret):
    """A wrapper's `interpret` argument as its pallas_call wants it. backend "triton" or "mgpu";
    interpret None -> interpret on a CPU; True -> the backend's interpreter (Mosaic GPU: an
    InterpretGPUParams, or the one given); False -> compile."""
    if interpret is None:
        interpret = not on_gpu()
    if not interpret:
        return None if backend == "mgpu" else False
    if backend == "mgpu":
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        return interpret if not isinstance(interpret, bool) else InterpretGPUParams()
    return True


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """x padded with `value` at the end of `axis` to length `size` (x itself when already that long)."""
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def e8m0(b):
    """uint8/int exponent bytes -> float32 2^(b-127) (b=0 -> 2^-127, b=255 -> NaN), elementwise in-kernel."""
    b = b.astype(jnp.int32)
    v = lax.bitcast_convert_type(b << 23, jnp.float32)
    v = jnp.where(b == 0, jnp.float32(2.0 ** -127), v)
    return jnp.where(b == 255, jnp.float32(jnp.nan), v)


FP4_FOLD = 2.0 ** 14   # e2m1_pair returns E2M1 values / 2^14; the kernels multiply their accumulators back


def e2m1_pair(p):
    """Packed E2M1 bytes (int32, sign-extended) -> (even, odd) column values / 2^14 as float32.

    Each nibble s|e1 e0|m is moved into an f16 bit pattern with the sign at bit 15, e1 e0 as the low two
    exponent bits and m as the top mantissa bit: that f16 is exactly e2m1 * 2^-14 for every code (e=0 lands
    on the f16 subnormals 0 and 2^-15). The f16 -> f32 conversion is exact, so no lookup table and no select.
    """
    lo = ((p & 0x7) << 9) | ((p & 0x8) << 12)
    hi = ((p & 0x70) << 5) | ((p & 0x80) << 8)
    f = lambda b: lax.bitcast_convert_type(b.astype(jnp.int16), jnp.float16).astype(jnp.float32)  # noqa: E731
    return f(lo), f(hi)


def fp4_tile(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """An FP4 tile in a kernel: packed E2M1 bytes [r, c] (column pairs, low nibble first) and their UE8M0
    exponent bytes [r, c / 16] (one per 32 logical columns) -> (even, odd) logical columns [r, c] float32,
    scaled, still divided by FP4_FOLD."""
    r, c = packed.shape
    full = jnp.broadcast_to(e8m0(scale)[:, :, None], (r, c // 16, 16)).reshape(r, c)
    lo, hi = e2m1_pair(packed.astype(jnp.int32))
    return lo * full, hi * full


def split_bf16x3(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 w -> bf16 (hi, mid, lo) with hi + mid + lo = w within float32 rounding, each product with a bf16
    value exact in a float32 accumulator. hi and mid are w's top mantissa bits cut off by a bit mask, not rounded
    conversions: XLA on the GPU (excess precision allowed) folds a float32 -> bf16 -> float32 round trip into the
    identity, which would make w - hi zero."""
    def top(v):
        return lax.bitcast_convert_type(lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32)
    hi = top(w)
    mid = top(w - hi)
    return hi.astype(jnp.bfloat16), mid.astype(jnp.bfloat16), (w - hi - mid).astype(jnp.bfloat16)


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    """In-kernel clamped SwiGLU of float32 gate and up: silu(min(g, L)) * clip(u, -L, L) (no clamp for L <= 0)."""
    if limit > 0:
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
    return g / (1.0 + jnp.exp(-g)) * u
