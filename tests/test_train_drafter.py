"""experiments/train_drafter.py: the training forward is inference's drafting (teacher-forced), a short
self-distillation run lowers the loss and leaves the target bit-identical, and greedy speculative
generation with the trained drafter still equals plain greedy generation.

Small configs (as tests/test_speculative.py) keep CPU compile time down.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import train_drafter as TD
from model import init_random
from model import draft as D
from sampling import generate

from common import small_v4, small_v41

V4_SMALL = small_v4()
V41_SMALL = small_v41()
CONFIGS = {"mtp": V4_SMALL, "dspark": V41_SMALL}


@nnx.jit(static_argnames="kind")
def _training_drafts(model, tokens, kind):
    _, extras = model.forward(tokens)
    anchors = jnp.arange(tokens.shape[1] - 5, dtype=jnp.int32)  # every p with labels for all drafts
    if kind == "mtp":
        return TD.mtp_forward(model, tokens, extras["residual"], anchors, 3)
    return TD.dspark_forward(model, tokens, extras["main_hidden"], anchors)[0]


@nnx.jit(static_argnames="kind")
def _inference_drafts(model, tokens, p, kind):
    """model/draft.py's commit of positions 0..p, then propose fed the true tokens x_{p+2}, ... as its
    choices (teacher forcing)."""
    b, t = tokens.shape
    _, extras = model.forward(tokens)
    dc = D.allocate_draft(model, b, 64)
    n_new = jnp.full((b,), p + 1, jnp.int32)  # rows > p are padding, never written

    def teacher(logits, j):
        return jnp.take(tokens, p + 2 + j, axis=1)

    if kind == "mtp":
        nxt = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], 1)
        logits, streams, dc = D.mtp_commit(model, dc, extras["residual"], nxt, n_new)
        row = lambda x: jnp.take(x, p, axis=1)  # noqa: E731
        return D.mtp_propose(model, dc, row(logits), row(streams), 3, teacher).logits
    dc = D.dspark_commit(model, dc, extras["main_hidden"], n_new)
    return D.dspark_propose(model, dc, jnp.take(tokens, p + 1, axis=1), teacher).logits


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_training_forward_is_inference_drafting(kind):
    """For anchors p, the batched training logits equal commit + propose of model/draft.py fed the
    true tokens (so the training accept-length metric is what greedy decoding measures there)."""
    model = init_random(CONFIGS[kind], seed=3)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (3, 24)), jnp.int32)
    train_logits = _training_drafts(model, tokens, kind)
    for p in (0, 9, 18):
        np.testing.assert_allclose(train_logits[:, p], _inference_drafts(model, tokens, jnp.int32(p), kind),
                                   atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=[pytest.param("mtp", marks=pytest.mark.slow), "dspark"])
def trained(request):
    """A short run (30 steps) on one fixed pool of 8 target continuations (about 35 s with compiling on
    the 2-core CPU). The MTP run is in the on-request slow set (CI time): the same trainer, and MTP drafting
    is tested in tests/test_speculative.py and above."""
    kind = request.param
    model = init_random(CONFIGS[kind], seed=2)
    tc = TD.TrainConfig(steps=30, batch=4, seq_len=32, prompt_len=8, pool=8, reuse=0, lr=3e-3, warmup=5)
    target_before = jax.tree.map(np.array, nnx.state(model, nnx.Not(TD.DRAFT_PARAMS)))
    draft_before = jax.tree.map(np.array, nnx.state(model, TD.DRAFT_PARAMS))
    prompts = TD.random_prompts(model.config, tc.pool, tc.prompt_len, seed=7)
    before = generate(model, prompts, max_new_tokens=tc.seq_len - tc.prompt_len, speculative=kind, num_draft=3)
    seqs = TD.generate_sequences(model, tc.pool, tc.prompt_len, tc.seq_len, seed=7, chunk=tc.pool)
    pool = TD.target_features(model, seqs, chunk=tc.pool)

    def batches():
        rng = np.random.default_rng(0)
        while True:
            idx = rng.permutation(tc.pool)[:tc.batch]
            yield {k: v[idx] for k, v in pool.items()}

    hist = TD.train(model, batches(), tc, val=pool, log_every=10, log=lambda msg: None)
    return dict(kind=kind, model=model, tc=tc, pool=pool, prompts=prompts, hist=hist, before=before,
                target_before=target_before, draft_before=draft_before)


def test_short_run_lowers_loss_and_freezes_target(trained):
    hist, model = trained["hist"], trained["model"]
    assert hist["val_step"] == [0, trained["tc"].steps]
    assert hist["val_loss"][-1] < hist["val_loss"][0] - 0.5, hist["val_loss"]  # same pool, before vs after
    assert hist["loss"][-1] < hist["loss"][0], hist["loss"]
    target_after = nnx.state(model, nnx.Not(TD.DRAFT_PARAMS))
    for a, b in zip(jax.tree.leaves(trained["target_before"]), jax.tree.leaves(target_after)):
        np.testing.assert_array_equal(np.asarray(b), a)  # bit-identical
    moved = [not np.array_equal(a, np.asarray(b)) for a, b in
             zip(jax.tree.leaves(trained["draft_before"]), jax.tree.leaves(nnx.state(model, TD.DRAFT_PARAMS)))]
    assert all(moved), f"{moved.count(False)} drafter parameters did not train"


def test_trained_drafter_is_lossless_and_accepted_more(trained):
    """Greedy speculative generation with the trained drafter equals plain greedy generation (the
    pool's continuations are the target's greedy tokens), for prompts of different lengths too, and
    the drafter, trained on these continuations, is accepted more often than before."""
    model, tc, pool, kind = trained["model"], trained["tc"], trained["pool"], trained["kind"]
    new = tc.seq_len - tc.prompt_len
    spec = generate(model, trained["prompts"], max_new_tokens=new, speculative=kind, num_draft=3)
    np.testing.assert_array_equal(spec.tokens, pool["tokens"][:, tc.prompt_len:])
    assert spec.stats["mean_accepted_length"] > trained["before"].stats["mean_accepted_length"] + 0.3, (
        spec.stats["mean_accepted_length"], trained["before"].stats["mean_accepted_length"])
    ragged = [list(p[:n]) for p, n in zip(trained["prompts"], (8, 5, 7, 3, 6, 8, 4, 2))]  # same shapes: no recompiling
    plain = generate(model, ragged, max_new_tokens=new)
    spec = generate(model, ragged, max_new_tokens=new, speculative=kind, num_draft=3)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    if kind == "dspark":  # the trained confidence head choosing how many drafts to verify
        spec = generate(model, ragged, max_new_tokens=new, speculative=kind, num_draft=3, policy="confidence")
        np.testing.assert_array_equal(spec.tokens, plain.tokens)


def test_markov_corpus_and_target_pretraining():
    """The synthetic language follows its successor table; pre-training moves only the target's
    parameters and brings its LM loss down towards the chain's entropy."""
    corpus = TD.MarkovCorpus(vocab=V4_SMALL.vocab_size, branching=3, alpha=2.0, seed=1)
    seqs = corpus.sample(6, 20, seed=0)
    succ = corpus.successors
    assert all(seqs[i, t + 1] in succ[seqs[i, t]] for i in range(6) for t in range(19))
    assert corpus.probs.sum() == pytest.approx(1.0) and 0 < corpus.entropy() < np.log(3)
    with pytest.raises(ValueError, match="branching"):
        TD.MarkovCorpus(vocab=4, branching=5)
    np.testing.assert_array_equal(TD.random_prompts(V4_SMALL, 3, 5, seed=2, corpus=corpus), corpus.sample(3, 5, 2))

    model = init_random(V4_SMALL, seed=0)
    draft_before = jax.tree.map(np.array, nnx.state(model, TD.DRAFT_PARAMS))
    hist = TD.pretrain_target(model, corpus, steps=40, batch=8, seq_len=24, lr=1e-2, log=lambda msg: None)
    assert np.mean(hist["loss"][-5:]) < hist["loss"][0] - 2.0, hist["loss"]
    for a, b in zip(jax.tree.leaves(draft_before), jax.tree.leaves(nnx.state(model, TD.DRAFT_PARAMS))):
        np.testing.assert_array_equal(np.asarray(b), a)
