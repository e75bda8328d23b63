"""Tests for model/config.py (ModelConfig, LayerSpec, presets, config.json readers) and the RoPE/YaRN
helpers of model/layers.py (docs/model.md §0.1, §0.2, §0.3, §0.4, §3.2, §3.3)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from model import LayerSpec, ModelConfig  # noqa: E402
from model.config import Yarn  # noqa: E402
from model.layers import apply_rope, rope_frequencies  # noqa: E402

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def kinds(cfg: ModelConfig) -> list[str]:
    return [s.attention for s in cfg.layer_specs]


def hf_config(**overrides):
    """`transformers.DeepseekV4Config(...)` (HF style: layer_types, compress_rates, mlp_layer_types,
    rope_parameters {main, compress})."""
    transformers = pytest.importorskip("transformers")
    lg = logging.getLogger("transformers")
    old = lg.level
    lg.setLevel(logging.ERROR)  # YaRN "factor does not match max_pos / orig" warning
    try:
        return transformers.DeepseekV4Config(**overrides)
    finally:
        lg.setLevel(old)


def hf_config_dict(**overrides) -> dict:
    return hf_config(**overrides).to_dict()


# A small HF-style config whose every field differs from the HF defaults.
HF_SMALL = dict(
    vocab_size=300, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=1, head_dim=96, partial_rotary_factor=1 / 3,
    q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=16,
    layer_types=[SWA, CSA, HCA, CSA, HCA, SWA], compress_rates={CSA: 4, HCA: 32},
    mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 4, rope_theta=20000.0, compress_rope_theta=50000.0,
    rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                     "beta_fast": 24, "beta_slow": 2},
    max_position_embeddings=512, index_n_heads=8, index_head_dim=64, index_topk=4,
    n_routed_experts=8, num_experts_per_tok=3, routed_scaling_factor=2.0, swiglu_limit=7.0,
    hc_sinkhorn_iters=10, num_nextn_predict_layers=1, eos_token_id=[1, 2],
)


# ------------------------------------------------------------------------------------ presets


def test_tiny_preset_layer_roles():
    cfg = ModelConfig.preset("tiny-v4")
    specs = cfg.layer_specs
    assert len(specs) == cfg.num_layers and all(isinstance(s, LayerSpec) for s in specs)
    k = kinds(cfg)
    assert k.count("swa") >= 1 and k.count("csa") == 2 and k.count("hca") == 2
    assert sum(s.hash_routed for s in specs) == 2
    assert cfg.hc_mult == 4
    for s in specs:
        assert s.overlap == s.indexer == (s.attention == "csa")
        if s.attention == "swa":
            assert s.compress_ratio == 0 and s.yarn is None and s.rope_theta == cfg.rope_theta
        else:
            assert s.compress_ratio > 0 and s.yarn == cfg.yarn and s.rope_theta == cfg.compress_rope_theta
    assert cfg.num_mtp_layers == 1 and cfg.num_blocks == cfg.num_layers + 1
    mtp = cfg.layer_spec(cfg.num_layers)
    assert mtp.mtp and mtp.attention == "swa" and not mtp.hash_routed
    with pytest.raises(ValueError, match="layer index 7 out of range"):
        cfg.layer_spec(cfg.num_blocks)


def test_v4_flash_preset_layer_roles():
    cfg = ModelConfig.preset("v4-flash")
    k = kinds(cfg)
    assert cfg.num_layers == 43 and len(k) == 43
    assert (k.count("csa"), k.count("hca"), k.count("swa")) == (21, 20, 2)
    assert k[:2] == ["swa", "swa"]
    assert all(k[i] == "csa" for i in range(2, 43, 2)) and all(k[i] == "hca" for i in range(3, 43, 2))
    assert {s.compress_ratio for s in cfg.layer_specs if s.attention == "hca"} == {128}
    assert [s.index for s in cfg.layer_specs if s.hash_routed] == [0, 1, 2]
    mtp = cfg.layer_spec(43)
    assert mtp.mtp and mtp.attention == "swa" and mtp.compress_ratio == 0 and mtp.yarn is None
    assert not mtp.hash_routed and mtp.rope_theta == 10000.0
    assert cfg.yarn == Yarn(16.0, 65536, 32.0, 1.0) and cfg.compress_rope_theta == 160000.0
    assert (cfg.hidden_size, cfg.head_dim, cfg.rope_head_dim, cfg.nope_head_dim) == (4096, 512, 64, 448)
    # describe() lists every block, MTP included
    assert len(cfg.describe().splitlines()) == 1 + 44 and "mtp.0" in cfg.describe()


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        ModelConfig.preset("nope")


def test_configs_are_hashable_and_static():
    a, b = ModelConfig.preset("tiny-v4"), ModelConfig.preset("tiny-v4")
    assert a is not b and a == b and hash(a) == hash(b)
    assert a.replace(name="renamed") == a and hash(a.replace(name="renamed")) == hash(a)  # name: a label
    c = a.replace(sliding_window=16)
    assert c != a
    assert len({a, b, c, ModelConfig.preset("v4-flash")}) == 3
    assert hash(a.layer_spec(2)) == hash(b.layer_spec(2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.hidden_size = 1  # type: ignore[misc]

    # usable as a static jit argument: equal configs share one trace
    traces = []

    def f(cfg, x):
        traces.append(cfg)
        return x * cfg.hc_mult

    g = jax.jit(f, static_argnums=0)
    g(a, jnp.ones(2))
    g(b, jnp.ones(2))
    assert len(traces) == 1
    g(c, jnp.ones(2))
    assert len(traces) == 2


# ------------------------------------------------------------------------------------ from_hf


def test_from_hf_official_golden(golden_dir):
    path = golden_dir / "v4" / "config.json"
    cfg = ModelConfig.from_hf(path)
    assert ModelConfig.from_hf(path.parent) == cfg  # a directory works too
    assert ModelConfig.from_hf(json.loads(path.read_text())) == cfg  # and a dict
    assert cfg.compress_ratios == (0, 0, 4, 16, 4, 0, 0)
    assert kinds(cfg) == ["swa", "swa", "csa", "hca", "csa", "swa"]
    assert [s.index for s in cfg.layer_specs if s.hash_routed] == [0, 1]
    assert (cfg.rope_head_dim, cfg.rope_theta, cfg.compress_rope_theta) == (32, 10000.0, 40000.0)
    assert cfg.yarn == Yarn(4.0, 32, 32.0, 1.0)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (16, 64, 4)
    assert (cfg.n_routed_experts, cfg.n_experts_per_tok, cfg.routed_scaling_factor) == (8, 2, 1.5)
    assert cfg.num_mtp_layers == 1 and cfg.max_position_embeddings == 128
    # The golden model is the tiny preset except layer 5 (SWA there, HCA in the preset) and max_pos.
    tiny = ModelConfig.preset("tiny-v4")
    assert cfg.replace(compress_ratios=tiny.compress_ratios, max_position_embeddings=1024) == tiny


def test_from_hf_transformers_style():
    raw = hf_config_dict(**HF_SMALL)
    assert raw["model_type"] == "deepseek_v4" and "layer_types" in raw and "main" in raw["rope_parameters"]
    cfg = ModelConfig.from_hf(raw)
    assert cfg.compress_ratios == (0, 4, 32, 4, 32, 0, 0)  # 6 layers + the MTP slot
    assert kinds(cfg) == ["swa", "csa", "hca", "csa", "hca", "swa"]
    assert cfg.csa_ratio == 4 and cfg.num_mtp_layers == 1
    assert cfg.num_hash_layers == 2 and [s.hash_routed for s in cfg.layer_specs] == [True] * 2 + [False] * 4
    assert cfg.head_dim == 96 and cfg.rope_head_dim == 32
    assert cfg.rope_theta == 20000.0 and cfg.compress_rope_theta == 50000.0
    assert cfg.yarn == Yarn(factor=8.0, original_max_position_embeddings=64, beta_fast=24.0, beta_slow=2.0)
    assert cfg.layer_spec(1).yarn == cfg.yarn and cfg.layer_spec(0).yarn is None
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank) == (300, 128, 4, 64)
    assert (cfg.o_groups, cfg.o_lora_rank, cfg.sliding_window, cfg.moe_intermediate_size) == (2, 32, 16, 64)
    assert (cfg.n_routed_experts, cfg.n_experts_per_tok) == (8, 3)
    assert (cfg.routed_scaling_factor, cfg.swiglu_limit, cfg.hc_sinkhorn_iters) == (2.0, 7.0, 10)
    assert cfg.eos_token_id == 1 and cfg.max_position_embeddings == 512

    # Without the derived qk_rope_head_dim the rope width comes from partial_rotary_factor, and
    # without top-level thetas they come from rope_parameters {main, compress}.
    stripped = {k: v for k, v in raw.items()
                if k not in ("qk_rope_head_dim", "rope_theta", "compress_rope_theta")}
    assert ModelConfig.from_hf(stripped) == cfg



def test_from_hf_transformers_saved_file(tmp_path):
    """A config.json written by transformers' save_pretrained reads like its dict."""
    hf_config(**HF_SMALL).save_pretrained(tmp_path)
    assert ModelConfig.from_hf(tmp_path) == ModelConfig.from_hf(hf_config_dict(**HF_SMALL))


