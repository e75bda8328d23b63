"""Sharding by table (DESIGN.md): arrays carry logical axis names, and one table maps logical axes to
mesh axes. Changing a strategy means editing a table.

LOGICAL_AXIS_RULES  logical axis -> mesh axis, tuple of mesh axes, or None (replicated)

Which logical axes an array has is its owner's business: the model names its parameters' and caches'
axes by regex on their names (model/sharded.py PARAM_RULES, CACHE_RULES), looked up by `axes_by_name`.
The defaults: attention, router, mHC, compressor and indexer weights are replicated (attention is data
parallel); routed experts are split over `ep` on their leading axis; the batch of activations and
caches is split over (dp, ep); with tp > 1, query heads / output-projection groups / the experts'
intermediate width are split over `tp`; [V4.1] split Engram tables lie in row ranges over all three axes
(sharding.row_lookup). A spec that uses one mesh axis twice raises ValueError, and so
does a dimension that the mesh axes do not divide.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

LOGICAL_AXIS_RULES: dict[str, Any] = {
    "batch": ("dp", "ep"),     # activations and caches: DP attention over every device of a tp group
    "experts": "ep",           # stacked routed experts [E, ...]
    "expert_mlp": "tp",        # routed experts' intermediate width I
    "heads": "tp",             # attention query heads (wq_b rows = heads x head_dim, sinks)
    "o_groups": "tp",          # grouped output projection (wo_a rows = groups x o_lora, wo_b columns)
    "vocab": None,
    "embed": None,
    "mlp": None,               # shared expert's intermediate width
    "index_heads": None,
    "q_lora": None,
    "head_dim": None,
    "hc": None,
    "norm": None,
    "router": None,
    "compressor": None,
    "window": None,
    "ring": None,
    "entries": None,
    "engram_rows": None,       # [V4.1] an Engram table kept whole on every device (placement "device")
    "engram_split": ("dp", "ep", "tp"),   # an Engram table's rows split over every device ("sharded", "host")
    "layers": None,            # a scanned layer group's repeats (stacked arrays' leading axis): never sharded
}

# ----------------------------------------------------------------------------- logical -> mesh


def _mesh_axes(logical, rules: Mapping[str, Any]) -> tuple[str, ...]:
    if logical is None:
        return ()
    if logical not in rules:
        raise ValueError(f"logical axis {logical!r} has no entry in LOGICAL_AXIS_RULES")
    target = rules[logical]
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def logical_to_spec(logical: tuple, mesh: Mesh | None = None, *, shape: tuple | None = None,
                    name: str = "array", rules: Mapping[str, Any] | None = None) -> P:
    """Logical axes -> PartitionSpec. Raises ValueError when a mesh axis is used twice, when the
    mesh lacks an axis, or (with `shape`) when a dimension is not divisible by its mesh axes."""
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    if shape is not None:
        if len(logical) > len(shape):
            raise ValueError(f"{name}: {len(logical)} logical axes {logical} for an array of rank {len(shape)}")
        logical = tuple(logical) + (None,) * (len(shape) - len(logical))
    used: dict[str, Any] = {}
    entries = []
    for dim, lg in enumerate(logical):
        axes = _mesh_axes(lg, rules)
        for a in axes:
            if a in used:
                raise ValueError(f"{name}: mesh axis {a!r} is used twice in one spec "
                                 f"(logical axes {used[a]!r} and {lg!r} of {tuple(logical)})")
            if mesh is not None and a not in mesh.shape:
                raise ValueError(f"{name}: logical axis {lg!r} maps to mesh axis {a!r}, "
                                 f"not in the mesh's axes {tuple(mesh.axis_names)}")
            used[a] = lg
        if mesh is not None:
            axes = tuple(a for a in axes if mesh.shape[a] > 1)  # size-1 axes: same layout, simpler specs
        if shape is not None and mesh is not None and axes:
            n = math.prod(mesh.shape[a] for a in axes)
            if shape[dim] % n:
                raise ValueError(f"{name}: dimension {dim} ({lg}) of size {shape[dim]} is not divisible by "
                                 f"{'x'.join(axes)} = {n}")
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def batch_spec(mesh: Mesh | None = None, ndim: int = 1, rules=None) -> P:
    """Activations [B, ...]: the batch over (dp, ep) by default."""
    return logical_to_spec(("batch",) + (None,) * (ndim - 1), mesh, rules=rules, name="batch")


def batch_sharding(mesh: Mesh, ndim: int = 1, rules=None) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(mesh, ndim, rules))


# ----------------------------------------------------------------------------- name tables

NameTable = Sequence[tuple[str, tuple]]  # (regex, logical axes): first full match wins


def key_name(k) -> str:
    """One entry of a jax pytree path (dict key, sequence index, attribute) as text."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_name(path) -> str:
    """A pytree path as a dotted name (`layers.3.kv`)."""
    return ".".join(key_name(k) for k in path)


def axes_by_name(table: NameTable, name: str, default: tuple | None = None, what: str = "array",
                 where: str = "its owner's name table") -> tuple:
    """The logical axes of the first rule of `table` whose regex fully matches `name` (else `default`; None:
    ValueError naming the array and `where` to add a rule)."""
    for pattern, logical in table:
        if re.fullmatch(pattern, name):
            return tuple(logical)
    if default is None:
        raise ValueError(f"no sharding rule for {what} {name!r}; add one to {where}")
    return tuple(default)


def tree_shardings(specs, mesh: Mesh):
    """A pytree of PartitionSpecs -> the same structure of NamedShardings (jit out_shardings, device_put)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
