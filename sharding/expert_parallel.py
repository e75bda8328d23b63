"""Routed experts sharded over `ep` inside `shard_map` (DESIGN.md "Sharding by table").

The router, the shared expert and everything else run under the compiler's sharding propagation;
only the routed experts run in `shard_map` over the (dp, ep, tp) mesh, each ep shard holding
E_slots / ep consecutive expert slots (w1, w3 [E_local, I/tp, D], w2 [E_local, D, I/tp]).

Strategies (`EPConfig.strategy`):

* "all_to_all": tokens stay split over (dp, ep). Each shard sends every (token, choice) row to the
  shard owning its expert, the owners run their experts, results travel back and are combined with
  the routing weights at the token's home. Transports (`EPConfig.transport`):
    - "ragged":  `jax.lax.ragged_all_to_all` (only the routed rows move; GPU/TPU; XLA:CPU lacks it);
    - "padded":  the same exchange with the same offsets, emulated by a dense `all_to_all` of
                 per-peer chunks padded to the worst case (runs anywhere; tests the bookkeeping);
    - "gather":  all-gather the tokens over ep, run the local experts on the rows routed to them,
                 psum-scatter the results home (the CPU fallback);
    - "auto":    "gather" everywhere. Measured on nvidia-h200-x2 (jax 0.11.2, FP4 experts, one
                 V4-Flash layer; experiments/results/bench_ep_20261129-211902_gpu.md), "ragged" took
                 2.6 / 33 / 125 ms for 64 / 2048 / 8192 tokens (its transport 47-93% of that) against
                 1.9 / 4.0 / 9.7 ms for replicate-and-reduce, whose collectives "gather" shares (an
                 all-gather and a reduce-scatter instead of an all-reduce). Ask for "ragged" by name.
  The receive buffer is sized for the worst case (every row of every peer to one shard), so no
  token is ever dropped; a capacity factor is future work.
* "replicate": replicate-and-reduce for small decode batches: every ep shard sees all tokens of
  its dp group, runs its local experts on the rows routed to them, and a psum over ep adds the
  partial results (one all-reduce, no dispatch bookkeeping).
* "auto": "replicate" when the tokens per device are at most `replicate_max_tokens` (decode),
  else "all_to_all" (prefill). The choice is made at trace time from static shapes and recorded:
  `ExpertParallel.choose(m)` / `describe(m)`, and `generate(..., mesh=...)` puts it in its stats.

With tp > 1 each tp shard computes a slice of the intermediate width and a psum over tp adds them.
Per shard the experts run as the function it is given (`ExpertParallel.local`, an `ExpertFn`; the model
gives its `model.moe.LocalExperts`): grouped `ragged_dot`s (impl "reference", the reference's arithmetic)
or the Pallas grouped-GEMM kernel (impl "pallas"), which drops the rows of other shards' experts itself
(ids outside its local range cost nothing). Row-for-row the arithmetic equals
`pallas_kernels.reference.moe_experts`; only the order in which the k choices (and ep / tp partial sums)
are added differs (float32, ~1e-7 relative). An expert function with `per_slot` (the model's batch-invariant
mode) returns each choice's output unsummed, [M, k, D]: every strategy then brings each choice home on its
own (the other shards add exact zeros to it) and the caller adds them in its own fixed order.

An ExpertParallel is frozen and hashable: the model holds it as its static expert function (part of
the graphdef, so a different mesh or strategy retraces). This module knows nothing of the model; it
dispatches over whatever expert function it is given.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels.moe import is_fp4_kernel_layout

from .placement import Placement

STRATEGIES = ("auto", "all_to_all", "replicate")
TRANSPORTS = ("auto", "ragged", "padded", "gather")


@dataclasses.dataclass(frozen=True)
class EPConfig:
    strategy: str = "auto"
    transport: str = "auto"
    replicate_max_tokens: int = 8  # "auto": replicate at <= this many tokens per device

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"EPConfig.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"EPConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")


class ExpertFn(Protocol):
    """The routed-expert block on one device: x [M, D], expert ids / weights [M, k], the stacked expert
    weights as stored (w1, w3 [E, I, D], w2 [E, D, I]; FP4: packed words, `scales` (s1, s2, s3)), the SwiGLU
    `limit`, `act_block` (act_quant of both GEMMs' inputs, 0 = off), `balanced` (a hint: the ids are
    forced_balance_ids') -> [M, D] float32 ([M, k, D], each choice's output, when `per_slot`). Ids outside
    [0, E) select no expert. `impl` ("reference" | "pallas") says how it treats them: the Pallas kernel drops
    such rows itself at no cost."""

    impl: str
    per_slot: bool

    def __call__(self, x: jax.Array, ids: jax.Array, weights: jax.Array, w1: jax.Array, w2: jax.Array,
                 w3: jax.Array, limit: float, scales=None, act_block: int = 0, balanced: bool = False
                 ) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How one MoE layer runs its routed experts: `local` on each ep shard's expert slots (static)."""

    mesh: Mesh | None
    local: ExpertFn
    config: EPConfig = EPConfig()
    placement: Placement | None = None
    layer: int = -1
    record: str | None = None  # key of a load recorder (see `recorded_load`)
    # skip the expert GEMMs on a mesh (rows come back scaled by their weights), so that experiments/bench_ep.py
    # can time dispatch and combine alone
    comm_only: bool = False

    @property
    def impl(self) -> str:
        return self.local.impl

    @property
    def per_slot(self) -> bool:
        return self.local.per_slot

    # ------------------------------------------------------------------ the choice
    def choose(self, m: int) -> tuple[str, str, tuple[str, ...]]:
        """Rows m -> (strategy, transport, mesh axes of the token rows) for this call."""
        if self.mesh is None:
            return "single", "none", ()
        dp, ep = int(self.mesh.shape["dp"]), int(self.mesh.shape["ep"])
        cfg = self.config
        strategy = cfg.strategy
        if strategy == "auto":
            strategy = "replicate" if m <= cfg.replicate_max_tokens * dp * ep else "all_to_all"
        if strategy == "all_to_all" and m % (dp * ep):
            strategy = "replicate"  # rows cannot be split over dp x ep (e.g. one prompt on many devices)
        if strategy == "replicate":
            return strategy, "psum", (("dp",) if m % dp == 0 else ())
        transport = cfg.transport
        if transport == "auto":
            transport = "gather"
        return strategy, transport, ("dp", "ep")

    def describe(self, m: int) -> str:
        strategy, transport, axes = self.choose(m)
        if strategy in ("single", "replicate"):
            return strategy
        return f"{strategy}/{transport}"

    # ------------------------------------------------------------------ the call
    def __call__(self, x: jax.Array, ids: jax.Array, weights: jax.Array, w1: jax.Array, w2: jax.Array,
                 w3: jax.Array, limit: float, scales=None, act_block: int = 0, balanced: bool = False) -> jax.Array:
        """The `ExpertFn` contract over the whole mesh: x [M, D], ids/weights [M, k] (logical experts),
        weights as stored -> [M, D] float32 ([M, k, D] when per_slot). `balanced` reaches `local` on one device
        without a placement (replicas and shards see other row counts)."""
        m, k = ids.shape
        local = _CommOnly(per_slot=self.per_slot) if self.comm_only else self.local
        if self.record is not None:
            jax.debug.callback(_record_load, self.record, self.layer, w1.shape[0], ids)
        if self.placement is not None and not self.placement.is_identity:
            ids = self.placement.slot_ids(ids)
            slots = jnp.asarray(self.placement.slot_to_expert, jnp.int32)
            w1, w2, w3 = (jnp.take(w, slots, axis=0) for w in (w1, w2, w3))
            scales = None if scales is None else tuple(jnp.take(s, slots, axis=0) for s in scales)
        if self.mesh is None:
            balanced = balanced and (self.placement is None or self.placement.is_identity)
            return local(x, ids, weights, w1, w2, w3, limit, scales=scales, act_block=act_block, balanced=balanced)
        strategy, transport, tok_axes = self.choose(m)
        tok = P(tok_axes if tok_axes else None)
        w13, w2s = P("ep", "tp", None), P("ep", None, "tp")  # FP4: packed weights and UE8M0 bytes split alike
        held = scales is not None and is_fp4_kernel_layout(scales[0])   # FP4 scales as fp4_kernel_scales
        s13, s2s = (w2s, w13) if held else (w13, w2s)                     # ([E, in/32, out]: transposed)
        if strategy == "replicate":
            body = _replicate_body
        elif transport == "gather":
            body = _gather_body
        else:
            body = _dispatch_body

        def run(x, ids, wts, w1, w2, w3, *s):
            return body(x, ids, wts, w1, w2, w3, s or None, limit=limit, transport=transport, local=local,
                        act_block=act_block)

        # pallas_call declares no varying-axes type for its outputs, and comm_only's rows do not vary over
        # tp: shard_map's varying-axes check runs with the reference arithmetic only
        fn = jax.shard_map(run, mesh=self.mesh, out_specs=tok, check_vma=local.impl == "reference",
                           in_specs=(tok, tok, tok, w13, w2s, w13) + ((s13, s2s, s13) if scales else ()))
        return fn(x, ids.astype(jnp.int32), weights.astype(jnp.float32), w1, w2, w3, *(scales or ()))


