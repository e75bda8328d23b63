"""Tables looked up by row id whose rows are split over every device of a mesh, in device or host memory.

A table is one or more arrays sharing their leading row axis (e.g. FP8 rows and their scale bytes). Split over a
(dp, ep, tp) mesh it lies in contiguous row ranges over all three axes in their flattened order (`SPLIT`): device d
holds rows [d S, (d + 1) S), S = rows / devices (callers pad the rows to a multiple of the device count). Ids come
with the activations, their leading (batch) axis split over dp x ep where it divides (else replicated); the rows
come back laid out the same way and exactly as stored (same dtypes, same bytes: callers dequantise the rows they
get).

Exchanges (`RowLookup.exchange`); each moves the rows of every table of a call in one collective, so a model
fetches all its layers' rows at once:
* "all_to_all": every device sends each requested id to the device that owns it and receives the rows back; two
  all-to-alls (ids, then rows), each peer's chunk sized by what the ids' column ranges allow: column c of a table
  draws its ids from [lo_c, hi_c), so only the devices overlapping that range are asked for it (the V4.1 tables on
  8 devices: at most 4 of a table's 24 columns per device, 1.3x the rows needed on the wire);
* "all_gather": the ids all-gathered over the batch axes, every device gathers the rows it owns for every token
  (zero bytes for the rest) and a reduce-scatter of the bytes over the batch axes (and a psum over tp) brings each
  token's rows home: devices x the rows needed on the wire, in one collective step.
Both are exact: rows travel as bytes, and the reduction adds only zeros to the one device's bytes.

Host memory: a table whose arrays live in host memory (memory kind "pinned_host") is gathered on the host inside
the jitted program (`compute_on("device_host")`) and only its gathered rows are copied to the device; XLA runs the
host gather asynchronously to the device's stream where the platform allows (GPU), so a fetch issued at the start
of a step overlaps the device work until the rows are used. There is no Python callback.

This module knows nothing of the model: it moves the rows of the tables it is given.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.experimental.compute_on as _compute_on
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from .mesh import AXES, parallel_config

EXCHANGES = ("all_to_all", "all_gather")
SPLIT = AXES  # a split table's row axis: over every device, dp x ep x tp in that order
HOST_MEMORY = "pinned_host"  # the memory kind of host-resident tables

# jax's compute_on with an explicit output memory space (jax 0.10 names it compute_on2, jax 0.11 compute_on)
_COMPUTE_ON = getattr(_compute_on, "compute_on2", None) or _compute_on.compute_on

Table = tuple  # of arrays [R, ...] sharing the row axis
Columns = tuple  # ((lo, hi), ...): column c's row ids lie in [lo, hi)


def in_host_memory(x) -> bool:
    """True for an array (or a tracer of one) held in host memory."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def _gather(table: jax.Array, idx: jax.Array) -> jax.Array:
    """table [R, ...] rows at idx [N] (in range) -> [N, ...], made of gather alone (no constants, which would sit in
    device memory and so cannot join a host computation)."""
    rest = tuple(table.shape[1:])
    dims = jax.lax.GatherDimensionNumbers(offset_dims=tuple(range(1, 1 + len(rest))), collapsed_slice_dims=(0,),
                                          start_index_map=(0,))
    return jax.lax.gather(table, idx[:, None], dims, (1, *rest), mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def take_rows(table: jax.Array, idx: jax.Array) -> jax.Array:
    """table [R, ...] rows at idx [...] (int, clipped into [0, R)) -> [..., ...] in device memory: gathered on the
    device, or on the host for a table in host memory (only the rows are copied over)."""
    flat = jnp.clip(idx.reshape(-1).astype(jnp.int32), 0, table.shape[0] - 1)
    if in_host_memory(table):
        host_gather = _COMPUTE_ON(_gather, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
        rows = jax.device_put(host_gather(table, jax.device_put(flat, jax.memory.Space.Host)), jax.memory.Space.Device)
    else:
        rows = _gather(table, flat)
    return rows.reshape(*idx.shape, *table.shape[1:])


def take_table(table: Table, idx: jax.Array) -> Table:
    """Every array of a table at the same rows idx [...] -> tuple of [..., ...]."""
    return tuple(take_rows(a, idx) for a in table)


# ----------------------------------------------------------------------------- rows as bytes

def _row_bytes(a: jax.Array, lead: int) -> jax.Array:
    """a [*lead dims, ...] -> uint8 [*lead dims, bytes of the rest]."""
    flat = a.reshape(*a.shape[:lead], -1)
    if flat.dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(flat, jnp.uint8)
    return jax.lax.bitcast_convert_type(flat, jnp.uint8).reshape(*a.shape[:lead], -1)


def _from_bytes(b: jax.Array, like: jax.ShapeDtypeStruct) -> jax.Array:
    """uint8 [..., n] -> `like`'s per-row shape and dtype: [..., *like.shape]."""
    size = jnp.dtype(like.dtype).itemsize
    lead = b.shape[:-1]
    if size == 1:
        out = jax.lax.bitcast_convert_type(b, like.dtype)
    else:
        out = jax.lax.bitcast_convert_type(b.reshape(*lead, -1, size), like.dtype)
    return out.reshape(*lead, *like.shape)


def _pack(tables_rows: Sequence[Table], lead: int) -> jax.Array:
    """Each table's gathered arrays [*lead, C_k, ...] -> one uint8 buffer [*lead, sum_k C_k * row bytes_k]."""
    parts = []
    for rows in tables_rows:
        per_row = jnp.concatenate([_row_bytes(a, lead + 1) for a in rows], axis=-1)  # [*lead, C_k, row bytes]
        parts.append(per_row.reshape(*per_row.shape[:lead], -1))
    return jnp.concatenate(parts, axis=-1)


def _unpack(buf: jax.Array, layout: Sequence[tuple[int, Sequence[jax.ShapeDtypeStruct]]]) -> list[Table]:
    """`_pack`'s inverse: layout [(C_k, per-row shapes of table k's arrays)] -> per table a tuple [..., C_k, ...]."""
    out, at = [], 0
    lead = buf.shape[:-1]
    for cols, likes in layout:
        sizes = [math.prod(l.shape) * jnp.dtype(l.dtype).itemsize for l in likes]
        rows = buf[..., at:at + cols * sum(sizes)].reshape(*lead, cols, sum(sizes))
        at += cols * sum(sizes)
        starts = np.cumsum([0] + sizes)
        out.append(tuple(_from_bytes(rows[..., starts[j]:starts[j + 1]], like) for j, like in enumerate(likes)))
    return out


# ----------------------------------------------------------------------------- the all-to-all plan

@dataclasses.dataclass(frozen=True)
class _Plan:
    """Where one table's columns can be sent: `send[d]` the columns whose id range overlaps device d's rows (-1 pads
    to the widest device's count), `slot[d, c]` column c's place in device d's list (0 where absent)."""

    rows_per_device: int
    send: np.ndarray  # [n, K] int
    slot: np.ndarray  # [n, C] int

    @classmethod
    def make(cls, columns: Columns, rows_per_device: int, devices: int) -> "_Plan":
        s = rows_per_device
        lists = [[c for c, (lo, hi) in enumerate(columns) if lo < (d + 1) * s and hi > d * s] for d in range(devices)]
        width = max(1, max(len(l) for l in lists))
        send = np.full((devices, width), -1, np.int32)
        slot = np.zeros((devices, len(columns)), np.int32)
        for d, cols in enumerate(lists):
            send[d, :len(cols)] = cols
            slot[d, cols] = np.arange(len(cols))
        return cls(s, send, slot)


def _requests(ids: jax.Array, plan: _Plan) -> jax.Array:
    """ids [M, C] -> per destination device the in-shard rows asked of it [n, M, K] (-1: nothing asked)."""
    n, _ = plan.send.shape
    cols = jnp.asarray(np.maximum(plan.send, 0))
    picked = jnp.take(ids, cols.reshape(-1), axis=1).reshape(ids.shape[0], n, -1)        # [M, n, K]
    dest = jnp.arange(n, dtype=jnp.int32)[None, :, None]
    asked = jnp.asarray(plan.send >= 0)[None] & (picked // plan.rows_per_device == dest)
    return jnp.where(asked, picked - dest * plan.rows_per_device, -1).transpose(1, 0, 2)


def _answers(back: jax.Array, ids: jax.Array, plan: _Plan, row_bytes: int) -> jax.Array:
    """Rows from every owner back [n, M, K * row_bytes] -> each id's row [M, C, row_bytes] (from the id's owner)."""
    n, width = plan.send.shape
    m, c = ids.shape
    owner = jnp.clip(ids // plan.rows_per_device, 0, n - 1)                               # [M, C]
    slot = jnp.asarray(plan.slot)[owner, jnp.arange(c)[None, :]]                         # [M, C]
    rows = back.reshape(n, m, width, row_bytes).transpose(1, 0, 2, 3).reshape(m, n * width, row_bytes)
    return jnp.take_along_axis(rows, (owner * width + slot)[..., None], axis=1)


# ----------------------------------------------------------------------------- per-device bodies

def _all_to_all_body(tables: Sequence[Table], ids: Sequence[jax.Array], plans: Sequence[_Plan]) -> jax.Array:
    """This device's tokens' ids [M, C_k] per table -> their rows as one byte buffer [M, sum_k C_k row bytes_k]."""
    asked = jax.lax.all_to_all(jnp.concatenate([_requests(i, p) for i, p in zip(ids, plans)], axis=2), SPLIT, 0, 0,
                               tiled=True)                                    # [n, M, sum K_k]: asked[src] of me
    rows, at = [], 0
    for table, plan in zip(tables, plans):
        width = plan.send.shape[1]
        local = asked[:, :, at:at + width]
        at += width
        rows.append(take_table(table, jnp.maximum(local, 0)))                 # [n, M, K_k, ...]
    back = jax.lax.all_to_all(_pack(rows, 2), SPLIT, 0, 0, tiled=True)      # [n, M, bytes]: back[d] from owner d
    out, at = [], 0
    for table, i, plan in zip(tables, ids, plans):
        row_bytes = sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a in table)
        size = plan.send.shape[1] * row_bytes
        out.append(_answers(back[:, :, at:at + size], i, plan, row_bytes).reshape(i.shape[0], -1))
        at += size
    return jnp.concatenate(out, axis=-1)


def _all_gather_body(tables: Sequence[Table], ids: Sequence[jax.Array], token_axes: tuple[str, ...],
                     other_axes: tuple[str, ...]) -> jax.Array:
    """As `_all_to_all_body`, by an all-gather of the ids and a reduce-scatter of the masked local rows' bytes."""
    if token_axes:
        ids = [jax.lax.all_gather(i, token_axes, tiled=True) for i in ids]   # every token's ids [M_all, C_k]
    me = jax.lax.axis_index(SPLIT)
    parts = []
    for table, i in zip(tables, ids):
        s = table[0].shape[0]
        local = i - me * s
        mine = (local >= 0) & (local < s)
        rows = _pack([take_table(table, local)], 1).reshape(*i.shape, -1)   # [M_all, C_k, row bytes]
        parts.append(jnp.where(mine[..., None], rows, 0).reshape(i.shape[0], -1))
    buf = jnp.concatenate(parts, axis=-1)
    if token_axes:
        buf = jax.lax.psum_scatter(buf, token_axes, scatter_dimension=0, tiled=True)
    return jax.lax.psum(buf, other_axes) if other_axes else buf


# ----------------------------------------------------------------------------- the lookup

@dataclasses.dataclass(frozen=True)
class RowLookup:
    """Lookups into tables split by rows over every device of `mesh` (frozen, hashable: a model holds it as a static
    part of its runtime). `exchange`: "all_to_all" or "all_gather" (module docstring)."""

    mesh: Mesh
    exchange: str = "all_to_all"

    def __post_init__(self):
        parallel_config(self.mesh)  # a (dp, ep, tp) mesh, else ValueError
        if self.exchange not in EXCHANGES:
            raise ValueError(f"RowLookup.exchange must be one of {EXCHANGES}, got {self.exchange!r}")

    @property
    def devices(self) -> int:
        return int(self.mesh.devices.size)

    def describe(self) -> str:
        return f"{self.exchange} over {self.devices} devices"

    def __call__(self, tables: Sequence[Table], ids: Sequence[jax.Array], columns: Sequence[Columns]) -> list[Table]:
        """tables[k]: arrays [R_k, ...] split by rows over the mesh (`SPLIT`; R_k a multiple of the device count);
        ids[k]: int row ids [B, ..., C_k] into table k (the same leading shape for every table); columns[k][c] =
        (lo, hi): the ids of column c lie in [lo, hi) -> per table, its arrays' rows [B, ..., C_k, ...] as stored,
        laid out as the ids."""
        if not (len(tables) == len(ids) == len(columns)) or not tables:
            raise ValueError(f"RowLookup: {len(tables)} tables, {len(ids)} id arrays, {len(columns)} column lists")
        n = self.devices
        lead = ids[0].shape[:-1]
        for k, (table, i, cols) in enumerate(zip(tables, ids, columns)):
            if i.shape[:-1] != lead or i.shape[-1] != len(cols):
                raise ValueError(f"RowLookup: ids of table {k} have shape {i.shape}, expected {(*lead, len(cols))}")
            rows = {a.shape[0] for a in table}
            if len(rows) != 1 or next(iter(rows)) % n:
                raise ValueError(f"RowLookup: table {k}'s arrays have rows {sorted(rows)}: one row count, a multiple "
                                 f"of the mesh's {n} devices, is needed (pad the table)")
        if n == 1:
            return [take_table(t, i) for t, i in zip(tables, ids)]
        pc = parallel_config(self.mesh)
        token_axes = ("dp", "ep") if lead[0] % pc.batch_shards == 0 else ()
        other_axes = tuple(a for a in SPLIT if a not in token_axes and self.mesh.shape[a] > 1)
        plans = [_Plan.make(cols, t[0].shape[0] // n, n) for t, cols in zip(tables, columns)]
        layout = [(len(cols), [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in t]) for t, cols in
                  zip(tables, columns)]

        def body(tables, ids):
            flat = [i.reshape(-1, i.shape[-1]).astype(jnp.int32) for i in ids]
            if self.exchange == "all_to_all":
                buf = _all_to_all_body(tables, flat, plans)
            else:
                buf = _all_gather_body(tables, flat, token_axes, other_axes)
            return [tuple(a.reshape(*i.shape, *a.shape[2:]) for a in t)
                    for t, i in zip(_unpack(buf, layout), ids)]

        tok = P(token_axes or None)
        split = P(SPLIT)
        fn = jax.shard_map(body, mesh=self.mesh, check_vma=False,
                           in_specs=([tuple(split for _ in t) for t in tables], [tok for _ in ids]),
                           out_specs=[tuple(tok for _ in t) for t in tables])
        return fn([tuple(t) for t in tables], list(ids))
