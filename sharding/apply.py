"""Global arrays on a (dp, ep, tp) mesh from host data, and back.

`place` lays out one array by a sharding, `shard_batch` splits a batch over dp x ep, `to_host` brings a
(possibly multi-process) global array back as numpy, and `local_experts` says which slices of an
expert axis this process's devices hold. Every function works with one process or many (each process
passes the same full host data; only its own devices' slices are transferred).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .mesh import check_batch
from .rules import batch_sharding


def place(x, sharding: NamedSharding) -> jax.Array:
    """An array (on a device or the host) -> the global array laid out by `sharding` (an array already laid
    out that way is not copied). Multi-process: every process holds the same full value and keeps its
    own slices."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_batch(x, mesh: Mesh, what: str = "batch") -> jax.Array:
    """Host array [B, ...] (the full batch, on every process) -> global array split over dp x ep."""
    x = np.asarray(x)
    check_batch(x.shape[0], mesh, what)
    sharding = batch_sharding(mesh, x.ndim)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x) -> np.ndarray:
    """A global array -> numpy on every process (gathers across processes where needed)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def local_experts(num_experts: int, mesh: Mesh) -> frozenset[int]:
    """Indices along an expert axis of `num_experts` split over `ep` that this process's devices hold."""
    sharding = NamedSharding(mesh, P("ep"))
    held = set()
    for idx in sharding.addressable_devices_indices_map((num_experts,)).values():
        held.update(range(num_experts)[idx[0]])
    return frozenset(held)
