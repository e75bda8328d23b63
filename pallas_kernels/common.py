"""What the kernel wrappers share: the backend query behind `interpret=None`, and the zero padding that
brings head counts and head dims to the power-of-two sizes the Triton lowering needs."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def on_gpu() -> bool:
    """True where jax's default backend is a GPU (compile the kernels); elsewhere they are interpreted."""
    return jax.default_backend() == "gpu"


def on_hopper() -> bool:
    """True where the first device is a Hopper GPU (compute capability 9.x: wgmma, TMA; Mosaic GPU kernels)."""
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