def test_from_hf_transformers_release_layout_is_v4_flash():
    """The HF config of the release (its defaults + the release layer types + YaRN) == the preset."""
    layer_types = [SWA, SWA] + [CSA, HCA] * 20 + [CSA]
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
            "beta_fast": 32, "beta_slow": 1}
    cfg = ModelConfig.from_hf(hf_config_dict(layer_types=layer_types, rope_parameters=yarn))
    assert cfg == ModelConfig.preset("v4-flash")


@pytest.mark.parametrize("preset", ["tiny-v4", "v4-flash", "v4-flash-4l"])
def test_official_dict_round_trip(preset, tmp_path):
    cfg = ModelConfig.preset(preset)
    assert ModelConfig.from_hf(cfg.to_official_dict()) == cfg
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_official_dict()))
    assert ModelConfig.from_hf(tmp_path) == cfg
    # also without MTP and without YaRN
    no_mtp = cfg.replace(num_mtp_layers=0, compress_ratios=cfg.compress_ratios[:cfg.num_layers], yarn=None)
    assert ModelConfig.from_hf(no_mtp.to_official_dict()) == no_mtp


# ------------------------------------------------------------------------------------ errors


def test_unknown_layer_type():
    raw = hf_config_dict(**{**HF_SMALL, "layer_types": [SWA, CSA, HCA, CSA, HCA, SWA]})
    raw["layer_types"][3] = "full_attention"
    with pytest.raises(ValueError, match="unknown layer type 'full_attention' at layer 3"):
        ModelConfig.from_hf(raw)
    raw = hf_config_dict(**HF_SMALL)
    raw["mlp_layer_types"][4] = "dense"
    with pytest.raises(ValueError, match="unknown mlp layer type 'dense' at layer 4"):
        ModelConfig.from_hf(raw)


