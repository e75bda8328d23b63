"""Will it fit: the bytes a model's parameters and a cache need against what the device has free, checked
before anything is built (`init_random`, `load_checkpoint` and `cache.allocate` call it; the CLIs call
`check_fits` before building), so that an impossible request fails in seconds instead of stalling."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np

from .config import ModelConfig

GIB = 1024 ** 3


def available_bytes(device=None) -> int | None:
    """Free memory of `device` (default: the first device): an accelerator's allocator limit minus what is in
    use; on the CPU the host's available memory (Linux /proc/meminfo MemAvailable). None when unknown."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform != "cpu":
        return None
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def require(need: int, what: str, device=None) -> None:
    """Raise MemoryError when `need` bytes (described by `what`) exceed the free memory of `device`."""
    free = available_bytes(device)
    if free is not None and need > free:
        device = device or jax.devices()[0]
        raise MemoryError(f"{what} needs {need / GIB:.2f} GiB, but {device} has {free / GIB:.2f} GiB free")


@functools.lru_cache(maxsize=64)
def parameter_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of the model's parameters as it holds them (abstract shapes; held FP8 / FP4 formats included)."""
    from flax import nnx

    from .transformer import abstract_model

    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(nnx.state(abstract_model(cfg, dtype))))


def check_fits(cfg: ModelConfig, dtype="bfloat16", batch: int = 0, max_len: int = 0, spec_room: int = 8,
               device=None) -> None:
    """Raise MemoryError naming the sizes when the parameters in `dtype` plus a cache of `batch` sequences of
    `max_len` positions (none when batch = 0) exceed the free memory of `device`."""
    from .cache import memory_estimate
    from .transformer import resolve_dtype

    dtype = resolve_dtype(dtype)
    name = np.dtype(dtype).name
    params = parameter_bytes(cfg, name)
    what = f"{cfg.name}'s parameters in {name}"
    need = params
    if batch:
        cache = int(batch * memory_estimate(cfg, max_len, dtype, spec_room)["bytes_per_sequence_at_max_len"])
        need += cache
        what += f" ({params / GIB:.2f} GiB) + a cache of {batch} x {max_len} positions ({cache / GIB:.2f} GiB)"
    try:
        require(need, what, device)
    except MemoryError as e:
        raise MemoryError(f"{e}: use a smaller config, bfloat16, FP8 / FP4 weights (dense_weights / expert_weights) "
                          "or a mesh") from None
