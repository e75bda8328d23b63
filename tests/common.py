"""Helpers shared by the tests (not a test module)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np


def rel_err(a, b) -> float:
    """Relative Frobenius error ||a - b|| / ||b|| in float64 (bf16 / fp32 inputs); NaN when `a` is not
    finite, so a comparison `rel_err(...) < tol` fails on it."""
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def small_config(preset: str):
    """The tiny presets cut to their essentials (compile time dominates on CPU): V4 with one hash SWA, one CSA
    and one HCA layer (every V4 attention kind, the indexer included) and no MTP layer; V4.1 without its DSpark
    draft layers."""
    from model import ModelConfig

    cfg = ModelConfig.preset(preset)
    if preset == "tiny-v4":
        return cfg.replace(num_layers=3, compress_ratios=(0, 4, 16), num_hash_layers=1, num_mtp_layers=0)
    return cfg.replace(num_mtp_layers=0, compress_ratios=cfg.compress_ratios[:cfg.num_layers])


def small_v4():
    """tiny-v4 cut to one hash SWA, one CSA and one HCA layer, keeping its MTP layer (the drafting tests)."""
    from model import ModelConfig

    return ModelConfig.preset("tiny-v4").replace(num_layers=3, compress_ratios=(0, 4, 16, 0), num_hash_layers=1,
                                                 name="v4-small")


def small_v41():
    """tiny-v41 cut to four layers that keep every V4.1 layer kind with an indexer or a published state: SWA;
    Full r=2 + Engram (KV and index source); Full r=1 (candidate source); Reindex with candidates; its three
    DSpark stages target layers 1-3. (No Reuse layer: Reuse layers read what the sources publish.)"""
    from model import ModelConfig

    return ModelConfig.preset("tiny-v41").replace(
        num_layers=4, compress_ratios=(0, 2, 1, 1, 0, 0, 0), kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2, engram_layer_ids=(1,),
        dspark_target_layer_ids=(1, 2, 3), name="v41-small")


def load_golden(golden_dir: Path, name: str):
    """(model float32, prompts [B, S], continuation [B, D+1], outputs) of ../shared/golden/<name>."""
    from safetensors.numpy import load_file

    from model.checkpoint import load_checkpoint

    d = golden_dir / name
    inputs = json.loads((d / "inputs.json").read_text())
    return (load_checkpoint(d, dtype="float32"), np.asarray(inputs["prompts"]), np.asarray(inputs["continuation"]),
            load_file(d / "outputs.safetensors"))


def teacher_forced_decode(model, prompts: np.ndarray, cont: np.ndarray, steps: int = 8) -> np.ndarray:
    """Prefill the prompts, then feed cont[:, i] one token at a time -> logits [B, steps, V]."""
    from model.cache import allocate
    from model.transformer import decode, prefill

    b, s = prompts.shape
    cache = allocate(model.config, b, 64, jnp.float32)
    _, cache = prefill(model, cache, prompts, np.full(b, s))
    out = []
    for i in range(steps):
        logits, cache = decode(model, cache, cont[:, i])
        out.append(np.asarray(logits))
    return np.stack(out, 1)
