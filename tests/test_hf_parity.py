"""Parity against an implementation nobody here wrote: HF transformers' DeepseekV4ForCausalLM.

A tiny random HF model (float32, every weight perturbed away from its trivial init) is saved with
`save_pretrained`, loaded with our `load_checkpoint`, and compared on logits (B=2, T=220: many
compression windows of every ratio close), block by block, and on greedy generation.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

import hf_oracle as H  # noqa: E402
from model.cache import Step, allocate_layer  # noqa: E402
from model.checkpoint import load_checkpoint  # noqa: E402
from model.mhc import hc_coefficients  # noqa: E402
from sampling import generate  # noqa: E402

from common import rel_err  # noqa: E402

# Our tiny-v4 layer pattern: SWA, SWA (both hash-routed), CSA, HCA, CSA, HCA.
RATIOS = (0, 0, 4, 16, 4, 16, 0)



@pytest.fixture(scope="module")
def hf_model():
    return H.build_hf_model(H.hf_tiny_config(compress_ratios=RATIOS), seed=0)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1234).integers(2, 256, (2, 220))


@pytest.fixture(scope="module")
def ours(hf_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_ckpt")
    H.save_hf_model(hf_model, str(d))
    return load_checkpoint(d, dtype="float32")


def test_inputs_have_no_near_ties(hf_model, tokens):
    H.check_no_near_ties(hf_model, tokens)


def test_logits_match_hf(hf_model, ours, tokens):
    assert [ours.config.layer_spec(i).attention for i in range(6)] == ["swa", "swa", "csa", "hca", "csa", "hca"]
    ref = H.hf_logits(hf_model, tokens)
    got = np.asarray(ours(tokens))
    assert rel_err(got, ref) < 1e-5


def test_official_layout_of_hf_weights_loads_identically(hf_model, ours, tokens, tmp_path):
    H.save_official_checkpoint(hf_model, str(tmp_path))
    other = load_checkpoint(tmp_path, dtype="float32")
    np.testing.assert_array_equal(np.asarray(other(tokens[:, :40])), np.asarray(ours(tokens[:, :40])))


# ----------------------------------------------------------------------------- block level

def _hf_layer_input(hf_model, tokens, layer: int):
    """Capture the residual streams entering HF layer `layer` and the attention input there."""
    captured = {}

    def grab(name):
        def hook(module, args, kwargs):
            captured.setdefault(name, args[0] if args else kwargs["hidden_states"])
        return hook

    lay = hf_model.model.layers[layer]
    h1 = lay.register_forward_pre_hook(grab("x"), with_kwargs=True)
    h2 = lay.self_attn.register_forward_pre_hook(grab("h"), with_kwargs=True)
    with torch.no_grad():
        hf_model(input_ids=torch.from_numpy(tokens), use_cache=False)
    h1.remove()
    h2.remove()
    return captured["x"], captured["h"]


def test_mhc_coefficients_match_hf(hf_model, ours, tokens):
    x, _ = _hf_layer_input(hf_model, tokens[:, :64], 3)
    hc = hf_model.model.layers[3].attn_hc
    with torch.no_grad():
        post, comb, collapsed = hc(x)
    mine = ours.layers[3].hc_attn
    cfg = ours.config
    pre_j, post_j, comb_j = hc_coefficients(mine.fn[...], mine.base[...], mine.scale[...], jnp.asarray(x.numpy()),
                                            norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
                                            sinkhorn_iters=cfg.hc_sinkhorn_iters)
    np.testing.assert_allclose(np.asarray(post_j), post.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(comb_j), comb.numpy(), rtol=1e-5, atol=1e-6)
    got = np.einsum("btn,btnd->btd", np.asarray(pre_j), x.numpy())
    np.testing.assert_allclose(got, collapsed.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", [2, 3])
def test_compressor_entries_and_indexer_topk_match_hf(hf_model, ours, tokens, layer):
    t = 96
    _, h = _hf_layer_input(hf_model, tokens[:, :t], layer)
    hf_attn = hf_model.model.layers[layer].self_attn
    pos = torch.arange(t)[None].expand(2, t)
    with torch.no_grad():
        q_res = hf_attn.q_a_norm(hf_attn.q_a_proj(h))
        comp_kv, _ = hf_attn.compressor(h, q_res, pos, None, layer)
    attn = ours.layers[layer].attn
    cfg = ours.config
    cache = allocate_layer(cfg, layer, 2, t, jnp.float32)
    step = Step.make(jnp.zeros(2, jnp.int32), jnp.full(2, t, jnp.int32), t)
    hj = jnp.asarray(h.numpy())
    cache = attn.compress(hj, step, cache)
    n = comp_kv.shape[2]
    np.testing.assert_allclose(np.asarray(cache.comp.entries[:, :n]), comp_kv[:, 0].numpy(), rtol=1e-5, atol=1e-5)
    if attn.indexer is not None:
        with torch.no_grad():
            hf_top = hf_attn.compressor.indexer(h, q_res, pos, None, layer).numpy()
        _, c_q = attn.queries(hj, step.positions)
        iq, iw = attn.indexer.queries(hj, c_q, step.positions)
        mine, _ = attn.indexer.select(iq, iw, cache.index.entries, step.positions)
        assert np.array_equal(np.sort(np.asarray(mine), -1), np.sort(hf_top, -1))


def test_moe_matches_hf(hf_model, ours, tokens):
    rng = np.random.default_rng(0)
    h = rng.standard_normal((2, 24, 128)).astype(np.float32)
    toks = tokens[:, :24]
    for layer in (0, 4):  # hash-routed and score-routed
        hf_moe = hf_model.model.layers[layer].mlp
        with torch.no_grad():
            ref = hf_moe(torch.from_numpy(h), input_ids=torch.from_numpy(toks)).numpy()
        got = np.asarray(ours.layers[layer].ffn(jnp.asarray(h), jnp.asarray(toks)))
        assert rel_err(got, ref) < 1e-5


# ----------------------------------------------------------------------------- generation

def test_greedy_generate_matches_hf(hf_model, ours, tokens):
    prompts = tokens[:, :37]
    ref = H.hf_greedy(hf_model, prompts, 40)
    out = generate(ours, prompts, max_new_tokens=40)
    np.testing.assert_array_equal(out.tokens, ref)
