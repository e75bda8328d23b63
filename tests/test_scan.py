"""Scanned layer groups (ModelConfig.scan_layers, model/groups.py, model/stack.py): the grouping, the stacked
model against the unrolled definition (logits through prefill and decode with caches), checkpoints in both
layouts (bitwise), the layer axis in the sharding tables, and the persistent compilation cache across
processes (experiments/compile_cache.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from model import ModelConfig, abstract_model, init_random
from model.cache import allocate, export_prefix, import_prefix
from model.checkpoint import load_checkpoint, official_tensors, restore_orbax, save_orbax, save_safetensors
from model.groups import LayerGroup, layer_groups, replay_cut, traced_layers
from model.sharded import param_logical_axes, param_specs

REPO = Path(__file__).resolve().parents[1]


def scanned(name: str, **changes) -> ModelConfig:
    return ModelConfig.preset(name).replace(scan_layers=True, **changes)


# ------------------------------------------------------------------------------------ grouping

def test_layer_groups_v4_flash():
    groups = layer_groups(scanned("v4-flash"))
    assert groups[:2] == (LayerGroup(0, 1, 2), LayerGroup(2, 1, 1))
    assert groups[2] == LayerGroup(3, 2, 20)  # (HCA, CSA) x 20
    assert traced_layers(groups) == 4
    assert [g.start for g in groups[1:]] == [g.stop for g in groups[:-1]] and groups[-1].stop == 43
    unrolled = layer_groups(ModelConfig.preset("v4-flash"))
    assert unrolled == tuple(LayerGroup(i) for i in range(43))


def test_layer_groups_v41_never_span_the_replay_cut():
    cfg = scanned("v41-flash")
    groups, cut = layer_groups(cfg), replay_cut(cfg)
    assert any(g.start == cut for g in groups)
    assert all(not g.start < cut < g.stop for g in groups)
    assert all(g.repeats == 1 for g in groups if any(cfg.layer_spec(i).engram for i in range(g.start, g.stop)))
    assert traced_layers(groups) < cfg.num_layers


def test_layer_axis_is_never_sharded():
    cfg = scanned("tiny-v4")
    model = abstract_model(cfg, "float32")
    axes = {name: a for name, a in param_logical_axes(model).items() if name.startswith("layers.{l}.")}
    assert axes and all(a[0] == "layers" for a in axes.values())
    specs = param_specs(model, AbstractMesh((1, 2, 2), ("dp", "ep", "tp")))["layers"]["2"]["period"]
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert all(len(spec) == 0 or spec[0] is None for spec in leaves)
    assert any(any(axis is not None for axis in spec) for spec in leaves)  # the per-layer axes still are


# ------------------------------------------------------------------------------------ numerics

@nnx.jit
def _step(model, tokens, cache, n_new):
    """One jitted chunk (every row's logits): a program per layout, where running the step op by op compiled each
    op of the unrolled stack separately (twice the time)."""
    return model.step(tokens, cache, n_new)[:2]


def _run(model, tokens: np.ndarray) -> list[np.ndarray]:
    """Forward logits, then prefill of the first 8 tokens and one 4-token chunk through a cache."""
    b = tokens.shape[0]
    cache = allocate(model.config, b, 64, jnp.float32)
    first, cache = _step(model, jnp.asarray(tokens[:, :8]), cache, jnp.full((b,), 8, jnp.int32))
    second, cache = _step(model, jnp.asarray(tokens[:, 8:12]), cache, jnp.full((b,), 4, jnp.int32))
    return [np.asarray(model(jnp.asarray(tokens))), np.asarray(first), np.asarray(second)]


@pytest.mark.parametrize("preset", ["tiny-v4", pytest.param("tiny-v41", marks=pytest.mark.slow)])
def test_scanned_equals_unrolled(preset):
    cfg = scanned(preset)
    assert traced_layers(layer_groups(cfg)) < cfg.num_layers
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    scanned_model = init_random(cfg, seed=5, dtype="float32")
    unrolled_model = init_random(cfg.replace(scan_layers=False), seed=5, dtype="float32")
    if jax.default_backend() == "cpu":   # one seed, the same weights bitwise in both layouts (built op by op)
        assert_same_tensors(official_tensors(scanned_model), official_tensors(unrolled_model))
    got, want = _run(scanned_model, tokens), _run(unrolled_model, tokens)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[2].argmax(-1), want[2].argmax(-1))


def test_stacking_frees_the_blocks_it_consumes():
    """LayerStack stacks each array and deletes its per-layer sources at once (the peak is one stacked array above
    the weights); an array that two blocks share is left alone, and the stacks hold the blocks' values."""
    from model.stack import _stacked
    from model.layers import Linear

    rngs = nnx.Rngs(0)
    blocks = [Linear(8, 4, rngs=rngs) for _ in range(3)]
    shared = blocks[0].weight[...]
    blocks[2].weight = nnx.Param(shared)          # one array in two blocks
    want = np.stack([np.asarray(b.weight[...]) for b in blocks])
    sources = [b.weight[...] for b in blocks]
    stacked = _stacked(blocks)
    np.testing.assert_array_equal(np.asarray(stacked.weight[...]), want)
    assert sources[1].is_deleted()
    assert not shared.is_deleted()


def test_random_scanned_model_is_written_into_its_stacks(monkeypatch):
    """On one device init_random writes each layer of a scanned group into the group's stacks as it is built
    (model.sharded), never stacking built blocks (which held a group twice and fragmented GPU memory): the model
    runs with the one-device runtime, every array on one device."""
    import model.stack
    from model.runtime import Runtime

    stack = model.stack._stacked

    def abstract_only(blocks):   # the abstract model (shapes only) still stacks its traced blocks
        assert not any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                       for x in jax.tree.leaves(nnx.state(blocks[0]))), "built blocks stacked"
        return stack(blocks)

    monkeypatch.setattr(model.stack, "_stacked", abstract_only)
    m = init_random(scanned("tiny-v4"), seed=0, dtype="float32")
    assert m.runtime == Runtime()
    assert all(len(x.devices()) == 1 for x in jax.tree.leaves(nnx.state(m)))


