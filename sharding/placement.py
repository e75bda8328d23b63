"""Expert placement over `ep`: redundant experts, EPLB-style rebalancing, forced-balance routing.

A `Placement` lists physical expert slots: slot s holds a copy of logical expert `slot_to_expert[s]`;
the S slots are split evenly over ep (shard g owns slots [g S/ep, (g+1) S/ep)). With S = E + R the
R redundant slots hold replicas of hot experts (DeepInfer serves 384 experts + 32 redundant in
prefill, + 64 in decode). A token routed to logical expert e goes to one of e's replicas, chosen
round-robin by (token row, choice), so replicas share e's load; results do not depend on placement
because replicas hold identical weights.

`rebalance(load, ep, num_redundant)` is greedy EPLB: give each extra slot to the expert with the
highest load per replica, then pack replicas (heaviest first) onto the least-loaded shard with a
free slot (longest-processing-time bin packing with equal capacities).

`forced_balance_ids` is the benchmark mode's routing (DeepInfer's DEEPINFER_FORCE_LOAD_BALANCE):
token row i's choice j goes to expert (i k + j) mod E, so every expert gets the same load whenever
M k is a multiple of E, and a token's k experts are distinct (k <= E). `ForcedBalance(experts)` is an
expert function (`expert_parallel.ExpertFn`) that runs `experts` with those ids in place of the router's:
a benchmark switch the experiment hands the model, never part of a model's config.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Placement:
    num_experts: int
    slot_to_expert: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "slot_to_expert", tuple(int(e) for e in self.slot_to_expert))
        s = np.asarray(self.slot_to_expert)
        if s.size < self.num_experts:
            raise ValueError(f"placement has {s.size} slots for {self.num_experts} experts")
        if s.min() < 0 or s.max() >= self.num_experts:
            raise ValueError(f"placement names experts outside [0, {self.num_experts})")
        missing = sorted(set(range(self.num_experts)) - set(s.tolist()))
        if missing:
            raise ValueError(f"placement gives no slot to experts {missing[:10]}")

    @staticmethod
    def identity(num_experts: int) -> "Placement":
        return Placement(num_experts, tuple(range(num_experts)))

    @property
    def num_slots(self) -> int:
        return len(self.slot_to_expert)

    @property
    def num_redundant(self) -> int:
        return self.num_slots - self.num_experts

    @property
    def is_identity(self) -> bool:
        return self.slot_to_expert == tuple(range(self.num_experts))

    def validate(self, ep: int) -> "Placement":
        if self.num_slots % ep:
            raise ValueError(f"{self.num_slots} expert slots ({self.num_experts} experts + "
                             f"{self.num_redundant} redundant) are not divisible by ep={ep}")
        return self

    def replicas(self) -> list[list[int]]:
        """Slots of each logical expert."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, e in enumerate(self.slot_to_expert):
            out[e].append(slot)
        return out

    def shards(self, ep: int) -> list[list[int]]:
        """Logical experts held by each ep shard (with repeats for replicas)."""
        self.validate(ep)
        per = self.num_slots // ep
        return [list(self.slot_to_expert[g * per:(g + 1) * per]) for g in range(ep)]

    def slot_ids(self, ids: jax.Array) -> jax.Array:
        """Logical expert ids [M, k] -> physical slots [M, k]: replica (row k + choice) mod count."""
        if self.is_identity:
            return ids
        reps = self.replicas()
        width = max(len(r) for r in reps)
        table = jnp.asarray([r + r[:1] * (width - len(r)) for r in reps], jnp.int32)  # [E, width]
        count = jnp.asarray([len(r) for r in reps], jnp.int32)
        m, k = ids.shape
        rr = jnp.arange(m * k, dtype=jnp.int32).reshape(m, k)
        return table[ids, rr % count[ids]]

    def shard_load(self, load, ep: int) -> np.ndarray:
        """Expected load of each shard: an expert's load split evenly over its replicas."""
        load = np.asarray(load, np.float64).reshape(-1)
        if load.shape[0] != self.num_experts:
            raise ValueError(f"load has {load.shape[0]} entries for {self.num_experts} experts")
        reps = self.replicas()
        per_slot = np.array([load[e] / len(reps[e]) for e in self.slot_to_expert])
        return per_slot.reshape(ep, -1).sum(axis=1)

    def imbalance(self, load, ep: int) -> float:
        """max / mean shard load (1.0 = perfectly balanced)."""
        s = self.shard_load(load, ep)
        return float(s.max() / max(s.mean(), 1e-12))


def rebalance(load, ep: int, num_redundant: int = 0) -> Placement:
    """Greedy EPLB from a recorded per-expert load [E] (token counts): -> Placement with E + R slots."""
    load = np.asarray(load, np.float64).reshape(-1)
    e = load.shape[0]
    if (load < 0).any():
        raise ValueError("expert load must be non-negative")
    if num_redundant < 0:
        raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
    slots = e + num_redundant
    if slots % ep:
        raise ValueError(f"{e} experts + {num_redundant} redundant = {slots} slots are not divisible by ep={ep}")
    count = np.ones(e, np.int64)
    heap = [(-load[i], i) for i in range(e)]  # max load per replica first
    heapq.heapify(heap)
    for _ in range(num_redundant):
        _, i = heapq.heappop(heap)
        count[i] += 1
        heapq.heappush(heap, (-load[i] / count[i], i))
    items = sorted(((load[i] / count[i], i) for i in range(e) for _ in range(count[i])), key=lambda t: (-t[0], t[1]))
    per = slots // ep
    shard_load = np.zeros(ep)
    shard_items: list[list[int]] = [[] for _ in range(ep)]
    for w, i in items:
        free = [g for g in range(ep) if len(shard_items[g]) < per]
        # least loaded shard with room; prefer one not holding a replica of i yet
        g = min(free, key=lambda g: (i in shard_items[g], shard_load[g], g))
        shard_items[g].append(i)
        shard_load[g] += w
    return Placement(e, tuple(x for g in range(ep) for x in sorted(shard_items[g])))


def forced_balance_ids(m: int, k: int, num_experts: int) -> jax.Array:
    """Benchmark-mode routing: row i's choice j -> expert (i k + j) mod E ([m, k] int32)."""
    if k > num_experts:
        raise ValueError(f"cannot route {k} distinct experts per token among {num_experts}")
    return (jnp.arange(m * k, dtype=jnp.int32).reshape(m, k) % num_experts).astype(jnp.int32)


def expert_load(ids, num_experts: int) -> np.ndarray:
    """Per-expert token count of routed ids [..., k] -> [E] int64."""
    return np.bincount(np.asarray(ids).reshape(-1), minlength=num_experts)


@dataclasses.dataclass(frozen=True)
class ForcedBalance:
    """An expert function (`expert_parallel.ExpertFn`) that routes by `forced_balance_ids` (over the E experts
    of w1's leading axis) instead of the ids it is given, then runs `experts` with balanced=True."""

    experts: Any  # an ExpertFn: model.moe.LocalExperts or an expert_parallel.ExpertParallel

    @property
    def impl(self) -> str:
        return self.experts.impl

    @property
    def per_slot(self) -> bool:
        return self.experts.per_slot

    def __call__(self, x, ids, weights, w1, w2, w3, limit, scales=None, act_block: int = 0, balanced: bool = False):
        m, k = ids.shape
        return self.experts(x, forced_balance_ids(m, k, w1.shape[0]), weights, w1, w2, w3, limit, scales=scales,
                            act_block=act_block, balanced=True)
