"""Checkpoint layouts and weight checks: every layout transformers' `from_pretrained` reads for this model
loads (official names, HF module names, transformers' default `save_pretrained`), and a tensor whose dtype
does not belong, a NaN / inf value or a misplaced scale raises an error naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest

from model import ModelConfig, init_random
from model import quant_io
from model.checkpoint import load_checkpoint, official_name, official_tensors

from common import rel_err, small_config, write_checkpoint

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_oracle as H  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    """A 3-layer HF model (SWA + hash routing, CSA, HCA), every weight perturbed."""
    return H.build_hf_model(H.hf_tiny_config(num_hidden_layers=3, compress_ratios=(0, 4, 16), num_hash_layers=1),
                            seed=3)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(7).integers(2, 256, (2, 40))


def test_every_from_pretrained_layout_loads(hf_model, tokens, tmp_path):
    """transformers' default save (official names under `model.`, with `embed_tokens`, `hc_head.hc_fn` and the
    kv_norm as `attn.norm`), HF module names and official names load to the same model as HF's logits."""
    layouts = {}
    layouts["default"] = H.save_hf_model(hf_model, str(tmp_path / "default"), original_format=True)
    layouts["hf"] = H.save_hf_model(hf_model, str(tmp_path / "hf"), original_format=False)
    layouts["official"] = H.save_official_checkpoint(hf_model, str(tmp_path / "official"))
    assert "model.layers.0.attn.norm.weight" in layouts["default"] and "head.weight" in layouts["default"]
    assert "model.layers.0.self_attn.kv_norm.weight" in layouts["hf"]
    assert "layers.0.attn.kv_norm.weight" in layouts["official"]
    ref = H.hf_logits(hf_model, tokens)
    got = {k: np.asarray(load_checkpoint(tmp_path / k, dtype="float32")(tokens)) for k in layouts}
    assert rel_err(got["default"], ref) < 1e-5
    np.testing.assert_array_equal(got["hf"], got["default"])
    np.testing.assert_array_equal(got["official"], got["default"])


def test_official_name_of_each_layout():
    cases = {
        "model.layers.3.attn.norm.weight": "layers.3.attn.kv_norm.weight",       # default save
        "model.layers.3.attn.compressor.norm.weight": "layers.3.attn.compressor.norm.weight",
        "model.embed_tokens.weight": "embed.weight",
        "model.hc_head.hc_fn": "hc_head_fn",
        "model.norm.weight": "norm.weight",
        "head.weight": "head.weight",
        "model.layers.0.ffn.experts.5.w1.weight": "layers.0.ffn.experts.5.w1.weight",
        "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight":       # HF module names
            "layers.2.attn.indexer.weights_proj.weight",
        "lm_head.weight": "head.weight",
        "layers.1.attn.kv_norm.weight": "layers.1.attn.kv_norm.weight",             # official
        "mtp.0.attn.norm.weight": "mtp.0.attn.kv_norm.weight",
    }
    assert {k: official_name(k) for k in cases} == cases


def test_two_names_for_one_tensor(tmp_path):
    tensors = official_tensors(init_random(small_config("tiny-v4"), seed=0))
    tensors["model.layers.0.attn.norm.weight"] = tensors["layers.0.attn.kv_norm.weight"]
    _write(tmp_path, tensors, small_config("tiny-v4"))
    with pytest.raises(ValueError, match=r"tensors 'layers\.0\.attn\.kv_norm\.weight' and "
                                         r"'model\.layers\.0\.attn\.norm\.weight' both hold"):
        load_checkpoint(tmp_path, "float32")


# ----------------------------------------------------------------------------- weight checks

CFG = small_config("tiny-v4")


def _write(directory, tensors, cfg=CFG):
    return write_checkpoint(directory, tensors, cfg.to_official_dict())


@pytest.fixture(scope="module")
def official():
    return official_tensors(init_random(CFG, seed=0))


