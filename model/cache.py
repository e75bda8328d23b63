"""The cache pytree: position-indexed rings and stores (docs/model.md §4.5, §13, §13.3, §13.6).

Everything is indexed by absolute position, so chunked prefill, speculative rollback and prefix
resume are length updates:

* SWA ring per layer: kv [B, R_w, Dh], position p in slot p mod R_w, R_w = W + spec_room. The
  slot's position is derived from the sequence length (never stored): slot s holds the latest
  p < length with p = s (mod R_w). Rows written speculatively past the length are simply never
  read; R_w >= W + spec_room keeps them from clobbering live window rows.
* Compressor per compressed layer (and the CSA indexer's own compressor): a ring of raw float32
  projections (a, g) [B, R_c, c*d] (R_c = 2r + spec_room) from which partial blocks are pooled when
  they close, plus the store of finished entries [B, N, d], entry j at index j. A stale entry past
  the length is invisible (queries at p see j < (p+1)//r) and is rewritten when its block closes.
* lengths [B]: tokens already in the cache per sequence.

`Cache.layers` holds one entry per layer group (model/groups.py): a `LayerCache` for a layer of its own,
a `StackCache` for a scanned group, whose arrays carry the group's repeats on a leading axis [G, B, ...].
Inside the scan a layer sees its slice of the entry stores as `LayerSlice`s (reads take the slice, writes
scatter into the stacked array in place: `write_rows`) and its rings as `PendingRing`s (reads see the ring
before the step, the chunk's rows are written into the stacked rings after the scan), so a step copies no
stack (model/stack.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.reference import mxfp4_row_bytes

from .config import ModelConfig
from .footprint import require
from .groups import LayerGroup, layer_groups


@struct.dataclass
class LayerSlice:
    """Layer `index` (a traced int32 scalar) of a stacked cache array `stack` [G, ...], as a scanned layer sees
    it: `shape` / `dtype` are the layer's, `read` takes the slice, `write_rows` scatters into the stack."""

    stack: jax.Array
    index: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype


@struct.dataclass
class PendingRing:
    """A ring of one layer inside a scanned group: reads see `values` [B, size, ...] (the ring before the step),
    `ring_write` records the chunk's `rows` [B, S, ...], which the group writes into its stacked ring after
    the scan (`write_ring_rows`). A step reads a ring only before writing it."""

    values: jax.Array
    rows: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self):
        return self.values.dtype


def read(a):
    """A cache array's values: the array itself, a LayerSlice's layer of its stack, a PendingRing's values."""
    if isinstance(a, LayerSlice):
        return jax.lax.dynamic_index_in_dim(a.stack, a.index, 0, keepdims=False)
    if isinstance(a, PendingRing):
        return a.values
    return a


def write_rows(target, index: tuple, rows: jax.Array):
    """target.at[index].set(rows, mode="drop") for an array, or into a LayerSlice's stack at its layer (in
    place: a store is written before it is read, so nothing keeps its old contents alive)."""
    rows = rows.astype(target.dtype)
    if not isinstance(target, LayerSlice):
        return target.at[index].set(rows, mode="drop")
    return target.replace(stack=target.stack.at[(target.index, *index)].set(rows, mode="drop"))


@struct.dataclass
class CompressorCache:
    proj_a: jax.Array | None  # [B, R_c, c*d] float32 (None: entries derived elsewhere, e.g. V4.1 index keys)
    proj_g: jax.Array | None  # [B, R_c, c*d] float32
    entries: jax.Array  # [B, N, d]


@struct.dataclass
class LayerCache:
    kv: jax.Array  # [B, R_w, Dh] SWA ring
    comp: CompressorCache | None = None
    index: CompressorCache | None = None


@struct.dataclass
class StackCache:
    """The caches of a scanned layer group: one LayerCache per position of its period, each array stacked over
    the group's repeats [G, B, ...] (axis 0 in the order of `LayerGroup.layer_ids`)."""

    period: tuple  # of LayerCache


