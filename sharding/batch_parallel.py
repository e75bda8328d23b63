"""Per-sequence Pallas kernels on a mesh: each (dp, ep) shard runs the kernel on its own sequences.

GSPMD cannot partition a `pallas_call` (an opaque custom call). Left to sharding propagation, a kernel
whose operands are split over the batch gets them all-gathered (the whole KV cache on every device) and
runs for the whole batch on each device. Attention and the indexer are independent per sequence, so
`BatchParallel` runs them inside `shard_map` with every batched operand split on axis 0 over the batch
axes of the tables (sharding/rules.py "batch": (dp, ep)) and the rest (e.g. the per-head sink)
replicated; the outputs stay split the same way, as the surrounding activations are.

Measured on nvidia-h200-x2 with the kernels left to propagation (V4-Flash widths, 4 layers, FP4 experts, 32K context,
experiments/results/sweep_h200x2-ep.md): decode B256 on dp=2 took 132.5 ms against 26.9 ms on one GPU.

`BatchParallel(mesh)` is a runner over the function it is given (frozen, hashable: the model holds it as
a static value of its graphdef); without one the kernels are called directly. A batch not divisible by
the shard count runs unsplit (correct, replicated).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
from jax.sharding import Mesh, PartitionSpec as P

from .mesh import parallel_config
from .rules import batch_spec


@dataclasses.dataclass(frozen=True)
class BatchParallel:
    mesh: Mesh

    def shards(self) -> int:
        """How many ways the batch is split (dp x ep, as for every batched activation and cache)."""
        return parallel_config(self.mesh).batch_shards

    def __call__(self, fn: Callable, batched: Sequence, replicated: Sequence = ()):
        """fn(*batched, *replicated) with batched arrays [B, ...] (None allowed) split over the batch shards;
        the output pytree's arrays are [B, ...] split the same way."""
        lead = next(x for x in batched if x is not None)
        n = self.shards()
        if n == 1 or lead.shape[0] % n:
            return fn(*batched, *replicated)
        split = batch_spec(self.mesh)
        specs = tuple(split if x is not None else P() for x in batched) + tuple(P() for _ in replicated)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=specs, out_specs=split, check_vma=False)(
            *batched, *replicated)