def test_heads_not_divisible_by_o_groups():
    tiny = ModelConfig.preset("tiny-v4")
    with pytest.raises(ValueError, match="num_heads 4 is not divisible by o_groups 3"):
        tiny.replace(o_groups=3)
    raw = tiny.to_official_dict() | {"num_attention_heads": 6, "o_groups": 4}
    with pytest.raises(ValueError, match="num_heads 6 is not divisible by o_groups 4"):
        ModelConfig.from_hf(raw)


def test_odd_rope_dims():
    tiny = ModelConfig.preset("tiny-v4")
    with pytest.raises(ValueError, match="rope_head_dim must be even, got 31"):
        tiny.replace(rope_head_dim=31)
    with pytest.raises(ValueError, match="rope_head_dim must be even, got 33"):
        ModelConfig.from_hf(tiny.to_official_dict() | {"qk_rope_head_dim": 33})
    with pytest.raises(ValueError, match="rope_head_dim 128 must be in"):
        tiny.replace(rope_head_dim=128)


def test_topk_experts_exceeds_experts():
    tiny = ModelConfig.preset("tiny-v4")
    with pytest.raises(ValueError, match="num_experts_per_tok 9 > n_routed_experts 8"):
        tiny.replace(n_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_experts_per_tok 5 > n_routed_experts 4"):
        ModelConfig.from_hf(tiny.to_official_dict() | {"n_routed_experts": 4, "num_experts_per_tok": 5})


def test_quant_sim_widths_fit_the_act_quant_block():
    """quant_sim rounds the official FP8 / FP4 GEMM inputs per fp8_block values: widths must be whole blocks."""
    tiny = ModelConfig.preset("tiny-v4")
    tiny.replace(quant_sim=True)                                   # 128-wide everywhere: fine
    with pytest.raises(ValueError, match=r"quant_sim needs moe_intermediate_size \(96\) to be a multiple of the "
                                         "act_quant block 128"):
        tiny.replace(quant_sim=True, moe_intermediate_size=96)
    tiny.replace(moe_intermediate_size=96)                         # without the sims any width runs


def test_other_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ValueError, match="model_type None is not supported"):
        ModelConfig.from_hf({"hidden_size": 4096})


