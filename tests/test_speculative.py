"""Speculative decoding: drafters against the official reference, losslessness (greedy: identical
tokens; sampling: the target's distribution, chi-square), no retracing, clear errors.

Small configs keep CPU compile time down: 3-layer V4 (SWA, CSA, HCA + MTP) and 4-layer V4.1
(SWA, Full r2, Full r1 candidate source, Reindex + 3 DSpark stages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as scipy_stats

from model import init_random
from model import draft as D
from model.cache import allocate
from sampling import generate
from sampling.generate import _TRACES

from common import load_golden, rel_err, small_v4, small_v41

V4_SMALL = small_v4()
V41_SMALL = small_v41()
PROMPTS = [list(range(3, 20)), list(range(30, 41))]


@nnx.jit
def _step(model, tokens, cache, n_new):
    logits, cache, extras = model.step(tokens, cache, n_new)
    return logits, cache, extras


# ----------------------------------------------------------------------------- official reference

def test_mtp_against_golden(golden_dir):
    model, toks, cont, out = load_golden(golden_dir, "v4")
    toks, cont = jnp.asarray(toks), jnp.asarray(cont)
    b, s = toks.shape
    cache, dc = allocate(model.config, b, 64, jnp.float32), D.allocate_draft(model, b, 64)
    commit = nnx.jit(D.mtp_commit)
    _, cache, ex = _step(model, toks, cache, jnp.full((b,), s))
    nxt = jnp.concatenate([toks[:, 1:], cont[:, :1]], 1)
    logits, _, dc = commit(model, dc, ex["residual"], nxt, jnp.full((b,), s))
    assert rel_err(logits, out["mtp_prefill_logits"]) < 1e-4
    steps = []
    for i in range(8):
        _, cache, ex = _step(model, cont[:, i:i + 1], cache, jnp.ones((b,), jnp.int32))
        logits, _, dc = commit(model, dc, ex["residual"], cont[:, i + 1:i + 2], jnp.ones((b,), jnp.int32))
        steps.append(np.asarray(logits[:, 0]))
    assert rel_err(np.stack(steps, 1), out["mtp_decode_logits"]) < 1e-4


def test_dspark_against_golden(golden_dir):
    """The golden driving convention: after decode step i at p, commit context key p, then draft the
    block [continuation[i+1], noise x3] at positions p+1..p+4 (greedy Markov chain)."""
    model, toks, cont, out = load_golden(golden_dir, "v41")
    toks, cont = jnp.asarray(toks), jnp.asarray(cont)
    b, s = toks.shape
    cache, dc = allocate(model.config, b, 64, jnp.float32), D.allocate_draft(model, b, 64)
    commit = nnx.jit(D.dspark_commit)
    propose = nnx.jit(lambda m, dc, a: D.dspark_propose(m, dc, a, lambda logits, i: jnp.argmax(logits, -1)))
    _, cache, ex = _step(model, toks, cache, jnp.full((b,), s))
    assert rel_err(ex["main_hidden"], out["prefill_main_hidden"]) < 1e-4
    dc = commit(model, dc, ex["main_hidden"], jnp.full((b,), s))
    ids, logits, conf = [], [], []
    for i in range(8):
        _, cache, ex = _step(model, cont[:, i:i + 1], cache, jnp.ones((b,), jnp.int32))
        dc = commit(model, dc, ex["main_hidden"], jnp.ones((b,), jnp.int32))
        p = propose(model, dc, cont[:, i + 1])
        ids.append(np.concatenate([np.asarray(cont[:, i + 1:i + 2]), np.asarray(p.tokens)], 1))
        logits.append(np.asarray(p.logits))
        conf.append(np.asarray(p.confidence))
    np.testing.assert_array_equal(np.stack(ids, 1), out["dspark_draft_ids"])
    assert rel_err(np.stack(logits, 1), out["dspark_draft_logits"]) < 1e-4
    assert rel_err(np.stack(conf, 1), out["dspark_confidence"]) < 1e-4


# ----------------------------------------------------------------------------- lossless greedy

@pytest.mark.parametrize("cfg,kind,policy", [(V4_SMALL, "mtp", "fixed"), (V41_SMALL, "dspark", "confidence")],
                         ids=["mtp-fixed", "dspark-confidence"])
def test_greedy_speculative_equals_plain(cfg, kind, policy):
    model = init_random(cfg, seed=2)
    plain = generate(model, PROMPTS, max_new_tokens=10)
    before = _TRACES["speculative"]
    spec = generate(model, PROMPTS, max_new_tokens=10, speculative=kind, num_draft=3, policy=policy)
    again = generate(model, PROMPTS, max_new_tokens=10, speculative=kind, num_draft=3, policy=policy)
    assert _TRACES["speculative"] - before == 1  # one trace for both calls: the loop never retraces
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_array_equal(again.tokens, plain.tokens)
    assert spec.stats["spec_steps"] >= 1 and 1.0 <= spec.stats["mean_accepted_length"] <= 4.0


def test_timed_speculative_phases():
    """timing=True runs verify and draft as separate calls: the same tokens as plain greedy, with prefill,
    verify and draft times, and the accepted-length histogram / per-step trace agree with the mean."""
    model = init_random(V4_SMALL, seed=2)
    plain = generate(model, PROMPTS, max_new_tokens=10)
    spec = generate(model, PROMPTS, max_new_tokens=10, speculative="mtp", num_draft=3, timing=True)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    st = spec.stats
    assert st["verify_s"] > 0 and st["draft_s"] > 0 and st["prefill_s"] > 0
    assert st["decode_s"] == pytest.approx(st["verify_s"] + st["draft_s"])
    hist = np.asarray(st["accepted_histogram"])  # index a: a drafts accepted (a + 1 tokens)
    assert hist.shape == (4,) and hist.sum() >= st["spec_steps"]
    assert (hist * np.arange(1, 5)).sum() / hist.sum() == pytest.approx(st["mean_accepted_length"])
    assert len(st["accepted_length_per_step"]) == st["spec_steps"]
    assert all(1.0 <= x <= 4.0 for x in st["accepted_length_per_step"])


def test_acceptance_math_greedy():
    """Exact drafts are all accepted (plus the bonus), a wrong first draft rejects everything."""
    from sampling.speculative import SpecParams, accept

    sp = SpecParams("mtp", 3)
    target = jax.nn.one_hot(jnp.array([[6, 7, 8, 9], [6, 7, 8, 9]]), 10) * 10.0  # row j predicts d_{j+1}
    prop = D.Proposal(tokens=jnp.array([[6, 7, 8], [1, 7, 8]]), logits=jnp.zeros((2, 3, 10)))
    a, nxt = accept(target, prop, jnp.array([3, 3]), jax.random.PRNGKey(0), sp)
    assert a.tolist() == [3, 0] and nxt.tolist() == [9, 6]  # bonus token / correction
    a, nxt = accept(target, prop, jnp.array([2, 3]), jax.random.PRNGKey(0), sp)  # verify only 2 drafts
    assert a.tolist() == [2, 0] and nxt.tolist() == [8, 6]


# ----------------------------------------------------------------------------- lossless sampling

def test_speculative_sampling_matches_target_distribution():
    """Rejection sampling is lossless: chi-square over 20k samples of the first two generated tokens.

    A target with a fixed next-token table over 8 tokens (p1, p2(.|t1)) and a deliberately different
    drafter (q1, q2(.|d1)); one verify step runs `accept` on two sampled drafts; when the first draft is
    rejected the second token comes from the target's next (plain) step."""
    from sampling.speculative import SpecParams, accept

    v, n = 8, 20000
    r = np.random.default_rng(0)
    p1, p2 = r.dirichlet(np.ones(v)), r.dirichlet(np.ones(v), size=v)
    q1, q2 = r.dirichlet(np.ones(v) * 0.5), r.dirichlet(np.ones(v) * 0.5, size=v)
    sp = SpecParams("mtp", 2, temperature=1.0)
    jp1, jp2, jq1, jq2 = (jnp.asarray(a, jnp.float32) for a in (p1, p2, q1, q2))

    def one(key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        d1 = jax.random.categorical(k1, jnp.log(jq1))
        d2 = jax.random.categorical(k2, jnp.log(jq2)[d1])
        target = jnp.log(jnp.stack([jp1, jp2[d1], jp1]))[None]  # rows predict t1, t2 | d1, (bonus: unused)
        prop = D.Proposal(tokens=jnp.stack([d1, d2])[None].astype(jnp.int32),
                          logits=jnp.log(jnp.stack([jq1, jq2[d1]]))[None])
        a, nxt = accept(target, prop, jnp.array([2]), k3, sp)
        a, nxt = a[0], nxt[0]
        t1 = jnp.where(a >= 1, d1, nxt)
        t2 = jnp.where(a >= 2, d2, jnp.where(a == 1, nxt, jax.random.categorical(k4, jnp.log(jp2)[t1])))
        return t1, t2

    t1, t2 = jax.vmap(one)(jax.random.split(jax.random.PRNGKey(1), n))
    observed = np.bincount(np.asarray(t1) * v + np.asarray(t2), minlength=v * v)
    expected = (p1[:, None] * p2).reshape(-1) * n
    keep = expected > 5  # chi-square validity; pool the rest
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    _, p_value = scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum())
    assert p_value > 0.01, p_value
    # and the drafter really differs: plain draft pairs would fail the same test
    d_obs = np.bincount(r.choice(v * v, n, p=(q1[:, None] * q2).reshape(-1)), minlength=v * v)
    assert scipy_stats.chisquare(np.append(d_obs[keep], d_obs[~keep].sum()), exp)[1] < 1e-6


