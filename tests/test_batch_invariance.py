"""Batch invariance (ModelConfig.batch_invariant, docs/batch_invariance.md): a sequence's numbers are bitwise the
same alone and at any row of any batch, in a ragged batch, under any chunking of its prefill, in a speculative
verify step, in sampled speculative decoding (with bounded replay and a prefix store too) and on any (dp, ep) mesh;
sampling draws from the seed and the sequence's id.

Every check compares with `np.array_equal` (bitwise); the batch-invariant path is also compared with the default
path within float tolerance (the same products, summed in another order). The default suite runs the primitives
and the switch's validation; every model-level check (forward rows on the cut-down presets of tests/common.py and
on the full ones, the steps, generation, speculative decoding, the golden checkpoints, the 8-device meshes) is
`slow`: each compiles the invariant loops anew, tens of seconds to minutes on 2 cores. The
8-device checks run in a subprocess (tests/invariance_worker.py), as in tests/test_sharding.py; the `gpu` ones
repeat the model-level checks on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, init_random, load_checkpoint
from model.cache import allocate
from model.runtime import make_runtime
from model.transformer import _jit_step
from pallas_kernels import invariant as inv
from pallas_kernels import reference as ref
from sampling import generate

from common import rel_err, small_config, small_v4, small_v41, small_vocab

WORKER = Path(__file__).with_name("invariance_worker.py")
RNG = np.random.default_rng(5)


def invariant(cfg: ModelConfig) -> ModelConfig:
    return cfg.replace(batch_invariant=True)


# ----------------------------------------------------------------------------- the primitives

def _row_alone_and_in_blocks(fn, width: int, dtype=np.float32):
    """fn's result for one row alone and at several rows of several batch sizes."""
    x0 = RNG.standard_normal((1, width)).astype(dtype)
    f = jax.jit(lambda x: inv.row_blocks(fn, x))
    alone = np.asarray(f(x0))[0]
    for m, r in ((2, 1), (9, 0), (9, 8), (40, 17), (64, 63)):
        x = RNG.standard_normal((m, width)).astype(dtype)
        x[r] = x0[0]
        np.testing.assert_array_equal(np.asarray(f(x))[r], alone, err_msg=f"row {r} of {m}")
    return alone, x0


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_row_blocks_products_and_sums(dtype):
    """A row's matmul, row sum and softmax do not depend on the batch (XLA:CPU's plain ones do: a one-row dot
    takes the matrix-vector path, a row sum changes its vectorisation at 33 rows)."""
    w = jnp.asarray(RNG.standard_normal((384, 128)), dtype)
    for fn in (lambda x: jnp.einsum("mk,nk->mn", x, w), lambda x: jnp.sum(x.astype(jnp.float32), -1),
               lambda x: jax.nn.softmax(x.astype(jnp.float32), -1)):
        alone, x0 = _row_alone_and_in_blocks(fn, 128, dtype)
        np.testing.assert_allclose(np.asarray(alone, np.float32), np.asarray(fn(jnp.asarray(x0))[0], np.float32),
                                   rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [128, 512, 4096, 7])
