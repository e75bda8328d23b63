"""Tests for model/checkpoint.py: safetensors round trip, the quantised official format (FP8 128-blocks,
FP4 experts, sharded index), error messages, orbax save/restore, and parameter counts (docs/model.md §14, §17.1)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from model import ModelConfig, abstract_model, init_random, parameter_count  # noqa: E402
from model import quant_io  # noqa: E402
from model.checkpoint import (  # noqa: E402
    load_checkpoint,
    official_tensors,
    path_to_official,
    restore_orbax,
    save_orbax,
    save_safetensors,
)

import common  # noqa: E402

TINY = ModelConfig.preset("tiny-v4")
BF16 = np.dtype(ml_dtypes.bfloat16)

# Storage classes of the official checkpoint (docs/model.md §14; golden/README.md section 3).
FP8_LINEAR = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.ffn\.shared_experts\.w[123]"
                        r"|^mtp\.\d+\.(e_proj|h_proj))\.weight$")
FP4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
BF16_TENSOR = re.compile(r"(^embed|^head|norm|\.gate|\.compressor\.(wkv|wgate)|\.weights_proj)\.weight$")


def state_arrays(model) -> list[tuple[str, np.ndarray]]:
    return [(".".join(map(str, p)), np.asarray(v[...])) for p, v in nnx.to_flat_state(nnx.state(model))]


def assert_same_state(a, b):
    sa, sb = state_arrays(a), state_arrays(b)
    assert [n for n, _ in sa] == [n for n, _ in sb]
    for (name, x), (_, y) in zip(sa, sb):
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def write_checkpoint(directory: Path, tensors: dict, config: dict | None = None) -> Path:
    return common.write_checkpoint(directory, tensors, config or TINY.to_official_dict())


def write_sharded(directory: Path, tensors: dict, n_shards: int, config: dict) -> dict[str, str]:
    """Round-robin over sorted names, so a weight and its scale usually sit in different shards."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    weight_map = {name: files[i % n_shards] for i, name in enumerate(sorted(tensors))}
    for f in files:
        quant_io.write_safetensors(directory / f, {n: tensors[n] for n, g in weight_map.items() if g == f})
    total = sum(np.asarray(t).nbytes for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return weight_map


def quantise_official(tensors: dict[str, np.ndarray]) -> tuple[dict, dict, dict[str, int]]:
    """Logical fp32 tensors -> (stored tensors in the release encoding, their exact dequantised
    values, counts per storage class)."""
    stored, expected = {}, {}
    counts = {"fp8": 0, "fp4": 0, "bf16": 0, "f32": 0, "int": 0}
    for name, w in tensors.items():
        if FP8_LINEAR.search(name):
            q, s = quant_io.quantize_fp8_blocks(w, 128)
            stored[name], stored[name[:-len("weight")] + "scale"] = q, s
            expected[name] = quant_io.dequant_fp8_blocks(q, s, 128)
            counts["fp8"] += 1
        elif FP4_EXPERT.search(name):
            q, s = quant_io.quantize_fp4(w)
            stored[name], stored[name[:-len("weight")] + "scale"] = q, s
            expected[name] = quant_io.dequant_fp4(q, s)
            counts["fp4"] += 1
        elif name.endswith(".tid2eid"):
            stored[name] = expected[name] = w.astype(np.int64)  # the release stores I64
            counts["int"] += 1
        elif BF16_TENSOR.search(name):
            stored[name] = w.astype(BF16)
            expected[name] = stored[name].astype(np.float32)
            counts["bf16"] += 1
        else:  # hc_*, attn_sink, gate.bias, compressor ape: F32
            stored[name] = expected[name] = w
            counts["f32"] += 1
    return stored, expected, counts


def quantised_config() -> dict:
    return TINY.to_official_dict() | {
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "expert_dtype": "fp4",
    }


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def model():
    return init_random(TINY, seed=3, dtype="float32")


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 24)).astype(np.int32)


@pytest.fixture(scope="module")
def logits(model, tokens):
    out = np.asarray(model(tokens))
    assert out.shape == (2, 24, TINY.vocab_size) and out.dtype == np.float32 and np.isfinite(out).all()
    return out


@pytest.fixture(scope="module")
def official(model):
    return official_tensors(model)


@pytest.fixture(scope="module")
def quantised(official):
    return quantise_official(official)


# ------------------------------------------------------------------------------------ round trips


