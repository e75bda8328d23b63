"""Apply the tables to a model, a batch and a cache on a (dp, ep, tp) mesh.

`init_sharded` / `shard_model` give a model whose arrays live where `rules.param_shardings` says
and whose MoE layers run expert parallel (`expert_parallel.attach`); `shard_batch` and
`allocate_cache` lay out inputs and caches; `to_host` brings a (possibly multi-process) global
array back as numpy. Every function works with one process or many (each process passes the
same full host data; only its own devices' slices are transferred).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from . import batch_parallel, expert_parallel as ep_mod
from .mesh import check_batch, parallel_config
from .rules import batch_sharding, cache_shardings, param_shardings, param_spec


def _attach(model, mesh: Mesh, config=None, placements=None):
    """The mesh's hooks: expert parallel MoE and per-batch-shard attention kernels."""
    batch_parallel.attach(model, mesh)
    return ep_mod.attach(model, mesh, config, placements)


def _validate(cfg, mesh: Mesh, config=None, placements=None) -> None:
    slots = None
    if placements is not None:
        one = placements if not isinstance(placements, dict) else next(iter(placements.values()), None)
        slots = None if one is None else one.num_slots
    parallel_config(mesh).validate(cfg, num_devices=int(mesh.devices.size), num_expert_slots=slots)


def init_sharded(cfg, seed: int = 0, dtype="float32", mesh: Mesh | None = None, config=None, placements=None,
                 token_map=None):
    """A random model born sharded, built piece by piece (`model.transformer.construction_plan`: embedding,
    each layer, draft stages, head) with one compiled program per distinct piece, whose out_shardings are
    the table's. No full copy on any device (in a multi-process job each process materialises only its own
    shards), and compile time does not grow with depth: one program for all 43 V4-Flash layers took XLA
    >430 s on the H200 host (its slow-compile alarm; CPU: 4.6 s per layer). The RNG state is threaded from
    piece to piece, so the values equal `init_random(cfg, seed, dtype)` on one device."""
    from model.transformer import _fast_tracing, abstract_model, construction_plan, engram_hasher

    _validate(cfg, mesh, config, placements)
    graphdef, state = nnx.split(abstract_model(cfg, dtype, token_map=token_map))
    shardings = param_shardings(state, mesh)
    hasher = engram_hasher(cfg, token_map, placeholder_map=True)
    rng_state = nnx.state(nnx.Rngs(params=seed))
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, jax.sharding.PartitionSpec()), rng_state)
    programs: dict = {}
    with _fast_tracing():
        for piece in construction_plan(cfg, dtype, hasher):
            # where the piece's state goes (and its layout): the top level, or one entry of a layer list
            parent, layout = (state, shardings) if piece.index is None else (state[piece.name], shardings[piece.name])
            key = piece.name if piece.index is None else piece.index
            if piece.key not in programs:  # pieces with equal keys share a program (same shapes and layout)
                def build(rng_state, piece=piece):
                    rngs = nnx.Rngs(params=seed)
                    nnx.update(rngs, rng_state)
                    module = piece.build(rngs)
                    return (None if module is None else nnx.state(module)), nnx.state(rngs)
                programs[piece.key] = jax.jit(build, out_shardings=(layout.get(key), replicated))
            value, rng_state = programs[piece.key](rng_state)
            if value is not None:
                parent[key] = value
    return _attach(nnx.merge(graphdef, state), mesh, config, placements)


def shard_model(model, mesh: Mesh, config=None, placements=None):
    """A copy of `model` with its arrays placed by the table on `mesh` and expert parallel MoE.
    (Arrays already laid out that way are not copied.)"""
    _validate(model.config, mesh, config, placements)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(_place, state, param_shardings(state, mesh))
    return _attach(nnx.merge(graphdef, state), mesh, config, placements)


def _place(x, sharding: NamedSharding):
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)  # multi-process: every process holds the same full value; keep its own slices
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def on_mesh(model, mesh: Mesh) -> bool:
    """True if the model's MoE layers already run on `mesh` (init_sharded / shard_model / load_checkpoint)."""
    plan = ep_mod.plan_of(model)
    return plan is not None and plan.mesh == mesh


def shard_batch(x, mesh: Mesh, what: str = "batch") -> jax.Array:
    """Host array [B, ...] (the full batch, on every process) -> global array split over dp x ep."""
    x = np.asarray(x)
    check_batch(x.shape[0], mesh, what)
    sharding = batch_sharding(mesh, x.ndim)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def allocate_cache(cfg, batch: int, max_len: int, dtype, mesh: Mesh, spec_room: int = 8):
    """`model.cache.allocate` born sharded (cache_shardings: batch over dp x ep)."""
    from model.cache import allocate

    check_batch(batch, mesh, "cache batch")
    make = lambda: allocate(cfg, batch, max_len, dtype, spec_room)  # noqa: E731
    shardings = cache_shardings(jax.eval_shape(make), mesh)
    return jax.jit(make, out_shardings=shardings)()