# ------------------------------------------------------------------------------------ checkpoints

def assert_same_tensors(got: dict, want: dict) -> None:
    """Two name -> array maps (`official_tensors`) hold the same names, dtypes and values, bitwise."""
    assert sorted(got) == sorted(want)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype, name
        np.testing.assert_array_equal(got[name], arr, err_msg=name)


@pytest.mark.parametrize("expert_weights", ["dense", pytest.param("fp4", marks=pytest.mark.slow)])
def test_checkpoints_round_trip_bitwise_in_both_layouts(expert_weights, tmp_path):
    cfg = scanned("tiny-v4", expert_weights=expert_weights)
    stacked = init_random(cfg, seed=2, dtype="float32")
    want = official_tensors(stacked)
    unrolled = official_tensors(init_random(cfg.replace(scan_layers=False), seed=2, dtype="float32"))

    # the same random weights by name in either layout: bitwise on the CPU, where both are built op by op; to
    # float32 rounding on an accelerator, where the scanned model is built by compiled pieces (model.sharded)
    if jax.default_backend() == "cpu":
        assert_same_tensors(unrolled, want)
    else:
        assert sorted(unrolled) == sorted(want)
        for name, arr in unrolled.items():
            np.testing.assert_allclose(want[name].astype(np.float32), arr.astype(np.float32), rtol=1e-6, atol=1e-7,
                                       err_msg=name)
    save_safetensors(stacked, tmp_path / "st")
    for scan in (True, False):
        loaded = load_checkpoint(tmp_path / "st", "float32", scan_layers=scan, expert_weights=expert_weights)
        assert loaded.config.scan_layers is scan
        assert_same_tensors(official_tensors(loaded), want)
    save_orbax(stacked, tmp_path / "orbax")
    assert_same_tensors(official_tensors(restore_orbax(tmp_path / "orbax", cfg, dtype="float32")), want)
    with pytest.raises(ValueError, match=r"saved with scan_layers=True, the config asks for scan_layers=False"):
        restore_orbax(tmp_path / "orbax", cfg.replace(scan_layers=False), dtype="float32")


@pytest.mark.parametrize("change, message", [
    (dict(batch_invariant=True), r"scan_layers=True with batch_invariant=True is not supported"),
    (dict(engram_placement="sharded"), r"scan_layers=True with engram_placement='sharded' is not supported"),
    (dict(engram_placement="host"), r"scan_layers=True with engram_placement='host' is not supported"),
])
def test_unsupported_combinations_raise(change, message):
    cfg = ModelConfig.preset("tiny-v41")
    cfg.replace(**change)   # each alone is fine
    with pytest.raises(ValueError, match=message):
        cfg.replace(scan_layers=True, **change)


def test_cache_groups_must_match_the_model():
    cfg = scanned("tiny-v4")
    graphdef, state = nnx.split(abstract_model(cfg, "float32"))
    cache = jax.eval_shape(lambda: allocate(cfg.replace(scan_layers=False), 1, 64, jnp.float32))

    def step(state, cache):
        return nnx.merge(graphdef, state).step(jnp.zeros((1, 4), jnp.int32), cache, jnp.full((1,), 4, jnp.int32))

    with pytest.raises(ValueError, match=r"allocate it with the model's config \(scan_layers\)"):
        jax.eval_shape(step, state, cache)


