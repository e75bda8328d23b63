"""Will a bench point fit? The device's memory, the weights per device on a mesh, and a point's weights + cache +
activations against them, refused above MEMORY_HEADROOM of the device before anything is allocated."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from experiments.bench import Point

MEMORY_HEADROOM = 0.92  # refuse above this fraction of the device memory (XLA workspace, fragmentation)


def device_capacity() -> tuple[float, str]:
    """Bytes one device can hold (jax's allocator limit; host RAM on CPU)."""
    import jax

    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend has memory stats
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"{getattr(dev, 'device_kind', dev.platform)} allocator limit"
    try:
        import psutil

        return float(psutil.virtual_memory().total), "host RAM"
    except ImportError:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "host RAM"


_WEIGHT_BYTES: dict = {}


def weight_bytes_per_device(cfg, dtype: str, mesh: tuple) -> float:
    """Resident parameter bytes per device under the sharding table (drafter included: the model holds it)."""
    key = (cfg, dtype, tuple(mesh))
    if key not in _WEIGHT_BYTES:
        from model.sharded import memory_per_device

        dp, ep, tp = mesh
        _WEIGHT_BYTES[key] = float(memory_per_device(cfg, dp, ep, tp, 1, 64, dtype)["params"])
    return _WEIGHT_BYTES[key]


def estimate_memory(cfg, dtype: str, p: Point, max_len: int, capacity: float | None = None) -> dict:
    """Per-device bytes: weights + cache (+ drafter's rings) + a rough activation peak of one step.

    Activations (one layer at a time, XLA frees between layers): residual streams, queries, the MoE's
    routed rows, logits; with `attention_impl="reference"` also the dense [B, H, T, keys] score matrix and
    the indexer's [B, T, HI, N] scores, which is what makes the reference path unusable at long contexts.
    """
    import jax.numpy as jnp

    from model.cache import memory_estimate

    dp, ep, tp = p.mesh
    item = jnp.dtype(dtype).itemsize
    seqs = math.ceil(p.batch / (dp * ep))
    weights = weight_bytes_per_device(cfg, dtype, p.mesh)
    per_seq = memory_estimate(cfg, max_len, jnp.dtype(dtype), spec_room=max(8, p.num_draft + 2))
    cache = per_seq["bytes_per_sequence_at_max_len"] * seqs
    draft = 0.0
    if p.kind == "spec":
        draft = cfg.num_mtp_layers * seqs * (cfg.sliding_window + max(8, p.num_draft + 2)) * cfg.head_dim * item
    t = p.rows
    rows = seqs * t
    d, h, dh = cfg.hidden_size, cfg.num_heads // tp, cfg.head_dim
    act = rows * (4 * cfg.hc_mult * d * 4            # streams (fp32 coefficients, a few copies)
                  + 3 * h * dh * item               # q, attention output, rotated
                  + cfg.n_experts_per_tok * (d * item + 3 * cfg.moe_intermediate_size * 4))  # routed rows
    logit_rows = seqs if p.phase == "prefill" else rows
    act += logit_rows * cfg.vocab_size * 4 * 2
    n_max = max([max_len // r for r in cfg.compress_ratios[:cfg.num_layers] if r] or [0])
    if cfg.attention_impl == "reference":
        keys = cfg.sliding_window + 8 + t + n_max
        act += 2 * seqs * h * t * keys * 4            # scores and probabilities, float32
        act += 2 * rows * cfg.index_n_heads * n_max * 4
    else:
        act += 2 * rows * n_max * 4                   # fused indexer: one score row per query
    total = weights + cache + draft + act
    out = {"weights_bytes": weights, "cache_bytes": cache, "draft_cache_bytes": draft,
           "activation_bytes_estimate": act, "total_bytes": total, "seqs_per_device": seqs, "max_len": max_len}
    if capacity is not None:
        out["capacity_bytes"] = capacity
        out["fits"] = bool(total <= MEMORY_HEADROOM * capacity)
    return out


def memory_message(mem: dict, where: str) -> str:
    gb = 1e9
    return (f"needs ~{mem['total_bytes'] / gb:.1f} GB per device (weights {mem['weights_bytes'] / gb:.1f} + cache "
            f"{mem['cache_bytes'] / gb:.1f} + drafter rings {mem['draft_cache_bytes'] / gb:.2f} + activations "
            f"~{mem['activation_bytes_estimate'] / gb:.1f}) but {where} holds {mem['capacity_bytes'] / gb:.1f} GB "
            f"(limit {MEMORY_HEADROOM:.0%}); use a smaller batch or context, more devices, or "
            f"--attention-impl pallas")
