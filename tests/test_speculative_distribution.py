"""Sampled speculative decoding end to end draws from the target's distribution: `generate` with MTP and DSpark
drafts (fixed and confidence policies), temperature != 1, top-k and top-p, against the exact distribution of
plain sampling's first tokens (every prefix's filtered next-token distribution, from full forwards).

A chi-square test on the joint of the first tokens (the second and third come through one verify step of two
drafts), in a 16-token vocabulary where the drafters' and the target's distributions overlap (so drafts are
accepted and rejected), at a false-alarm probability of 1e-3: a correct sampler fails a seeded draw with that probability, and the
seeds are fixed, so the suite cannot fail at random. Cuts that float noise could move (a top-k or top-p cut
whose deciding logits / masses lie within 1e-4) are ruled out by construction: the prompt is drawn again.
The two sampling settings of a case run on one compiled loop (the knobs are traced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from common import small_v4, small_v41, small_vocab
from model import init_random
from sampling import generate
from sampling.generate import _TRACES
from sampling.sampler import filter_logits

ALPHA = 1e-3
TIE = 1e-4
VOCAB = 16  # a small vocabulary: the drafter's and the target's distributions overlap, so `accept` decides often
# (knobs, tokens tested): the joint of the first `steps` tokens has at most (support)^steps cells
SETTINGS = ((dict(temperature=0.8, top_k=5, top_p=1.0), 3), (dict(temperature=1.5, top_k=0, top_p=0.75), 2))


def _filtered(logits: np.ndarray, knobs: dict) -> np.ndarray:
    """The sampler's filtered distribution [R, V], or None when a cut is within TIE of flipping."""
    z = np.asarray(logits, np.float64) / knobs["temperature"]
    order = np.sort(z, -1)[:, ::-1]
    k = knobs["top_k"]
    if k and np.any(order[:, k - 1] - order[:, k] < TIE):
        return None
    p = np.exp(order - order[:, :1])
    p = p[:, :k] if k else p
    p /= p.sum(-1, keepdims=True)
    before = np.cumsum(p, -1) - p
    if knobs["top_p"] < 1 and np.any(np.abs(before - knobs["top_p"]) < TIE):
        return None
    probs = jax.nn.softmax(filter_logits(jnp.asarray(logits), knobs["temperature"], k, knobs["top_p"]), -1)
    return np.asarray(probs, np.float64)


def target_distribution(model, prompt: list[int], knobs: dict, steps: int) -> dict | None:
    """{(t_1, .., t_steps): probability} of plain sampling, or None when some cut is near-tied."""
    dist = {(): 1.0}
    for _ in range(steps):
        prefixes = list(dist)
        logits = np.asarray(model(np.array([prompt + list(p) for p in prefixes])))[:, -1]
        probs = _filtered(logits, knobs)
        if probs is None:
            return None
        dist = {p + (int(t),): w * row[t] for p, w, row in zip(prefixes, dist.values(), probs)
                for t in np.nonzero(row > 0)[0]}
    return dist


def tie_free_prompt(model, seed: int) -> tuple[list[int], list[dict]]:
    rng = np.random.default_rng(seed)
    for _ in range(8):
        prompt = rng.integers(3, VOCAB - 1, 12).tolist()
        dists = [target_distribution(model, prompt, knobs, steps) for knobs, steps in SETTINGS]
        if all(d is not None for d in dists):
            return prompt, dists
    raise AssertionError("every drawn prompt has a near-tied top-k / top-p cut")


def chi_square_p(tokens: np.ndarray, dist: dict) -> float:
    steps = len(next(iter(dist)))
    seen = [tuple(int(t) for t in row[:steps]) for row in tokens]
    outside = [s for s in seen if s not in dist]
    assert not outside, f"sampled sequences outside the target's support: {outside[:5]}"
    cells = list(dist)
    observed = np.array([sum(s == c for s in seen) for c in cells], np.float64)
    expected = np.array([dist[c] for c in cells]) * len(seen)
    keep = expected >= 5  # chi-square validity; the rest pooled into one cell
    obs, exp = observed[keep], expected[keep]
    if not keep.all():
        obs, exp = np.append(obs, observed[~keep].sum()), np.append(exp, expected[~keep].sum())
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def check_case(cfg, kind, policy, n: int, seed: int):
    model = init_random(cfg, seed=seed)
    prompt, dists = tie_free_prompt(model, seed)
    before = _TRACES["fused" if kind is None else "speculative"]
    for (knobs, _), dist in zip(SETTINGS, dists):
        spec = {} if kind is None else dict(speculative=kind, num_draft=2, policy=policy)
        out = generate(model, [prompt] * n, max_new_tokens=3, seed=seed + 1, **knobs, **spec)
        p = chi_square_p(out.tokens, dist)
        assert p > ALPHA, f"{kind} {policy} {knobs}: chi-square p = {p:.2e} over {len(dist)} sequences"
        if kind is not None:
            rates = out.stats["acceptance_per_position"]
            assert 0 < rates[0] < 1, rates  # drafts are accepted and rejected: both paths of `accept` ran
    assert _TRACES["fused" if kind is None else "speculative"] - before == 1  # one compile for both settings


def v4():
    return small_vocab(small_v4(), VOCAB)


def v41():
    return small_vocab(small_v41(), VOCAB)


CASES = {"plain": (v4, None, "fixed"), "mtp-fixed": (v4, "mtp", "fixed"), "dspark-fixed": (v41, "dspark", "fixed"),
         "dspark-confidence": (v41, "dspark", "confidence")}


# The default run tests DSpark with the confidence policy (a varying number of verified drafts, the most involved
# accept path); MTP with the fixed policy shares the accept / resample code and runs on request (-m slow), as
# does every case at 20000 sequences below.
@pytest.mark.parametrize("case", [pytest.param("mtp-fixed", marks=pytest.mark.slow), "dspark-confidence"])
def test_sampled_generation_has_the_target_distribution(case):
    make, kind, policy = CASES[case]
    check_case(make(), kind, policy, n=4000, seed=5)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_generation_has_the_target_distribution_large(case):
    make, kind, policy = CASES[case]
    check_case(make(), kind, policy, n=20000, seed=17)