def test_compress_ratios_length_mismatch():
    tiny = ModelConfig.preset("tiny-v4")
    with pytest.raises(ValueError, match=r"compress_ratios has 6 entries, expected num_layers \+ num_mtp_layers = 7"):
        tiny.replace(compress_ratios=tiny.compress_ratios[:-1])
    raw = tiny.to_official_dict()
    raw["compress_ratios"] = raw["compress_ratios"][:5]
    with pytest.raises(ValueError, match="compress_ratios has 5 entries < num_hidden_layers 6"):
        ModelConfig.from_hf(raw)
    raw = hf_config_dict(**HF_SMALL)
    raw["layer_types"] = raw["layer_types"][:4]
    with pytest.raises(ValueError, match="layer_types has 4 entries < num_hidden_layers 6"):
        ModelConfig.from_hf(raw)


def test_other_config_errors(tmp_path):
    tiny = ModelConfig.preset("tiny-v4")
    with pytest.raises(ValueError, match="MTP slot 6 must be SWA only"):
        tiny.replace(compress_ratios=tiny.compress_ratios[:-1] + (4,))
    raw = tiny.to_official_dict()
    del raw["q_lora_rank"]
    with pytest.raises(ValueError, match="missing config field 'q_lora_rank'"):
        ModelConfig.from_hf(raw)
    with pytest.raises(ValueError, match="num_key_value_heads must be 1"):
        ModelConfig.from_hf(tiny.to_official_dict() | {"num_key_value_heads": 8})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        ModelConfig.from_hf(tmp_path / "absent" / "config.json")


# ------------------------------------------------------------------------------------ RoPE / YaRN