@struct.dataclass
class Cache:
    lengths: jax.Array  # [B] int32
    layers: tuple  # one LayerCache, or StackCache for a scanned group, per entry of `groups`
    tokens: jax.Array | None = None  # [V4.1 Engram] ring of raw token ids [B, R_t] (n-gram history)
    # [B] int32: the shortest length a rollback may keep. The rings hold spec_room slots beyond what a step
    # reads, so rows written past the kept length clobber nothing only while the furthest row written is at
    # most spec_room positions ahead: the floor is (furthest row written + 1) - spec_room, or a prefix import's
    # length (the import brings exactly the rows a resume at that length reads).
    rollback_floor: jax.Array | None = None
    max_len: int = struct.field(pytree_node=False, default=0)
    spec_room: int = struct.field(pytree_node=False, default=0)
    groups: tuple = struct.field(pytree_node=False, default=())  # the LayerGroups of `layers` (model/groups.py)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def layer(self, index: int) -> LayerCache:
        """Backbone layer `index`'s LayerCache (for a scanned group: its arrays sliced out of the stacks)."""
        for group, entry in zip(self.groups, self.layers):
            if group.start <= index < group.stop:
                if not group.stacked:
                    return entry
                repeat, position = group.locate(index)
                return jax.tree.map(lambda a: a[repeat], entry.period[position])
        raise ValueError(f"the cache holds no layer {index} (it has {sum(g.period * g.repeats for g in self.groups)})")

    def advanced(self, end: jax.Array, layers: tuple) -> "Cache":
        """The cache after a step wrote every position below `end` [B]."""
        floor = None if self.rollback_floor is None else jnp.maximum(self.rollback_floor, end - self.spec_room)
        return self.replace(lengths=end, layers=layers, rollback_floor=floor)

    def rollback(self, lengths: jax.Array) -> "Cache":
        """Keep only the first `lengths[b]` positions of each sequence (never more than the current).

        Undoing more than the rings can (below `rollback_floor`: more than spec_room positions behind the
        furthest row written) raises ValueError when the lengths are concrete. Inside jit the caller
        guarantees it: speculative verification writes at most spec_room rows past the kept length."""
        new = jnp.minimum(jnp.asarray(lengths, jnp.int32), self.lengths)
        if self.rollback_floor is not None and not isinstance(new, jax.core.Tracer) \
                and not isinstance(self.rollback_floor, jax.core.Tracer):
            floor, kept = np.asarray(self.rollback_floor), np.asarray(new)
            if (kept < floor).any():
                b = int(np.argmax(kept < floor))
                raise ValueError(f"cannot roll sequence {b} back to length {kept[b]}: its rings hold spec_room="
                                 f"{self.spec_room} slots beyond the window, and rows up to position "
                                 f"{floor[b] + self.spec_room - 1} were written (or a prefix was imported at "
                                 f"{floor[b]}), so no length below {floor[b]} can be restored; allocate the cache "
                                 "with a larger spec_room")
        return self.replace(lengths=new)


@struct.dataclass
class Step:
    """Where a chunk of S rows lands: row i of sequence b is position start[b] + i, valid iff i < n_new[b].

    floor [B]: window keys below it are not attended (bounded replay; 0 = exact). write_global=False
    leaves the global KV / index-key stores untouched (encoder-side replay over a cached prefix).
    """

    start: jax.Array  # [B] int32
    n_new: jax.Array  # [B] int32
    positions: jax.Array  # [B, S] int32
    valid: jax.Array  # [B, S] bool
    floor: jax.Array  # [B] int32
    write_global: bool = struct.field(pytree_node=False, default=True)

    @staticmethod
    def make(start: jax.Array, n_new: jax.Array, width: int, floor: jax.Array | None = None,
             write_global: bool = True) -> "Step":
        start = jnp.asarray(start, jnp.int32)
        n_new = jnp.asarray(n_new, jnp.int32)
        i = jnp.arange(width, dtype=jnp.int32)[None, :]
        floor = jnp.zeros_like(start) if floor is None else jnp.asarray(floor, jnp.int32)
        return Step(start=start, n_new=n_new, positions=start[:, None] + i, valid=i < n_new[:, None], floor=floor,
                    write_global=write_global)

    @property
    def end(self) -> jax.Array:
        return self.start + self.n_new


# ----------------------------------------------------------------------------- ring helpers

