"""Prefix reuse with speculative decoding on one device: lossless against the same store path without it
([V4] an exact resume, so also equal to a cold run; [V4.1] encoder-side replay, the same approximation with
and without drafts), and kernel paths off a GPU say that they are interpreted."""

from __future__ import annotations

import numpy as np
import pytest

from common import small_v4, small_v41
from model import init_random
from sampling import generate
from sampling.replay import PrefixStore

BASE = np.random.default_rng(0).integers(3, 90, 40).tolist()
OTHER = BASE[:37] + [9, 9, 9, 9, 9]   # shares 32 tokens (two pages of 16) with BASE


def test_v4_mtp_with_prefix_store_is_exact():
    model = init_random(small_v4(), seed=0)
    cold = generate(model, [OTHER], max_new_tokens=8)
    store = PrefixStore(page_size=16)
    generate(model, [BASE + [5, 6, 7]], max_new_tokens=8, prefix_store=store, speculative="mtp", num_draft=2)
    miss = [7, 8, 9] * 7  # a hit and a miss in one batch
    warm = generate(model, [OTHER, miss], max_new_tokens=8, prefix_store=store, speculative="mtp", num_draft=2)
    assert warm.stats["prefix_hits"] == [32, 0]
    np.testing.assert_array_equal(warm.tokens[0], cold.tokens[0])
    np.testing.assert_array_equal(warm.tokens[1], generate(model, [miss], max_new_tokens=8).tokens[0])
    assert warm.stats["spec_steps"] >= 1 and warm.stats["mean_accepted_length"] >= 1.0


@pytest.mark.slow
def test_v41_dspark_with_prefix_store_equals_the_store_path_without_drafts():
    model = init_random(small_v41(), seed=0)
    store = PrefixStore(page_size=16)
    generate(model, [BASE + [5, 6, 7]], max_new_tokens=2, prefix_store=store)
    plain = generate(model, [OTHER], max_new_tokens=8, prefix_store=store)
    spec = generate(model, [OTHER], max_new_tokens=8, prefix_store=store, speculative="dspark", num_draft=3)
    assert plain.stats["prefix_hits"] == spec.stats["prefix_hits"] == [32]
    np.testing.assert_array_equal(spec.tokens, plain.tokens)


def test_interpreted_kernels_warn():
    import jax
    import jax.numpy as jnp

    from common import small_config

    model = init_random(small_config("tiny-v4").replace(attention_impl="pallas"), seed=0)
    with pytest.warns(UserWarning, match=r"attention_impl='pallas', moe_impl='reference' on the cpu backend run the "
                                         r"Pallas kernels in interpret mode"):
        jax.eval_shape(lambda t: model.forward(t)[0], jnp.zeros((1, 8), jnp.int32))
