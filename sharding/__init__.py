"""jaxinfer sharding (DESIGN.md "Sharding by table"): meshes, the logical-axis tables, expert
parallel MoE and expert placement.

    from sharding import ParallelConfig, EPConfig
    mesh = ParallelConfig(dp=2, ep=4).make_mesh()              # 8 devices
    model = init_random(cfg, seed=0, mesh=mesh)                 # born sharded, MoE expert parallel
    out = generate(model, prompts, mesh=mesh)                   # caches sharded too
"""

from .apply import allocate_cache, init_sharded, on_mesh, shard_batch, shard_model, to_host
from .expert_parallel import EPConfig, ExpertParallel, attach, detach, recorded_load
from .mesh import ParallelConfig, check_batch, initialize_multihost, make_mesh, parallel_config
from .placement import Placement, forced_balance_ids, rebalance
from .rules import cache_shardings, param_shardings

__all__ = [
    "EPConfig", "ExpertParallel", "ParallelConfig", "Placement", "allocate_cache", "attach", "cache_shardings",
    "check_batch", "detach", "forced_balance_ids", "init_sharded", "initialize_multihost", "make_mesh",
    "on_mesh", "param_shardings", "parallel_config", "rebalance", "recorded_load", "shard_batch",
    "shard_model", "to_host",
]
