"""The routing plan: the M*k routed rows of a MoE block laid out in a tile-aligned buffer (XLA).

Rows are sorted by expert; expert e owns ceil(rows_e / block_m) consecutive tiles of block_m rows, so every
tile belongs to one expert (`tile_expert[t]`, -1 past the last tile). Experts with no rows own no tiles and cost
nothing: their weights are never read. Padding rows carry routing weight 0. The buffer has a static worst-case
size `max_tiles` tiles; tiles past `num_tiles` are dead and the kernels skip them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def forced_balance(num_tokens: int, num_experts: int, k: int, *, offset: int = 0) -> jax.Array:
    """DeepInfer's benchmark routing: every expert gets the same load (to within one row).

    Routed row r = t*k + j goes to expert (r + offset) mod E, so each token's k experts are distinct
    (k <= E) and consecutive tokens walk round the experts. Returns expert ids [num_tokens, k] int32.
    `offset` rotates the assignment (e.g. by step or by rank) without changing the balance.
    """
    if k > num_experts:
        raise ValueError(f"forced_balance: k={k} > num_experts={num_experts}")
    r = jnp.arange(num_tokens * k, dtype=jnp.int32) + jnp.int32(offset % num_experts)
    return (r % num_experts).reshape(num_tokens, k)


class RoutePlan(NamedTuple):
    """Tile-aligned layout of the routed rows (all int32 except row_weight).

    tile_expert [T]   expert of tile t, -1 for t >= num_tiles
    tile_rows   [T]   routed (non-padding) rows in tile t (its first ones), 0 for t >= num_tiles
    row_token   [P]   token feeding padded row p (0 for padding rows), P = T * block_m
    row_weight  [P]   routing weight of row p (0 for padding)
    dest        [M,k] padded row holding token t's j-th routed row
    num_tiles   []    tiles in use
    group_sizes [E]   rows per expert
    """
    tile_expert: jax.Array
    tile_rows: jax.Array
    row_token: jax.Array
    row_weight: jax.Array
    dest: jax.Array
    num_tiles: jax.Array
    group_sizes: jax.Array


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Static bound on sum_e ceil(rows_e / block_m): cdiv(R, bm) + (number of non-empty experts)."""
    return -(-num_rows // block_m) + min(num_experts, num_rows)


def route_plan(expert_ids: jax.Array, weights: jax.Array, num_experts: int, block_m: int) -> RoutePlan:
    """expert_ids [M, k] int, weights [M, k] float -> RoutePlan (see the module docstring). Ids outside
    [0, num_experts) are dropped: no tile, and `dest` = P (past the buffer) so they combine to 0."""
    m, k = expert_ids.shape
    r = m * k
    t_max = max_tiles(r, num_experts, block_m)
    p = t_max * block_m
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # dropped rows sort last
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)       # sorted position -> flat row
    sorted_e = flat[order]
    kept = sorted_e < num_experts
    gs = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # the sentinel is not counted
    tiles = (gs + block_m - 1) // block_m
    tiles_end = jnp.cumsum(tiles).astype(jnp.int32)
    tile_first = tiles_end - tiles
    group_first = (jnp.cumsum(gs) - gs).astype(jnp.int32)
    e_kept = jnp.minimum(sorted_e, num_experts - 1)
    rank = jnp.arange(r, dtype=jnp.int32) - group_first[e_kept]
    dest_sorted = jnp.where(kept, tile_first[e_kept] * block_m + rank, p)
    row_token = jnp.zeros((p,), jnp.int32).at[dest_sorted].set(order // k, mode="drop")
    row_weight = jnp.zeros((p,), jnp.float32).at[dest_sorted].set(
        weights.reshape(-1).astype(jnp.float32)[order], mode="drop")
    dest = jnp.zeros((r,), jnp.int32).at[order].set(dest_sorted).reshape(m, k)
    num_tiles = tiles_end[-1]
    t = jnp.arange(t_max, dtype=jnp.int32)
    # one fused compare-and-count (T x E): the default binary search is a chain of ~2 log2(E) tiny GPU kernels
    tile_expert = jnp.searchsorted(tiles_end, t, side="right", method="compare_all").astype(jnp.int32)
    live = t < num_tiles
    e_t = jnp.minimum(tile_expert, num_experts - 1)
    tile_rows = jnp.where(live, jnp.clip(gs[e_t] - (t - tile_first[e_t]) * block_m, 0, block_m), 0)
    return RoutePlan(jnp.where(live, tile_expert, -1), tile_rows.astype(jnp.int32), row_token, row_weight, dest,
                     num_tiles, gs)