def test_non_finite_weight_names_the_tensor(official, tmp_path):
    tensors = dict(official)
    w = tensors["layers.1.attn.wq_b.weight"].copy()
    w[3, 5], w[0, 0] = np.nan, np.inf
    tensors["layers.1.attn.wq_b.weight"] = w
    _write(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"tensor 'layers\.1\.attn\.wq_b\.weight' holds 2 non-finite value\(s\) "
                                         r"\(NaN / inf\).*check_finite=False"):
        load_checkpoint(tmp_path, "float32")
    model = load_checkpoint(tmp_path, "float32", check_finite=False)  # the opt-out loads it as stored
    assert np.isnan(np.asarray(model.layers[1].attn.wq_b.weight[...])[3, 5])


def test_non_finite_scale_names_the_tensor(official, tmp_path):
    tensors = dict(official)
    q, s = quant_io.quantize_fp8_blocks(tensors["layers.2.attn.wo_b.weight"], 128)
    s = s.view(np.uint8).copy()
    s[0, 0] = 255  # UE8M0 NaN
    tensors["layers.2.attn.wo_b.weight"], tensors["layers.2.attn.wo_b.scale"] = q, s.view(quant_io.F8_E8M0)
    _write(tmp_path / "a", tensors)
    with pytest.raises(ValueError, match=r"tensor 'layers\.2\.attn\.wo_b\.weight' holds \d+ non-finite"):
        load_checkpoint(tmp_path / "a", "float32")
    _write(tmp_path / "b", tensors, CFG.replace(dense_weights="fp8"))  # held FP8: the scale byte itself
    with pytest.raises(ValueError, match=r"tensor 'layers\.2\.attn\.wo_b\.scale' holds 1 non-finite"):
        load_checkpoint(tmp_path / "b", "float32", dense_weights="fp8")


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_integer_tensor_where_a_float_belongs(official, tmp_path, dtype):
    tensors = dict(official)
    tensors["layers.0.attn.wkv.weight"] = np.ones(official["layers.0.attn.wkv.weight"].shape, dtype)
    _write(tmp_path, tensors)
    with pytest.raises(ValueError, match=rf"tensor 'layers\.0\.attn\.wkv\.weight' is stored as {np.dtype(dtype)}, "
                                         r"but the model holds a floating-point tensor there"):
        load_checkpoint(tmp_path, "bfloat16")


def test_float_tensor_where_an_integer_belongs(official, tmp_path):
    tensors = dict(official)
    tensors["layers.0.ffn.gate.tid2eid"] = official["layers.0.ffn.gate.tid2eid"].astype(np.float32)
    _write(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"tensor 'layers\.0\.ffn\.gate\.tid2eid' is stored as float32, but the "
                                         r"model holds an integer tensor \(int32\) there"):
        load_checkpoint(tmp_path, "float32")


def test_scale_of_a_weight_stored_unquantised(official, tmp_path):
    """An FP8 weight re-stored in bf16 next to its old scale: the message says what is wrong with the pair."""
    import ml_dtypes

    tensors = dict(official)
    w = tensors["layers.1.attn.wo_a.weight"]
    _, scale = quant_io.quantize_fp8_blocks(w, 128)
    tensors["layers.1.attn.wo_a.weight"] = w.astype(ml_dtypes.bfloat16)
    tensors["layers.1.attn.wo_a.scale"] = scale
    _write(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"tensor 'layers\.1\.attn\.wo_a\.scale': its weight "
                                         r"'layers\.1\.attn\.wo_a\.weight' is stored as bfloat16, which carries no "
                                         r"scale"):
        load_checkpoint(tmp_path, "float32")


def test_v41_names_pass_through():
    """V4.1 has no HF port: its official names (DSpark and Engram tensors included) come back unchanged."""
    from flax import nnx

    from model import abstract_model
    from model.checkpoint import path_to_official

    names = [path_to_official(p) for p, _ in nnx.to_flat_state(nnx.state(abstract_model(ModelConfig.preset("tiny-v41"))))]
    assert names and all(official_name(n) == n for n in names)


def test_unreadable_orbax_metadata(tmp_path):
    """A save_orbax checkpoint whose metadata is corrupt: the error says so (not 'missing every parameter')."""
    from model.checkpoint import restore_orbax, save_orbax

    path = save_orbax(init_random(CFG, seed=0), tmp_path / "ckpt")
    (path / "state" / "_METADATA").write_text("{not json")
    with pytest.raises(ValueError, match=r"orbax metadata is missing or unreadable"):
        restore_orbax(path)
