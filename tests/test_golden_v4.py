"""The official V4 reference's own outputs (../shared/golden/v4, official names, real FP8/FP4 encodings):
prefill logits, one-shot logits, MTP logits, teacher-forced decode and greedy tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sampling import generate

from common import load_golden, rel_err, teacher_forced_decode


@pytest.fixture(scope="module")
def golden(golden_dir):
    return load_golden(golden_dir, "v4")


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
    steps = teacher_forced_decode(model, prompts, cont)
    assert rel_err(steps, out["decode_logits"]) < 1e-4


def test_greedy_tokens(golden):
    model, prompts, _, out = golden
    np.testing.assert_array_equal(generate(model, prompts, max_new_tokens=8).tokens, out["greedy_tokens"])
