"""Rollback undoes at most what the rings can: spec_room positions behind the furthest row written.

Rows written past the kept length sit in ring slots that live window rows share once more than spec_room of
them were written: rolling back further would read clobbered rows. Within the bound the result is exact."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from common import rel_err, small_config
from model import init_random
from model.cache import allocate
from model.transformer import decode, prefill

CFG = small_config("tiny-v4")


@pytest.fixture(scope="module")
def setup():
    model = init_random(CFG, seed=4)
    tokens = np.random.default_rng(4).integers(2, CFG.vocab_size, (1, 48))
    return model, tokens, np.asarray(model(tokens))


def _prefilled(model, tokens, n: int, spec_room: int = 8):
    cache = allocate(CFG, 1, 64, jnp.float32, spec_room)
    _, cache = prefill(model, cache, tokens[:, :n], np.array([n]))
    return cache


def test_rollback_within_spec_room_is_exact(setup):
    model, tokens, full = setup
    cache = _prefilled(model, tokens, 20)
    _, cache = decode(model, cache, np.full((1, 8), 5))  # 8 rows that get rejected
    cache = cache.rollback(np.array([20]))
    logits, cache = decode(model, cache, tokens[:, 20:24])
    assert rel_err(logits[0], full[0, 20:24]) < 1e-5


def test_rollback_past_spec_room_raises(setup):
    model, tokens, _ = setup
    cache = _prefilled(model, tokens, 20)
    _, cache = decode(model, cache, np.full((1, 12), 5))  # 12 rows with spec_room = 8
    with pytest.raises(ValueError, match=r"cannot roll sequence 0 back to length 20: its rings hold spec_room=8 "
                                         r"slots beyond the window.*no length below 24 can be restored"):
        cache.rollback(np.array([20]))
    cache.rollback(np.array([24]))  # 8 behind the furthest row: fine


def test_rollback_in_two_steps_counts_from_the_furthest_row(setup):
    model, tokens, _ = setup
    cache = _prefilled(model, tokens, 20)
    _, cache = decode(model, cache, np.full((1, 12), 5))
    cache = cache.rollback(np.array([26]))
    with pytest.raises(ValueError, match="no length below 24 can be restored"):
        cache.rollback(np.array([21]))


def test_rollback_below_an_imported_prefix_raises(setup):
    """A prefix import brings exactly the rows a resume at its length reads: nothing before it can be restored."""
    from model.cache import export_prefix, import_prefix

    model, tokens, _ = setup
    state = export_prefix(_prefilled(model, tokens, 32), CFG, 0, 32, include_window=True)
    cache = import_prefix(allocate(CFG, 1, 64, jnp.float32), CFG, 0, state)
    with pytest.raises(ValueError, match="prefix was imported at 32"):
        cache.rollback(np.array([30]))


def test_verification_wider_than_spec_room_raises():
    from model import draft as D
    from sampling.speculative import SpecParams, verify

    model = init_random(CFG.replace(compress_ratios=CFG.compress_ratios + (0,), num_mtp_layers=1), seed=0)
    cache = allocate(model.config, 1, 64, jnp.float32, spec_room=4)
    proposal = D.Proposal(tokens=jnp.zeros((1, 6), jnp.int32), logits=jnp.zeros((1, 6, CFG.vocab_size)))
    with pytest.raises(ValueError, match=r"verifying 6 drafts writes 6 rows past the kept length, but the cache "
                                         r"has spec_room=4"):
        verify(model, cache, jnp.zeros((1,), jnp.int32), proposal, None, SpecParams("mtp", 6))
