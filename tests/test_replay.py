"""Bounded replay (decoder- and encoder-side, V4.1) and prefix reuse through `generate`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from common import small_config
from model import ModelConfig, init_random
from model.cache import allocate, export_prefix, set_token_history
from sampling import generate
from sampling.replay import PrefixStore, _chunk

rng = np.random.default_rng(0)
BASE = rng.integers(3, 90, 40).tolist()


@pytest.fixture(scope="module")
def v41():
    return init_random(ModelConfig.preset("tiny-v41"), seed=0)


@nnx.jit(static_argnames="tail")
def _last_logits(model, tokens, cache, n_new, tail):
    return model.step(tokens, cache, n_new, last_only=True, replay_tail=tail)[0][:, 0]


def test_decoder_replay_with_long_tail_is_exact(v41):
    toks = jnp.asarray(rng.integers(3, 90, (2, 40)))
    n = jnp.array([40, 29])
    exact = _last_logits(v41, toks, allocate(v41.config, 2, 64, jnp.float32), n, None)
    same = _last_logits(v41, toks, allocate(v41.config, 2, 64, jnp.float32), n, 40)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(exact))
    approx = _last_logits(v41, toks, allocate(v41.config, 2, 64, jnp.float32), n, 8)
    assert 0 < np.abs(np.asarray(approx) - np.asarray(exact)).max() < 5.0


def test_replay_composes_with_speculative(v41):
    """Speculative decoding is lossless against plain decoding with the same replay tail. (`bounded_replay=True`
    picks window + num_draft rows with speculative decoding and window rows without: two different
    approximations, which need not agree; a tail of 5 changes both prompts' output here.)"""
    tail = 5
    prompts = [BASE, BASE[:29]]
    plain = generate(v41, prompts, max_new_tokens=8, bounded_replay=tail)
    spec = generate(v41, prompts, max_new_tokens=8, bounded_replay=tail, speculative="dspark", num_draft=3)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert not np.array_equal(plain.tokens, generate(v41, prompts, max_new_tokens=8).tokens)


@pytest.mark.slow
def test_v4_prefix_reuse_is_exact():
    """tiny-v4 cut to one layer of each attention kind (common.small_config: the CSA and HCA layers' ratios 4 and
    16, which decide where a prefix may resume, as in the full preset). On request (-m slow): the default run has
    a V4 store hit through `generate` equal to a cold run with MTP drafts (tests/test_prefix_store_speculative.py),
    the exact V4 export / import (tests/test_prefix_store.py) and the store path without drafts on V4.1 (below)."""
    model = init_random(small_config("tiny-v4"), seed=0)
    store = PrefixStore(page_size=16)
    other = BASE[:37] + [9, 9, 9, 9, 9]
    cold = generate(model, [other], max_new_tokens=8)
    generate(model, [BASE + [5, 6, 7]], max_new_tokens=8, prefix_store=store)
    warm = generate(model, [other], max_new_tokens=8, prefix_store=store)
    assert warm.stats["prefix_hits"] == [32]
    np.testing.assert_array_equal(warm.tokens, cold.tokens)


def test_v41_encoder_replay_equals_cold_run_with_the_same_replay(v41):
    """Resume at H=32 from the store (global KV only) + replay [H-W, H) == a cold run that prefills [0, H),
    rolls back to H-W and replays [H-W, H) with the compressors off, then prefills the suffix."""
    cfg, w, h = v41.config, v41.config.sliding_window, 32
    prompt = np.asarray([BASE[:37] + [9, 9, 9, 9, 9]], np.int32)
    store = PrefixStore(page_size=16)
    generate(v41, [BASE + [5, 6, 7]], max_new_tokens=2, prefix_store=store)
    warm = generate(v41, prompt.tolist(), max_new_tokens=6, prefix_store=store)
    assert warm.stats["prefix_hits"] == [h]
    cache = allocate(cfg, 1, 64, jnp.float32)
    z = jnp.zeros(1, jnp.int32)
    _, cache = _chunk(v41, jnp.asarray(prompt[:, :h]), cache, jnp.array([h]), z, False, None, True)
    cache = set_token_history(cache.replace(lengths=jnp.array([h - w], jnp.int32)), prompt, np.array([h - w]))
    _, cache = _chunk(v41, jnp.asarray(prompt[:, h - w:h]), cache, jnp.array([w]), jnp.array([h - w]), False, None,
                      False)
    tokens = []
    logits, cache = _chunk(v41, jnp.asarray(prompt[:, h:]), cache, jnp.array([prompt.shape[1] - h]), z, True, None,
                           True)
    from model.transformer import decode
    tok = int(np.argmax(logits[0, 0]))
    for _ in range(6):
        tokens.append(tok)
        step_logits, cache = decode(v41, cache, np.array([tok]))
        tok = int(np.argmax(step_logits[0]))
    np.testing.assert_array_equal(warm.tokens[0], tokens)


def test_export_requires_even_v41_length(v41):
    cache = allocate(v41.config, 1, 64, jnp.float32)
    _, cache = _chunk(v41, jnp.asarray([BASE[:35]]), cache, jnp.array([35]), jnp.zeros(1, jnp.int32), False, None,
                      True)
    with pytest.raises(ValueError):
        export_prefix(cache, v41.config, 0, 35, include_window=False)


def test_bad_replay_options():
    model = init_random(ModelConfig.preset("tiny-v4"), seed=0)
    with pytest.raises(ValueError, match="V4.1 mechanism"):
        generate(model, [[1, 2, 3]], max_new_tokens=2, bounded_replay=True)