def test_yarn_ramp_boundaries_real_config():
    """docs/model.md §3.2, §3.3: for R=64, theta=160000, factor 16, orig 65536: lo = 15, hi = 25."""
    cfg = ModelConfig.preset("v4-flash")
    spec = cfg.layer_spec(2)  # a CSA layer: compress theta + YaRN
    r, y = cfg.rope_head_dim, spec.yarn
    corr = lambda beta: r * math.log(y.original_max_position_embeddings / (2 * math.pi * beta)) / (  # noqa: E731
        2 * math.log(spec.rope_theta))
    assert (math.floor(corr(y.beta_fast)), math.ceil(corr(y.beta_slow))) == (15, 25)

    freqs = np.array(rope_frequencies(r, spec.rope_theta, y))
    k = np.arange(r // 2)
    base = 1.0 / spec.rope_theta ** (2.0 * k / r)
    assert len(freqs) == 32
    ramp = (1.0 - freqs / base) / (1.0 - 1.0 / y.factor)  # 0: original, 1: fully interpolated
    np.testing.assert_allclose(ramp, np.clip((k - 15) / 10, 0, 1), atol=1e-12)
    assert np.all(ramp[:16] == 0) and np.all(ramp[25:] > 1 - 1e-12) and np.all((ramp[16:25] > 0) & (ramp[16:25] < 1))

    # SWA layers (and the MTP slot): theta 10000, no YaRN
    swa = cfg.layer_spec(0)
    np.testing.assert_allclose(rope_frequencies(r, swa.rope_theta, swa.yarn), 1.0 / 10000.0 ** (2.0 * k / r))
    assert rope_frequencies(r, 1e4, Yarn(1.0, 4096)) == rope_frequencies(r, 1e4, None)


def _rope_reference(x: np.ndarray, positions: np.ndarray, freqs) -> np.ndarray:
    """Interleaved pairs of the last R channels times exp(i p omega) (complex RoPE), in float64."""
    r = 2 * len(freqs)
    tail = x[..., -r:].astype(np.float64)
    z = (tail[..., 0::2] + 1j * tail[..., 1::2]) * np.exp(1j * positions[..., None] * np.asarray(freqs))
    out = x.astype(np.float64).copy()
    out[..., -r:][..., 0::2] = z.real
    out[..., -r:][..., 1::2] = z.imag
    return out


def test_rope_inverse_of_forward_is_identity():
    cfg = ModelConfig.preset("tiny-v4")
    rng = np.random.default_rng(0)
    b, t, h, dh = 2, 9, 3, cfg.head_dim
    x = rng.standard_normal((b, t, h, dh)).astype(np.float32)
    pos = rng.integers(0, 4096, (b, t)).astype(np.int32)
    pos[0, 0] = 0
    for spec in (cfg.layer_spec(0), cfg.layer_spec(2)):  # plain and YaRN frequencies
        freqs = rope_frequencies(cfg.rope_head_dim, spec.rope_theta, spec.yarn)
        y = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos)[..., None], freqs))
        back = np.asarray(apply_rope(jnp.asarray(y), jnp.asarray(pos)[..., None], freqs, inverse=True))
        np.testing.assert_allclose(back, x, atol=2e-5, rtol=0)
        # nope channels untouched, position 0 is the identity, rotation keeps pair norms
        np.testing.assert_array_equal(y[..., :cfg.nope_head_dim], x[..., :cfg.nope_head_dim])
        np.testing.assert_allclose(y[0, 0], x[0, 0], atol=1e-6)
        assert not np.allclose(y, x, atol=1e-3)
        # interleaved-pair ("complex") convention, docs/model.md §3.2
        ref = _rope_reference(x, pos[..., None].astype(np.float64), freqs)
        np.testing.assert_allclose(y, ref, atol=5e-3, rtol=0)  # float32 angles at p ~ 4096
    # positions broadcast over a [B, T, D] tensor (the shared kv) too
    kv = rng.standard_normal((b, t, dh)).astype(np.float32)
    freqs = rope_frequencies(cfg.rope_head_dim, cfg.rope_theta, None)
    rot = apply_rope(jnp.asarray(kv), jnp.asarray(pos), freqs)
    np.testing.assert_allclose(np.asarray(apply_rope(rot, jnp.asarray(pos), freqs, inverse=True)), kv, atol=2e-5)