def ring_positions(start: jax.Array, size: int) -> jax.Array:
    """Position held by each ring slot given the sequence length `start` [B] -> [B, size] (-1 = empty)."""
    s = jnp.arange(size, dtype=jnp.int32)[None, :]
    last = start[:, None] - 1
    pos = last - jnp.mod(last - s, size)
    return jnp.where(pos >= 0, pos, -1)


def _ring_slots(batch: int, size: int, width: int, step: Step) -> tuple[jax.Array, jax.Array]:
    """(sequence [B, 1], slot [B, S]) indices of a chunk's rows in a ring of `size` slots: position mod size
    for the valid rows among the last `size`, `size` (dropped) for the rest."""
    i = jnp.arange(width, dtype=jnp.int32)[None, :]
    keep = step.valid & (i >= step.n_new[:, None] - size)
    return jnp.arange(batch)[:, None], jnp.where(keep, jnp.mod(step.positions, size), size)


def ring_write(ring, rows: jax.Array, step: Step):
    """Write the chunk's valid rows [B, S, ...] at slots position mod size (only the last `size` rows) of a
    ring [B, size, ...]; a PendingRing records them."""
    if isinstance(ring, PendingRing):
        return ring.replace(rows=rows.astype(ring.dtype))
    b, slot = _ring_slots(ring.shape[0], ring.shape[1], rows.shape[1], step)
    return ring.at[b, slot].set(rows.astype(ring.dtype), mode="drop")


def write_ring_rows(rings: jax.Array, rows: jax.Array, step: Step) -> jax.Array:
    """A scanned group's recorded ring rows [G, B, S, ...] written into its stacked ring [G, B, size, ...]."""
    b, slot = _ring_slots(rings.shape[1], rings.shape[2], rows.shape[2], step)
    return rings.at[:, b, slot].set(rows.astype(rings.dtype), mode="drop")


def ring_gather(ring, positions: jax.Array) -> jax.Array:
    """Rows of `ring` [B, size, ...] (an array or a PendingRing) for absolute positions [B, K] (caller masks
    invalid ones)."""
    return jnp.take_along_axis(read(ring), jnp.mod(positions, ring.shape[1])[..., None], axis=1)


# ----------------------------------------------------------------------------- allocation

@dataclass(frozen=True)
class CacheGeometry:
    """Static sizes of the cache for one config (rings, stores) for a given max length."""

    window_ring: int
    spec_room: int
    max_len: int

    def compressor_ring(self, ratio: int) -> int:
        return 2 * ratio + self.spec_room

    def entries(self, ratio: int) -> int:
        return math.ceil(self.max_len / ratio)


def geometry(cfg: ModelConfig, max_len: int, spec_room: int = 8) -> CacheGeometry:
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds the model's context "
                         f"(max_position_embeddings={cfg.max_position_embeddings})")
    return CacheGeometry(window_ring=cfg.sliding_window + spec_room, spec_room=spec_room, max_len=max_len)


def _layer_shapes(cfg: ModelConfig, index: int, geo: CacheGeometry, batch: int) -> dict:
    """Per-layer arrays as {name: (shape, kind)} with kind in {"act", "f32", "u8"}.

    Global KV lives only in the layers that own a compressor ([V4] every compressed layer, [V4.1]
    KV sources); index keys with their own projection ring in V4 CSA layers, derived from the
    latent (no ring) in V4.1 KV sources.
    """
    spec = cfg.layer_spec(index)
    shapes = {"kv": ((batch, geo.window_ring, cfg.head_dim), "act")}
    if not spec.owns_kv:
        return shapes
    r = spec.compress_ratio
    v4 = cfg.generation == "v4"
    for part, d, on, ring in (("comp", cfg.head_dim, True, True),
                              ("index", cfg.index_head_dim, spec.indexer, v4)):
        if on:
            if ring:
                width = (2 if spec.overlap else 1) * d
                shapes[f"{part}.proj_a"] = ((batch, geo.compressor_ring(r), width), "f32")
                shapes[f"{part}.proj_g"] = ((batch, geo.compressor_ring(r), width), "f32")
            if part == "index" and cfg.index_key_format == "fp4":   # MXFP4 rows: packed E2M1 + UE8M0 bytes
                shapes[f"{part}.entries"] = ((batch, geo.entries(r), mxfp4_row_bytes(d)), "u8")
            else:
                shapes[f"{part}.entries"] = ((batch, geo.entries(r), d), "act")
    return shapes


