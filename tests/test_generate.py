"""Sampler and generation loop: determinism, stops, ragged prompts, no retracing, clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import small_config
from model import init_random
from sampling import generate, sample
from sampling.generate import _TRACES
from sampling.sampler import filter_logits


@pytest.fixture(scope="module")
def model():
    """tiny-v4 cut to one layer of each attention kind (common.small_config): the loop under test is the same
    for any stack, and its compiles (one per batch and prompt shape) cost less with fewer layers."""
    return init_random(small_config("tiny-v4"), seed=1)


def test_sampler_greedy_topk_topp():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    assert int(sample(logits, jax.random.PRNGKey(0))[0]) == 0
    kept = np.isfinite(np.asarray(filter_logits(logits, 1.0, 2, 1.0)))[0]
    assert kept.tolist() == [True, True, False, False]
    kept = np.isfinite(np.asarray(filter_logits(logits, 1.0, 0, 0.7)))[0]  # 0.5 < 0.7 <= 0.8
    assert kept.tolist() == [True, True, False, False]
    draws = jax.vmap(lambda k: sample(logits, k, 1.0, 0, 1.0))(jax.random.split(jax.random.PRNGKey(1), 4000))
    freq = np.bincount(np.asarray(draws).ravel(), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_generate_ragged_deterministic_and_compiles_once(model):
    prompts = [[3, 4, 5, 6, 7], list(range(10, 30)), [9]]
    before = _TRACES["fused"]
    a = generate(model, prompts, max_new_tokens=6, temperature=0.9, top_k=30, top_p=0.95, seed=5)
    b = generate(model, prompts, max_new_tokens=6, temperature=0.9, top_k=30, top_p=0.95, seed=5)
    c = generate(model, prompts, max_new_tokens=6, temperature=0.9, top_k=30, top_p=0.95, seed=6)
    assert _TRACES["fused"] - before == 1  # one trace for all three calls (same shapes)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    # ragged greedy == each prompt alone
    g = generate(model, prompts, max_new_tokens=6)
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(g.tokens[i], generate(model, [p], max_new_tokens=6).tokens[0])


def test_stop_tokens(model):
    g = generate(model, [[3, 4, 5]], max_new_tokens=6)
    stop = int(g.tokens[0, 2])
    s = generate(model, [[3, 4, 5]], max_new_tokens=6, stop_tokens=[stop])
    first = int(np.argmax(g.tokens[0] == stop))
    assert s.tokens[0, first] == stop and (s.tokens[0, first + 1:] == -1).all()
    assert s.lengths[0] == first + 1


def test_padded_array_with_lengths(model):
    arr = np.array([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10]])
    a = generate(model, arr, lengths=[3, 5], max_new_tokens=4)
    b = generate(model, [[3, 4, 5], [6, 7, 8, 9, 10]], max_new_tokens=4)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_bad_input(model):
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, [[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate(model, [[1, 2, 3]], max_new_tokens=model.config.max_position_embeddings)
    with pytest.raises(ValueError, match="lengths has 3 entries"):
        generate(model, np.ones((2, 4), int), lengths=[4, 4, 4], max_new_tokens=2)
    with pytest.raises(ValueError, match="exceed the prompt array width"):
        generate(model, np.ones((2, 4), int), lengths=[4, 5], max_new_tokens=2)
    with pytest.raises(ValueError, match="token ids"):
        generate(model, [[1, 999]], max_new_tokens=2)


def test_main_command_plain_and_speculative(tmp_path, capsys):
    """The README's main job (experiments/generate.py), plain and with MTP speculative decoding."""
    import json

    from experiments import generate as main_job

    common = ["--preset", "tiny-v4", "--max-new-tokens", "6", "--batch", "2", "--prompt-len", "12"]
    plain = main_job.main(common + ["--json", str(tmp_path / "plain.json")])
    spec = main_job.main(common + ["--speculative", "mtp", "--num-draft", "2"])
    out = capsys.readouterr().out
    assert "prefill:" in out and "speculative (mtp, 2 drafts): mean accepted length" in out
    assert json.loads((tmp_path / "plain.json").read_text())["decode_s"] == plain["decode_s"]
    assert spec["verify_s"] > 0 and spec["draft_s"] > 0 and 1.0 <= spec["mean_accepted_length"] <= 3.0
