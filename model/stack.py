"""The backbone's layers as groups (model/groups.py): a layer of its own is a `Block`; a group of repeated
layers is a `LayerStack` whose period blocks hold every array stacked over the repeats [G, ...] and which
runs as one `jax.lax.scan`, so the compiled step holds one body per group position whatever the depth.

State paths: `layers.{i}.…` for layer i on its own (the official names), `layers.{start}.period.{p}.…` for
position p of the group starting at `start` (official names `layers.{l}.…` with l = `group.layer_ids(p)`
along axis 0: model/sharded.py `official_entries`). `Transformer.layers[i]` is layer i's Block either way
(for a stacked layer, a Block over slices of the stacks).

Why `jax.lax.scan` over `nnx.split` state rather than `nnx.scan`: the stacked arrays go in as the scan's
`xs` exactly as they are held, so each iteration reads its layer in place (no re-stacking, no graph
bookkeeping inside the step); the body re-merges the period blocks from their static graphdefs, so the
blocks run their ordinary code (the same Pallas kernel calls and shapes per shard, the same expert
function) and the carry holds only what the step threads anyway: the residual streams, the last mHC
collapse vector, the stacked caches and the part of the V4.1 shared state the group hands across
iterations (`groups.shared_roles`). The cache stacks travel in the carry and each layer writes its rows
into them at its own index (`cache.LayerSlice`), which XLA does in place; read-before-write rings order
the write behind their reads (`cache.write_rows`), so no step copies a stack. Draft blocks (MTP, DSpark)
stay outside, in `Transformer.mtp`.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.invariant import row_blocks

from .attention import Shared
from .cache import LayerCache, LayerSlice, PendingRing, Step, StackCache, write_ring_rows
from .groups import LayerGroup, SharedRoles


def _slice(a, repeat: int):
    """Layer `repeat` of a stacked array (or of its abstract shape)."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
    return a[repeat]


def stream_mean(x: jax.Array, batch_invariant: bool = False) -> jax.Array:
    """[V4.1 DSpark] a tap: the streams entering a layer averaged, [B, S, n, D] -> [B, S, D] (model dtype; on
    fixed blocks of rows if batch_invariant)."""
    if batch_invariant:
        return row_blocks(stream_mean, x, lead=2)
    return jnp.mean(x.astype(jnp.float32), axis=-2).astype(x.dtype)


class LayerStack(nnx.Module):
    """A scanned group: `period[p]` is the Block of position p with its arrays stacked over the group's repeats
    (axis 0 in the order of `group.layer_ids(p)`). Built from the group's blocks in layer order."""

    def __init__(self, group: LayerGroup, blocks: Sequence[nnx.Module], roles: SharedRoles, taps: tuple[bool, ...]):
        if len(blocks) != group.period * group.repeats:
            raise ValueError(f"a group of {group.period} x {group.repeats} layers needs as many blocks, got "
                             f"{len(blocks)}")
        self.group = group
        self.roles = roles
        self.taps = taps  # per position: a DSpark tap reads the streams entering the layer
        self.period = nnx.List([_stacked(blocks[p::group.period]) for p in range(group.period)])

    def layer(self, repeat: int, position: int) -> nnx.Module:
        """The Block of layer `group.layer_ids(position)[repeat]` over slices of the stacks."""
        graphdef, state = nnx.split(self.period[position])
        return nnx.merge(graphdef, jax.tree.map(lambda a: _slice(a, repeat), state))

    def __call__(self, x: jax.Array, pre: jax.Array, step: Step, tokens: jax.Array, cache: StackCache,
                 shared: Shared) -> tuple[jax.Array, jax.Array, StackCache, Shared, dict, dict]:
        """Run the group's layers in order: x [B, S, n, D] streams, pre [B, S, n] the last collapse vector ->
        (x, pre, cache, shared, {layer: top-k [B, S, K]} of its indexer layers, {layer: tap [B, S, D]}).

        Cache arrays travel by how a layer uses them. The rings (window KV, compressor projections) are read
        before the chunk is written: they go in as `xs`, each layer reads its ring as it was (`PendingRing`)
        and hands out the chunk's rows, written into the stacked rings after the scan. The entry stores are
        written before they are read: they stay in the carry, each layer scattering into its slice in place
        (`LayerSlice`)."""
        graphdefs, states = zip(*(nnx.split(block) for block in self.period))
        consts = {f: getattr(shared, f) for f in self.roles.invariant}
        layouts = [_CacheLayout(lc) for lc in cache.period]

        def body(carry, xs):
            x, pre, carried, stores = carry
            layer_states, rings, repeat = xs
            shared = Shared(**consts, **carried)
            topk, taps, ring_rows, new_stores = [], [], [], []
            for p, (graphdef, state) in enumerate(zip(graphdefs, layer_states)):
                block = nnx.merge(graphdef, state)
                if self.taps[p]:
                    taps.append(stream_mean(x, block.batch_invariant))
                view = layouts[p].view(rings[p], stores[p], repeat)
                x, view, shared, pre = block(x, step, tokens, view, shared, pre)
                rows, store = layouts[p].written(view)
                ring_rows.append(rows)
                new_stores.append(store)
                if block.spec.indexer:
                    topk.append(shared.topk)
            carried = {f: getattr(shared, f) for f in self.roles.carried}
            return (x, pre, carried, tuple(new_stores)), (tuple(ring_rows), tuple(topk), tuple(taps))

        rings, stores = zip(*(layout.parts(lc) for layout, lc in zip(layouts, cache.period)))
        xs = (states, rings, jnp.arange(self.group.repeats, dtype=jnp.int32))
        carried = {f: getattr(shared, f) for f in self.roles.carried}
        if any(v is None for v in carried.values()):  # written before read, needed after: start from zeros
            first = jax.tree.map(lambda a: a[0], xs)
            out = jax.eval_shape(lambda: body((x, pre, carried, stores), first)[0][2])
            carried = {f: jnp.zeros(out[f].shape, out[f].dtype) if v is None else v for f, v in carried.items()}
        (x, pre, carried, stores), (ring_rows, topk, taps) = jax.lax.scan(body, (x, pre, carried, stores), xs)
        dead = {f: None for f in self.roles.written if f not in carried}
        shared = shared.replace(**dead, **carried)
        period = tuple(layout.whole(tuple(r if w is None else write_ring_rows(r, w, step) for r, w in zip(old, new)), s)
                       for layout, old, new, s in zip(layouts, rings, ring_rows, stores))
        return x, pre, StackCache(period), shared, self._by_layer(topk, indexer=True), self._by_layer(taps)

    def _by_layer(self, ys: tuple, indexer: bool = False) -> dict[int, jax.Array]:
        """Per-position scan outputs [G, ...] (of the indexer or the tapped positions) -> {layer: [...]}."""
        chosen = [p for p in range(self.group.period)
                  if (self.period[p].spec.indexer if indexer else self.taps[p])]
        return {layer: y[r] for p, y in zip(chosen, ys) for r, layer in enumerate(self.group.layer_ids(p))}


