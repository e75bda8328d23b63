"""The model built, loaded and placed on one device or a (dp, ep, tp) mesh (DESIGN.md "Sharding by table").

The model names the logical axes of its arrays here, by regex on their names: PARAM_RULES on the
official-style parameter name (`path_to_official`: `layers.3.attn.wq_b.weight`,
`layers.3.ffn.experts.{e}.w1.weight`, ...), CACHE_RULES on the cache array's path (`lengths`,
`layers.3.kv`, `layers.3.comp.proj_a`, ...); `sharding.rules.LOGICAL_AXIS_RULES` maps logical axes to
mesh axes. A scanned layer group's arrays (model/stack.py) carry the group's repeats on a leading axis,
logical axis "layers", which is never sharded: their parameter names read `layers.{l}.…` and their cache
paths `layers.{g}.period.{p}.…`, and the per-layer rule applies to the axes after it. On top of those tables
and sharding's generic tools:

    init_random(cfg, seed, dtype, mesh)      random weights; on a mesh (or with scanned layers) piece by piece
    shard_model(model, mesh, config, placements)   an existing model laid out on a mesh
    allocate_cache(cfg, batch, max_len, dtype, mesh)   a cache born sharded
    local_expert_tensors / skipped_expert_names / place_loaded   `load_checkpoint(mesh=)`: each process
                                             reads only the routed experts its devices hold
    memory_per_device(cfg, dp, ep, tp, ...)  bytes per device from abstract shapes (no devices); and as a line:
                                             describe_memory_per_device

A model on a mesh runs with that mesh's runtime (model/runtime.py: expert parallel MoE, the attention
kernels once per batch shard); every function works with one process or many.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding.apply import local_experts, place
from sharding.row_lookup import HOST_MEMORY, in_host_memory
from sharding.mesh import check_batch, make_mesh
from sharding.rules import axes_by_name, key_name, logical_to_spec, path_name, tree_shardings

from .cache import allocate, batch_axis, memory_estimate
from .config import ModelConfig
from .footprint import check_fits
from .groups import layer_groups
from .runtime import make_runtime
from .transformer import Transformer, _fast_tracing, abstract_model, construction_plan, engram_hasher

# ----------------------------------------------------------------------------- the tables

ENGRAM_TABLE = r"(.*\.)?engram\.embed\.(weight|scale)"  # a table's rows and FP8 scales (of a model, or of a piece)

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
    # [V4.1] Engram: the tables replicated (placement "device"; "sharded" / "host" split their rows over every device:
    # param_rules); DSpark heads replicated
    (ENGRAM_TABLE, ("engram_rows", None)),
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
_WHERE = "model/sharded.py PARAM_RULES"


def param_rules(cfg: ModelConfig | None = None) -> list[tuple[str, tuple]]:
    """PARAM_RULES for a model of `cfg`: [V4.1] with engram_placement "sharded" or "host" the Engram tables' rows
    split over every device ("engram_split": dp x ep x tp; the rows padded to a multiple of the devices on a mesh:
    `pad_engram_tables`)."""
    if cfg is not None and cfg.engram_layer_ids and cfg.engram_placement != "device":
        return [(ENGRAM_TABLE, ("engram_split", None))] + PARAM_RULES
    return PARAM_RULES


def host_resident(cfg: ModelConfig | None, name: str) -> bool:
    """True for the parameters `cfg` holds in host memory ([V4.1] the Engram tables with engram_placement="host")."""
    return cfg is not None and cfg.engram_placement == "host" and re.fullmatch(ENGRAM_TABLE, name) is not None


# ----------------------------------------------------------------------------- names

_STACKED = re.compile(r"^layers\.(\d+)\.period\.(\d+)\.")


def path_to_official(path: tuple) -> str:
    """nnx state path -> official name (stacked experts give the pattern with '{e}', a scanned group's arrays
    the pattern `layers.{l}.…`)."""
    name = ".".join(str(p) for p in path)
    name = _STACKED.sub("layers.{l}.", name)
    name = re.sub(r"(^|\.)engram\.embed\.host\.", r"\1engram.embed.", name)  # a host-resident table (HostTable)
    name = re.sub(r"(^|\.)(hc_(?:attn|ffn|head))\.(fn|base|scale)$", r"\1\2_\3", name)
    m = re.match(r"^(.*\.experts)\.([ws])([123])$", name)
    if m:  # stacked experts; FP4 scales s1..s3 are the official `w1.scale` ...
        return f"{m.group(1)}.{{e}}.w{m.group(3)}.{'weight' if m.group(2) == 'w' else 'scale'}"
    return name


def official_entries(path: tuple, shape: tuple, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """The official tensors one state array holds: (name, index into its leading axes): a scanned group's layers
    on axis 0 (`LayerGroup.layer_ids`), then the routed experts."""
    name = path_to_official(path)
    layers = [((), {})]
    m = _STACKED.match(".".join(str(p) for p in path))
    if m:
        group = next(g for g in layer_groups(cfg) if g.start == int(m.group(1)))
        layers = [((r,), {"l": layer}) for r, layer in enumerate(group.layer_ids(int(m.group(2))))]
    experts = [((), {})]
    if "{e}" in name:
        experts = [((e,), {"e": e}) for e in range(shape[len(layers[0][0])])]
    return [(name.format(**lf, **ef), li + ei) for li, lf in layers for ei, ef in experts]


def _state_name(path) -> str:
    """A jax pytree path into a model's nnx.State -> the parameter's official name."""
    keys = [key_name(k) for k in path]
    if keys and keys[-1] == "value":  # nnx Variables flatten to their value
        keys = keys[:-1]
    return path_to_official(tuple(keys))


def _state_of(model_or_state) -> nnx.State:
    return model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)


# ----------------------------------------------------------------------------- specs

def _config_of(model_or_state, cfg: ModelConfig | None) -> ModelConfig | None:
    return cfg if cfg is not None or isinstance(model_or_state, nnx.State) else model_or_state.config


def param_axes(name: str, strict: bool = False, cfg: ModelConfig | None = None) -> tuple:
    """The logical axes of a parameter by its official-style name (`cfg`: param_rules' choices for its model; a
    scanned group's: "layers" first)."""
    logical = axes_by_name(param_rules(cfg), name, None if strict else DEFAULT_PARAM_AXES, "parameter", _WHERE)
    return (("layers",) if name.startswith("layers.{l}.") else ()) + tuple(logical)


def param_spec(name: str, shape: tuple, mesh: Mesh | None = None, strict: bool = False, rules=None,
               cfg: ModelConfig | None = None) -> P:
    """PartitionSpec of one parameter, by its official-style name (`cfg`: param_rules' choices for its model)."""
    return logical_to_spec(param_axes(name, strict, cfg), mesh, shape=tuple(shape), name=name, rules=rules)


def param_sharding(name: str, shape: tuple, mesh: Mesh, cfg: ModelConfig | None = None, rules=None) -> NamedSharding:
    """The NamedSharding of one parameter: param_spec's layout, in host memory where `cfg` keeps it there."""
    return NamedSharding(mesh, param_spec(name, shape, mesh, rules=rules, cfg=cfg),
                         memory_kind=HOST_MEMORY if host_resident(cfg, name) else None)


def param_logical_axes(model_or_state, strict: bool = False, cfg: ModelConfig | None = None) -> dict[str, tuple]:
    """Official-style name -> logical axes (padded to the rank) of every array in the model's state."""
    cfg = _config_of(model_or_state, cfg)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(_state_of(model_or_state))[0]:
        name = _state_name(path)
        logical = param_axes(name, strict, cfg)
        out[name] = logical + (None,) * (len(leaf.shape) - len(logical))
    return out


def param_specs(model_or_state, mesh: Mesh | None = None, strict: bool = False, rules=None,
                cfg: ModelConfig | None = None):
    """The model's state (nnx.State) with a PartitionSpec in place of every array (`cfg`: the model's, taken from
    a Transformer; give it with a bare State of a model whose rules depend on it)."""
    cfg = _config_of(model_or_state, cfg)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: param_spec(_state_name(path), leaf.shape, mesh, strict, rules, cfg),
        _state_of(model_or_state))