# ----------------------------------------------------------------------------- per-shard bodies

@dataclasses.dataclass(frozen=True)
class _CommOnly:
    """Stands in for the expert GEMMs when the transport alone is timed: each (row, choice) comes back as it
    went, scaled by its weight (0 for ids outside [0, E))."""

    impl: str = "comm_only"
    per_slot: bool = False

    def __call__(self, x, ids, weights, w1, w2, w3, limit, scales=None, act_block=0, balanced=False):
        valid = (ids >= 0) & (ids < w1.shape[0])
        rows = x[:, None, :].astype(jnp.float32) * weights[..., None].astype(jnp.float32)
        rows = jnp.where(valid[..., None], rows, 0.0)
        return rows if self.per_slot else jnp.sum(rows, axis=1)


def _local_experts(rows, slot, wts, valid, w1, w2, w3, scales, limit, local, act_block):
    """Rows [N, D] for this shard's expert slots `slot` [N] (local ids), weights [N], valid [N] ->
    [N, D] float32 = w * W2 swiglu(W1 x, W3 x) per row (0 where not valid): `local` with one expert choice per
    row, an invalid row's slot n_local being outside every expert (the kernel drops it, the reference's
    grouped GEMMs leave it out; slots without rows cost nothing either way). act_block: act_quant of both
    GEMMs' inputs."""
    ids = jnp.where(valid, slot, w1.shape[0])[:, None]
    y = local(rows, ids, wts[:, None].astype(jnp.float32), w1, w2, w3, limit, scales=scales, act_block=act_block)
    return jnp.where(valid[:, None], y.reshape(rows.shape[0], -1), 0.0)


