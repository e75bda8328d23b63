"""Sharding by table (DESIGN.md): every parameter and cache array gets logical axis names from one
table, and one table maps logical axes to mesh axes. Changing a strategy means editing a table.

PARAM_RULES    regex (full match) on the official-style parameter name (`model.checkpoint.path_to_official`:
               `layers.3.attn.wq_b.weight`, `layers.3.ffn.experts.{e}.w1.weight`, ...) -> logical axes
CACHE_RULES    regex on the cache array's path (`lengths`, `layers.3.kv`, `layers.3.comp.proj_a`, ...)
LOGICAL_AXIS_RULES  logical axis -> mesh axis, tuple of mesh axes, or None (replicated)

The defaults: attention, router, mHC, compressor and indexer weights are replicated (attention is
data parallel); routed experts are split over `ep` on their leading axis; the batch of activations
and caches is split over (dp, ep); with tp > 1, query heads / output-projection groups / the experts'
intermediate width are split over `tp`. A spec that uses one mesh axis twice raises ValueError,
and so does a dimension that the mesh axes do not divide.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# ----------------------------------------------------------------------------- the tables

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
    "engram_rows": None,
}

# First match wins. Logical tuples shorter than the array's rank are padded with None. The UE8M0 block
# scales of weights held FP8 (cfg.dense_weights="fp8", `<name>.scale` [ceil(out/B), ceil(in/B)]) follow
# their weight's rule, so a shard holds the scales of its own blocks; a mesh axis must then divide the
# scale grid too (each shard whole blocks: true at full size, not for every tiny config with tp > 1).
PARAM_RULES: list[tuple[str, tuple]] = [
    (r"embed\.weight", ("vocab", "embed")),
    (r"head\.weight", ("vocab", "embed")),
    # attention (data parallel; tp splits heads and output groups)
    (r".*\.attn\.wq_b\.(weight|scale)", ("heads", "q_lora")),
    (r".*\.attn\.attn_sink", ("heads",)),
    (r".*\.attn\.wo_a\.(weight|scale)", ("o_groups", None)),
    (r".*\.attn\.wo_b\.(weight|scale)", ("embed", "o_groups")),
    (r".*\.attn\.(wq_a|wkv)\.(weight|scale)", (None, "embed")),
    (r".*\.attn\.(indexer\.)?compressor\.(wkv|wgate)\.weight", ("compressor", "embed")),
    (r".*\.attn\.(indexer\.)?compressor\.ape", (None, "compressor")),
    (r".*\.attn\.indexer\.wq_b\.(weight|scale)", ("index_heads", "q_lora")),
    (r".*\.attn\.indexer\.weights_proj\.weight", ("index_heads", "embed")),
    (r".*\.attn\.indexer\.wk\.weight", (None, "embed")),                     # [V4.1] own index keys
    (r".*\.attn\.indexer\.k_norm\.weight", ("norm",)),
    # MoE: routed experts over ep; router and shared expert replicated
    (r".*\.ffn\.experts\.\{e\}\.w[13]\.weight", ("experts", "expert_mlp", "embed")),   # FP4: packed alike
    (r".*\.ffn\.experts\.\{e\}\.w2\.weight", ("experts", "embed", "expert_mlp")),
    # FP4 scales are held transposed ([E, in/32, out]: pallas_kernels.moe.fp4_kernel_scales)
    (r".*\.ffn\.experts\.\{e\}\.w[13]\.scale", ("experts", "embed", "expert_mlp")),
    (r".*\.ffn\.experts\.\{e\}\.w2\.scale", ("experts", "expert_mlp", "embed")),
    (r".*\.ffn\.gate\.weight", ("router", "embed")),
    (r".*\.ffn\.gate\.bias", ("router",)),
    (r".*\.ffn\.gate\.tid2eid", ("vocab", "router")),
    (r".*\.ffn\.shared_experts\.w[13]\.(weight|scale)", ("mlp", "embed")),
    (r".*\.ffn\.shared_experts\.w2\.(weight|scale)", ("embed", "mlp")),
    # norms, hyper-connections, MTP input projections
    (r"(.*\.)?(norm|attn_norm|ffn_norm|q_norm|kv_norm|enorm|hnorm)\.weight", ("norm",)),
    (r"(.*\.)?hc_(attn|ffn|head)_(fn|base|scale)", ("hc",)),
    (r"mtp\.\d+\.(e_proj|h_proj)\.(weight|scale)", (None, "embed")),
    # [V4.1] Engram: the tables stay replicated (the full-size row counts do not divide evenly by a
    # mesh; host / sharded Engram placement is its own issue); DSpark heads replicated
    (r".*\.engram\.embed\.weight", ("engram_rows", None)),
    (r".*\.engram\.(wkv\.(weight|scale)|k_weight|q_weight)", (None, "embed")),
    (r"mtp\.\d+\.main_proj\.(weight|scale)", ("embed", None)),
    (r"mtp\.\d+\.main_norm\.weight", ("norm",)),
    (r"mtp\.\d+\.(markov_head\.(embed|head)|confidence_head\.proj)\.weight", ("vocab", None)),
]
# Parameters no rule names are replicated (never a wrong answer, only memory); strict=True raises.
DEFAULT_PARAM_AXES: tuple = ()

CACHE_RULES: list[tuple[str, tuple]] = [
    (r"lengths", ("batch",)),
    (r".*\.kv", ("batch", "window", "head_dim")),
    (r".*\.(comp|index)\.proj_[ag]", ("batch", "ring", "compressor")),
    (r".*\.(comp|index)\.entries", ("batch", "entries", "head_dim")),
    (r".*", ("batch",)),  # model/cache.py: every cache array has the batch on axis 0
]

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


# ----------------------------------------------------------------------------- parameters

def _key_name(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _match(rules_list, name: str, default=None, what: str = "array"):
    for pattern, logical in rules_list:
        if re.fullmatch(pattern, name):
            return logical
    if default is None:
        raise ValueError(f"no sharding rule for {what} {name!r}; add one to sharding/rules.py")
    return default


def _state_of(model_or_state) -> nnx.State:
    return model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)


def _official_name(path) -> str:
    from model.checkpoint import path_to_official

    keys = [_key_name(k) for k in path]
    if keys and keys[-1] == "value":  # nnx Variables flatten to their value
        keys = keys[:-1]
    return path_to_official(tuple(keys))


def param_logical_axes(model_or_state, strict: bool = False) -> dict[str, tuple]:
    """Official-style name -> logical axes (padded to the rank) of every array in the model's state."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(_state_of(model_or_state))[0]:
        name = _official_name(path)
        logical = _match(PARAM_RULES, name, None if strict else DEFAULT_PARAM_AXES, "parameter")
        out[name] = tuple(logical) + (None,) * (len(leaf.shape) - len(logical))
    return out


