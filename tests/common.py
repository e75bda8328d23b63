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