def _experts_for_all(x, ids, wts, w1, w2, w3, scales, limit, local, act_block):
    """Every token [M, D] x its k choices against this shard's slots -> partial [M, D] float32 ([M, k, D] when
    per_slot: zero for the choices of other shards)."""
    m, k = ids.shape
    n_local = w1.shape[0]
    slot = ids - jax.lax.axis_index("ep") * n_local
    valid = (slot >= 0) & (slot < n_local)
    if local.impl == "pallas":  # the kernel drops the other shards' rows itself (no broadcast copies of x)
        return local(x, jnp.where(valid, slot, n_local), wts, w1, w2, w3, limit, scales=scales, act_block=act_block)
    rows = jnp.broadcast_to(x[:, None, :], (m, k, x.shape[-1])).reshape(m * k, -1)
    y = _local_experts(rows, slot.reshape(-1), wts.reshape(-1), valid.reshape(-1), w1, w2, w3, scales, limit,
                       local, act_block).reshape(m, k, -1)
    return y if local.per_slot else jnp.sum(y, axis=1)


def _replicate_body(x, ids, wts, w1, w2, w3, scales, *, limit, transport, local, act_block):
    return jax.lax.psum(_experts_for_all(x, ids, wts, w1, w2, w3, scales, limit, local, act_block), ("ep", "tp"))


def _gather_body(x, ids, wts, w1, w2, w3, scales, *, limit, transport, local, act_block):
    xg, ig, wg = (jax.lax.all_gather(a, "ep", tiled=True) for a in (x, ids, wts))
    y = _experts_for_all(xg, ig, wg, w1, w2, w3, scales, limit, local, act_block)
    return jax.lax.psum(jax.lax.psum_scatter(y, "ep", scatter_dimension=0, tiled=True), "tp")


def _exclusive_cumsum(a, axis=0):
    return jnp.cumsum(a, axis=axis) - a


