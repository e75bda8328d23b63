"""Layer groups: consecutive backbone layers of the same structure, which run as one scanned body.

Two layers have the same structure when everything that shapes their traced code is equal
(`structure_key`): their weights (`weights_key`: the spec without its position, KV / top-k sources only
as "own" or "another layer's", Engram layers keeping their own index, hash routing, ratio, indexer,
candidate roles), and with it their cache arrays; whether a DSpark tap reads the streams entering them;
and on which side of the decoder-side replay cut they sit (rows are narrowed there, so no group spans it).

`layer_groups(cfg)` cuts the layer list into groups left to right: at each layer it takes the period P
(1..MAX_PERIOD) that repeats most often from there and saves the most traced layers ((repeats - 1) * P),
or a group of one layer when nothing repeats. V4-Flash: [0, 1] (SWA, hash routed), [2] (CSA, hash routed),
then (HCA, CSA) x 20 for layers 3-42: four traced layer bodies for 43 layers. V4.1-Flash: its KV-source
period (Full, Reuse x 5) over layers 2-13, the Reuse run after the Engram layer 14, and (Reuse x 3,
Reindex) over 21-36 after the cut. `scan_layers=False` gives every layer its own group (the layers
unrolled: the reference definition).

`shared_roles` says how a group's layers use the V4.1 state handed down the stack (`attention.Shared`):
fields they read but never write come in as constants of the scan; fields they write and read again
across iterations, or that a later layer reads, are the scan's carry; the rest live inside one iteration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import LayerSpec, ModelConfig

MAX_PERIOD = 8
SHARED_FIELDS = ("kv", "keys", "topk", "candidates")


@dataclass(frozen=True)
class LayerGroup:
    """Layers start + r * period + p for r < repeats, p < period (one layer: period = repeats = 1)."""

    start: int
    period: int = 1
    repeats: int = 1

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    @property
    def stacked(self) -> bool:
        return self.repeats > 1

    def layer_ids(self, position: int) -> tuple[int, ...]:
        """The layers at `position` of the period, one per repeat (the order of the stacked axis)."""
        return tuple(self.start + r * self.period + position for r in range(self.repeats))

    def locate(self, layer: int) -> tuple[int, int]:
        """layer -> (repeat, position)."""
        if not self.start <= layer < self.stop:
            raise ValueError(f"layer {layer} is not in the group of layers [{self.start}, {self.stop})")
        return divmod(layer - self.start, self.period)


def weights_key(spec: LayerSpec) -> LayerSpec:
    """What a block's weights depend on: the spec without its position (kept for Engram layers, whose table
    is the layer's own), the KV / top-k sources only as "own" or "another layer's"."""
    rel = lambda src: None if src is None else ("own" if src == spec.index else "other")  # noqa: E731
    return dataclasses.replace(spec, index=spec.index if spec.engram else -1, kv_source=rel(spec.kv_source),
                               topk_source=rel(spec.topk_source))


def replay_cut(cfg: ModelConfig) -> int | None:
    """[V4.1] the first layer after the last KV source: decoder-side bounded replay narrows the rows there."""
    return max(cfg.kv_source_layer_ids) + 1 if cfg.kv_source_layer_ids else None


def structure_key(cfg: ModelConfig, index: int) -> tuple:
    """Equal for two backbone layers iff one traced body runs both (module docstring)."""
    cut = replay_cut(cfg)
    return (weights_key(cfg.layer_spec(index)), index in cfg.dspark_target_layer_ids,
            cut is not None and index >= cut)


def layer_groups(cfg: ModelConfig) -> tuple[LayerGroup, ...]:
    """The backbone cut into groups (module docstring); every layer in exactly one, in order."""
    n = cfg.num_layers
    if not cfg.scan_layers:
        return tuple(LayerGroup(i) for i in range(n))
    keys = [structure_key(cfg, i) for i in range(n)]
    groups, s = [], 0
    while s < n:
        saved, period, repeats = 0, 1, 1
        for p in range(1, min(MAX_PERIOD, (n - s) // 2) + 1):
            r = 1
            while s + (r + 1) * p <= n and keys[s + r * p: s + (r + 1) * p] == keys[s: s + p]:
                r += 1
            if (r - 1) * p > saved:
                saved, period, repeats = (r - 1) * p, p, r
        groups.append(LayerGroup(s, period, repeats))
        s += period * repeats
    return tuple(groups)


def traced_layers(groups: tuple[LayerGroup, ...]) -> int:
    """Layer bodies the compiled step holds: one per group position."""
    return sum(g.period for g in groups)


# ----------------------------------------------------------------------------- the shared state of a group

def reads_first(spec: LayerSpec) -> frozenset[str]:
    """Shared fields a layer reads before writing them (attention.Attention.__call__: a KV owner publishes its
    store before reading it, an indexer its top-k; Reuse layers read the latest source's)."""
    own = spec.owns_kv
    return frozenset(f for f, on in (("kv", spec.compress_ratio > 0 and not own), ("keys", spec.indexer and not own),
                                      ("topk", spec.topk_source is not None and not spec.indexer),
                                      ("candidates", spec.uses_candidates)) if on)


def writes(spec: LayerSpec) -> frozenset[str]:
    """Shared fields a layer publishes (an indexer that is no candidate source passes the mask on unchanged)."""
    return frozenset(f for f, on in (("kv", spec.owns_kv), ("keys", spec.owns_kv), ("topk", spec.indexer),
                                      ("candidates", spec.candidate_source)) if on)


@dataclass(frozen=True)
class SharedRoles:
    invariant: tuple[str, ...] = ()  # read by the group, written by none of its layers: constants of the scan
    carried: tuple[str, ...] = ()    # written by the group and read by a later iteration or layer: the carry
    written: tuple[str, ...] = ()    # every field its layers write (those not carried are dead after it)


def shared_roles(cfg: ModelConfig, group: LayerGroup) -> SharedRoles:
    """How a group's layers use `attention.Shared` (module docstring). The extras' candidate mask counts as a
    read after the last layer."""
    period = [cfg.layer_spec(group.start + p) for p in range(group.period)]
    written = frozenset().union(*map(writes, period))
    read = frozenset().union(*map(reads_first, period))
    before_write, seen = set(), set()
    for spec in period:
        before_write |= reads_first(spec) - seen
        seen |= writes(spec)

    def live_after(field: str) -> bool:
        for i in range(group.stop, cfg.num_layers):
            spec = cfg.layer_spec(i)
            if field in reads_first(spec):
                return True
            if field in writes(spec):
                return False
        return field == "candidates"

    carried = tuple(f for f in SHARED_FIELDS if f in written and (f in before_write or live_after(f)))
    invariant = tuple(f for f in SHARED_FIELDS if f in read and f not in written)
    return SharedRoles(invariant=invariant, carried=carried, written=tuple(f for f in SHARED_FIELDS if f in written))
