"""ParallelConfig -> jax.sharding.Mesh with axes (dp, ep, tp); multi-host start-up (DESIGN.md
"Sharding by table").

* `dp`  data parallel: attention runs on its own slice of the batch, weights replicated.
* `ep`  expert parallel: routed experts are split over it; attention is data parallel over it too
        (the batch of activations and caches is split over dp x ep, as DeepInfer's DP-attention + EP).
* `tp`  tensor parallel (optional): attention heads, the output-projection groups and the experts'
        intermediate width are split over it.

Axis types are always given explicitly. The default is `AxisType.Auto` (the compiler propagates
shardings from the parameters, caches and inputs); `axis_type="explicit"` builds an
`AxisType.Explicit` mesh (jax's default in 0.10) for code that annotates its own out-shardings; the
model's forward does not yet (its first gather, the embedding, raises a ShardingTypeError there).

Multi-host: every process calls `initialize_multihost(coordinator, num_processes, process_id)` before
touching devices, then builds the same `ParallelConfig(...).make_mesh()` over all global devices.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("dp", "ep", "tp")
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the three mesh axes; their product must equal the number of (global) devices."""

    dp: int = 1
    ep: int = 1
    tp: int = 1
    axis_type: str = "auto"  # "auto" | "explicit"

    def __post_init__(self):
        for axis in AXES:
            v = getattr(self, axis)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ParallelConfig.{axis} must be a positive integer, got {v!r}")
        if self.axis_type not in AXIS_TYPES:
            raise ValueError(f"ParallelConfig.axis_type must be one of {sorted(AXIS_TYPES)}, got {self.axis_type!r}")

    @property
    def num_devices(self) -> int:
        return self.dp * self.ep * self.tp

    @property
    def batch_shards(self) -> int:
        """How many pieces the batch of activations and caches is cut into (dp x ep)."""
        return self.dp * self.ep

    def __str__(self) -> str:
        return f"dp={self.dp} ep={self.ep} tp={self.tp}"

    def validate(self, cfg=None, num_devices: int | None = None, batch: int | None = None,
                 num_expert_slots: int | None = None) -> "ParallelConfig":
        """Raise ValueError if this layout cannot run `cfg` on `num_devices` devices with `batch` sequences.

        `num_expert_slots`: physical expert slots when redundant experts are placed (default: the
        config's routed experts).
        """
        if num_devices is not None and self.num_devices != num_devices:
            raise ValueError(f"ParallelConfig({self}) needs dp*ep*tp = {self.num_devices} devices, "
                             f"but {num_devices} are available")
        if cfg is not None:
            if num_expert_slots is not None and num_expert_slots % self.ep:
                raise ValueError(f"{cfg.name}: {num_expert_slots} expert slots (routed + redundant) are not "
                                 f"divisible by ep={self.ep}")
            for i in range(cfg.num_blocks):  # every MoE layer, draft layers included
                n = cfg.layer_spec(i).n_experts or cfg.n_routed_experts
                if num_expert_slots is None and n % self.ep:
                    where = f"draft layer {i - cfg.num_layers}" if i >= cfg.num_layers else f"layer {i}"
                    raise ValueError(f"{cfg.name}: {n} routed experts ({where}) are not divisible by ep={self.ep}")
            for field, value in (("num_heads", cfg.num_heads), ("o_groups", cfg.o_groups),
                                 ("moe_intermediate_size", cfg.moe_intermediate_size)):
                if value % self.tp:
                    raise ValueError(f"{cfg.name}: {field}={value} is not divisible by tp={self.tp}")
        if batch is not None:
            check_batch(batch, self)
        return self

    def make_mesh(self, devices: Sequence | None = None) -> Mesh:
        """The mesh over `devices` (default: all global devices, every process's)."""
        devices = list(jax.devices() if devices is None else devices)
        self.validate(num_devices=len(devices))
        kind = AXIS_TYPES[self.axis_type]
        return jax.make_mesh((self.dp, self.ep, self.tp), AXES, axis_types=(kind,) * 3, devices=devices)


def make_mesh(dp: int = 1, ep: int = 1, tp: int = 1, *, cfg=None, axis_type: str = "auto",
              devices: Sequence | None = None) -> Mesh:
    """Shorthand: `ParallelConfig(dp, ep, tp).validate(cfg).make_mesh(devices)`."""
    pc = ParallelConfig(dp, ep, tp, axis_type)
    pc.validate(cfg)
    return pc.make_mesh(devices)


def parallel_config(mesh: Mesh) -> ParallelConfig:
    """Read a (dp, ep, tp) mesh back as a ParallelConfig (ValueError for other axis names)."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"expected a mesh with axes {AXES} (from ParallelConfig.make_mesh), "
                         f"got axes {tuple(mesh.axis_names)}")
    kinds = {t for t in mesh.axis_types}
    kind = "explicit" if kinds == {AxisType.Explicit} else "auto"
    return ParallelConfig(*(int(mesh.shape[a]) for a in AXES), axis_type=kind)


def check_batch(batch: int, mesh_or_config, what: str = "batch") -> None:
    """The batch of activations and caches is split over dp x ep: it must divide evenly."""
    pc = mesh_or_config if isinstance(mesh_or_config, ParallelConfig) else parallel_config(mesh_or_config)
    if batch % pc.batch_shards:
        raise ValueError(f"{what} of {batch} sequences cannot be split over dp*ep = {pc.batch_shards} "
                         f"({pc}); use a multiple of {pc.batch_shards}")


def describe(mesh: Mesh) -> dict:
    """A small record of a mesh for results files: axis sizes, types, devices, processes."""
    pc = parallel_config(mesh)
    dev = mesh.devices.flat[0]
    return {"dp": pc.dp, "ep": pc.ep, "tp": pc.tp, "axis_type": pc.axis_type,
            "devices": int(mesh.devices.size), "platform": dev.platform,
            "device_kind": getattr(dev, "device_kind", "?"), "processes": jax.process_count()}


def initialize_multihost(coordinator: str, num_processes: int, process_id: int,
                         local_device_ids: Sequence[int] | None = None, timeout_s: int = 300) -> None:
    """Join a multi-process JAX job (one process per host, or several per host on CPU).

    coordinator: "host:port" of process 0 (every process passes the same address);
    num_processes, process_id: this job's size and this process's rank in [0, num_processes).
    Call before anything touches a device. Afterwards `jax.devices()` lists every process's devices
    and a mesh built from them spans all hosts; arrays are global and each process holds the shards
    of its own devices (`jax.local_devices()`).
    """
    if not isinstance(coordinator, str) or ":" not in coordinator:
        raise ValueError(f"coordinator must be 'host:port', got {coordinator!r}")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} must be in [0, num_processes={num_processes})")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids,
                               initialization_timeout=timeout_s)