def test_head_dtype():
    """head_dtype="bfloat16" rounds the head's input to bf16 (f32 accumulation, f32 logits): close to the
    float32 head on the same weights; anything else is refused."""
    from flax import nnx

    from common import rel_err
    from model.layers import Linear
    from model.transformer import construction_plan
    with pytest.raises(ValueError, match="head_dtype must be one of"):
        ModelConfig.preset("tiny-v4").replace(head_dtype="float16")
    cfg = ModelConfig.preset("tiny-v4")
    heads = {h: next(p for p in construction_plan(cfg.replace(head_dtype=h), jnp.bfloat16, None) if p.name == "head")
             .build(nnx.Rngs(0)) for h in ("float32", "bfloat16")}        # the model's head, same weights
    assert all(isinstance(m, Linear) and m.input_dtype == h for h, m in heads.items())
    y = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, cfg.hidden_size)), jnp.float32)
    f32, bf16 = heads["float32"](y), heads["bfloat16"](y)
    assert bf16.dtype == f32.dtype == jnp.float32 and bf16.shape == (2, 16, cfg.vocab_size)
    assert 0 < rel_err(bf16, f32) < 1e-2
    assert np.mean(np.argmax(bf16, -1) == np.argmax(f32, -1)) > 0.9


@pytest.mark.parametrize("seed", [0, 1])
def test_float32_linear_of_bf16_operands(seed):
    """bf16 x bf16 in the float32 linear multiplies without upcasting (no weight conversion, no TF32 on a GPU): its
    products are exact in float32, so it is the float32 linear of the upcast operands up to summation order --
    within 2e-6 of float64 on fresh random operands; float32 operands keep the float32 path."""
    from model.layers import float32_linear

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((3, 7, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((300, 512)) * 512 ** -0.5, jnp.bfloat16)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    for got in (float32_linear(x, w), float32_linear(x.astype(jnp.float32), w.astype(jnp.float32))):
        assert got.dtype == jnp.float32
        assert np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref) < 2e-6
    text = str(jax.make_jaxpr(float32_linear)(x, w))
    assert "convert_element_type" not in text and "preferred_element_type=float32" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_in_place_update_equals_concatenation(dtype):
    """The GPU's formulation (the rotated channels written over x in place; chosen wherever the kernels are, here
    under lowering_for_hopper) gives the CPU's concatenation bitwise, queries [B, T, H, Dh] and keys [B, T, Dh]."""
    from pallas_kernels.common import lowering_for_hopper
    cfg = ModelConfig.preset("tiny-v4")
    freqs = rope_frequencies(cfg.rope_head_dim, cfg.layer_spec(2).rope_theta, cfg.layer_spec(2).yarn)
    rng = np.random.default_rng(1)
    pos = jnp.asarray(rng.integers(0, 4096, (2, 9)).astype(np.int32))
    for shape, p in (((2, 9, 3, cfg.head_dim), pos[..., None]), ((2, 9, 64), pos)):
        x = jnp.asarray(rng.standard_normal(shape), dtype)
        for inverse in (False, True):
            want = jax.jit(lambda x, p: apply_rope(x, p, freqs, inverse=inverse))(x, p)
            with lowering_for_hopper():
                got = jax.jit(lambda x, p: apply_rope(x, p, freqs, inverse=inverse))(x, p)
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_gpu_rope_in_place_in_the_decode_step(preset, monkeypatch):
    """The GPU writes RoPE in place inside the whole jitted steps: a prefill and teacher-forced decode steps equal
    the same steps with the concatenation (what the CPU runs), float32 at the highest matmul precision. Catches a
    miscompiled in-place update like the one XLA's CPU backend has (8% off there)."""
    import model.layers as layers_mod
    from common import rel_err, seed_of_test
    from model import init_random
    from model.cache import allocate
    from model.transformer import decode, prefill

    model = init_random(ModelConfig.preset(preset), seed=3)
    tokens = np.random.default_rng(seed_of_test()).integers(2, model.config.vocab_size, (2, 24))

    def steps():
        cache = allocate(model.config, 2, 64, jnp.float32)
        first, cache = prefill(model, cache, tokens[:, :16], np.full(2, 16))
        out = [np.asarray(first)]
        for i in range(16, 24):
            logits, cache = decode(model, cache, tokens[:, i])
            out.append(np.asarray(logits))
        return np.stack(out, 1)

    with jax.default_matmul_precision("highest"):
        in_place = steps()
        monkeypatch.setattr(layers_mod, "on_gpu", lambda: False)
        jax.clear_caches()
        concatenated = steps()
    assert rel_err(in_place, concatenated) < 1e-5