def _filled(cfg: ModelConfig, seed: int):
    """A 2-sequence cache of `cfg`'s layout with random contents (the same values per layer in either layout)."""
    cache = allocate(cfg.replace(scan_layers=False), 2, 64, jnp.float32)
    rng = np.random.default_rng(seed)
    cache = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape).astype(a.dtype)), cache)
    cache = cache.replace(lengths=jnp.asarray([40, 24], jnp.int32))
    if not cfg.scan_layers:
        return cache
    stacked = allocate(cfg, 2, 64, jnp.float32)
    layers = []
    for group, entry in zip(stacked.groups, stacked.layers):
        if not group.stacked:
            layers.append(cache.layers[group.start])
            continue
        layers.append(entry.replace(period=tuple(
            jax.tree.map(lambda *a: jnp.stack(a), *[cache.layers[i] for i in group.layer_ids(p)])
            for p in range(group.period))))
    return stacked.replace(lengths=cache.lengths, layers=tuple(layers))


def _same_prefix(got, want):
    """Prefix states (LayerPrefix / CompressorPrefix dataclasses of host arrays) equal field by field."""
    if dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            _same_prefix(getattr(got, f.name), getattr(want, f.name))
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same_prefix(g, w)
    else:
        np.testing.assert_array_equal(got, want)


def test_prefix_export_import_on_stacked_caches():
    cfg = scanned("tiny-v4")
    stacked, flat = _filled(cfg, 3), _filled(cfg.replace(scan_layers=False), 3)
    for i in range(cfg.num_layers):  # Cache.layer slices a stacked layer out
        jax.tree.map(np.testing.assert_array_equal, stacked.layer(i), flat.layer(i))
    state = export_prefix(stacked, cfg, 0, 40, include_window=True)
    want = export_prefix(flat, cfg.replace(scan_layers=False), 0, 40, include_window=True)
    _same_prefix(state.layers, want.layers)
    back = import_prefix(allocate(cfg, 2, 64, jnp.float32), cfg, 1, state)
    assert back.groups == stacked.groups and int(back.lengths[1]) == 40
    _same_prefix(export_prefix(back, cfg, 1, 40, include_window=True).layers, want.layers)


# ------------------------------------------------------------------------------------ compilation cache

@pytest.mark.slow
def test_second_process_hits_the_compilation_cache(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "experiments.compile_time", "--preset", "tiny-v4", "--layers", "3", "--steps",
           "verify", "--context", "40", "--decode-batch", "2", "--scan-layers",
           "--compile-cache", str(tmp_path / "xla")]
    status = []
    for run in ("cold", "warm"):
        subprocess.run(cmd + ["--out", str(tmp_path / run)], check=True, env=env, cwd=REPO, timeout=600,
                       capture_output=True)
        (rec,) = json.loads(next((tmp_path / run).glob("compile_time_*.json")).read_text())["records"]
        status.append(rec["compile_cache"])
    assert status == ["miss", "hit"]


SHARDED_CHECK = """
import numpy as np, jax.numpy as jnp
from model import ModelConfig, init_random
from model.sharded import shard_model
from sharding.mesh import ParallelConfig
cfg = ModelConfig.preset("tiny-v4").replace(scan_layers=True)
tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (8, 6)).astype(np.int32))
one = init_random(cfg, seed=4, dtype="float32")
want = np.asarray(one(tokens))
mesh = ParallelConfig(2, 4, 1).make_mesh()
for model in (shard_model(one, mesh), init_random(cfg, seed=4, dtype="float32", mesh=mesh)):
    np.testing.assert_allclose(np.asarray(model(tokens)), want, rtol=1e-5, atol=1e-5)
print("ok")
"""


@pytest.mark.slow
def test_sharded_stacked_model_equals_one_device():
    """dp=2 x ep=4 on 8 simulated devices: a sharded and a born-sharded stacked model give one device's logits."""
    from common import simulated_devices_env

    env = simulated_devices_env(8)
    out = subprocess.run([sys.executable, "-c", SHARDED_CHECK], env=env, cwd=REPO, timeout=1200, capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v4", "v41"])
def test_golden_checkpoints_scanned(golden_dir, name):
    """The official reference's outputs (../shared/golden, read in place) from the stacked layout: prefill
    logits as the parity tests bound them, greedy tokens identical."""
    from safetensors.numpy import load_file

    from sampling import generate

    d = golden_dir / name
    model = load_checkpoint(d, dtype="float32", scan_layers=True)
    assert traced_layers(layer_groups(model.config)) < model.config.num_layers
    prompts = np.asarray(json.loads((d / "inputs.json").read_text())["prompts"])
    out = load_file(d / "outputs.safetensors")
    got = np.asarray(model(prompts))
    assert np.linalg.norm(got - out["prefill_logits"]) / np.linalg.norm(out["prefill_logits"]) < 1e-4
    np.testing.assert_array_equal(generate(model, prompts, max_new_tokens=8).tokens, out["greedy_tokens"])