def param_shardings(model_or_abstract, mesh: Mesh, strict: bool = False, rules=None, cfg: ModelConfig | None = None):
    """Model (concrete or `abstract_model`) or its nnx.State -> the same State with a NamedSharding per array
    (usable as jit out_shardings or with jax.device_put); host-resident arrays get the host memory kind."""
    cfg = _config_of(model_or_abstract, cfg)
    specs = param_specs(model_or_abstract, mesh, strict, rules, cfg)
    names = jax.tree_util.tree_map_with_path(lambda path, _: _state_name(path), _state_of(model_or_abstract))
    return jax.tree.map(lambda spec, name: NamedSharding(mesh, spec, memory_kind=HOST_MEMORY if host_resident(
        cfg, name) else None), specs, names, is_leaf=lambda x: isinstance(x, P))


def _split_table(cfg: ModelConfig, name: str) -> bool:
    return cfg.engram_placement != "device" and re.fullmatch(ENGRAM_TABLE, name) is not None


def _pad_rows(x, devices: int):
    """x [R, ...] with zero rows appended up to a multiple of `devices`: concrete arrays padded on the host (numpy),
    tracers in the program (host-resident ones through the device), abstract shapes as shapes."""
    extra = -x.shape[0] % devices
    if not extra:
        return x
    widths = ((0, extra),) + ((0, 0),) * (len(x.shape) - 1)
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((x.shape[0] + extra, *x.shape[1:]), x.dtype)
    if not isinstance(x, jax.core.Tracer):
        return np.pad(np.asarray(x), widths)
    if in_host_memory(x):
        return jax.device_put(jnp.pad(jax.device_put(x, jax.memory.Space.Device), widths), jax.memory.Space.Host)
    return jnp.pad(x, widths)


