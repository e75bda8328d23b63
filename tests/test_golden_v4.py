"""The official V4 reference's own outputs (../shared/golden/v4, official names, real FP8/FP4 encodings):
prefill logits, one-shot logits, MTP logits, teacher-forced decode and greedy tokens."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from model.cache import allocate
from model.checkpoint import load_checkpoint
from model.transformer import decode, prefill
from sampling import generate


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@pytest.fixture(scope="module")
def golden(golden_dir):
    from safetensors.numpy import load_file

    d = golden_dir / "v4"
    inputs = json.loads((d / "inputs.json").read_text())
    return (load_checkpoint(d, dtype="float32"), np.asarray(inputs["prompts"]), np.asarray(inputs["continuation"]),
            load_file(d / "outputs.safetensors"))


def test_prefill_and_one_shot_logits(golden):
    model, prompts, cont, out = golden
    assert rel_err(model(prompts), out["prefill_logits"]) < 1e-4
    full = np.concatenate([prompts, cont[:, :8]], axis=1)
    assert rel_err(model(full), out["full_prefill_logits"]) < 1e-4


def test_mtp_logits(golden):
    model, prompts, cont, out = golden
    residual = model.forward(jnp.asarray(prompts))[1]["residual"]
    nxt = jnp.concatenate([prompts[:, 1:], cont[:, :1]], axis=1)
    assert rel_err(model.mtp_logits(residual, nxt), out["mtp_prefill_logits"]) < 1e-4


def test_teacher_forced_decode(golden):
    """Prefill 42 tokens (partial compression groups left open), then 8 single-token decodes."""
    model, prompts, cont, out = golden
    b, s = prompts.shape
    cache = allocate(model.config, b, 64, jnp.float32)
    _, cache = prefill(model, cache, prompts, np.full(b, s))
    steps = []
    for i in range(8):
        logits, cache = decode(model, cache, cont[:, i])
        steps.append(np.asarray(logits))
    assert rel_err(np.stack(steps, 1), out["decode_logits"]) < 1e-4


def test_greedy_tokens(golden):
    model, prompts, _, out = golden
    np.testing.assert_array_equal(generate(model, prompts, max_new_tokens=8).tokens, out["greedy_tokens"])
