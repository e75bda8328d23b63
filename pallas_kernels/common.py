"""What the kernel wrappers share: the backend query behind `interpret=None`, and the zero padding that
brings head counts and head dims to the power-of-two sizes the Triton lowering needs."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def on_gpu() -> bool:
    """True where jax's default backend is a GPU (compile the kernels); elsewhere they are interpreted."""
    return jax.default_backend() == "gpu"


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