def to_host(x) -> np.ndarray:
    """A global array -> numpy on every process (gathers across processes where needed)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def local_experts(num_experts: int, mesh: Mesh) -> frozenset[int]:
    """Expert indices (leading axis of the stacked expert arrays) held by this process's devices."""
    sharding = NamedSharding(mesh, jax.sharding.PartitionSpec("ep"))
    held = set()
    for idx in sharding.addressable_devices_indices_map((num_experts,)).values():
        held.update(range(num_experts)[idx[0]])
    return frozenset(held)


def make_sharded_array(shape, dtype, sharding: NamedSharding, fetch) -> jax.Array:
    """Global array from `fetch(index) -> np.ndarray` called only for this process's shards."""
    return jax.make_array_from_callback(tuple(shape), sharding, lambda idx: np.asarray(fetch(idx), dtype))



# ----------------------------------------------------------------------------- loading

_EXPERT_TENSOR = re.compile(r"^(layers|mtp)\.(\d+)\..*\.experts\.(\d+)\.")


def local_expert_tensors(items, cfg, mesh: Mesh):
    """Filter (official name, array) pairs down to the routed-expert tensors this process's devices
    hold (weights and scales alike); everything else passes. Placed before dequantisation, so the
    memory-mapped tensors of other processes' experts are never read."""
    held: dict[int, frozenset[int]] = {}
    for name, arr in items:
        m = _EXPERT_TENSOR.match(name)
        if m:
            layer = int(m.group(2)) + (cfg.num_layers if m.group(1) == "mtp" else 0)
            if layer not in held:
                n = cfg.layer_spec(layer).n_experts or cfg.n_routed_experts
                held[layer] = local_experts(n, mesh)
            if int(m.group(3)) not in held[layer]:
                continue
        yield name, arr


def skipped_expert_names(expected: dict, mesh: Mesh) -> set[str]:
    """Of build_from_tensors' {name: (leaf, expert index)}, the expert tensors other processes load."""
    sizes: dict[int, int] = {}
    for name, (leaf, e) in expected.items():
        if e is not None:
            sizes[leaf] = max(sizes.get(leaf, 0), e + 1)
    held = {leaf: local_experts(n, mesh) for leaf, n in sizes.items()}
    return {name for name, (leaf, e) in expected.items() if e is not None and e not in held[leaf]}


def place_loaded(graphdef, flat, buffers, mesh: Mesh, config=None):
    """build_from_tensors' host buffers -> a model with global arrays laid out by the table (each
    device gets only its slice) and expert parallel MoE."""
    from model.checkpoint import path_to_official

    leaves = []
    for (path, var), buf in zip(flat, buffers):
        sharding = NamedSharding(mesh, param_spec(path_to_official(path), var.shape, mesh))
        arr = jax.make_array_from_callback(tuple(var.shape), sharding, lambda idx, b=buf: b[idx])
        leaves.append((path, var.replace(arr)))
    model = nnx.merge(graphdef, nnx.from_flat_state(leaves))
    parallel_config(mesh).validate(model.config, num_devices=int(mesh.devices.size))
    return _attach(model, mesh, config)


# ----------------------------------------------------------------------------- memory

def memory_per_device(cfg, dp: int = 1, ep: int = 1, tp: int = 1, seqs_per_device: int = 1,
                      max_len: int = 131072, dtype="bfloat16") -> dict:
    """Bytes per device of parameters and caches from abstract shapes (no devices needed) under the
    table's layout. `params` holds weights as this model keeps them (`dtype`, or as shipped where the config
    says: FP8 + block scales with cfg.dense_weights="fp8", FP4 + scales with cfg.expert_weights="fp4");
    `params_fp4_experts` counts routed experts as released (FP4 + one UE8M0 scale per 32 values; an FP4 model
    holds the scales as bf16, one byte more per 32 values);
    `engram` is the part of `params` in replicated Engram tables (V4.1, device placement);
    `cache` is `seqs_per_device` sequences of `max_len` positions (each sequence lives on one device)."""
    from model.cache import memory_estimate
    from model.transformer import abstract_model

    from .rules import _official_name, param_specs

    shape = {"dp": dp, "ep": ep, "tp": tp}
    state = nnx.state(abstract_model(cfg, dtype))
    specs = param_specs(state)
    out = {"params": 0, "params_fp4_experts": 0, "engram": 0}
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(state)[0], flat_specs):
        n = 1
        for entry in spec:
            for a in ((entry,) if isinstance(entry, str) else (entry or ())):
                n *= shape.get(a, 1)
        count = int(np.prod(leaf.shape)) // n
        size = count * np.dtype(leaf.dtype).itemsize
        name = _official_name(path)
        out["params"] += size
        if ".experts." in name and name.endswith(".scale"):   # FP4 models' scales: one UE8M0 byte as released
            out["params_fp4_experts"] += count                 # (held as bf16, fp4_kernel_scales)
        elif ".experts." in name and jnp.issubdtype(leaf.dtype, jnp.floating):   # dense experts as released
            out["params_fp4_experts"] += count * (0.5 + 1 / 32)
        else:
            out["params_fp4_experts"] += size
        if ".engram." in name:
            out["engram"] += size
    out["cache"] = seqs_per_device * memory_estimate(cfg, max_len)["bytes_per_sequence_at_max_len"]
    return out