def _kind_dtype(kind: str, act_dtype) -> np.dtype:
    """A `_layer_shapes` kind -> the array's dtype: "act" the cache dtype, "f32" float32, "u8" uint8."""
    return np.dtype({"act": act_dtype, "f32": jnp.float32, "u8": jnp.uint8}[kind])


def allocate_layer(cfg: ModelConfig, index: int, batch: int, max_len: int, dtype=jnp.bfloat16,
                   spec_room: int = 8, repeats: int | None = None) -> LayerCache:
    """An empty cache for block `index` (backbone layer or MTP slot); with `repeats`, for a position of a scanned
    group: every array with a leading [repeats] axis."""
    geo = geometry(cfg, max_len, spec_room)
    lead = () if repeats is None else (repeats,)
    arrays = {name: jnp.zeros(lead + shape, _kind_dtype(kind, dtype))
              for name, (shape, kind) in _layer_shapes(cfg, index, geo, batch).items()}

    def comp(part):
        if f"{part}.entries" not in arrays:
            return None
        return CompressorCache(proj_a=arrays.get(f"{part}.proj_a"), proj_g=arrays.get(f"{part}.proj_g"),
                               entries=arrays[f"{part}.entries"])

    return LayerCache(kv=arrays["kv"], comp=comp("comp"), index=comp("index"))


def allocate(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, spec_room: int = 8) -> Cache:
    """An empty cache for `batch` sequences of up to `max_len` positions (backbone layers, grouped as the
    model's: model/groups.py). Called outside jit, a cache that cannot fit the device raises MemoryError before
    anything is allocated."""
    if not isinstance(jnp.zeros(()), jax.core.Tracer):  # traced (eval_shape, born-sharded jit): nothing is held
        need = batch * memory_estimate(cfg, max_len, dtype, spec_room)["bytes_per_sequence_at_max_len"]
        require(int(need), f"a {cfg.name} cache of {batch} x {max_len} positions ({np.dtype(dtype).name})")
    groups = layer_groups(cfg)
    layers = tuple(StackCache(tuple(allocate_layer(cfg, g.start + p, batch, max_len, dtype, spec_room, g.repeats)
                                    for p in range(g.period)))
                   if g.stacked else allocate_layer(cfg, g.start, batch, max_len, dtype, spec_room) for g in groups)
    tokens = None
    if cfg.engram_layer_ids:
        tokens = jnp.zeros((batch, cfg.engram_max_ngram_size - 1 + spec_room), jnp.int32)
    return Cache(lengths=jnp.zeros((batch,), jnp.int32), layers=layers, tokens=tokens,
                 rollback_floor=jnp.zeros((batch,), jnp.int32), max_len=max_len, spec_room=spec_room, groups=groups)


def batch_axis(path: str) -> int:
    """The batch axis of the cache array at dotted pytree path `path`: 1 in a scanned group's stacks, else 0."""
    return 1 if ".period." in f".{path}." else 0


def packed_entry_bytes(cfg: ModelConfig, part: str) -> float:
    """Bytes of one global-KV entry ("comp") or index key ("index") in the trained storage formats
    (docs/model.md §13.7): [V4] FP8 nope + bf16 rope + UE8M0 scales (FlashMLA 584 B row) / MXFP4 keys;
    [V4.1] E2M1 + one E4M3 scale per 16 / MXFP4 (E2M1 + UE8M0 per 32) keys."""
    if part == "index":
        return cfg.index_head_dim / 2 + cfg.index_head_dim / 32
    if cfg.generation == "v4":
        nope = cfg.head_dim - cfg.rope_head_dim
        return nope + 2 * cfg.rope_head_dim + nope / 64 + 1
    return cfg.head_dim / 2 + cfg.head_dim / 16