def param_spec(name: str, shape: tuple, mesh: Mesh | None = None, strict: bool = False, rules=None) -> P:
    """PartitionSpec of one parameter, by its official-style name."""
    logical = _match(PARAM_RULES, name, None if strict else DEFAULT_PARAM_AXES, "parameter")
    return logical_to_spec(tuple(logical), mesh, shape=tuple(shape), name=name, rules=rules)


def param_specs(model_or_state, mesh: Mesh | None = None, strict: bool = False, rules=None):
    """The model's state (nnx.State) with a PartitionSpec in place of every array."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: param_spec(_official_name(path), leaf.shape, mesh, strict, rules),
        _state_of(model_or_state))


def param_shardings(model_or_abstract, mesh: Mesh, strict: bool = False, rules=None):
    """Model (concrete or `abstract_model`) or its nnx.State -> the same State with a NamedSharding
    per array (usable as jit out_shardings or with jax.device_put)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(model_or_abstract, mesh, strict, rules),
                        is_leaf=lambda x: isinstance(x, P))


# ----------------------------------------------------------------------------- caches

def _path_name(path) -> str:
    return ".".join(_key_name(k) for k in path)


def cache_specs(cache, mesh: Mesh | None = None, rules=None):
    """Cache pytree (concrete or from jax.eval_shape) -> same structure of PartitionSpecs."""

    def spec(path, leaf):
        name = _path_name(path)
        return logical_to_spec(_match(CACHE_RULES, name, what="cache array"), mesh, shape=tuple(leaf.shape),
                               name=f"cache {name}", rules=rules)

    return jax.tree_util.tree_map_with_path(spec, cache)


def cache_shardings(cache, mesh: Mesh, rules=None):
    """Cache pytree -> same structure of NamedShardings (batch over dp x ep by default)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(cache, mesh, rules),
                        is_leaf=lambda x: isinstance(x, P))


# ----------------------------------------------------------------------------- memory

def bytes_per_device(tree, specs, mesh_shape: Mapping[str, int]) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) laid out by `specs`
    (matching PartitionSpecs) on a mesh of `mesh_shape` {axis: size} (no mesh object needed)."""
    total = 0
    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for leaf, spec in zip(leaves, spec_leaves):
        n = 1
        for entry in spec:
            for a in ((entry,) if isinstance(entry, str) else (entry or ())):
                n *= mesh_shape.get(a, 1)
        total += int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize // n
    return total
