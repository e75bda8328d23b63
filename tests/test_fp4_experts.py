"""FP4-resident routed experts (cfg.expert_weights="fp4"): packed E2M1 + UE8M0 per 32 in memory, as the
official checkpoints ship them; the reference path dequantises in-graph, the Pallas kernel in registers."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, init_random, quant_io
from model.checkpoint import load_checkpoint, save_safetensors
from pallas_kernels import reference as ref
from pallas_kernels.moe import fp4_scale_bytes, fp4_weight_bytes

from common import seed_of_test

CFG = ModelConfig.preset("tiny-v4").replace(num_layers=3, compress_ratios=(0, 4, 16, 0), num_hash_layers=1,
                                            name="v4-small")


def test_traceable_quantiser_is_quant_io():
    seed = seed_of_test()
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(3, 16, 96)) * np.exp(2 * rng.normal(size=(3, 16, 1)))).astype(np.float32)
    w[0, 0, :32] = 0.0  # an all-zero block
    packed, scale = jax.jit(ref.quantize_fp4_experts)(jnp.asarray(w))
    for e in range(3):
        want_p, want_s = quant_io.quantize_fp4(w[e])
        np.testing.assert_array_equal(np.asarray(packed[e]), want_p, err_msg=f"seed {seed}")
        np.testing.assert_array_equal(np.asarray(scale[e]), want_s.view(np.uint8), err_msg=f"seed {seed}")
    with pytest.raises(ValueError, match="multiple of 32"):
        CFG.replace(moe_intermediate_size=48, expert_weights="fp4")
    with pytest.raises(ValueError, match="expert_weights"):
        CFG.replace(expert_weights="fp8")


@pytest.fixture(scope="module")
def fp4_checkpoint(tmp_path_factory):
    model = init_random(CFG.replace(expert_weights="fp4"), seed=1)
    d = save_safetensors(model, tmp_path_factory.mktemp("fp4"))
    return model, d


def test_checkpoint_round_trip_and_dense_equivalence(fp4_checkpoint):
    """Saved in the official FP4 layout; loaded FP4 the bytes come back unchanged, loaded dense the experts
    are the dequantised values, and both give the same logits."""
    model, d = fp4_checkpoint
    tensors = dict(quant_io.iter_checkpoint_tensors(d))
    assert tensors["layers.1.ffn.experts.0.w1.weight"].dtype == np.int8
    assert tensors["layers.1.ffn.experts.0.w1.scale"].shape == (CFG.moe_intermediate_size, CFG.hidden_size // 32)
    again = load_checkpoint(d, dtype="float32", expert_weights="fp4")
    np.testing.assert_array_equal(np.asarray(again.layers[1].ffn.experts.w2[...]),
                                  np.asarray(model.layers[1].ffn.experts.w2[...]))
    dense = load_checkpoint(d, dtype="float32")
    assert dense.layers[1].ffn.experts.w1[...].dtype == jnp.float32
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 40))
    want = np.asarray(dense(tokens))
    np.testing.assert_allclose(np.asarray(model(tokens)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(again(tokens)), want, rtol=1e-5, atol=1e-5)
    # a dense checkpoint loaded as FP4 is quantised on the way in: exact here, the values were FP4 (the
    # bytes may differ: a block whose largest code is below 6 gets a halved scale and doubled codes)
    d2 = save_safetensors(dense, d.parent / "dense")
    requant = load_checkpoint(d2, dtype="float32", expert_weights="fp4")
    for name in ("w1", "w2", "w3"):
        values = [ref.dequant_experts(fp4_weight_bytes(getattr(m.layers[2].ffn.experts, name)[...]),
                                      fp4_scale_bytes(getattr(m.layers[2].ffn.experts, "s" + name[1])[...]))
                  for m in (requant, model)]
        np.testing.assert_array_equal(np.asarray(values[0]), np.asarray(values[1]))


def test_pallas_kernel_on_fp4_experts(fp4_checkpoint):
    """The MoE layer with the Pallas kernel (interpreted on CPU) on the packed weights against the
    reference path (bf16 activations in the kernel: bf16 tolerance)."""
    _, d = fp4_checkpoint
    r = load_checkpoint(d, dtype="float32", expert_weights="fp4")
    k = load_checkpoint(d, dtype="float32", expert_weights="fp4", moe_impl="pallas")
    rng = np.random.default_rng(seed_of_test())
    h = jnp.asarray(rng.normal(size=(2, 24, CFG.hidden_size)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 24)), jnp.int32)
    for layer in (0, 1, 2):  # hash-routed and score-routed
        want = np.asarray(r.layers[layer].ffn(h, tokens))
        got = np.asarray(k.layers[layer].ffn(h, tokens))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2, layer


def test_memory_accounting():
    """Resident bytes of an FP4 model = the released-format estimate of the dense one plus one byte per 32
    expert weights (the scales are held as bf16, fp4_kernel_scales); the full V4-Flash (bf16 dense, FP4
    experts) needs ~190 GB: two H200s with the experts split (ep=2) hold it."""
    from experiments.roofline_formats import bytes_per_param
    from model.sharded import memory_per_device

    cfg = ModelConfig.preset("v4-flash")
    fp4 = memory_per_device(cfg.replace(expert_weights="fp4"), 1, 2, 1, 1, 4096)
    released = memory_per_device(cfg, 1, 2, 1, 1, 4096)["params_fp4_experts"]
    assert fp4["params_fp4_experts"] == pytest.approx(released)
    held_scales = fp4["params"] - released          # ~141.7e9 expert weights per device / 32
    assert 4.2e9 < held_scales < 4.6e9
    assert 85e9 < released < 95e9 and fp4["params"] < 100e9
    assert bytes_per_param(cfg, "dense", "bf16-fp4-experts") == 2.0
    assert bytes_per_param(cfg, "expert", "bf16-fp4-experts") == 0.5 + 1 / 32


@pytest.mark.parametrize("name", ["v4", "v41"])
def test_official_checkpoint_kept_fp4(golden_dir, name):
    """The official reference checkpoints ship FP4 experts: loaded FP4 their bytes are kept as stored and
    the prefill logits still match the official implementation's."""
    import json

    from safetensors.numpy import load_file

    d = golden_dir / name
    model = load_checkpoint(d, dtype="float32", expert_weights="fp4")
    stored = dict(quant_io.iter_checkpoint_tensors(d))
    np.testing.assert_array_equal(np.asarray(fp4_weight_bytes(model.layers[0].ffn.experts.w1[...])[3]),
                                  stored["layers.0.ffn.experts.3.w1.weight"])
    np.testing.assert_array_equal(np.asarray(fp4_scale_bytes(model.layers[0].ffn.experts.s2[...][3])),
                                  stored["layers.0.ffn.experts.3.w2.scale"].view(np.uint8))
    prompts = np.asarray(json.loads((d / "inputs.json").read_text())["prompts"])
    want = load_file(d / "outputs.safetensors")["prefill_logits"]
    got = np.asarray(model(prompts))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4


def test_large_fp4_scales_warn_at_load():
    """FP4 expert scales above 2 (UE8M0 byte > 128) load, with a warning naming the tensor: the model's held
    scales (fp4_kernel_scales, the default decode's fold) are NaN for them."""
    from model.checkpoint import _as_held
    from pallas_kernels.moe import FP4_KERNEL_MAX_BYTE
    cfg = CFG.replace(expert_weights="fp4")
    name = "layers.0.ffn.experts.0.w1"
    packed = np.zeros((4, 32), np.int8)
    for top, warns in ((FP4_KERNEL_MAX_BYTE, False), (FP4_KERNEL_MAX_BYTE + 1, True)):
        scale = np.full((4, 2), top, np.uint8).view(quant_io.F8_E8M0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            held = dict(_as_held({name + ".weight": packed, name + ".scale": scale}, cfg))
        assert held[name + ".scale"].dtype == np.uint8 and held[name + ".weight"] is not None
        assert any(name + ".scale" in str(w.message) for w in caught) == warns