def memory_estimate(cfg: ModelConfig, max_len: int, dtype=jnp.bfloat16, spec_room: int = 8,
                    packed: bool = False) -> dict:
    """Cache bytes for one sequence: growing stores (per token) and fixed rings (per sequence).

    `packed=True` counts the global KV in the trained storage formats instead of our `dtype` arrays
    (V4.1-Flash: 890 B/token; V4-Flash: 3514 B/token).
    """
    geo = geometry(cfg, max_len, spec_room)
    per_token, fixed = 0.0, 0
    for i in range(cfg.num_layers):
        for name, (shape, kind) in _layer_shapes(cfg, i, geo, 1).items():
            size = int(np.prod(shape)) * _kind_dtype(kind, dtype).itemsize
            if name.endswith("entries"):
                entry = packed_entry_bytes(cfg, name.split(".")[0]) if packed else size / shape[1]
                per_token += entry / cfg.layer_spec(i).compress_ratio
            else:
                fixed += size
    total = fixed + per_token * max_len
    return {"bytes_per_token": per_token, "fixed_bytes_per_sequence": fixed,
            "bytes_per_sequence_at_max_len": total, "max_len": max_len}


def describe_memory(cfg: ModelConfig, max_len: int, batch: int = 1, dtype=jnp.bfloat16, spec_room: int = 8) -> str:
    m = memory_estimate(cfg, max_len, dtype, spec_room)
    gib = 1024 ** 3
    return (f"cache for {cfg.name} ({np.dtype(dtype).name} KV): {m['bytes_per_token']:.1f} B/token growing + "
            f"{m['fixed_bytes_per_sequence'] / 1024 ** 2:.2f} MiB/sequence fixed; "
            f"{batch} x {max_len} tokens = {batch * m['bytes_per_sequence_at_max_len'] / gib:.3f} GiB")


# ----------------------------------------------------------------------------- prefix export / import
# docs/model.md §13.6, §13.7, §15.2: what resuming a sequence at position `length` needs, copied to
# the host. Every ring segment is "the rows of positions [length - n, length)" (n = its first axis),
# every entry store "entries [0, n)", so a state carries no slot numbers and imports into a cache of
# any ring size or max_len.

@dataclass(frozen=True)
class CompressorPrefix:
    """One compressor's share of a prefix: entries [n, d] (entry j at row j, n = length // r) and, when
    the resume point needs them, the raw float32 projections proj_a / proj_g [m, c*d] of positions
    [length - m, length) (m = 0 when `length` ends a block and no overlap lends A halves; None where
    the layer keeps no projection ring, e.g. V4.1 index keys)."""

    entries: np.ndarray
    proj_a: np.ndarray | None = None
    proj_g: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.entries, self.proj_a, self.proj_g) if x is not None)


@dataclass(frozen=True)
class LayerPrefix:
    """One backbone layer's share: SWA rows kv [n, Dh] of positions [length - n, length) (None when the
    window was not exported) and the compressor / indexer stores of KV-owning layers."""

    kv: np.ndarray | None = None
    comp: CompressorPrefix | None = None
    index: CompressorPrefix | None = None

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.kv, self.comp, self.index) if x is not None)


@dataclass(frozen=True)
class PrefixState:
    """Host (numpy) copy of everything needed to resume one sequence at position `length`.

    layers: one LayerPrefix per backbone layer. tokens: [V4.1 Engram] the ids of positions
    [length - len(tokens), length) (the n-gram history; None without Engram). window: whether the SWA
    rows were exported (then the resume is exact; without them the window must be rebuilt, e.g. by
    encoder-side replay, which takes tokens before its replay start from the token list).
    """

    length: int
    layers: tuple
    tokens: np.ndarray | None = None
    window: bool = False

    @property
    def nbytes(self) -> int:
        return sum(l.nbytes for l in self.layers) + (0 if self.tokens is None else self.tokens.nbytes)


def _layer_entries(cache: Cache):
    """(layer index, LayerCache, lead) for every backbone layer in order: `lead` indexes the layer's arrays in
    the LayerCache (() for a layer of its own, (repeat,) into a scanned group's stacked arrays)."""
    out = []
    for group, entry in zip(cache.groups, cache.layers):
        for p in range(group.period):
            for r, i in enumerate(group.layer_ids(p)):
                out.append((i, entry.period[p], (r,)) if group.stacked else (i, entry, ()))
    return sorted(out, key=lambda e: e[0])