def test_safetensors_round_trip(model, tokens, logits, tmp_path):
    save_safetensors(model, tmp_path)
    names = quant_io.read_safetensors_header(tmp_path / "model.safetensors")[0]
    # official names: hc_* flattened, routed experts unstacked
    assert {"layers.0.hc_attn_fn", "hc_head_scale", "layers.5.ffn.experts.7.w2.weight",
            "mtp.0.hc_head_base", "layers.2.attn.indexer.compressor.ape"} <= set(names)
    loaded = load_checkpoint(tmp_path, "float32")
    assert loaded.config == TINY
    assert_same_state(model, loaded)
    np.testing.assert_array_equal(np.asarray(loaded(tokens)), logits)

    low = load_checkpoint(tmp_path, "bfloat16")
    w = low.layers[2].attn.wq_a.weight[...]
    assert w.dtype == BF16
    np.testing.assert_array_equal(np.asarray(w), np.asarray(model.layers[2].attn.wq_a.weight[...]).astype(BF16))


def _check_loaded_quantised(loaded, expected):
    got = official_tensors(loaded)
    assert set(got) == set(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_quantised_official_format(quantised, official, tokens, logits, tmp_path):
    stored, expected, counts = quantised
    # every class is exercised: 7 blocks x (5 attn + 3 shared), 2 indexers, MTP e/h; 7 x 8 x 3 experts
    assert counts == {"fp8": 7 * 8 + 2 + 2, "fp4": 7 * 8 * 3, "bf16": counts["bf16"], "f32": counts["f32"],
                      "int": 2}
    assert stored["layers.2.attn.wo_a.weight"].dtype == quant_io.F8_E4M3
    assert stored["layers.2.attn.wo_a.scale"].shape == (1, 2)  # [128, 192]: ceil-sized grid
    assert stored["layers.0.ffn.experts.3.w2.weight"].dtype == np.int8
    assert stored["layers.0.ffn.experts.3.w2.scale"].shape == (128, 4)
    assert not np.array_equal(expected["layers.0.ffn.experts.3.w2.weight"],
                              official["layers.0.ffn.experts.3.w2.weight"])  # really quantised

    single = tmp_path / "single"
    write_checkpoint(single, stored, quantised_config())
    a = load_checkpoint(single, "float32")
    _check_loaded_quantised(a, expected)

    sharded = tmp_path / "sharded"
    weight_map = write_sharded(sharded, stored, 3, quantised_config())
    assert sum(weight_map[n] != weight_map[n[:-len("scale")] + "weight"]
               for n in weight_map if n.endswith(".scale")) > 100  # pairs split across shards
    b = load_checkpoint(sharded, "float32")
    _check_loaded_quantised(b, expected)

    out_a, out_b = np.asarray(a(tokens)), np.asarray(b(tokens))
    np.testing.assert_array_equal(out_a, out_b)
    assert np.isfinite(out_a).all() and not np.array_equal(out_a, logits)

    low = load_checkpoint(sharded, "bfloat16")
    name = "layers.4.attn.indexer.wq_b.weight"
    np.testing.assert_array_equal(np.asarray(low.layers[4].attn.indexer.wq_b.weight[...]),
                                  expected[name].astype(BF16))


def test_orbax_round_trip(model, tokens, logits, tmp_path):
    path = save_orbax(model, tmp_path / "ckpt")
    restored = restore_orbax(path, TINY, dtype="float32")
    assert_same_state(model, restored)
    np.testing.assert_array_equal(np.asarray(restored(tokens)), logits)
    # config from the saved config.json; float32 state restored into a bfloat16 model
    low = restore_orbax(path)
    assert low.config == TINY
    np.testing.assert_array_equal(np.asarray(low.layers[1].ffn.experts.w1[...]),
                                  np.asarray(model.layers[1].ffn.experts.w1[...]).astype(BF16))
    with pytest.raises(ValueError, match="exists and is not empty"):
        save_orbax(model, path)
    with pytest.raises(ValueError, match=r"'layers\.0\.ffn\.experts\.w1' has shape \(8, 128, 128\), "
                                         r"expected \(8, 64, 128\)"):
        restore_orbax(path, TINY.replace(moe_intermediate_size=64), dtype="float32")
    no_mtp = TINY.replace(num_mtp_layers=0, compress_ratios=TINY.compress_ratios[:-1])
    with pytest.raises(ValueError, match=r"unexpected \['mtp\.0\."):
        restore_orbax(path, no_mtp, dtype="float32")
    with pytest.raises(FileNotFoundError, match="no orbax state"):
        restore_orbax(tmp_path / "absent", TINY)


# ------------------------------------------------------------------------------------ bad input


def test_missing_tensor(official, tmp_path):
    tensors = {k: v for k, v in official.items() if k != "layers.3.attn.wkv.weight"}
    write_checkpoint(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"missing tensors: \['layers\.3\.attn\.wkv\.weight'\]"):
        load_checkpoint(tmp_path, "float32")


def test_missing_expert(official, tmp_path):
    tensors = {k: v for k, v in official.items() if k != "layers.1.ffn.experts.5.w2.weight"}
    write_checkpoint(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"missing tensors: \['layers\.1\.ffn\.experts\.5\.w2\.weight'\]"):
        load_checkpoint(tmp_path, "float32")


def test_wrong_shape(official, tmp_path):
    tensors = dict(official)
    tensors["layers.2.attn.wq_a.weight"] = official["layers.2.attn.wq_a.weight"][:, :64]
    write_checkpoint(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"tensor 'layers\.2\.attn\.wq_a\.weight' has shape \(128, 64\), "
                                         r"expected \(128, 128\)"):
        load_checkpoint(tmp_path, "float32")


def test_unexpected_tensor(official, tmp_path):
    tensors = dict(official)
    tensors["layers.0.attn.bogus.weight"] = np.zeros((4, 4), np.float32)
    tensors["layers.6.attn_norm.weight"] = np.ones(128, np.float32)  # a layer the config does not have
    write_checkpoint(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"unexpected tensors .*'layers\.0\.attn\.bogus\.weight', "
                                         r"'layers\.6\.attn_norm\.weight'"):
        load_checkpoint(tmp_path, "float32")


def test_duplicate_tensor_across_shards(official, tmp_path):
    write_sharded(tmp_path, official, 2, TINY.to_official_dict())
    extra = quant_io.read_safetensors(tmp_path / "model-00002-of-00002.safetensors")
    extra["embed.weight"] = official["embed.weight"]  # also in shard 1 (sorted first)
    quant_io.write_safetensors(tmp_path / "model-00002-of-00002.safetensors", dict(extra))
    with pytest.raises(ValueError, match=r"tensor 'embed\.weight' appears twice"):
        load_checkpoint(tmp_path, "float32")


def test_quantised_weight_without_scale(quantised, tmp_path):
    stored = dict(quantised[0])
    del stored["layers.0.attn.wq_a.scale"]
    write_checkpoint(tmp_path / "a", stored, quantised_config())
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.wq_a\.weight': FP8 tensor without its scale"):
        load_checkpoint(tmp_path / "a", "float32")
    stored = dict(quantised[0])
    del stored["layers.1.ffn.experts.2.w3.weight"]
    write_checkpoint(tmp_path / "b", stored, quantised_config())
    with pytest.raises(ValueError, match=r"'layers\.1\.ffn\.experts\.2\.w3\.scale': scale without its weight"):
        load_checkpoint(tmp_path / "b", "float32")


def test_other_model_type_config(official, tmp_path):
    write_checkpoint(tmp_path, {"embed.weight": official["embed.weight"]},
                     {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128})
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        load_checkpoint(tmp_path, "float32")


def test_missing_files(official, tmp_path):
    quant_io.write_safetensors(tmp_path / "model.safetensors", {"embed.weight": official["embed.weight"]})
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_checkpoint(tmp_path, "float32")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(TINY.to_official_dict()))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_checkpoint(empty, "float32")


