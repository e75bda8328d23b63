"""Sampling parameters and generate's options: every bad value raises naming the option, before anything is
compiled; new values of temperature / top_k / top_p reuse the compiled loop (traced, never static)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import small_v4
from model import init_random
from sampling import generate, sample
from sampling.generate import _TRACES
from sampling.replay import PrefixStore


@pytest.fixture(scope="module")
def model():
    return init_random(small_v4(), seed=1)


BAD = [
    (dict(temperature=-0.5), r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.5"),
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0 .*got nan"),
    (dict(temperature=True), r"temperature must be a finite number >= 0 .*got True"),
    (dict(temperature="0.7"), r"temperature must be a finite number >= 0 .*got '0.7'"),
    (dict(top_k=-1), r"top_k must be an integer >= 0 \(0 = no top-k\), got -1"),
    (dict(top_k=2.5), r"top_k must be an integer >= 0 .*got 2.5"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\] \(1 = no top-p\), got 0.0"),
    (dict(top_p=-0.2), r"top_p must be a number in \(0, 1\] .*got -0.2"),
    (dict(top_p=1.5), r"top_p must be a number in \(0, 1\] .*got 1.5"),
    (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=4.0), r"max_new_tokens must be an integer >= 1, got 4.0"),
    (dict(seed=1.5), r"seed must be an integer, got 1.5"),
    (dict(stop_tokens=[1, 999]), r"stop_tokens must be token ids in \[0, 256\), got \[999\]"),
    (dict(num_draft=2), r"num_draft=2 needs speculative decoding"),
    (dict(policy="confidence"), r"policy='confidence' needs speculative decoding"),
    (dict(verify_cost=[1.0, 1.0]), r"verify_cost=\[1.0, 1.0\] needs speculative decoding"),
    (dict(speculative="mtp", num_draft=2, verify_cost=[1.0, 0.0, 1.0]), r"verify_cost needs 3 positive costs"),
    (dict(speculative="mtp", num_draft=2.0), r"num_draft must be >= 1 \(an integer\), got 2.0"),
    (dict(prefix_store={}), r"prefix_store must be a sampling.replay.PrefixStore, got dict"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[str(k) for k, _ in BAD])
def test_bad_options_raise_before_compiling(model, kwargs, message):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        generate(model, [[3, 4, 5]], **{"max_new_tokens": 4, **kwargs})
    assert time.perf_counter() - t0 < 10  # nothing was traced


@pytest.mark.parametrize("prompts", [[[3.0, 4.0, 5.0]], np.array([[3.5, 4.0]]), [[True, False]]])
def test_float_or_bool_token_ids_are_rejected(model, prompts):
    """`generate` used to truncate float ids; `model(...)` always rejected them."""
    with pytest.raises(ValueError, match=r"token ids must be integers, got (float64|bool)"):
        generate(model, prompts, max_new_tokens=2)


def test_bounded_replay_values(model):
    with pytest.raises(ValueError, match="V4.1 mechanism"):
        generate(model, [[3, 4, 5]], max_new_tokens=2, bounded_replay=4)
    from model import ModelConfig
    from sampling.generate import check_request

    cfg = ModelConfig.preset("tiny-v41")
    for bad in (0, -3, 2.5, "yes"):
        with pytest.raises(ValueError, match=r"bounded_replay must be True, False or a tail length >= 1"):
            check_request(cfg, bounded_replay=bad)
    assert check_request(cfg, bounded_replay=True, speculative="dspark", num_draft=2) == cfg.sliding_window + 2


def test_new_sampling_values_reuse_the_compiled_loop(model):
    """temperature / top_k / top_p are traced: one trace for greedy, sampled, top-k, top-p and an integer
    temperature alike (each different value used to recompile the whole loop)."""
    prompts = [[3, 4, 5, 6], [9, 10]]
    before = _TRACES["fused"]
    outs = [generate(model, prompts, max_new_tokens=5, seed=3, **kw).tokens
            for kw in (dict(), dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=0.9, top_p=0.5),
                       dict(temperature=2, top_k=1))]
    assert _TRACES["fused"] - before == 1
    np.testing.assert_array_equal(outs[-1], outs[0])  # top_k = 1 samples the argmax: greedy's tokens
    assert not np.array_equal(outs[1], outs[0])


def test_sample_knobs_traced_under_jit():
    """`sample` under jit with the knobs as arguments: greedy at 0, the top-1 at top_k = 1, one compile."""
    logits = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
    traces = []

    @jax.jit
    def draw(key, t, k, p):
        traces.append(1)
        return sample(logits, key, t, k, p)

    key = jax.random.PRNGKey(0)
    assert draw(key, np.float32(0.0), np.int32(0), np.float32(1.0)).tolist() == [1, 0]
    assert draw(key, np.float32(5.0), np.int32(1), np.float32(1.0)).tolist() == [1, 0]
    assert draw(key, np.float32(1.0), np.int32(0), np.float32(1e-6)).tolist() == [1, 0]  # top-p keeps the best
    assert len(traces) == 1


def test_prefix_store_combinations_that_raise(model):
    from sharding import ParallelConfig

    with pytest.raises(NotImplementedError, match=r"timing=True with prefix_store: the store path prefills in "
                                                  r"host-driven chunks"):
        generate(model, [[3, 4, 5]], max_new_tokens=2, prefix_store=PrefixStore(), timing=True)
    explicit = ParallelConfig(axis_type="explicit").make_mesh()
    with pytest.raises(NotImplementedError, match=r"meshes with explicit axis types are not supported"):
        generate(model, [[3, 4, 5]], max_new_tokens=2, mesh=explicit)