def pad_engram_tables(state: nnx.State, cfg: ModelConfig, devices: int) -> nnx.State:
    """[V4.1] The state with each split Engram table (engram_placement "sharded" / "host") padded with zero rows to
    a multiple of `devices`, so that every device holds as many rows; whole tables are left as they are."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _pad_rows(x, devices) if _split_table(cfg, _state_name(path)) else x, state)


def cache_specs(cache, mesh: Mesh | None = None, rules=None):
    """Cache pytree (concrete or from jax.eval_shape) -> same structure of PartitionSpecs."""

    def spec(path, leaf):
        name = path_name(path)
        logical = axes_by_name(CACHE_RULES, name, what="cache array", where="model/sharded.py CACHE_RULES")
        logical = ("layers",) * batch_axis(name) + logical
        return logical_to_spec(logical, mesh, shape=tuple(leaf.shape), name=f"cache {name}", rules=rules)

    return jax.tree_util.tree_map_with_path(spec, cache)


def cache_shardings(cache, mesh: Mesh, rules=None):
    """Cache pytree -> same structure of NamedShardings (batch over dp x ep by default)."""
    return tree_shardings(cache_specs(cache, mesh, rules), mesh)


# ----------------------------------------------------------------------------- building and placing

def init_random(cfg: ModelConfig, seed: int = 0, dtype="float32", mesh: Mesh | None = None,
                token_map: np.ndarray | None = None) -> Transformer:
    """A model with random weights (norm weights 1 + 0.1 N, matrices N / sqrt(fan_in), ...). Without a mesh, a
    model that cannot fit the device raises MemoryError before anything is built (`footprint.check_fits`).

    With a (dp, ep, tp) `mesh` (sharding.ParallelConfig) the arrays are born sharded by the tables and
    the model runs with the mesh's runtime; the values equal those of one device to float32 rounding. A model
    with scanned layer groups (cfg.scan_layers) is built piece by piece on one device too: each layer is written
    into its group's stacks in place, where building the blocks and stacking them afterwards held every stacked
    array twice and left the device's memory in holes too small for the next stack (the 24-layer release-format
    V4-Flash could not allocate a 10 GiB stack on the H200 with ~40 GB free).
    """
    if mesh is not None:
        return _init_by_pieces(cfg, mesh, make_runtime(cfg, mesh), seed, dtype, token_map)
    check_fits(cfg, dtype)
    if cfg.scan_layers:
        # on the CPU op by op, as the unrolled build below, so that both layouts hold the same values bitwise; on an
        # accelerator compiled, where one layer's float32 temporaries (FP4 experts: 3 x 8.6 GB at V4-Flash widths)
        # would not fit beside the stacks of the largest models
        return _init_by_pieces(cfg, make_mesh(devices=jax.devices()[:1]), make_runtime(cfg), seed, dtype, token_map,
                               compiled=jax.default_backend() != "cpu")
    return Transformer(cfg, rngs=nnx.Rngs(params=seed), dtype=dtype, token_map=token_map, placeholder_map=True)


def _init_by_pieces(cfg: ModelConfig, mesh: Mesh, runtime, seed: int, dtype, token_map: np.ndarray | None,
                    compiled: bool = True) -> Transformer:
    """A random model born laid out on `mesh` and running with `runtime`, built piece by piece
    (`model.transformer.construction_plan`: embedding, each layer, draft stages, head) with one compiled program
    per distinct piece, whose out_shardings are the table's. No full copy on any device (in a multi-process job
    each process materialises only its own shards), and compile time does not grow with depth: one program for
    all 43 V4-Flash layers took XLA >430 s on the H200 host (its slow-compile alarm; CPU: 4.6 s per layer). A
    layer of a scanned group is built alone and written into its place in the group's stacks (born laid out,
    updated in place). The RNG state is threaded from piece to piece, so the values equal those of
    `Transformer(cfg, rngs=nnx.Rngs(params=seed))` to float32 rounding (a compiled piece may round an op
    differently from the op-by-op build); `compiled=False` (one device) builds each piece op by op, as that
    constructor does, and equals it bitwise."""
    devices = int(mesh.devices.size)
    graphdef, state = nnx.split(abstract_model(cfg, dtype, token_map=token_map, runtime=runtime))
    state = pad_engram_tables(state, cfg, devices)
    shardings = param_shardings(state, mesh, cfg=cfg)
    hasher = engram_hasher(cfg, token_map, placeholder_map=True)
    rng_state = nnx.state(nnx.Rngs(params=seed))
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), rng_state)
    stacked = {i: (g, *g.locate(i)) for g in layer_groups(cfg) if g.stacked for i in range(g.start, g.stop)}
    programs: dict = {}
    stacks: dict = {}  # (group start, position) -> its stacked state, filled layer by layer
    with _fast_tracing():
        for piece in construction_plan(cfg, dtype, hasher):
            if piece.name == "layers" and piece.index in stacked:
                group, repeat, position = stacked[piece.index]
                where = (str(group.start), "period", position)
                parent, layout = state["layers"], shardings["layers"]
                for k in where:
                    parent, layout = parent[k], layout[k]
                one = jax.tree.map(lambda s: NamedSharding(mesh, P(*s.spec[1:])), layout)   # axis 0: never split
                value, rng_state = _piece_program(programs, piece, one, replicated, seed, cfg, devices,
                                                  compiled)(rng_state)
                if where not in stacks:
                    stacks[where] = jax.jit(lambda a=parent: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), a),
                                            out_shardings=layout)()
                stacks[where] = _insert_program(programs, where, layout)(stacks[where], value, repeat)
                continue
            # where the piece's state goes (and its layout): the top level, or one entry of a layer list
            parent, layout = (state, shardings) if piece.index is None else (state[piece.name], shardings[piece.name])
            key = piece.name if piece.index is None else (str(piece.index) if piece.name == "layers" else piece.index)
            build = _piece_program(programs, piece, layout.get(key), replicated, seed, cfg, devices, compiled)
            value, rng_state = build(rng_state)
            if value is not None:
                parent[key] = value
    for (start, _, position), value in stacks.items():
        state["layers"][start]["period"][position] = value
    return nnx.merge(graphdef, state)


def _piece_program(programs: dict, piece, layout, replicated, seed: int, cfg: ModelConfig, devices: int,
                   compiled: bool = True):
    """The build of a piece: rng state -> (the piece's state laid out by `layout`, split Engram tables padded to a
    multiple of `devices`, the advanced rng state); compiled (one program shared by pieces of equal keys: same
    shapes and layout), or op by op (`compiled=False`, one device)."""
    def build(rng_state, piece=piece):
        rngs = nnx.Rngs(params=seed)
        nnx.update(rngs, rng_state)
        module = piece.build(rngs)
        out = None if module is None else pad_engram_tables(nnx.state(module), cfg, devices)
        return out, nnx.state(rngs)
    if not compiled:
        return build
    if piece.key not in programs:
        programs[piece.key] = jax.jit(build, out_shardings=(layout, replicated))
    return programs[piece.key]


def _insert_program(programs: dict, where: tuple, layout):
    """(stacked state, one layer's state, repeat) -> the stacks with that layer written at `repeat`, in place."""
    key = ("insert", where)
    if key not in programs:
        def insert(stack, value, repeat):
            return jax.tree.map(lambda s, v: jax.lax.dynamic_update_index_in_dim(s, v, repeat, 0), stack, value)
        programs[key] = jax.jit(insert, donate_argnums=0, out_shardings=layout)
    return programs[key]


def shard_model(model: Transformer, mesh: Mesh, config=None, placements=None) -> Transformer:
    """A copy of `model` with its arrays placed by the table on `mesh` (arrays already laid out that way are
    not copied), running with the mesh's runtime: `make_runtime(cfg, mesh, config, placements)`."""
    runtime = make_runtime(model.config, mesh, config, placements)
    graphdef, state = nnx.split(model)
    state = pad_engram_tables(state, model.config, int(mesh.devices.size))
    state = jax.tree.map(place, state, param_shardings(state, mesh, cfg=model.config))
    return nnx.merge(graphdef, state).with_runtime(runtime)


def on_mesh(model: Transformer, mesh: Mesh) -> bool:
    """True if the model runs with a runtime made for `mesh` (init_random / shard_model / load_checkpoint)."""
    return model.runtime.mesh == mesh


def allocate_cache(cfg: ModelConfig, batch: int, max_len: int, dtype, mesh: Mesh, spec_room: int = 8):
    """`model.cache.allocate` born sharded (cache_shardings: batch over dp x ep)."""
    check_batch(batch, mesh, "cache batch")
    make = lambda: allocate(cfg, batch, max_len, dtype, spec_room)  # noqa: E731
    shardings = cache_shardings(jax.eval_shape(make), mesh)
    return jax.jit(make, out_shardings=shardings)()


# ----------------------------------------------------------------------------- loading

_EXPERT_TENSOR = re.compile(r"^(layers|mtp)\.(\d+)\..*\.experts\.(\d+)\.")


def local_expert_tensors(items, cfg: ModelConfig, mesh: Mesh):
    """Filter (official name, array) pairs down to the routed-expert tensors this process's devices
    hold (weights and scales alike); everything else passes. Placed before dequantisation, so the
    memory-mapped tensors of other processes' experts are never read."""
    elsewhere = _held_elsewhere(cfg, mesh)
    for name, arr in items:
        if not elsewhere(name):
            yield name, arr


def skipped_expert_names(names, cfg: ModelConfig, mesh: Mesh) -> set[str]:
    """Of the official tensor names `names`, the routed-expert tensors other processes' devices hold."""
    elsewhere = _held_elsewhere(cfg, mesh)
    return {name for name in names if elsewhere(name)}


def _held_elsewhere(cfg: ModelConfig, mesh: Mesh):
    """name -> whether it is a routed-expert tensor that only other processes' devices hold (the experts this
    process's devices hold computed once per layer)."""
    held: dict[int, frozenset[int]] = {}

    def elsewhere(name: str) -> bool:
        m = _EXPERT_TENSOR.match(name)
        if not m:
            return False
        layer = int(m.group(2)) + (cfg.num_layers if m.group(1) == "mtp" else 0)
        if layer not in held:
            held[layer] = local_experts(cfg.layer_spec(layer).n_experts, mesh)
        return int(m.group(3)) not in held[layer]
    return elsewhere


def place_loaded(graphdef, flat, buffers, mesh: Mesh, cfg: ModelConfig) -> Transformer:
    """build_from_tensors' host buffers -> a model of `cfg` with global arrays laid out by the table (each device
    gets only its slice; split Engram tables padded first); `graphdef` carries the runtime (an abstract model made
    with the mesh's)."""
    leaves = []
    devices = int(mesh.devices.size)
    for (path, var), buf in zip(flat, buffers):
        name = path_to_official(path)
        if _split_table(cfg, name):
            buf = _pad_rows(buf, devices)
        sharding = param_sharding(name, buf.shape, mesh, cfg)
        arr = jax.make_array_from_callback(tuple(buf.shape), sharding, lambda idx, b=buf: b[idx])
        leaves.append((path, var.replace(arr)))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


# ----------------------------------------------------------------------------- memory

@functools.lru_cache(maxsize=4)
def _abstract_state(cfg: ModelConfig, dtype) -> nnx.State:
    """The abstract model's state (shapes only; v41-flash: ~10 s to trace), kept for the meshes a table compares."""
    return nnx.state(abstract_model(cfg, dtype))


def memory_per_device(cfg: ModelConfig, dp: int = 1, ep: int = 1, tp: int = 1, seqs_per_device: int = 1,
                      max_len: int = 131072, dtype="bfloat16") -> dict:
    """Bytes per device of parameters and caches from abstract shapes (no devices needed) under the
    table's layout. `params` holds the weights in device memory as this model keeps them (`dtype`, or as shipped
    where the config says: FP8 + block scales with cfg.dense_weights="fp8", FP4 + scales with
    cfg.expert_weights="fp4", FP8 rows + scales with cfg.engram_tables="fp8");
    `params_fp4_experts` counts routed experts as released (FP4 + one UE8M0 scale per 32 values; an FP4 model
    holds the scales as bf16, one byte more per 32 values);
    [V4.1] `engram` is the part of `params` in Engram tables (a whole copy with engram_placement="device", a 1 /
    (dp ep tp) share with "sharded", none with "host"), `engram_host` the host memory each device's share of the
    tables takes with "host" (a host of k devices holds k of them: one copy of the tables in all);
    `cache` is `seqs_per_device` sequences of `max_len` positions (each sequence lives on one device)."""
    shape = {"dp": dp, "ep": ep, "tp": tp}
    state = pad_engram_tables(_abstract_state(cfg, dtype), cfg, dp * ep * tp)
    specs = param_specs(state, cfg=cfg)
    out = {"params": 0, "params_fp4_experts": 0, "engram": 0, "engram_host": 0}
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(state)[0], flat_specs):
        n = 1
        for entry in spec:
            for a in ((entry,) if isinstance(entry, str) else (entry or ())):
                n *= shape.get(a, 1)
        count = int(np.prod(leaf.shape)) // n
        size = count * np.dtype(leaf.dtype).itemsize
        name = _state_name(path)
        if host_resident(cfg, name):
            out["engram_host"] += size
            continue
        out["params"] += size
        if ".experts." in name and name.endswith(".scale"):   # FP4 models' scales: one UE8M0 byte as released
            out["params_fp4_experts"] += count                 # (held as bf16, fp4_kernel_scales)
        elif ".experts." in name and jnp.issubdtype(leaf.dtype, jnp.floating):   # dense experts as released
            out["params_fp4_experts"] += count * (0.5 + 1 / 32)
        else:
            out["params_fp4_experts"] += size
        if re.fullmatch(ENGRAM_TABLE, name):
            out["engram"] += size
    out["cache"] = seqs_per_device * memory_estimate(cfg, max_len)["bytes_per_sequence_at_max_len"]
    return out


def describe_memory_per_device(cfg: ModelConfig, dp: int = 1, ep: int = 1, tp: int = 1, seqs_per_device: int = 1,
                               max_len: int = 131072, dtype="bfloat16") -> str:
    """`memory_per_device` as one line: device memory (weights, of which Engram tables, and cache) and, with host
    tables, the host memory per device."""
    m = memory_per_device(cfg, dp, ep, tp, seqs_per_device, max_len, dtype)
    gib = 1024 ** 3
    line = (f"{cfg.name} on dp={dp} ep={ep} tp={tp}, Engram {cfg.engram_placement} ({cfg.engram_tables}): "
            f"{(m['params'] + m['cache']) / gib:.2f} GiB per device = weights {m['params'] / gib:.2f} "
            f"(Engram tables {m['engram'] / gib:.2f}) + cache {m['cache'] / gib:.2f} ({seqs_per_device} x {max_len})")
    return line + (f"; host memory {m['engram_host'] / gib:.2f} GiB per device" if m["engram_host"] else "")