def test_bad_tokens(model, logits):
    v = TINY.vocab_size
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\); got range \[0, 256\]"):
        model(np.array([[0, 5, v]], np.int32))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\); got range \[-1, 7\]"):
        model(np.array([[3, -1, 7]], np.int32))
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\], got shape \(5,\)"):
        model(np.arange(5, dtype=np.int32))
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\], got shape \(1, 2, 3\)"):
        model(np.zeros((1, 2, 3), np.int32))
    with pytest.raises(ValueError, match="tokens must be integers"):
        model(np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="zero length"):
        model(np.zeros((1, 0), np.int32))


# ------------------------------------------------------------------------------------ parameter counts


def expected_parameter_count(cfg: ModelConfig, include_mtp: bool = True) -> int:
    """Independent count from the shapes of docs/model.md §17.1 (nnx.Param only: tid2eid is a table)."""
    d, n, h, dh, q = cfg.hidden_size, cfg.hc_mult, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
    mix = (2 + n) * n
    hc_head = n * n * d + n + 1

    def compressor(ratio, overlap, width):
        c = 2 if overlap else 1
        return 2 * c * width * d + ratio * c * width + width

    def block(spec):
        p = 2 * (mix * n * d + mix + 3) + 2 * d  # hc_attn, hc_ffn, attn_norm, ffn_norm
        p += q * d + q + h * dh * q + dh * d + dh + h * dh * cfg.o_lora_rank + d * cfg.o_groups * cfg.o_lora_rank + h
        if spec.compress_ratio:
            p += compressor(spec.compress_ratio, spec.overlap, dh)
        if spec.indexer:
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            p += hi * di * q + hi * d + compressor(spec.compress_ratio, True, di)
        p += e * d + (0 if spec.hash_routed else e) + 3 * e * i * d + 3 * i * d
        return p

    total = 2 * cfg.vocab_size * d + d + hc_head + sum(block(s) for s in cfg.layer_specs)
    if include_mtp:
        total += sum(block(cfg.layer_spec(j)) + 2 * d * d + 3 * d + hc_head
                     for j in range(cfg.num_layers, cfg.num_blocks))
    return total


