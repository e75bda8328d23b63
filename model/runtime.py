"""The runtime a model runs with: how its MoE layers run their routed experts and how its attention
kernels run on a mesh. Weights and config say what the model computes; the runtime says where.

    Runtime()                                   one device: LocalExperts(cfg.moe_impl), kernels on the batch
    make_runtime(cfg, mesh)                     expert parallel over `ep` (sharding.ExpertParallel per
                                                block) and the kernels once per batch shard (BatchParallel)
    make_runtime(cfg, mesh, EPConfig("replicate"), placements=..., record="key", forced_balance=True)

Design. The model receives its runtime explicitly, at construction (`Transformer(cfg, rngs=...,
runtime=...)`, which `init_random(mesh=)`, `load_checkpoint(mesh=)` and `shard_model` build for their
mesh) or as a copy that shares the arrays (`model.with_runtime(runtime)`); nothing outside the model
writes into its modules. The runtime is a frozen, hashable dataclass whose parts the Transformer hands to
its own layers (`MoE.expert_fn`, `Attention.per_shard`), so it is static under jit: part of the
graphdef, and a different mesh, strategy or switch retraces. It is held by the model rather than passed
to every step because the step functions, the drafters (model/draft.py) and the speculative loop all
reach the layers, and each would have to thread it through. The pieces come from `sharding`, which
knows nothing of the model: an expert dispatch over the expert function it is given (the model's
`moe.LocalExperts`), a per-shard runner over the kernel function it is given.

`forced_balance` is DeepInfer's benchmark routing (every expert gets the same load: `sharding.placement.
forced_balance_ids`), a switch an experiment passes here; it is no field of the model's config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jax.sharding import Mesh

from sharding.batch_parallel import BatchParallel
from sharding.expert_parallel import EPConfig, ExpertFn, ExpertParallel
from sharding.mesh import parallel_config
from sharding.placement import ForcedBalance, Placement
from sharding.row_lookup import RowLookup

from .config import ModelConfig
from .moe import LocalExperts


@dataclasses.dataclass(frozen=True)
class Runtime:
    """mesh: what the runtime was made for (None: one device). experts: one expert function per block (the
    backbone layers, then the draft stages), or () for LocalExperts(cfg.moe_impl) everywhere. per_shard: the
    runner of the Pallas attention / indexer kernels (None: called on the whole batch). forced_balance: route
    by forced_balance_ids (benchmark mode). engram: [V4.1] the lookup of Engram tables split over the mesh
    (cfg.engram_placement "sharded" / "host" on a mesh), None where each table is whole on every device."""

    mesh: Mesh | None = None
    experts: tuple[ExpertFn, ...] = ()
    per_shard: Callable[..., Any] | None = None
    forced_balance: bool = False
    engram: RowLookup | None = None

    def check(self, cfg: ModelConfig) -> "Runtime":
        """Raise ValueError unless this runtime fits a model of `cfg`."""
        if self.experts and len(self.experts) != cfg.num_blocks:
            raise ValueError(f"the runtime has expert functions for {len(self.experts)} blocks, {cfg.name} has "
                             f"{cfg.num_blocks} (layers + draft stages): make it with make_runtime(cfg, ...)")
        split = cfg.engram_layer_ids and cfg.engram_placement != "device" and self.mesh is not None
        if split and (self.engram is None or self.engram.mesh != self.mesh):
            raise ValueError(f"{cfg.name}: engram_placement={cfg.engram_placement!r} splits the Engram tables over the "
                             "mesh: the runtime needs their lookup (make it with make_runtime(cfg, mesh))")
        if not split and self.engram is not None:
            raise ValueError(f"{cfg.name}: the runtime looks up split Engram tables, but engram_placement="
                             f"{cfg.engram_placement!r}{' on one device' if self.mesh is None else ''} keeps them whole")
        for block, fn in enumerate(self.experts):
            if fn.impl != cfg.moe_impl:
                raise ValueError(f"the runtime's experts of block {block} run {fn.impl!r}, {cfg.name} asks for "
                                 f"moe_impl={cfg.moe_impl!r}")
            if fn.per_slot != cfg.batch_invariant:
                raise ValueError(f"the runtime's experts of block {block} were made for batch_invariant="
                                 f"{fn.per_slot}, {cfg.name} has batch_invariant={cfg.batch_invariant}: make it with "
                                 "make_runtime(cfg, ...)")
        return self

    def experts_for(self, block: int, impl: str, per_slot: bool = False) -> ExpertFn:
        """The expert function block `block` runs (its MoE's `expert_fn`); per_slot: cfg.batch_invariant."""
        fn = self.experts[block] if self.experts else LocalExperts(impl, per_slot)
        return ForcedBalance(fn) if self.forced_balance else fn

    def experts_for_group(self, blocks: tuple[int, ...], impl: str, per_slot: bool = False) -> ExpertFn:
        """The one expert function the layers of a scanned group run (one traced body serves them all). Raises
        ValueError when this runtime gives them different ones (per-layer placements, load recording)."""
        fns = {self.experts_for(b, impl, per_slot) for b in blocks}
        if len(fns) > 1:
            raise ValueError(f"layers {list(blocks)} run as one scanned group (ModelConfig.scan_layers), but this "
                             "runtime gives them different expert functions (per-layer placements or load "
                             "recording); build the model with scan_layers=False to run them")
        return fns.pop()

    @property
    def expert_parallel(self) -> ExpertParallel | None:
        """The first block's ExpertParallel (strategy and placement records), None on the local path."""
        first = self.experts[0] if self.experts else None
        return first if isinstance(first, ExpertParallel) else None


def make_runtime(cfg: ModelConfig, mesh: Mesh | None = None, config: EPConfig | None = None,
                 placements: Placement | dict[int, Placement] | None = None, record: str | None = None,
                 forced_balance: bool = False) -> Runtime:
    """The runtime of a `cfg` model on `mesh` (None: one device).

    config: how the experts run over the mesh (default EPConfig()); placements: None, one Placement for
    every layer, or {block index: Placement} (redundant experts, rebalancing); record: a key under which
    every MoE layer counts its routed load (`sharding.recorded_load`); forced_balance: benchmark routing.
    On one device the experts run as LocalExperts(cfg.moe_impl), through an ExpertParallel without a mesh
    where a placement or a recorder asks for one. Raises ValueError for a layout the mesh cannot hold.
    cfg.batch_invariant: each choice's expert output comes home on its own and is added in expert-id order, so
    the mesh, the strategy and the placement do not change a token's numbers; tp must be 1 (tp shards would add
    partial sums of the experts' inner products).
    """
    if mesh is None and config is not None:
        raise ValueError("an EPConfig says how experts run over a mesh; pass the mesh with it")
    if cfg.batch_invariant and mesh is not None and int(mesh.shape["tp"]) > 1:
        raise ValueError(f"batch_invariant needs tp=1 (got tp={int(mesh.shape['tp'])}): tp shards add partial sums "
                         "of the experts' and projections' inner products, in an order the mesh decides")
    if mesh is None and placements is None and record is None:
        return Runtime(forced_balance=forced_balance)
    ep = 1 if mesh is None else int(mesh.shape["ep"])
    if mesh is not None:
        one = placements if not isinstance(placements, dict) else next(iter(placements.values()), None)
        parallel_config(mesh).validate(cfg, num_devices=int(mesh.devices.size),
                                       num_expert_slots=None if one is None else one.num_slots)
    experts = []
    for block in range(cfg.num_blocks):
        n = cfg.layer_spec(block).n_experts   # per block: V4.1 draft layers have their own expert count
        placement = placements.get(block) if isinstance(placements, dict) else placements
        if placement is not None:
            placement.validate(ep)
            if placement.num_experts != n:
                raise ValueError(f"placement for layer {block} has {placement.num_experts} experts, the layer has {n}")
        elif n % ep:
            raise ValueError(f"layer {block}: {n} routed experts are not divisible by ep={ep}")
        # the block index matters only to a load recorder: without one, layers of equal placement run one
        # expert function (a scanned group's layers share it)
        experts.append(ExpertParallel(mesh, LocalExperts(cfg.moe_impl, cfg.batch_invariant), config or EPConfig(),
                                      placement, block if record is not None else -1, record))
    engram = None
    if mesh is not None and cfg.engram_layer_ids and cfg.engram_placement != "device":
        engram = RowLookup(mesh, cfg.engram_exchange)
    return Runtime(mesh, tuple(experts), None if mesh is None else BatchParallel(mesh), forced_balance, engram)