class _CacheLayout:
    """A position's stacked LayerCache split into its rings and its entry stores (leaves named `*.entries`)."""

    def __init__(self, lc: LayerCache):
        leaves, self.treedef = jax.tree_util.tree_flatten_with_path(lc)
        self.store = tuple(jax.tree_util.keystr(path).endswith("entries") for path, _ in leaves)

    def parts(self, lc: LayerCache) -> tuple[tuple, tuple]:
        """(rings, stores) of a stacked LayerCache."""
        leaves = jax.tree.leaves(lc)
        return (tuple(a for a, s in zip(leaves, self.store) if not s),
                tuple(a for a, s in zip(leaves, self.store) if s))

    def view(self, rings: tuple, stores: tuple, repeat: jax.Array) -> LayerCache:
        """One iteration's LayerCache: its rings (this layer's slices) as PendingRings, its stores as LayerSlices."""
        rings, stores = iter(rings), iter(stores)
        return self.treedef.unflatten([LayerSlice(next(stores), repeat) if s else PendingRing(next(rings))
                                       for s in self.store])

    def written(self, view: LayerCache) -> tuple[tuple, tuple]:
        """(the rows each ring recorded, or None; the stacked stores) of a view after the layer ran."""
        leaves = jax.tree.leaves(view, is_leaf=lambda v: isinstance(v, (LayerSlice, PendingRing)))
        return (tuple(a.rows for a, s in zip(leaves, self.store) if not s),
                tuple(a.stack for a, s in zip(leaves, self.store) if s))

    def whole(self, rings: tuple, stores: tuple) -> LayerCache:
        rings, stores = iter(rings), iter(stores)
        return self.treedef.unflatten([next(stores) if s else next(rings) for s in self.store])


def _stacked(blocks: Sequence[nnx.Module]) -> nnx.Module:
    """Blocks of equal structure -> one Block (the first's static attributes) whose arrays are stacked [G, ...].

    The blocks are consumed: each of their arrays is deleted as soon as its stack exists, so stacking a group holds
    one stacked array above the model's weights rather than a second copy of the group (on one H200 the scanned
    28-layer release-format V4-Flash did not fit otherwise). Arrays that appear more than once among the blocks
    are left alone, as are abstract values and tracers."""
    graphdef, first = nnx.split(blocks[0])
    states = [first] + [nnx.split(b)[1] for b in blocks[1:]]
    uses: dict[int, int] = {}
    for leaf in jax.tree.leaves(states):
        uses[id(leaf)] = uses.get(id(leaf), 0) + 1

    def stack(*arrays):
        out = jnp.stack(arrays)
        for a in arrays:
            if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and uses[id(a)] == 1:
                a.delete()
        return out
    return nnx.merge(graphdef, jax.tree.map(stack, *states))


class Layers(nnx.Module):
    """The backbone: one member per layer group (a Block, or a LayerStack), attribute `str(group.start)`.
    Indexing, `len` and iteration are per layer (`layers[i]`: layer i's Block; a stacked layer's is a Block
    over slices of the stacks with that layer's spec)."""

    def __init__(self, cfg, groups: tuple[LayerGroup, ...], members: Sequence[nnx.Module]):
        self.config = cfg
        self.groups = tuple(groups)
        for group, member in zip(groups, members):
            setattr(self, str(group.start), member)

    def members(self) -> list[tuple[LayerGroup, nnx.Module]]:
        return [(g, getattr(self, str(g.start))) for g in self.groups]

    def unstacked(self) -> Iterator[tuple[int, nnx.Module]]:
        """(layer, Block) of the layers held on their own (Engram layers always are: their tables are their own)."""
        for group, member in self.members():
            if not group.stacked:
                yield group.start, member

    def __len__(self) -> int:
        return sum(g.period * g.repeats for g in self.groups)

    def __getitem__(self, index: int) -> nnx.Module:
        if not 0 <= index < len(self):
            raise IndexError(f"layer {index} out of range [0, {len(self)})")
        for group, member in self.members():
            if group.start <= index < group.stop:
                if not group.stacked:
                    return member
                block = member.layer(*group.locate(index))
                block.spec = block.attn.spec = self.config.layer_spec(index)
                return block
        raise AssertionError("groups cover every layer")

    def __iter__(self) -> Iterator[nnx.Module]:
        return (self[i] for i in range(len(self)))