def test_sampled_speculative_generation_runs():
    """Temperature > 0 through the whole loop: deterministic given the seed, tokens in range."""
    model = init_random(V4_SMALL, seed=1)
    a = generate(model, PROMPTS, max_new_tokens=6, temperature=0.8, top_k=50, seed=3, speculative="mtp", num_draft=2)
    b = generate(model, PROMPTS, max_new_tokens=6, temperature=0.8, top_k=50, seed=3, speculative="mtp", num_draft=2)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert ((a.tokens >= 0) & (a.tokens < V4_SMALL.vocab_size)).all()


# ----------------------------------------------------------------------------- errors

def test_bad_options(tmp_path):
    model = init_random(V4_SMALL, seed=0)
    with pytest.raises(ValueError, match="num_draft must be >= 1"):
        generate(model, PROMPTS, max_new_tokens=4, speculative="mtp", num_draft=0)
    with pytest.raises(ValueError, match="DSpark drafting needs a V4.1 model"):
        generate(model, PROMPTS, max_new_tokens=4, speculative="dspark")
    with pytest.raises(ValueError, match="confidence policy needs DSpark"):
        generate(model, PROMPTS, max_new_tokens=4, speculative="mtp", policy="confidence")
    with pytest.raises(ValueError, match="speculative must be"):
        generate(model, PROMPTS, max_new_tokens=4, speculative="eagle")
    no_drafts = init_random(V4_SMALL.replace(num_mtp_layers=0, compress_ratios=(0, 4, 16)), seed=0)
    with pytest.raises(ValueError, match="no draft weights"):
        generate(no_drafts, PROMPTS, max_new_tokens=4, speculative="mtp")
