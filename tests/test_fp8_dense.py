"""FP8-resident dense weights (cfg.dense_weights="fp8"): the tensors the release stores FP8 (quant_io.release_fp8)
held as E4M3 + one UE8M0 byte per B x B block (B = 128 V4, 32 V4.1), dequantised in-graph before each matmul;
loaded as shipped, saved in the official layout, born sharded on meshes."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import ModelConfig, init_random, quant_io
from model.checkpoint import (build_from_tensors, load_checkpoint, official_tensors, restore_orbax, save_orbax,
                              save_safetensors)
from model.transformer import abstract_model, parameter_count
from pallas_kernels import reference as ref

from common import seed_of_test

V4 = ModelConfig.preset("tiny-v4").replace(num_layers=3, compress_ratios=(0, 4, 16, 0), num_hash_layers=1,
                                           name="v4-small")
V41 = ModelConfig.preset("tiny-v41")


def _fp8_names(model) -> list[str]:
    return [".".join(map(str, k)) for k, v in nnx.to_flat_state(nnx.state(model)) if v.dtype == jnp.float8_e4m3fn]


def _bytes(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def test_traceable_quantiser_is_quant_io():
    """ref.quantize_fp8_blocks (jit) == quant_io.quantize_fp8_blocks bit for bit: partial edge blocks, an
    all-zero block, tiny and subnormal values, stacked leading dims; dequantisation agrees too."""
    seed = seed_of_test()
    rng = np.random.default_rng(seed)
    for shape, block in (((200, 96), 32), ((384, 128), 128), ((2, 96, 130), 128), ((70, 45), 32)):
        w = (rng.normal(size=shape) * np.exp(3 * rng.normal(size=shape[:-1] + (1,)))).astype(np.float32)
        w[..., :block, :block] = 0.0
        w[..., -1, -3:] = 1e-30
        w[..., -2, :] = 1e-40
        q, s = jax.jit(ref.quantize_fp8_blocks, static_argnums=1)(jnp.asarray(w), block)
        assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.uint8
        deq = np.asarray(jax.jit(ref.dequant_fp8_blocks)(q, s))
        for i in np.ndindex(shape[:-2]):
            want_q, want_s = quant_io.quantize_fp8_blocks(w[i], block)
            np.testing.assert_array_equal(_bytes(q[i]), _bytes(want_q), err_msg=f"seed {seed} {shape}")
            np.testing.assert_array_equal(np.asarray(s[i]), _bytes(want_s), err_msg=f"seed {seed} {shape}")
            np.testing.assert_array_equal(deq[i], quant_io.dequant_fp8_blocks(want_q, want_s, block))


def test_config():
    assert V4.fp8_block == 128 and V41.fp8_block == 32
    with pytest.raises(ValueError, match=r"dense_weights must be one of \('model', 'fp8'\), got 'fp4'"):
        V4.replace(dense_weights="fp4")
    # any width: the scale grid is ceil(out/B) x ceil(in/B) (tiny V4 is smaller than one block)
    model = abstract_model(V4.replace(dense_weights="fp8", hidden_size=72), "float32")
    assert model.layers[0].attn.wq_a.scale.shape == (1, 1)


@pytest.mark.parametrize("cfg", [V4, V41], ids=["v4", "v41"])
def test_same_logits_as_dense_model_with_dequantised_weights(cfg):
    """An FP8 model == the dense model whose weights are its dequantised values (float32: the same einsums on
    the same numbers); the FP8 tensors are exactly quant_io.release_fp8's; logical parameter counts agree."""
    fp8 = init_random(cfg.replace(dense_weights="fp8"), seed=3, dtype="float32")
    names = _fp8_names(fp8)
    assert names and all(quant_io.release_fp8(n) for n in names)
    dense_names = [".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(init_random(cfg, seed=3)))]
    assert sorted(names) == sorted(n for n in dense_names if quant_io.release_fp8(n))
    wq_b = fp8.layers[0].attn.wq_b
    b = cfg.fp8_block
    assert wq_b.scale[...].shape == tuple(-(-n // b) for n in wq_b.weight[...].shape)
    logical = quant_io.dequantize_official(official_tensors(fp8))
    dense = build_from_tensors(cfg, logical, dtype="float32")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    np.testing.assert_allclose(np.asarray(fp8(tokens)), np.asarray(dense(tokens)), rtol=1e-6, atol=1e-6)
    assert parameter_count(fp8) == parameter_count(dense)
    assert parameter_count(fp8, include_drafts=False) == parameter_count(dense, include_drafts=False)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    model = init_random(V41.replace(dense_weights="fp8"), seed=1, dtype="float32")
    return model, save_safetensors(model, tmp_path_factory.mktemp("fp8"))


def test_checkpoint_round_trip(fp8_checkpoint, tmp_path):
    """Saved in the official layout (E4M3 `.weight` + E8M0 `.scale`); loaded FP8 the bytes come back; loaded
    with the default the weights are the dequantised values; a dense checkpoint loaded FP8 is quantised on
    the way in; orbax keeps the bytes."""
    model, d = fp8_checkpoint
    stored = dict(quant_io.iter_checkpoint_tensors(d))
    assert stored["layers.0.attn.wq_b.weight"].dtype == quant_io.F8_E4M3
    assert stored["layers.0.attn.wq_b.scale"].dtype == quant_io.F8_E8M0
    assert stored["layers.1.engram.wkv.scale"].dtype == quant_io.F8_E8M0
    again = load_checkpoint(d, dtype="float32", dense_weights="fp8")
    want = nnx.to_flat_state(nnx.state(model))
    for (k, a), (_, b) in zip(nnx.to_flat_state(nnx.state(again)), want):
        np.testing.assert_array_equal(_bytes(a[...]), _bytes(b[...]), err_msg=".".join(map(str, k)))
    dense = load_checkpoint(d, dtype="float32")
    assert dense.layers[0].attn.wq_b.weight[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(dense.layers[0].attn.wq_b.weight[...]),
                                  np.asarray(model.layers[0].attn.wq_b.dense_weight()))
    requant = load_checkpoint(save_safetensors(dense, tmp_path / "dense"), dtype="float32", dense_weights="fp8")
    for name in ("wq_a", "wo_a", "wo_b"):  # exact: the values were FP8 on this grid before
        a, b = (getattr(m.layers[2].attn, name) for m in (requant, model))
        np.testing.assert_array_equal(_bytes(a.weight[...]), _bytes(b.weight[...]))
        np.testing.assert_array_equal(np.asarray(a.scale[...]), np.asarray(b.scale[...]))
    restored = restore_orbax(save_orbax(model, tmp_path / "orbax"), model.config, dtype="float32")
    np.testing.assert_array_equal(_bytes(restored.mtp[0].main_proj.weight[...]),
                                  _bytes(model.mtp[0].main_proj.weight[...]))
    np.testing.assert_array_equal(np.asarray(restored.mtp[0].main_proj.scale[...]),
                                  np.asarray(model.mtp[0].main_proj.scale[...]))


def test_bad_scale_shape_raises(fp8_checkpoint, tmp_path):
    _, d = fp8_checkpoint
    tensors = dict(quant_io.iter_checkpoint_tensors(d))
    tensors["layers.0.attn.wkv.scale"] = np.full((3, 5), 127, np.uint8).view(quant_io.F8_E8M0)
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    quant_io.write_safetensors(tmp_path / "model.safetensors", tensors)
    for fmt in ("fp8", "model"):
        with pytest.raises(ValueError, match=r"layers\.0\.attn\.wkv\.weight.*scale \(3, 5\)"):
            load_checkpoint(tmp_path, dtype="float32", dense_weights=fmt)


@pytest.mark.parametrize("name", ["v4", "v41"])
def test_official_checkpoint_kept_fp8(golden_dir, name):
    """The official reference checkpoints: every FP8 block-scaled tensor is one of quant_io.release_fp8 (and
    vice versa); loaded with dense_weights="fp8" (+ FP4 experts) their bytes are kept, the prefill logits still
    match the official implementation's, and saving writes the same bytes back."""
    from safetensors.numpy import load_file

    d = golden_dir / name
    stored = dict(quant_io.iter_checkpoint_tensors(d))
    block_fp8 = {n for n, a in stored.items() if a.dtype == quant_io.F8_E4M3
                 and stored[n[:-len(".weight")] + ".scale"].shape != a.shape[:-1] + (-(-a.shape[-1] // 32),)}
    assert block_fp8 == {n for n in stored if quant_io.release_fp8(n)}
    model = load_checkpoint(d, dtype="float32", dense_weights="fp8", expert_weights="fp4")
    prompts = np.asarray(json.loads((d / "inputs.json").read_text())["prompts"])
    want = load_file(d / "outputs.safetensors")["prefill_logits"]
    got = np.asarray(model(prompts))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4
    saved = official_tensors(model)
    for n in block_fp8:
        s = n[:-len(".weight")] + ".scale"
        assert saved[n].dtype == quant_io.F8_E4M3 and saved[s].dtype == quant_io.F8_E8M0, n
        np.testing.assert_array_equal(_bytes(saved[n]), _bytes(stored[n]), err_msg=n)
        np.testing.assert_array_equal(_bytes(saved[s]), _bytes(stored[s]), err_msg=s)


def test_memory_and_roofline_formats():
    """The full V4-Flash with FP8 dense + FP4 experts is the release's 159.6 GB, held in 168.5 GB (its FP4 scales
    as bf16 in the kernels' layout, fp4_kernel_scales); the roofline format bench uses for it has the release's
    bytes, and its floors charge the FP8 / FP4-held GEMMs at the FP8 peak (the fastest MMA the format allows)."""
    from experiments.bench_floor import weight_format
    from experiments.hardware import H200_MEASURED
    from experiments.roofline_formats import bytes_per_param, gemm_peak
    from model.sharded import memory_per_device

    cfg = ModelConfig.preset("v4-flash")
    one = memory_per_device(cfg.replace(dense_weights="fp8", expert_weights="fp4"), 1, 1, 1, 1, 4096)
    two = memory_per_device(cfg.replace(dense_weights="fp8", expert_weights="fp4"), 1, 2, 1, 1, 4096)
    assert one["params_fp4_experts"] == pytest.approx(159.6e9, rel=1e-3)
    assert one["params"] == pytest.approx(168.5e9, rel=1e-3)
    assert 84e9 < two["params_fp4_experts"] < 85e9 and 88e9 < two["params"] < 89e9
    assert {weight_format(cfg.replace(dense_weights=dw, expert_weights=ew))
            for dw in ("model", "fp8") for ew in ("dense", "fp4")} == {
        "bf16", "bf16-fp4-experts", "fp8-dense", "fp8-fp4-experts"}
    fmt = weight_format(cfg.replace(dense_weights="fp8"))
    assert bytes_per_param(cfg, "dense", fmt) == 1 + 1 / 128 ** 2 and bytes_per_param(cfg, "expert", fmt) == 2
    assert gemm_peak("dense", fmt, H200_MEASURED) == H200_MEASURED["fp8_flops"]
    assert gemm_peak("expert", fmt, H200_MEASURED) == H200_MEASURED["bf16_flops"]   # bf16-held experts
    for cls in ("dense", "expert"):
        assert bytes_per_param(cfg, cls, "fp8-fp4-experts") == bytes_per_param(cfg, cls, "fp4-experts")
        assert gemm_peak(cls, "fp8-fp4-experts", H200_MEASURED) == H200_MEASURED["fp8_flops"]
        assert gemm_peak(cls, "fp4-experts", H200_MEASURED) == H200_MEASURED["fp8_flops"]


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_quant_sim_rounds_the_official_fp8_gemm_inputs(preset):
    """quant_sim gives act_quant to the inputs of exactly the official FP8 GEMMs (the release's FP8 matrices but
    wo_a, which the official inference dequantises to bf16) and of the routed experts, with cfg.fp8_block. The
    numbers: tests/test_kernels_moe.py (MoE layer, Pallas and reference), tests/test_sharding.py (ep=4 against
    one device), tests/test_golden_v41.py (the whole model with every sim on)."""
    from model.layers import Linear
    from model.moe import MoE

    cfg = ModelConfig.preset(preset)
    plain = abstract_model(cfg, dtype="float32")
    sim = abstract_model(cfg.replace(quant_sim=True), dtype="float32")
    rounded = []
    for path, sub in nnx.iter_modules(sim):
        name = ".".join(map(str, path)) + ".weight"
        if isinstance(sub, Linear):
            assert sub.act_block == (cfg.fp8_block if quant_io.official_fp8_gemm(name) else 0), name
            rounded += [name] if sub.act_block else []
        if isinstance(sub, MoE):
            assert sub.act_block == cfg.fp8_block
    assert any("shared_experts" in n for n in rounded) and any("wq_a" in n for n in rounded)
    assert not any("wo_a" in n or "compressor" in n or n == "head.weight" for n in rounded)
    assert all(m.act_block == 0 for _, m in nnx.iter_modules(plain) if isinstance(m, (Linear, MoE)))


@pytest.mark.slow
def test_sharded_on_8_devices(tmp_path_factory):
    """init_random(mesh=) and load_checkpoint(mesh=) of FP8-dense, FP4-expert models on 8 simulated devices
    equal one device; scales are laid out like their weights (tiny-v41 wq_b split over tp=2), FP4 experts'
    held scales like their weights' transposes."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_sharding import _worker_results

    cases = _worker_results(tmp_path_factory, "fp8", timeout=600)
    assert len(cases) == 4
    for c in cases:
        # init_random(mesh) builds under jit: ulp-level differences from the eager build in the random
        # float32 weights (not the FP8 ones: bytes_equal), as for dense models
        assert c["logits_rel_err"] < (1e-4 if c["case"] == "init_random(mesh)" else 1e-5), c
        assert c["weight_dtype"] == "float8_e4m3fn" and c["bytes_equal"], c
        assert c["scale_spec"] == c["weight_spec"], c
        w1, s1, w2, s2 = c["expert_specs"]
        assert (w1, s1, w2, s2) == (("P('ep', 'tp')", "P('ep', None, 'tp')", "P('ep', None, 'tp')", "P('ep', 'tp')")
                                    if c["mesh"][2] > 1 else ("P('ep',)",) * 4), c
        # every weight, not only the logits: the piecewise born-sharded build (one program per distinct
        # layer, tiny-v41's reuse / reindex layers included) equals the one-device build
        assert c["params_max_rel_diff"] < 1e-6 and c["params_int_mismatch"] < 1e-3, c
    assert any(c["scale_spec"] == "P('tp',)" for c in cases)


@pytest.mark.slow
def test_bench_smoke_fp8(tmp_path):
    """experiments/bench.py --dense-weights fp8 on CPU: the record says so and is costed as "fp8-dense". On request
    (-m slow), as the other CLI smoke runs beside the default bench.py run (tests/test_bench.py); the "fp8-dense"
    costing is checked in the default run by test_memory_and_roofline_formats."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_bench import run_cli

    out = tmp_path / "results"
    run_cli(["experiments.bench", "--quick", "--preset", "tiny-v4", "--layers", "4", "--mode", "deepinfer",
             "--phase", "decode", "--dense-weights", "fp8", "--out", str(out), "--tag", "fp8"], 240)
    (f,) = out.glob("bench_*_fp8.json")
    (rec,) = json.loads(f.read_text())
    assert rec["status"] == "ok" and rec["finite_outputs"] is True, rec
    assert rec["dense_weights"] == "fp8" and rec["roofline"]["weight_format"] == "fp8-dense"
    assert "+ fp8 dense" in f.with_suffix(".md").read_text()
