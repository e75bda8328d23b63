"""jaxinfer sharding (DESIGN.md "Sharding by table"): meshes and multi-host start-up, the logical-axis
table, global arrays from host data, expert dispatch over `ep` and the per-batch-shard kernel runner
(both over the functions they are given), and expert placement. It knows nothing of the model: the
model builds its runtime from these tools (model/runtime.py, model/sharded.py).

    from sharding import ParallelConfig
    mesh = ParallelConfig(dp=2, ep=4).make_mesh()              # 8 devices
    model = init_random(cfg, seed=0, mesh=mesh)                 # born sharded, MoE expert parallel
    out = generate(model, prompts, mesh=mesh)                   # caches sharded too
"""

from .apply import local_experts, place, shard_batch, to_host
from .batch_parallel import BatchParallel
from .expert_parallel import EPConfig, ExpertFn, ExpertParallel, recorded_load
from .mesh import ParallelConfig, check_batch, initialize_multihost, make_mesh, parallel_config
from .placement import ForcedBalance, Placement, forced_balance_ids, rebalance
from .rules import LOGICAL_AXIS_RULES, batch_sharding, logical_to_spec

__all__ = [
    "BatchParallel", "EPConfig", "ExpertFn", "ExpertParallel", "ForcedBalance", "LOGICAL_AXIS_RULES",
    "ParallelConfig", "Placement", "batch_sharding", "check_batch", "forced_balance_ids", "initialize_multihost",
    "local_experts", "logical_to_spec", "make_mesh", "parallel_config", "place", "rebalance", "recorded_load",
    "shard_batch", "to_host",
]