def test_rms_normalize_rows(width):
    """The pairwise-tree RMS normalisation: a row alone and at any row of batches of 2 to 16,384 rows (V4's
    per-head query norm sees rows x heads), bitwise; the float32 normalisation to rounding."""
    f = jax.jit(lambda x: inv.rms_normalize(x, 1e-6))
    x0 = RNG.standard_normal((1, width)).astype(np.float32) * 3
    alone = np.asarray(f(x0))[0]
    for m, r in ((2, 1), (9, 0), (33, 32), (64, 17), (16384 // max(1, width // 128), 5)):
        x = RNG.standard_normal((m, width)).astype(np.float32)
        x[r] = x0[0]
        np.testing.assert_array_equal(np.asarray(f(x))[r], alone, err_msg=f"row {r} of {m}")
    exact = x0[0] / np.sqrt(np.mean(np.square(x0[0], dtype=np.float64)) + 1e-6)
    np.testing.assert_allclose(alone, exact, rtol=2e-6)
    assert inv.pairwise_sum(jnp.arange(7.0)[None]).shape == (1, 1) and float(inv.pairwise_sum(jnp.arange(7.0))[0]) == 21


@pytest.mark.parametrize("slots,width", [(8, 128), (128, 16), (5, 7)])
def test_softmax_pool_rows(slots, width):
    """The compressors' pooling without row loops: a row's softmax pool over its slots alone and at any row of
    batches of 2 to 600 rows, bitwise; the plain float32 pool to rounding."""
    pool = jax.jit(inv.softmax_pool)
    a0, g0 = (RNG.standard_normal((1, slots, width)).astype(np.float32) * 3 for _ in range(2))
    alone = np.asarray(pool(a0, g0))[0]
    for m, r in ((2, 1), (9, 0), (33, 32), (600, 17)):
        a, g = (RNG.standard_normal((m, slots, width)).astype(np.float32) for _ in range(2))
        a[r], g[r] = a0[0], g0[0]
        np.testing.assert_array_equal(np.asarray(pool(a, g))[r], alone, err_msg=f"row {r} of {m}")
    plain = jnp.sum(jax.nn.softmax(jnp.asarray(g0), axis=-2) * a0, axis=-2)[0]
    np.testing.assert_allclose(alone, np.asarray(plain), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_hadamard_on_fixed_tiles(dtype):
    """The indexer's rotation on the fixed tiles (dense_impl="pallas" under the switch): rows x heads alone and in
    a batch, bitwise; the matrix form to float32 rounding (bf16: one rounding of the output)."""
    from model.layers import hadamard

    x = jnp.asarray(RNG.standard_normal((5, 7, 128)), dtype)
    f = jax.jit(lambda v: hadamard(v, batch_invariant=True, fixed_tiles=True))
    full = np.asarray(f(x).astype(jnp.float32))
    for lo, hi in ((0, 1), (2, 3), (1, 5)):
        np.testing.assert_array_equal(np.asarray(f(x[lo:hi]).astype(jnp.float32)), full[lo:hi])
    np.testing.assert_array_equal(np.asarray(f(x[3:4, 2:3]).astype(jnp.float32)), full[3:4, 2:3])
    want = np.asarray(hadamard(x).astype(jnp.float32))
    assert rel_err(full, want) < (1e-6 if dtype == np.float32 else 4e-3)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_router_on_fixed_tiles(scoring):
    """The router under the switch with dense_impl="pallas" (logits on the fixed tiles, all tokens at once): a
    token's choices and weights alone and at any place of a batch of 70, bitwise; the same experts as the default
    router and weights to float32 rounding."""
    from flax import nnx

    from model.moe import Gate

    cfg = ModelConfig.preset("tiny-v4").replace(batch_invariant=True, dense_weights="fp8", dense_impl="pallas",
                                               scoring_func=scoring)
    spec = next(s for s in cfg.layer_specs if not s.hash_routed)
    gate = Gate(cfg, spec, rngs=nnx.Rngs(3), dtype=jnp.bfloat16)
    h = jnp.asarray(RNG.standard_normal((70, cfg.hidden_size)), jnp.bfloat16)
    tokens = jnp.zeros((70,), jnp.int32)
    ids, weights = (np.asarray(a) for a in gate(h, tokens))
    for lo, hi in ((0, 1), (5, 6), (69, 70), (3, 40)):
        sub_ids, sub_w = gate(h[lo:hi], tokens[lo:hi])
        np.testing.assert_array_equal(np.asarray(sub_ids), ids[lo:hi])
        np.testing.assert_array_equal(np.asarray(sub_w), weights[lo:hi])
    want_ids, want_w = inv.sort_choices(*gate.route(h, tokens))
    np.testing.assert_array_equal(ids, np.asarray(want_ids))
    np.testing.assert_allclose(weights, np.asarray(want_w), rtol=1e-5)


def test_row_blocks_shapes():
    x = jnp.asarray(RNG.standard_normal((3, 5, 7)), jnp.float32)
    out = inv.row_blocks(lambda a, b: (a * 2, None if b is None else b.sum(-1)), x, None, lead=2)
    assert out[0].shape == (3, 5, 7) and out[1] is None
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(x) * 2)


def test_sink_attention_matches_reference():
    """The per-row attention (own keys + entry blocks) against reference.sink_attention on the same keys."""
    c, h, dh, n, ne = 8, 4, 32, 12, 37
    q = RNG.standard_normal((c, h, dh)).astype(np.float32)
    kv = RNG.standard_normal((c, n, dh)).astype(np.float32)
    ok = RNG.random((c, n)) < 0.7
    entries = RNG.standard_normal((c, ne, dh)).astype(np.float32)
    visible = np.arange(ne)[None, :] < RNG.integers(0, ne + 1, (c, 1))
    sink = RNG.standard_normal(h).astype(np.float32)
    got = inv.sink_attention(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(ok), jnp.asarray(sink), 0.2,
                             (inv.entry_blocks(jnp.asarray(entries)), inv.entry_blocks(jnp.asarray(visible), False)))
    keys = np.concatenate([kv, entries], 1)
    mask = np.concatenate([ok, visible], 1)
    want = jax.vmap(lambda q, k, m: ref.sink_attention(q[None, None], k[None], m[None, None], jnp.asarray(sink),
                                                       0.2)[0, 0])(jnp.asarray(q), jnp.asarray(keys),
                                                                    jnp.asarray(mask))
    assert rel_err(got, want) < 1e-6
    plain = inv.sink_attention(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(ok), jnp.asarray(sink), 0.2)
    want = jax.vmap(lambda q, k, m: ref.sink_attention(q[None, None], k[None], m[None, None], jnp.asarray(sink),
                                                       0.2)[0, 0])(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(ok))
    assert rel_err(plain, want) < 1e-6


def test_indexer_scores_match_reference():
    c, hi, di, n = 8, 8, 32, 45
    q, w = RNG.standard_normal((c, hi, di)), RNG.standard_normal((c, hi))
    keys = RNG.standard_normal((c, n, di))
    got = inv.indexer_scores(jnp.asarray(q, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(keys, jnp.float32))
    want = jax.vmap(lambda q, w, k: ref.indexer_scores(q[None, None], w[None, None], k[None],
                                                       jnp.ones((1, 1, n), bool))[0, 0])(
        jnp.asarray(q, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(keys, jnp.float32))
    assert rel_err(got, want) < 1e-6


def test_expert_slots_match_reference():
    """Per-choice outputs on fixed tiles, added in expert-id order, against the ragged_dot reference; a row's
    outputs do not depend on the other rows; ids outside [0, E) give zeros."""
    e, d, i, k = 6, 32, 48, 2
    w1, w3 = (jnp.asarray(RNG.standard_normal((e, i, d)) / 6, jnp.float32) for _ in range(2))
    w2 = jnp.asarray(RNG.standard_normal((e, d, i)) / 7, jnp.float32)

    def run(x, ids, wts):
        ids, wts = inv.sort_choices(jnp.asarray(ids), jnp.asarray(wts, jnp.float32))
        return jax.jit(inv.expert_slots, static_argnums=6)(jnp.asarray(x, jnp.float32), ids, wts, w1, w2, w3, 1.0)

    x = RNG.standard_normal((19, d))
    ids = np.stack([RNG.choice(e, k, replace=False) for _ in range(19)])
    wts = RNG.random((19, k))
    slots = run(x, ids, wts)
    want = ref.moe_experts(jnp.asarray(x, jnp.float32), jnp.asarray(ids), jnp.asarray(wts, jnp.float32), w1, w2, w3,
                           1.0)
    assert slots.shape == (19, k, d)
    assert rel_err(inv.add_slots(slots), want) < 1e-6
    alone = run(x[4:5], ids[4:5], wts[4:5])
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(slots[4]))
    dropped = run(x[:3], np.full((3, k), e), wts[:3])
    assert not np.any(np.asarray(dropped))


def test_sampled_acceptance_rows():
    """The rejection test of sampled speculative decoding with per-sequence keys: a sequence's accepted count and
    next token alone equal its own at any row of any batch (other rows arbitrary), whatever the verified width."""
    from model.draft import Proposal
    from sampling.sampler import sequence_keys
    from sampling.speculative import SpecParams, accept

    k, v = 3, 64
    sp = SpecParams("dspark", k, temperature=0.8, top_k=40, top_p=0.9)
    run = jax.jit(accept, static_argnums=4)

    def batch(m):
        target = RNG.standard_normal((m, k + 1, v)).astype(np.float32)
        drafted = RNG.standard_normal((m, k, v)).astype(np.float32)
        return target, drafted, RNG.integers(0, v, (m, k)), RNG.integers(1, k + 1, m), RNG.integers(0, 1000, m)

    for width in (k, 2):
        mine = batch(1)
        alone = run(jnp.asarray(mine[0][:, :width + 1]), Proposal(jnp.asarray(mine[2]), jnp.asarray(mine[1])),
                    jnp.minimum(jnp.asarray(mine[3]), width), sequence_keys(7, mine[4]), sp)
        for m, r in ((2, 1), (9, 8), (40, 17)):
            target, drafted, tokens, n_verify, ids = batch(m)
            for x, y in zip((target, drafted, tokens, n_verify, ids), mine):
                x[r] = y[0]
            got = run(jnp.asarray(target[:, :width + 1]), Proposal(jnp.asarray(tokens), jnp.asarray(drafted)),
                      jnp.minimum(jnp.asarray(n_verify), width), sequence_keys(7, ids), sp)
            for a, b in zip(got, alone):
                np.testing.assert_array_equal(np.asarray(a)[r], np.asarray(b)[0], err_msg=f"row {r} of {m}")


# ----------------------------------------------------------------------------- the switch

def test_switch_validation():
    cfg = ModelConfig.preset("tiny-v4")
    with pytest.raises(ValueError, match="Mosaic GPU attention kernel has no invariant launch"):
        ModelConfig.preset("v4-flash").replace(batch_invariant=True, attention_impl="mgpu")
    for impl in ("pallas", "triton"):   # the Triton attention kernel's invariant launch
        assert cfg.replace(batch_invariant=True, attention_impl=impl).attention_impl == impl
    assert cfg.replace(batch_invariant=True, moe_impl="pallas").moe_impl == "pallas"   # one tiling per format
    assert cfg.replace(batch_invariant=True, mhc_impl="pallas").mhc_impl == "pallas"   # its GEMM on fixed tiles
    # the FP8 linears on their fixed tiles, not with quant_sim's FP8 x FP8 (its MMA changes with the rows)
    assert cfg.replace(batch_invariant=True, dense_weights="fp8", dense_impl="pallas").dense_impl == "pallas"
    with pytest.raises(ValueError, match="dense_impl='pallas' and quant_sim=True is not supported"):
        cfg.replace(batch_invariant=True, dense_weights="fp8", dense_impl="pallas", quant_sim=True)
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        cfg.replace(batch_invariant=1)
    assert "batch_invariant" not in cfg.replace(batch_invariant=True).to_official_dict()
    # a runtime made for the other mode is refused
    from model.runtime import Runtime
    from model.moe import LocalExperts
    experts = tuple(LocalExperts("reference") for _ in range(cfg.num_blocks))
    with pytest.raises(ValueError, match="made for batch_invariant=False"):
        Runtime(experts=experts).check(invariant(cfg))


@pytest.mark.slow
def test_switch_off_builds_the_same_program():
    """With the switch off the step has none of the invariant mode's loops and barriers."""
    cfg = small_config("tiny-v4")
    for on in (False, True):
        model = init_random(cfg.replace(batch_invariant=on), seed=0)
        cache = allocate(model.config, 2, 32, jnp.float32)
        text = _jit_step.lower(model, jnp.zeros((2, 4), jnp.int32), cache, jnp.full((2,), 4, jnp.int32),
                               False).as_text()
        assert ("optimization_barrier" in text) == on


def test_runtime_refuses_tp():
    mesh = jax.sharding.AbstractMesh((1, 1, 2), ("dp", "ep", "tp"))
    with pytest.raises(ValueError, match="batch_invariant needs tp=1"):
        make_runtime(invariant(ModelConfig.preset("tiny-v4")), mesh)


# ----------------------------------------------------------------------------- the model

CASES = [pytest.param(("tiny-v4", "bfloat16"), id="v4-bf16"),
         pytest.param(("tiny-v41", "float32"), id="v41-f32", marks=pytest.mark.slow),
         pytest.param(("tiny-v4", "float32"), id="v4-f32", marks=pytest.mark.slow),
         pytest.param(("tiny-v41", "bfloat16"), id="v41-bf16", marks=pytest.mark.slow)]


CASE_SEED = 1   # the weights of `case`'s two models (and of the float32 twin test_forward_rows builds)


@pytest.fixture(scope="module", params=CASES)
def case(request):
    preset, dtype = request.param
    cfg = small_config(preset)
    return init_random(invariant(cfg), seed=CASE_SEED, dtype=dtype), init_random(cfg, seed=CASE_SEED, dtype=dtype)


def _tokens(cfg, *shape):
    return RNG.integers(3, cfg.vocab_size - 2, shape)


def _check_forward_rows(model, rows, length: int = 20) -> np.ndarray:
    """A sequence's logits alone equal its logits at row r of a batch of b (other rows random), for every (b, r)
    of `rows`. -> (the logits alone [S, V], the sequence [1, S])."""
    cfg = model.config
    seq = _tokens(cfg, 1, length)
    alone = np.asarray(model(seq))[0]
    for b, r in rows:
        batch = _tokens(cfg, b, length)
        batch[r] = seq[0]
        np.testing.assert_array_equal(np.asarray(model(batch))[r], alone, err_msg=f"row {r} of {b}")
    return alone, seq


@pytest.mark.slow
def test_forward_rows(case):
    """model(tokens): a sequence alone and at a row of a batch (other rows arbitrary); float32: close to the default
    path; bf16 (where the tiny presets amplify rounding: the two paths differ by up to ~0.1 relative): no farther
    from the float32 model than the default path is."""
    model, plain = case
    _check_forward_rows(model, ((3, 1),))
    # accuracy on eight fixed sequences (one sequence's bf16 error swings from 0.015 to 0.10 with its tokens)
    seqs = np.random.default_rng(CASE_SEED).integers(3, plain.config.vocab_size - 2, (8, 20))
    got = np.asarray(model(seqs))
    if model.dtype == jnp.float32:
        assert rel_err(got, np.asarray(plain(seqs))) < 1e-5
    else:
        exact = np.asarray(init_random(plain.config, seed=CASE_SEED, dtype="float32")(seqs))
        assert rel_err(got, exact) < 1.5 * rel_err(np.asarray(plain(seqs)), exact) + 1e-2


def _step(model, cache, tokens, n_new, width):
    chunk = np.zeros((tokens.shape[0], width), np.int32)
    chunk[:, :tokens.shape[1]] = tokens
    logits, cache = _jit_step(model, jnp.asarray(chunk), cache, jnp.asarray(n_new, jnp.int32), False)
    return np.asarray(logits), cache


@pytest.mark.slow
def test_ragged_chunked_and_verify_steps(case):
    """Step logits of one sequence: its prompt alone in one chunk; the same prompt in chunks of 7, 1 and 12
    rows inside a ragged batch with a longer cache; then 4 decode steps alone against one 4-row verify step."""
    _check_ragged_chunked_and_verify(case[0])


def _check_ragged_chunked_and_verify(model):
    cfg = model.config
    prompt, cont = _tokens(cfg, 1, 20), _tokens(cfg, 1, 4)
    cache = allocate(cfg, 1, 64, model.dtype)
    alone, cache = _step(model, cache, prompt, [20], 24)
    decoded = []
    for i in range(4):
        logits, cache = _step(model, cache, cont[:, i:i + 1], [1], 1)
        decoded.append(logits[0, 0])
    others = _tokens(cfg, 3, 40)
    cache = allocate(cfg, 3, 128, model.dtype)
    rows, start = [], 0
    for size in (7, 1, 12):  # row 1 is our sequence; the others get ragged chunks of their own
        chunk = others[:, start:start + 24].copy()
        chunk[1, :size] = prompt[0, start:start + size]
        logits, cache = _step(model, cache, chunk, [24, size, 5], 24)
        rows.append(logits[1, :size])
        start += size
    np.testing.assert_array_equal(np.concatenate(rows), alone[0, :20])
    verify = others[:, :4].copy()
    verify[1] = cont[0]
    logits, cache = _step(model, cache, verify, [4, 4, 2], 4)
    np.testing.assert_array_equal(logits[1], np.stack(decoded))


@pytest.mark.slow
def test_generate_ragged_and_sampling(case):
    """generate: greedy tokens alone and in a ragged batch; sampled tokens follow the sequence id, not the row."""
    model, _ = case
    cfg = model.config
    prompt = _tokens(cfg, 11).tolist()
    batch = [_tokens(cfg, 17).tolist(), _tokens(cfg, 3).tolist(), prompt, _tokens(cfg, 30).tolist()]
    alone = generate(model, [prompt], max_new_tokens=6)
    together = generate(model, batch, max_new_tokens=6)
    np.testing.assert_array_equal(together.tokens[2], alone.tokens[0])
    sampled = dict(max_new_tokens=6, temperature=1.0, seed=3)
    mine = generate(model, [prompt], sequence_ids=[41], **sampled)
    theirs = generate(model, batch, sequence_ids=[7, 8, 41, 9], **sampled)
    np.testing.assert_array_equal(theirs.tokens[2], mine.tokens[0])
    by_row = generate(model, batch, **sampled)  # default ids: the rows
    np.testing.assert_array_equal(by_row.tokens[2], generate(model, [_tokens(cfg, 5).tolist(), [3], prompt],
                                                             **sampled).tokens[2])


def test_sequence_ids_errors():
    model = init_random(invariant(small_config("tiny-v4")), seed=0)
    with pytest.raises(ValueError, match="sequence_ids must be 2 integers"):
        generate(model, [[3, 4], [5]], sequence_ids=[1])
    with pytest.raises(ValueError, match=r"sequence_ids must be in \[0, 2\^32\)"):
        generate(model, [[3, 4], [5]], sequence_ids=[1, -2])


@pytest.mark.slow
@pytest.mark.parametrize("build,kind", [pytest.param(small_v4, "mtp", id="mtp"),
                                        pytest.param(small_v41, "dspark", id="dspark", marks=pytest.mark.slow)])
def test_greedy_speculative_equals_plain(build, kind):
    """Greedy speculative tokens (any num_draft) equal plain greedy decoding's, alone and in a batch."""
    model = init_random(invariant(build()), seed=2, dtype="bfloat16")
    prompts = [_tokens(model.config, n).tolist() for n in (9, 14, 5)]
    plain = generate(model, prompts, max_new_tokens=8).tokens
    for num_draft in (1, 3):
        spec = generate(model, prompts, max_new_tokens=8, speculative=kind, num_draft=num_draft).tokens
        np.testing.assert_array_equal(spec, plain, err_msg=f"num_draft={num_draft}")


SAMPLED = dict(temperature=0.8, top_k=12, top_p=0.95, seed=3)  # a 16-token vocabulary (`small_vocab`)


def _alone_and_in_batch(model, prompt: list[int], others: list[list[int]], **options):
    """generate(**options) of `prompt` alone (sequence id 41) and at row 1 of a ragged batch with `others` (ids 7, 9,
    ...): -> (alone, in the batch) as (tokens [max_new], length) each. Stores (`prefix_store`: a callable making a
    fresh one) are made anew for each run."""
    runs = []
    for prompts in ([prompt], [others[0], prompt, *others[1:]]):
        ids = [41] if len(prompts) == 1 else [7, 41, *range(9, 8 + len(others))]
        opts = dict(options)
        if "prefix_store" in opts:
            opts["prefix_store"] = opts["prefix_store"]()
        out = generate(model, prompts, sequence_ids=ids, **opts)
        row = 0 if len(prompts) == 1 else 1
        runs.append((out.tokens[row], out.lengths[row], out.stats))
    return runs


def _check_alone_equals_batch(model, prompt, others, **options) -> dict:
    """Tokens and length of `prompt` alone equal its own in the batch, bitwise. -> the run alone's stats."""
    (tokens, length, stats), (in_batch, length_in_batch, _) = _alone_and_in_batch(model, prompt, others, **options)
    np.testing.assert_array_equal(in_batch, tokens, err_msg=str(options))
    assert length_in_batch == length, options
    return stats


SPEC_CASES = [pytest.param(small_v4, "mtp", "float32", id="mtp-f32"),
              pytest.param(small_v4, "mtp", "bfloat16", id="mtp-bf16"),
              pytest.param(small_v41, "dspark", "float32", id="dspark-f32"),
              pytest.param(small_v41, "dspark", "bfloat16", id="dspark-bf16")]


@pytest.mark.slow
@pytest.mark.parametrize("build,kind,dtype", SPEC_CASES)
def test_sampled_speculative_alone_and_in_ragged_batch(build, kind, dtype):
    """Sampled speculative generation (temperature, top-k and top-p; num_draft 1 and 3, DSpark also with the
    confidence policy): a prompt's tokens and length alone equal its own at row 1 of a ragged batch of prompts of
    other lengths under the same sequence id; drafts are accepted and rejected along the way."""
    model = init_random(invariant(small_vocab(build(), 16)), seed=2, dtype=dtype)
    rng = np.random.default_rng(11)
    prompt, others = rng.integers(3, 15, 11).tolist(), [rng.integers(3, 15, n).tolist() for n in (17, 3, 30)]
    runs = [(1, "fixed"), (3, "fixed")] + ([(3, "confidence")] if kind == "dspark" else [])
    for num_draft, policy in runs:
        stats = _check_alone_equals_batch(model, prompt, others, max_new_tokens=12, speculative=kind,
                                          num_draft=num_draft, policy=policy, **SAMPLED)
        assert 0 < stats["acceptance_per_position"][0] < 1, (num_draft, policy, stats["acceptance_per_position"])


@pytest.mark.slow
def test_sampled_bounded_replay_alone_and_in_ragged_batch():
    """[V4.1] decoder-side bounded replay (the window's tail after the last KV source): sampled tokens, plain and
    DSpark-speculative, of a prompt alone equal its own in a ragged batch (the replayed rows are each sequence's
    own)."""
    model = init_random(invariant(small_vocab(small_v41(), 16)), seed=2, dtype="bfloat16")
    rng = np.random.default_rng(12)
    prompt, others = rng.integers(3, 15, 21).tolist(), [rng.integers(3, 15, n).tolist() for n in (5, 34)]
    for spec in ({}, dict(speculative="dspark", num_draft=3)):
        _check_alone_equals_batch(model, prompt, others, max_new_tokens=10, bounded_replay=True, **spec, **SAMPLED)


@pytest.mark.slow
@pytest.mark.parametrize("build,kind", [pytest.param(small_v4, "mtp", id="mtp"),
                                        pytest.param(small_v41, "dspark", id="dspark")])
def test_sampled_prefix_store_alone_and_in_ragged_batch(build, kind):
    """With a prefix store holding the same prefixes (a hit of two pages for the prompt, misses for its
    batch-mates): sampled tokens, plain and speculative, alone equal its own in a ragged batch."""
    from sampling.replay import PrefixStore

    model = init_random(invariant(small_vocab(build(), 16)), seed=2, dtype="bfloat16")
    rng = np.random.default_rng(13)
    base = rng.integers(3, 15, 40).tolist()
    prompt = base[:37] + [9, 9, 9, 9, 9]  # shares 32 tokens (two pages of 16) with base
    others = [rng.integers(3, 15, n).tolist() for n in (21, 6)]

    def warm_store():
        store = PrefixStore(page_size=16)
        generate(model, [base + [5, 6, 7]], max_new_tokens=2, prefix_store=store)
        return store

    for spec in ({}, dict(speculative=kind, num_draft=3)):
        stats = _check_alone_equals_batch(model, prompt, others, max_new_tokens=10, prefix_store=warm_store, **spec,
                                          **SAMPLED)
        assert stats["prefix_hits"] == [32], stats["prefix_hits"]


# ----------------------------------------------------------------------------- full presets and the golden models

@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_presets_forward_rows(preset, dtype):
    _check_forward_rows(init_random(invariant(ModelConfig.preset(preset)), seed=4, dtype=dtype), ((6, 3),), 40)


@pytest.mark.slow
@pytest.mark.parametrize("expert_weights", ["dense", "fp4"])
def test_moe_kernels_rows_ragged_and_verify(expert_weights):
    """moe_impl="pallas" under the switch (the MoE kernels on one tiling per weight format; interpreted on a CPU):
    a sequence alone and at a row of a batch, chunked, ragged and verified, bitwise."""
    cfg = small_config("tiny-v4").replace(moe_impl="pallas", expert_weights=expert_weights)
    model = init_random(invariant(cfg), seed=1, dtype="bfloat16")
    _check_forward_rows(model, ((3, 1),))
    _check_ragged_chunked_and_verify(model)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_dense_kernels_rows_ragged_and_verify(preset):
    """dense_impl="pallas" under the switch (pallas_kernels/invariant_linear.py, interpreted on a CPU: the FP8
    projections in V4's 128- and V4.1's 32-blocks, the shared expert's among them, and the float32 linears of bf16
    weights, the LM head among them, on fixed tiles over all rows at once): a sequence alone and at a row of a
    batch, chunked, ragged and verified, bitwise."""
    from flax import nnx

    cfg = small_config(preset).replace(dense_weights="fp8", dense_impl="pallas")
    model = init_random(invariant(cfg), seed=1, dtype="bfloat16")
    assert sum(getattr(m, "fp8_kernel", False) for _, m in nnx.iter_modules(model)) > 10
    assert model.head.invariant_kernel
    _check_forward_rows(model, ((3, 1),))
    _check_ragged_chunked_and_verify(model)


@pytest.mark.slow
@pytest.mark.parametrize("preset,dtype", [("tiny-v4", "bfloat16"), ("tiny-v41", "bfloat16"), ("tiny-v41", "float32")])
def test_mhc_kernels_rows_ragged_and_verify(preset, dtype):
    """mhc_impl="pallas" under the switch (pallas_kernels/mhc.py with its coefficient GEMM on fixed tiles,
    interpreted on a CPU; V4's two passes and V4.1's carried collapse vector; three Sinkhorn rounds keep the
    interpreter short): a sequence alone and at a row of a batch, chunked, ragged and verified, bitwise."""
    cfg = small_config(preset).replace(mhc_impl="pallas", hc_sinkhorn_iters=3)
    model = init_random(invariant(cfg), seed=1, dtype=dtype)
    _check_forward_rows(model, ((3, 1),))
    _check_ragged_chunked_and_verify(model)


@pytest.mark.slow
@pytest.mark.parametrize("preset,keys,dtype", [("tiny-v4", "model", "bfloat16"), ("tiny-v41", "model", "bfloat16"),
                                               ("tiny-v4", "fp4", "bfloat16"), ("tiny-v4", "model", "float32")])
def test_attention_kernels_rows_ragged_and_verify(preset, keys, dtype):
    """attention_impl="pallas" under the switch (interpreted on a CPU: the Triton attention kernel's invariant
    launch, each row's keys in the canonical order; the indexer's scores on its fused kernel at one tiling, V4.1's
    candidate layers among them, MXFP4 index keys read as cached): a sequence alone and at a row of a batch,
    chunked, ragged and verified, bitwise."""
    cfg = small_config(preset).replace(attention_impl="pallas", index_key_format=keys)
    model = init_random(invariant(cfg), seed=1, dtype=dtype)
    _check_forward_rows(model, ((3, 1),))
    _check_ragged_chunked_and_verify(model)


def gpu_release_experts(preset: str) -> ModelConfig:
    """A tiny preset with FP4 experts on the MoE kernels, widened to the Hopper FP4 tiles' 256-value steps."""
    return ModelConfig.preset(preset).replace(hidden_size=256, moe_intermediate_size=256, expert_weights="fp4",
                                              moe_impl="pallas")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("experts", ["reference", "fp4-kernels", "release-kernels"])
def test_gpu_rows_ragged_and_verify(preset, dtype, experts):
    """On the GPU (the reference paths; "fp4-kernels": FP4 experts on the MoE kernels; "release-kernels": those,
    the FP8 projections on their fixed tiles, the mHC kernels and the attention and indexer kernels; both bf16
    only): a sequence alone and at rows of batches up to 64
    (where XLA's library GEMMs would change algorithm on the default path), chunked, ragged and verified."""
    if experts != "reference" and dtype == "float32":
        pytest.skip("the FP4 expert kernels compute in bfloat16")
    cfg = ModelConfig.preset(preset) if experts == "reference" else gpu_release_experts(preset)
    if experts == "release-kernels":
        cfg = cfg.replace(dense_weights="fp8", dense_impl="pallas", mhc_impl="pallas", attention_impl="pallas")
    model = init_random(invariant(cfg), seed=4, dtype=dtype)
    _check_forward_rows(model, ((6, 3), (64, 0), (64, 63)), 40)
    _check_ragged_chunked_and_verify(model)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v4", "v41"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_golden_rows(golden_dir, name, dtype):
    """The golden checkpoints: a prompt alone and at row 3 of 6; float32 still matches the official logits."""
    d = golden_dir / name
    model = load_checkpoint(d, dtype=dtype, batch_invariant=True)
    prompts = np.asarray(json.loads((d / "inputs.json").read_text())["prompts"])
    seq = prompts[:1]
    alone = np.asarray(model(seq))[0]
    batch = _tokens(model.config, 6, seq.shape[1])
    batch[0], batch[3] = prompts[1], seq[0]
    np.testing.assert_array_equal(np.asarray(model(batch))[3], alone)
    if dtype == "float32":
        plain = load_checkpoint(d, dtype=dtype)
        assert rel_err(alone, np.asarray(plain(seq))[0]) < 1e-5


# ----------------------------------------------------------------------------- 8 simulated devices

def _worker(tmp_path, mode: str, timeout: int) -> dict:
    out = tmp_path / f"{mode}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parents[1]), str(WORKER.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(WORKER), mode, str(out)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check_cases(results: dict):
    bad = [c for c in results["cases"] if not c["equal"]]
    assert not bad, bad
    assert results["cases"]


@pytest.mark.slow
def test_mesh_dp_ep(tmp_path):
    """dp=2 x ep=4 with the default strategies (forward: all_to_all over the gather transport; generate:
    prefill all_to_all, decode replicate) against one device: logits and greedy tokens bitwise."""
    _check_cases(_worker(tmp_path, "mesh", 1500))


@pytest.mark.slow
def test_mesh_matrix(tmp_path):
    """dp=8, ep=8 and dp=2 x ep=4 with every EP transport and strategy, redundant + rebalanced experts, both
    generations and dtypes, greedy and sampled generation."""
    _check_cases(_worker(tmp_path, "mesh-matrix", 5400))


@pytest.mark.slow
def test_mesh_moe_kernels(tmp_path):
    """dp=2 x ep=4 with every kernel that has an invariant tiling (MoE, FP8 and float32 linears, mHC, attention,
    indexer scoring; interpreted on the CPU) against one device: logits and greedy tokens bitwise."""
    _check_cases(_worker(tmp_path, "mesh-kernels", 1500))


@pytest.mark.slow
def test_mesh_speculative(tmp_path):
    """dp=2 x ep=4 against one device: greedy and sampled speculative generation (MTP on V4 in bf16, DSpark on V4.1
    in float32; num_draft 1 and 3) give the same tokens and lengths, and greedy speculative equals plain greedy."""
    _check_cases(_worker(tmp_path, "mesh-speculative", 1500))


def test_invariant_blocks_option(monkeypatch):
    """`pytest --invariant-blocks R,E,K` replaces the module's block sizes for the run; bad values are a usage
    error naming the option."""
    import conftest

    class Config:
        def __init__(self, value):
            self.value = value

        def getoption(self, name):
            assert name == "--invariant-blocks"
            return self.value

    for name in ("ROWS", "ENTRY_BLOCK", "INDEX_KEY_BLOCK"):
        monkeypatch.setattr(inv, name, getattr(inv, name))   # restored after the test
    conftest.pytest_configure(Config("16,32,128"))
    assert (inv.ROWS, inv.ENTRY_BLOCK, inv.INDEX_KEY_BLOCK) == (16, 32, 128)
    for bad in ("16,32", "a,b,c", "0,16,16"):
        with pytest.raises(pytest.UsageError, match="--invariant-blocks"):
            conftest.pytest_configure(Config(bad))


def test_loop_count_probe(tmp_path):
    """experiments.probes.invariant_loops counts a traced step's loop trips and products: larger row blocks repeat
    less; the MoE kernels replace the experts' tile loop with kernel calls."""
    from experiments.probes.invariant_loops import main

    def count(*extra):
        return main(["--preset", "tiny-v4", "--expert-weights", "dense", "--dense-weights", "model", "--steps",
                     "verify", "--decode-batch", "16", "--context", "64", "--out", str(tmp_path), *extra])["records"][0]

    module_blocks = (inv.ROWS, inv.ENTRY_BLOCK, inv.INDEX_KEY_BLOCK)
    small, large = count("--blocks", "8,16,16"), count("--blocks", "64,64,512")
    assert small["row_block"] == 8 and large["index_key_block"] == 512
    assert (inv.ROWS, inv.ENTRY_BLOCK, inv.INDEX_KEY_BLOCK) == module_blocks   # restored
    assert small["loop_trips"] > large["loop_trips"] > 0 and small["dots"] > large["dots"]
    kernels = count("--moe-impl", "pallas")
    assert kernels["pallas_calls"] > 0 and large["pallas_calls"] == 0
    assert not any("expert_slots" in where for where in kernels["trips_by_source"])
    assert any("expert_slots" in where for where in large["trips_by_source"])


def test_release_compiled_code():
    """Compiled programs are dropped only past the given share of the memory-map limit (Linux /proc)."""
    from common import release_compiled_code

    if not Path("/proc/self/maps").exists():
        pytest.skip("no /proc here")
    assert release_compiled_code(share=1e9) is False
    assert release_compiled_code(share=0.0) is True