def _dispatch_body(x, ids, wts, w1, w2, w3, scales, *, limit, transport, local, act_block):
    """all-to-all dispatch -> local experts -> all-to-all combine, for this shard's [M_l] tokens."""
    a2a = jax.lax.ragged_all_to_all if transport == "ragged" else _ragged_all_to_all_padded
    m, k = ids.shape
    n = m * k
    ep = jax.lax.axis_size("ep")
    me = jax.lax.axis_index("ep")
    n_local = w1.shape[0]
    slot = ids.reshape(-1)
    dest = slot // n_local
    order = jnp.argsort(dest, stable=True)  # rows grouped by destination shard
    send_rows = jnp.take(x, order // k, axis=0)
    send_slot = jnp.take(slot, order)
    send_w = jnp.take(wts.reshape(-1), order)
    send_sizes = jnp.bincount(dest, length=ep).astype(jnp.int32)
    sizes = jax.lax.all_gather(send_sizes, "ep")  # [ep, ep]: sizes[i, j] rows from shard i to shard j
    in_off = _exclusive_cumsum(send_sizes)
    out_off = _exclusive_cumsum(sizes, axis=0)[me]  # where my rows land in each receiver's buffer
    recv_sizes = sizes[:, me]
    cap = ep * n  # worst case: every peer routes every row here
    args = dict(input_offsets=in_off, send_sizes=send_sizes, output_offsets=out_off, recv_sizes=recv_sizes)
    recv_rows = a2a(send_rows, jnp.zeros((cap, x.shape[-1]), x.dtype), axis_name="ep", **args)
    recv_slot = a2a(send_slot, jnp.full((cap,), -1, jnp.int32), axis_name="ep", **args)
    recv_w = a2a(send_w, jnp.zeros((cap,), jnp.float32), axis_name="ep", **args)
    valid = jnp.arange(cap) < jnp.sum(recv_sizes)
    y = _local_experts(recv_rows, recv_slot - me * n_local, recv_w, valid, w1, w2, w3, scales, limit, local,
                       act_block)
    # back: the rows from shard i sit contiguously at sum_{i'<i} recv_sizes[i'] of my buffer
    back = a2a(y, jnp.zeros((n, y.shape[-1]), y.dtype), axis_name="ep",
               input_offsets=_exclusive_cumsum(recv_sizes), send_sizes=recv_sizes,
               output_offsets=_exclusive_cumsum(sizes, axis=1)[:, me], recv_sizes=send_sizes)
    pairs = jnp.zeros_like(back).at[order].set(back).reshape(m, k, -1)
    return jax.lax.psum(pairs if local.per_slot else jnp.sum(pairs, axis=1), "tp")


def _ragged_all_to_all_padded(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                              axis_name):
    """`jax.lax.ragged_all_to_all` semantics from a dense `all_to_all`: each peer's chunk is padded
    to the operand's length, exchanged, then scattered at the sender's output offset."""
    n = operand.shape[0]
    r = jnp.arange(n, dtype=jnp.int32)
    src = jnp.clip(input_offsets[:, None] + r[None, :], 0, n - 1)  # [ep, n]
    chunks = jnp.take(operand, src.reshape(-1), axis=0)  # [ep * n, ...]
    recv = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # recv[i*n:(i+1)*n] from peer i
    their_off = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # peer i's offset for me
    dst = their_off[:, None] + r[None, :]
    dst = jnp.where(r[None, :] < recv_sizes[:, None], dst, output.shape[0])  # padding -> dropped
    return output.at[dst.reshape(-1)].set(recv, mode="drop")


# ----------------------------------------------------------------------------- load recording

_LOADS: dict[str, dict[int, np.ndarray]] = {}
_LOCK = threading.Lock()


def _record_load(key, layer, num_experts, ids):
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=int(num_experts))
    with _LOCK:
        table = _LOADS.setdefault(str(key), {})
        table[int(layer)] = table.get(int(layer), 0) + counts


def recorded_load(key: str, clear: bool = False) -> dict[int, np.ndarray]:
    """{layer: per-expert token counts [E]} accumulated by the ExpertParallels made with record=key
    (counts logical experts, before placement). Padding rows of a chunk are counted too."""
    with _LOCK:
        out = {layer: np.array(v) for layer, v in _LOADS.get(key, {}).items()}
        if clear:
            _LOADS.pop(key, None)
    return out