# Host copies and writes of a cache's rows. On a mesh spanning processes this process holds only its own devices'
# shards: a read gathers the rows to every process, a write takes the same host rows on every process (every process
# makes the same calls, as it runs the same generation).

def _host(a: jax.Array, index) -> np.ndarray:
    """a[index] as numpy."""
    if a.is_fully_addressable:
        return np.asarray(a[index])
    replicated = jax.sharding.NamedSharding(a.sharding.mesh, jax.sharding.PartitionSpec())
    return np.asarray(jax.jit(lambda a: a[index], out_shardings=replicated)(a))


def _write(a: jax.Array, index, rows) -> jax.Array:
    """a.at[index].set(rows) for host rows, on a's sharding (a cache split over a mesh stays split the same way)."""
    if a.is_fully_addressable:
        out = a.at[index].set(jnp.asarray(rows, a.dtype))
        return out if out.sharding == a.sharding else jax.device_put(out, a.sharding)
    rows = np.asarray(rows, a.dtype)
    replicated = jax.sharding.NamedSharding(a.sharding.mesh, jax.sharding.PartitionSpec())
    rows = jax.make_array_from_callback(rows.shape, replicated, lambda i: rows[i])
    return jax.jit(lambda a, r: a.at[index].set(r), out_shardings=a.sharding)(a, rows)


def host_lengths(cache: "Cache") -> np.ndarray:
    """The cache's lengths [B] as numpy (on every process of a mesh)."""
    return _host(cache.lengths, slice(None))


def set_lengths(cache: "Cache", lengths: np.ndarray) -> "Cache":
    """The cache with lengths [B] from the host (the same on every process of a mesh)."""
    return cache.replace(lengths=_write(cache.lengths, slice(None), np.asarray(lengths, np.int32)))


def _ring_rows(ring: jax.Array, lead: tuple, row: int, first: int, length: int, cur: int, what: str) -> np.ndarray:
    """Host copy of ring rows of positions [first, length) of sequence `row` (cache length `cur`)."""
    size = ring.shape[len(lead) + 1]
    if first < cur - size:
        raise ValueError(f"{what}: positions [{first}, {length}) are no longer in its ring of {size} slots "
                         f"(sequence {row} is at length {cur}); export at most {size - (length - first)} "
                         f"positions behind the current length")
    slots = np.arange(first, length) % size
    return _host(ring, (*lead, row, slots))