def _mtp_parameters(model) -> tuple[int, int]:
    """MTP parameters counted two ways: the `mtp` subtree, and paths starting with 'mtp'."""
    sub = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model.mtp, nnx.Param)))
    by_path = sum(int(np.prod(v.shape)) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                  if p[0] == "mtp")
    return sub, by_path


def test_parameter_count_tiny(model):
    assert parameter_count(model) == expected_parameter_count(TINY)
    assert parameter_count(abstract_model(TINY)) == parameter_count(model)
    mtp, mtp2 = _mtp_parameters(model)
    assert mtp == mtp2 == expected_parameter_count(TINY) - expected_parameter_count(TINY, include_mtp=False)


@pytest.fixture(scope="module")
def flash_abstract():
    # jax's tracer builds an error message (walking the whole jaxpr) each time flax reads `.sharding`
    # off the traced RNG counter, which makes eval_shape of the 44-block model quadratic: ~48 s on
    # 2 CPU cores, ~2 s without the message. The message is never shown; the shapes are unchanged.
    with pytest.MonkeyPatch.context() as mp:
        try:
            from jax._src.interpreters import partial_eval as pe
            if hasattr(pe, "DynamicJaxprTracer") and hasattr(pe.DynamicJaxprTracer, "_origin_msg"):
                mp.setattr(pe.DynamicJaxprTracer, "_origin_msg", lambda self: "")
        except ImportError:  # pragma: no cover - internal layout changed: just slower
            pass
        return abstract_model(ModelConfig.preset("v4-flash"))


def test_parameter_count_v4_flash(flash_abstract):
    """V4-Flash is "284B total": the backbone. Our tree also holds the MTP block.

    Measured: total 290,942,289,362; MTP 6,610,048,891; backbone 284,332,240,471 (+0.12%).
    """
    cfg = ModelConfig.preset("v4-flash")
    total = parameter_count(flash_abstract)
    mtp, mtp_by_path = _mtp_parameters(flash_abstract)
    backbone = total - mtp
    print(f"v4-flash parameters: total {total:,}, mtp {mtp:,}, backbone {backbone:,}")
    assert mtp == mtp_by_path
    assert total == expected_parameter_count(cfg)
    assert backbone == expected_parameter_count(cfg, include_mtp=False)
    assert abs(backbone - 284e9) / 284e9 < 0.01
    assert 6.5e9 < mtp < 6.7e9


def test_v4_flash_checkpoint_tensor_names(flash_abstract):
    """Official names of the abstract model + one .scale per FP8/FP4 weight = the release's 69,187
    tensors, 1,575 of them under mtp.0 (docs/model.md §14)."""
    names = []
    for path, var in nnx.to_flat_state(nnx.state(flash_abstract)):
        name = path_to_official(path)
        names += [name.format(e=e) for e in range(var.shape[0])] if "{e}" in name else [name]
    assert len(set(names)) == len(names)
    scales = [n[:-len("weight")] + "scale" for n in names if FP8_LINEAR.search(n) or FP4_EXPERT.search(n)]
    everything = names + scales
    assert len(everything) == 69187
    assert sum(n.startswith("mtp.0.") for n in everything) == 1575
    assert sum(n.endswith(".tid2eid") for n in names) == 3