def _export_compressor(comp: CompressorCache, lead: tuple, ratio: int, overlap: bool, row: int, length: int,
                       cur: int, what: str) -> CompressorPrefix:
    entries = _host(comp.entries, (*lead, row, slice(0, length // ratio)))
    if comp.proj_a is None:
        return CompressorPrefix(entries=entries)
    # the next chunk pools from the first open block, or (overlap) the block before it: see
    # Compressor.latents, which reads ring rows [base, start) with base = (start // r) * r - r*overlap
    first = max(0, (length // ratio) * ratio - (ratio if overlap else 0))
    return CompressorPrefix(entries=entries,
                            proj_a=_ring_rows(comp.proj_a, lead, row, first, length, cur, f"{what}.proj_a"),
                            proj_g=_ring_rows(comp.proj_g, lead, row, first, length, cur, f"{what}.proj_g"))


def export_prefix(cache: Cache, cfg: ModelConfig, row: int, length: int, include_window: bool) -> PrefixState:
    """Copy to the host what resuming sequence `row` at position `length` needs (docs/model.md §13.6).

    For every KV-owning layer: entries [0, length // r) of the global KV (and of the V4 indexer keys /
    V4.1 index keys), plus the projection rows a later block still pools ([V4] `length` may end inside
    a block: its partial block's rows, and with overlap the previous block's, are exported; [V4.1]
    `length` must be a multiple of every source ratio, since the persistent cache stores no carry).
    With `include_window`: the SWA rows of positions [length - W, length) of every layer (exact resume).
    [V4.1 Engram] the last max_ngram - 1 token ids are always exported (a few bytes).

    `length` may lie behind the sequence's current length as long as the rows it needs are still in
    the rings (and nothing was written speculatively past the current length since).
    """
    if not 0 <= row < cache.batch:
        raise ValueError(f"row {row} out of range for a cache of {cache.batch} sequences")
    cur = int(_host(cache.lengths, row))
    if not 0 < length <= cur:
        raise ValueError(f"cannot export sequence {row} at length {length}: it holds {cur} positions")
    entries = _layer_entries(cache)
    if len(entries) != cfg.num_layers:
        raise ValueError(f"cache has {len(entries)} layers, config {cfg.name} has {cfg.num_layers}")
    layers = []
    for i, lc, lead in entries:
        spec = cfg.layer_spec(i)
        kv = None
        if include_window:
            kv = _ring_rows(lc.kv, lead, row, max(0, length - cfg.sliding_window), length, cur, f"layer {i} kv")
        comp = index = None
        if spec.owns_kv:
            r = spec.compress_ratio
            if cfg.generation == "v41" and length % r:
                raise ValueError(f"{cfg.name}: a V4.1 prefix must end on a block of every KV source; length "
                                 f"{length} is not a multiple of layer {i}'s ratio {r}")
            comp = _export_compressor(lc.comp, lead, r, spec.overlap, row, length, cur, f"layer {i} comp")
            if lc.index is not None:
                index = _export_compressor(lc.index, lead, r, spec.overlap, row, length, cur, f"layer {i} index")
        layers.append(LayerPrefix(kv=kv, comp=comp, index=index))
    tokens = None
    if cfg.engram_layer_ids and cache.tokens is not None:
        first = max(0, length - (cfg.engram_max_ngram_size - 1))
        tokens = _ring_rows(cache.tokens, (), row, first, length, cur, "Engram token history")
    return PrefixState(length=length, layers=tuple(layers), tokens=tokens, window=include_window)


# Imports write each array once per layer group: the rows of a scanned group's layers go in stacked [G, n, ...]
# (`lead` = (slice(None),)) with one scatter per stacked array.

def _put_ring(ring: jax.Array, lead: tuple, row: int, rows: np.ndarray, length: int, what: str) -> jax.Array:
    """Write rows of positions [length - n, length) into ring slots position mod size of sequence `row`."""
    n, size = rows.shape[len(lead)], ring.shape[len(lead) + 1]
    if n > size:
        raise ValueError(f"{what}: {n} rows do not fit its ring of {size} slots")
    _check_rows(ring, lead, rows, what)
    if n == 0:
        return ring
    slots = np.arange(length - n, length) % size
    return _write(ring, (*lead, row, slots), rows)


def _check_rows(target: jax.Array, lead: tuple, rows: np.ndarray, what: str) -> None:
    k = len(lead)
    if rows.shape[k + 1:] != target.shape[k + 2:]:
        raise ValueError(f"{what}: rows of shape {rows.shape[k + 1:]} do not match the cache's {target.shape[k + 2:]}")
    if np.dtype(rows.dtype) != np.dtype(target.dtype):
        raise ValueError(f"{what}: exported as {rows.dtype}, the cache holds {target.dtype}")


def _stacked(parts: list, lead: tuple):
    """The layers' host arrays of one group position: the one array, or stacked [G, ...] for a scanned group."""
    return np.stack(parts) if lead else parts[0]


def _import_compressor(comp: CompressorCache | None, lead: tuple, states: list, row: int, length: int,
                       what: str) -> CompressorCache:
    if comp is None:
        raise ValueError(f"{what}: the prefix has a compressor store the cache lacks")
    n = states[0].entries.shape[0]
    if n > comp.entries.shape[len(lead) + 1]:
        raise ValueError(f"{what}: {n} entries do not fit the cache's store of {comp.entries.shape[len(lead) + 1]}")
    rows = _stacked([st.entries for st in states], lead)
    _check_rows(comp.entries, lead, rows, f"{what}.entries")
    entries = _write(comp.entries, (*lead, row, slice(0, n)), rows) if n else comp.entries
    proj_a, proj_g = comp.proj_a, comp.proj_g
    if states[0].proj_a is not None:
        if proj_a is None:
            raise ValueError(f"{what}: the prefix has projection rows but the cache keeps no projection ring")
        proj_a = _put_ring(proj_a, lead, row, _stacked([st.proj_a for st in states], lead), length, f"{what}.proj_a")
        proj_g = _put_ring(proj_g, lead, row, _stacked([st.proj_g for st in states], lead), length, f"{what}.proj_g")
    return comp.replace(proj_a=proj_a, proj_g=proj_g, entries=entries)


def _import_layers(lc: LayerCache, lead: tuple, layer_ids: tuple, prefixes: list, cfg: ModelConfig, row: int,
                   length: int) -> LayerCache:
    """Write the LayerPrefixes of `layer_ids` (one layer, or a scanned group position's) into `lc`."""
    what = f"layer {layer_ids[0]}"
    first = prefixes[0]
    kv = lc.kv if first.kv is None else _put_ring(lc.kv, lead, row, _stacked([lp.kv for lp in prefixes], lead),
                                                  length, f"{what} kv")
    comp = lc.comp if first.comp is None else _import_compressor(lc.comp, lead, [lp.comp for lp in prefixes], row,
                                                                 length, f"{what} comp")
    index = lc.index if first.index is None else _import_compressor(lc.index, lead, [lp.index for lp in prefixes],
                                                                    row, length, f"{what} index")
    for i, lp in zip(layer_ids, prefixes):
        if cfg.layer_spec(i).owns_kv and lp.comp is None:
            raise ValueError(f"layer {i} owns global KV but the prefix carries none for it")
    return lc.replace(kv=kv, comp=comp, index=index)


def import_prefix(cache: Cache, cfg: ModelConfig, row: int, state: PrefixState) -> Cache:
    """Write `state` into sequence `row` of `cache` at the same absolute positions (ring slot = position
    mod ring size, entry j at index j) and set lengths[row] = state.length. Rows the state does not
    carry (e.g. the window when `state.window` is False) keep whatever the cache held; the caller
    rebuilds them. Raises ValueError if the cache cannot hold the state (max_len, ring or store
    sizes, layer layout, dtypes)."""
    if not 0 <= row < cache.batch:
        raise ValueError(f"row {row} out of range for a cache of {cache.batch} sequences")
    length = state.length
    if length > cache.max_len:
        raise ValueError(f"a prefix of {length} positions does not fit a cache of max_len {cache.max_len}")
    n_cache = sum(g.period * g.repeats for g in cache.groups)
    if len(state.layers) != n_cache or n_cache != cfg.num_layers:
        raise ValueError(f"prefix has {len(state.layers)} layers, cache {n_cache}, config {cfg.name} {cfg.num_layers}")
    layers = []
    for group, entry in zip(cache.groups, cache.layers):
        if not group.stacked:
            layers.append(_import_layers(entry, (), (group.start,), [state.layers[group.start]], cfg, row, length))
            continue
        period = []
        for p, lc in enumerate(entry.period):
            ids = group.layer_ids(p)
            period.append(_import_layers(lc, (slice(None),), ids, [state.layers[i] for i in ids], cfg, row, length))
        layers.append(StackCache(tuple(period)))
    tokens = cache.tokens
    if state.tokens is not None:
        if tokens is None:
            raise ValueError("the prefix carries an Engram token history but the cache has no token ring")
        tokens = _put_ring(tokens[..., None], (), row, state.tokens[:, None], length, "Engram token history")[..., 0]
    floor = None if cache.rollback_floor is None else _write(cache.rollback_floor, row, length)
    return cache.replace(lengths=_write(cache.lengths, row, length), layers=tuple(layers), tokens=tokens,
                         rollback_floor=floor)


def set_token_history(cache: Cache, tokens: np.ndarray, before: np.ndarray) -> Cache:
    """[Engram] Put each row's raw tokens at positions before[b]-h .. before[b]-1 (h = ring history the
    n-gram hash reads) into the token ring, so a chunk starting at `before` hashes with the right history.
    tokens [B, >= before] are the rows' full token sequences (positions = indices)."""
    if cache.tokens is None:
        return cache
    hist = cache.tokens.shape[1]
    ring = _host(cache.tokens, slice(None)).copy()
    for b, end in enumerate(np.asarray(before, np.int64)):
        positions = np.arange(max(int(end) - hist, 0), int(end))
        ring[b, positions % hist] = np.asarray(tokens[b])[positions]
    return cache.replace(tokens=_write(cache.tokens, slice(None), ring))
