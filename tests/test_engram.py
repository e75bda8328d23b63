"""Tests for model/engram.py: prime tables, hash ids (golden V4.1 oracle), chunking, the gated module."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from model import quant_io as q  # noqa: E402
from model.engram import (DEAD, Engram, EngramHasher, engram_primes, hash_multipliers, is_prime,  # noqa: E402
                          next_prime)

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"  # <repo>/../shared/golden
V41 = GOLDEN / "v41"


def real_hasher() -> EngramHasher:
    # V4.1-Flash: layers [1, 14], max n-gram 4, 8 heads, primes from 16e6, pad 2, Vc 99092.
    # Identity token map of size Vc (only the map size enters the multipliers).
    return EngramHasher([1, 14], 4, 8, 16_000_000, 2, np.arange(99092), 99092)


def tiny_hasher(vocab=96) -> EngramHasher:
    return EngramHasher([1, 2], 4, 2, 50, 2, np.arange(vocab))


def naive_hash_ids(h: EngramHasher, seq: list[int], dead: set[int] = frozenset()) -> np.ndarray:
    """Per-position Python-int reimplementation straight from docs/model.md §10 (one sequence)."""
    out = np.zeros((len(seq), h.n_layers, h.n_columns), np.int64)
    for p in range(len(seq)):
        taus, blocked = [], False
        for s in range(h.max_ngram_size):
            j = p - s
            blocked = blocked or j < 0 or j in dead
            taus.append(h.pad_id if blocked else int(h.token_map[seq[j]]))
        for li in range(h.n_layers):
            mu = [int(m) for m in h.multipliers[li]]
            rho, col, off = taus[0] * mu[0], 0, 0
            for n in range(2, h.max_ngram_size + 1):
                rho ^= taus[n - 1] * mu[n - 1]
                for hd in range(h.n_heads):
                    pr = int(h.primes[li, n - 2, hd])
                    out[p, li, col] = rho % pr + off
                    off += pr
                    col += 1
    return out


# ----------------------------------------------------------------------------- primes / sizes

def test_is_prime_matches_sieve():
    n = 20000
    sieve = np.ones(n, bool)
    sieve[:2] = False
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = False
    assert [i for i in range(n) if is_prime(i)] == list(np.nonzero(sieve)[0])
    # strong pseudoprimes to several small bases and large known primes / composites
    assert not is_prime(3215031751) and not is_prime(3825123056546413051)
    assert is_prime(2 ** 61 - 1) and not is_prime((2 ** 61 - 1) * 3)
    assert next_prime(15_999_999) == 16_000_057 and next_prime(15_999_999, {16_000_057}) == 16_000_079


def test_real_config_table_sizes():
    h = real_hasher()
    assert h.num_embeddings == (384006168, 384016682)
    assert h.table_rows(1) == 384006168 and h.table_rows(14) == 384016682
    assert h.n_columns == 24 and h.offsets.shape == (2, 24)
    assert h.primes[0, 0].tolist() == [16000057, 16000079, 16000081, 16000097, 16000121, 16000129,
                                       16000133, 16000183]
    assert h.primes[0, -1, -1] == 16000463 and h.primes[1, 0, 0] == 16000477 and h.primes[1, -1, -1] == 16000889
    assert len(set(h.primes.ravel().tolist())) == 48
    assert np.all(h.offsets[:, 1:] == np.cumsum(h.moduli, axis=1)[:, :-1]) and np.all(h.offsets[:, 0] == 0)
    with pytest.raises(ValueError):
        h.table_rows(2)


def test_real_config_multipliers_and_vectors():
    """Multipliers and hash ids for compressed ids [5, 17, 99091, 0, 42] (docs/model.md §10 vectors)."""
    h = real_hasher()
    assert h.multipliers.tolist() == [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                                      [67716810739261, 51510806800915, 30921347202721, 82619226485591]]
    ids = h.hash_ids(np.array([[5, 17, 99091, 0, 42]]))
    assert ids.shape == (1, 5, 2, 24) and ids.dtype == np.int64
    assert ids[0, 3, 0, [0, 1, 2, 3, 8, 16, 23]].tolist() == [11738160, 23620665, 43700001, 60873512,
                                                             135599064, 263356187, 378717148]
    assert ids[0, 4, 0, [0, 1, 2, 3, 8, 16, 23]].tolist() == [7905795, 30439965, 44125553, 57613403,
                                                             128504499, 264580462, 374224477]
    assert ids[0, 3, 1, [0, 1, 2, 3, 8, 16, 23]].tolist() == [13474695, 28825723, 39710019, 55489684,
                                                             132806965, 262387460, 371800352]
    np.testing.assert_array_equal(ids[0], naive_hash_ids(h, [5, 17, 99091, 0, 42]))


def test_from_config_real_and_checks():
    cfg = {"text_config": {"vocab_size": 99092, "engram_layer_ids": [1, 14], "engram_max_ngram_size": 4,
                           "engram_n_heads": 8, "engram_vocab_size": 16000000, "engram_pad_token_id": 2,
                           "engram_compressed_vocab_size": 99092,
                           "engram_num_embeddings": [384006168, 384016682]}}
    assert EngramHasher.from_config(cfg).num_embeddings == (384006168, 384016682)
    bad = json.loads(json.dumps(cfg))
    bad["text_config"]["engram_num_embeddings"] = [1, 2]
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramHasher.from_config(bad)
    bad = json.loads(json.dumps(cfg))
    bad["text_config"]["vocab_size"] = 129280  # real model: needs the tokenizer map
    with pytest.raises(ValueError, match="token_map"):
        EngramHasher.from_config(bad)


# ----------------------------------------------------------------------------- golden oracle

@pytest.mark.skipif(not V41.is_dir(), reason="golden data not present")
def test_golden_prefill_hash_ids():
    cfg = json.loads((V41 / "config.json").read_text())
    prompts = np.array(json.loads((V41 / "inputs.json").read_text())["prompts"])
    want = q.read_safetensors(V41 / "outputs.safetensors", ["prefill_engram_hash_ids"])["prefill_engram_hash_ids"]
    h = EngramHasher.from_config(cfg)  # also checks engram_num_embeddings [384, 552]
    assert h.num_embeddings == (384, 552)
    got = h.hash_ids(prompts)
    assert got.shape == want.shape == (2, 41, 2, 6)
    np.testing.assert_array_equal(got, want.astype(np.int64))
    # same values from the naive per-position implementation and from the reference's own args
    np.testing.assert_array_equal(got[1], naive_hash_ids(h, prompts[1].tolist()))
    args = json.loads((V41 / "reference_model_args.json").read_text())
    np.testing.assert_array_equal(EngramHasher.from_config(args).hash_ids(prompts), got)
    # and chunked (prefill 17 + 1-token decodes) reproduces it too
    ids, hist = h.hash_chunk(prompts[:, :17])
    parts = [ids]
    for p in range(17, 41):
        ids, hist = h.hash_chunk(prompts[:, p:p + 1], hist)
        parts.append(ids)
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), want)


# ----------------------------------------------------------------------------- chunking

def test_prefill_decode_split_invariance():
    h = tiny_hasher()
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 96, (3, 37))
    toks[0, 5] = toks[1, 0] = toks[2, 1] = 2  # pad id as a real token
    full = h.hash_ids(toks)
    for cuts in ([1], [2], [3], [4], [20], [10, 11, 12, 30], list(range(1, 37))):
        bounds = [0, *cuts, 37]
        hist, parts = None, []
        for a, b in zip(bounds[:-1], bounds[1:]):
            ids, hist = h.hash_chunk(toks[:, a:b], hist)
            parts.append(ids)
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), full)
    # resume from a prefix (e.g. prefix-cache hit) and an empty chunk leaves history unchanged
    hist = h.history_from_prefix(toks[:, :25])
    np.testing.assert_array_equal(h.hash_ids(toks[:, 25:], hist), full[:, 25:])
    np.testing.assert_array_equal(h.next_history(toks[:, :0], hist), hist)
    assert h.hash_ids(toks[:, :0], hist).shape == (3, 0, 2, 6)
    # start of sequence == history of pad ids
    np.testing.assert_array_equal(h.initial_history(3), np.full((3, 3), 2))


def test_dead_positions_block_history():
    h = tiny_hasher()
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 96, (1, 20))
    mask = np.ones((1, 20), bool)
    mask[0, [6, 7, 13]] = False
    full = h.hash_ids(toks, token_mask=mask)
    np.testing.assert_array_equal(full[0], naive_hash_ids(h, toks[0].tolist(), dead={6, 7, 13}))
    # no dead positions: mask is a no-op; a dead position changes later n-grams
    np.testing.assert_array_equal(h.hash_ids(toks, token_mask=np.ones_like(mask)), h.hash_ids(toks))
    assert not np.array_equal(full[0, 8], h.hash_ids(toks)[0, 8])
    hist, parts = None, []
    for a, b in [(0, 7), (7, 8), (8, 14), (14, 20)]:
        ids, hist = h.hash_chunk(toks[:, a:b], hist, mask[:, a:b])
        parts.append(ids)
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), full)
    assert DEAD in h.history_from_prefix(toks[:, :8], mask[:, :8])


def test_non_identity_token_map_and_errors():
    tm = np.arange(40) // 2  # pairs of raw ids share a compressed id; Vc = 20
    h = EngramHasher([3], 3, 4, 30, 2, tm)
    assert h.compressed_vocab_size == 20 and h.pad_id == 1
    np.testing.assert_array_equal(h.multipliers, hash_multipliers([3], 3, 20))
    a = h.hash_ids(np.array([[4, 9, 10, 33]]))
    b = h.hash_ids(np.array([[5, 8, 11, 32]]))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[0], naive_hash_ids(h, [4, 9, 10, 33]))
    assert np.all(a >= 0) and np.all(a < h.table_rows(3))
    with pytest.raises(ValueError):
        h.hash_ids(np.array([[40]]))
    with pytest.raises(ValueError):
        h.hash_ids(np.array([[1, 2]]), history=np.zeros((1, 5), np.int64))
    with pytest.raises(ValueError):
        EngramHasher([1], 1, 2, 50, 2, np.arange(10))


def test_ids_in_column_ranges_and_speed():
    import time
    h = real_hasher()
    toks = np.random.default_rng(2).integers(0, 99092, (2, 50_000))
    t0 = time.perf_counter()
    ids = h.hash_ids(toks)
    assert time.perf_counter() - t0 < 5.0
    lo, hi = h.offsets, h.offsets + h.moduli
    assert np.all(ids >= lo) and np.all(ids < hi)
    assert engram_primes(2, 4, 8, 16_000_000).sum() == 384006168 + 384016682


# ----------------------------------------------------------------------------- module

_call = nnx.jit(lambda m, x, ids, mask=None: m(x, ids, mask))
_kv = nnx.jit(lambda m, ids: m.key_value(ids))


def _tiny_module(dim=32, n=4, cols=6, hd=16, rows=100, seed=0, eps=1e-20):
    return Engram(dim, n, cols, hd, rows, eps, rngs=nnx.Rngs(seed))


def test_parameter_names_match_checkpoint():
    h = tiny_hasher()
    eng = Engram.from_hasher(h, 1, 128, 4, 64, 1e-20, rngs=nnx.Rngs(0))
    names = {".".join(str(p) for p in path): tuple(v.shape)
             for path, v in nnx.to_flat_state(nnx.state(eng, nnx.Param))}
    assert names == {"embed.weight": (384, 64), "wkv.weight": (640, 384),
                     "q_weight": (4, 128), "k_weight": (4, 128)}
    if (V41 / "tensor_index.json").is_file():
        index = json.loads((V41 / "tensor_index.json").read_text())
        for k, shape in names.items():
            assert tuple(index[f"layers.1.engram.{k}"]["shape"]) == shape


def test_module_matches_numpy_formula():
    dim, n, cols, hd, rows = 32, 4, 6, 16, 100
    eng = _tiny_module(dim, n, cols, hd, rows)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 5, n, dim)).astype(np.float32)
    ids = rng.integers(0, rows, (2, 5, cols))
    y = np.asarray(_call(eng, jnp.asarray(x), jnp.asarray(ids)))

    table = np.asarray(eng.embed.weight[...], np.float64)
    w = np.asarray(eng.wkv.weight[...], np.float64)
    qk = np.asarray(eng.q_weight[...], np.float64) * np.asarray(eng.k_weight[...], np.float64)
    for b, t in [(0, 0), (1, 4), (0, 3)]:  # hand computation for single tokens
        v = np.concatenate([table[i] for i in ids[b, t]])
        kv = w @ v
        K, val = kv[: n * dim].reshape(n, dim), kv[n * dim:]
        X = x[b, t].astype(np.float64)
        want = np.empty_like(X)
        for i in range(n):
            rx = math.sqrt(np.mean(X[i] ** 2) + 1e-20)
            rk = math.sqrt(np.mean(K[i] ** 2) + 1e-20)
            delta = float(np.sum(X[i] * qk[i] * K[i])) / (rx * rk * math.sqrt(dim))
            g = 1.0 / (1.0 + math.exp(-math.copysign(math.sqrt(max(abs(delta), 1e-6)), delta)))
            want[i] = X[i] + g * val
        np.testing.assert_allclose(y[b, t], want, rtol=1e-4, atol=1e-4)


def test_gate_edge_cases_and_mask():
    dim, n = 8, 2
    eng = Engram(dim, n, 1, 4, 3, 1e-6, rngs=nnx.Rngs(1))
    # zero residual: delta = 0 -> copysign(sqrt(1e-6), +0) -> gamma = sigmoid(1e-3)
    x = jnp.zeros((1, 1, n, dim), jnp.float32)
    ids = jnp.zeros((1, 1, 1), jnp.int32)
    _, val = _kv(eng, ids)
    y = _call(eng, x, ids)
    np.testing.assert_allclose(np.asarray(y[0, 0]), np.broadcast_to(
        1.0 / (1.0 + np.exp(-1e-3)) * np.asarray(val[0, 0]), (n, dim)), rtol=1e-5, atol=1e-6)
    # mask False -> pass-through
    x = jnp.asarray(np.random.default_rng(5).normal(size=(1, 2, n, dim)), jnp.float32)
    ids2 = jnp.array([[[1], [2]]])
    y = _call(eng, x, ids2, jnp.array([[False, True]]))
    np.testing.assert_array_equal(np.asarray(y[0, 0]), np.asarray(x[0, 0]))
    assert not np.allclose(np.asarray(y[0, 1]), np.asarray(x[0, 1]))
    with pytest.raises(ValueError):
        eng(x, jnp.zeros((1, 2, 3), jnp.int32))


def test_module_random_inputs_jit_bf16_and_hasher_ids():
    h = tiny_hasher()
    toks = np.random.default_rng(4).integers(0, 96, (2, 12))
    ids = h.hash_ids(toks)[:, :, h.layer_index(2)]  # this layer's slice [B, T, C]
    eng = Engram.from_hasher(h, 2, 64, 4, 32, 1e-20, rngs=nnx.Rngs(2), dtype=jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(6).normal(size=(2, 12, 4, 64)), jnp.bfloat16)
    y = _call(eng, x, jnp.asarray(ids, jnp.int32))
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
    # the update is gamma * val with gamma in (0, 1), identical for the n streams' value direction
    _, val = _kv(eng, jnp.asarray(ids))
    diff = np.asarray(y, np.float32) - np.asarray(x, np.float32)
    val = np.asarray(val)
    gam = np.sum(diff * val[..., None, :], -1) / np.sum(val * val, -1)[..., None]  # least squares
    assert np.all((gam > 0) & (gam < 1))


# ----------------------------------------------------------------------------- hashing on the device

def _device_ids(h: EngramHasher, tokens, history=None, token_mask=None) -> np.ndarray:
    import jax

    hist = h.initial_history(np.shape(tokens)[0]) if history is None else history
    mask = None if token_mask is None else jnp.asarray(token_mask)
    return np.asarray(jax.jit(h.hash_ids_device)(jnp.asarray(tokens, jnp.int32), jnp.asarray(hist, jnp.int32), mask))


def test_device_hash_matches_numpy_on_the_spec_vectors():
    h = real_hasher()
    tokens = np.array([[5, 17, 99091, 0, 42]])
    np.testing.assert_array_equal(_device_ids(h, tokens), h.hash_ids(tokens))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_hash_matches_numpy_on_random_streams(seed):
    """Random raw tokens through a random many-to-one token map, random histories with dead entries, random
    dead positions: the jnp hasher gives the numpy hasher's ids bit for bit."""
    rng = np.random.default_rng(seed)
    vocab, vc = 5000, 3001
    h = EngramHasher([1, 14], 4, 8, 16_000_000, 2, rng.integers(0, vc, vocab), vc)
    tokens = rng.integers(0, vocab, (4, 37))
    history = rng.integers(0, vc, (4, h.history_len))
    history[rng.random(history.shape) < 0.2] = DEAD
    mask = rng.random(tokens.shape) > 0.15
    np.testing.assert_array_equal(_device_ids(h, tokens, history, mask), h.hash_ids(tokens, history, mask))
    np.testing.assert_array_equal(_device_ids(h, tokens, history), h.hash_ids(tokens, history))


@pytest.mark.parametrize("placement", ["device", "sharded", "host"])
def test_decode_step_has_no_host_callback(placement):
    """A V4.1 decode step is one device program: no callback in its jaxpr, whichever the tables' placement (host
    tables are gathered by a host computation inside the program; on a mesh: tests/test_engram_sharded.py)."""
    import jax

    from model import ModelConfig, init_random
    from model.cache import allocate

    model = init_random(ModelConfig.preset("tiny-v41").replace(engram_placement=placement), seed=0, dtype="float32")
    graphdef, state = nnx.split(model)
    cache = allocate(model.config, 2, 32)

    def step(state, cache, tokens):
        return nnx.merge(graphdef, state).step(tokens, cache, jnp.ones((2,), jnp.int32))[:2]

    text = str(jax.make_jaxpr(step)(state, cache, jnp.zeros((2, 1), jnp.int32)))
    assert model.hasher is not None and "callback" not in text
    assert ("compute_on" in text) == (placement == "host")


# ----------------------------------------------------------------------------- table formats and placements

def _engram_model(**changes):
    from model import init_random
    from sharding_worker import engram_config  # two Engram layers, FP8 tables (tables of 358 and 522 rows)

    return init_random(engram_config().replace(**changes), seed=0, dtype="float32")


def test_fp8_rows_quantiser_matches_quant_io():
    """The traceable FP8-row quantiser (random FP8 tables) and its dequantiser give quant_io's bytes and values."""
    from model.engram import dequant_fp8_rows, quantize_fp8_rows

    rng = np.random.default_rng(8)
    w = (rng.normal(size=(37, 64)) * 10.0 ** rng.uniform(-4, 4, (37, 1))).astype(np.float32)
    w[3] = 0.0
    q_jnp, s_jnp = quantize_fp8_rows(jnp.asarray(w))
    q_np, s_np = q.quantize_fp8_rows(w)
    np.testing.assert_array_equal(np.asarray(q_jnp).view(np.uint8), q_np.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s_jnp), s_np.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(dequant_fp8_rows(q_jnp, s_jnp)), q.dequant_fp8_rows(q_np, s_np))


@pytest.mark.slow
@pytest.mark.parametrize("tables", ["fp8", "model"])
def test_placements_equal_on_one_device(tables):
    """On one device every placement gathers the same rows: prefill and decode logits equal bitwise; host tables
    live in host memory (pinned_host), gathered there inside the step. On request (-m slow): the default run has
    host tables equal to device ones on one device (the golden checkpoint, FP8 and dequantised tables) and split
    and host tables equal to replicated ones on 8 devices in prefill, decode and speculative decoding
    (tests/test_engram_sharded.py)."""
    from common import teacher_forced_decode

    rng = np.random.default_rng(9)
    prompts, cont = rng.integers(3, 94, (2, 9)), rng.integers(3, 94, (2, 2))
    want = None
    for placement in ("device", "sharded", "host"):
        model = _engram_model(engram_tables=tables, engram_placement=placement)
        held = model.layers[1].engram.embed.stored()
        assert [a.dtype for a in held] == ([jnp.float32] if tables == "model" else [jnp.float8_e4m3fn, jnp.uint8])
        assert {a.sharding.memory_kind for a in held} == {"pinned_host" if placement == "host" else "device"}
        got = np.asarray(model(prompts)), teacher_forced_decode(model, prompts, cont, steps=2)
        if want is None:
            want = got
        np.testing.assert_array_equal(got[0], want[0], err_msg=placement)
        np.testing.assert_array_equal(got[1], want[1], err_msg=placement)


def test_fp8_tables_saved_as_shipped_and_loaded_back(tmp_path):
    """FP8 tables save as the release's tensors (E4M3 rows + UE8M0 per 32); loaded dequantised ("model") onto the
    device or as FP8 rows into host memory, the logits are the FP8 model's bitwise."""
    from model.checkpoint import load_checkpoint, official_tensors, save_safetensors

    fp8 = _engram_model()
    tensors = official_tensors(fp8)
    assert tensors["layers.0.engram.embed.weight"].dtype == q.F8_E4M3
    assert tensors["layers.0.engram.embed.weight"].shape == (358, 64)
    assert tensors["layers.0.engram.embed.scale"].dtype == q.F8_E8M0
    assert tensors["layers.0.engram.embed.scale"].shape == (358, 2)
    save_safetensors(fp8, tmp_path)
    prompts = np.random.default_rng(10).integers(3, 94, (2, 7))
    want = np.asarray(fp8(prompts))
    for tables, placement in (("model", "device"), ("fp8", "host")):
        model = load_checkpoint(tmp_path, dtype="float32", engram_tables=tables, engram_placement=placement)
        np.testing.assert_array_equal(np.asarray(model(prompts)), want, err_msg=f"{tables} {placement}")
        if tables == "fp8":  # kept as shipped, and saved back the same
            again = official_tensors(model)
            for name in ("layers.1.engram.embed.weight", "layers.1.engram.embed.scale"):
                np.testing.assert_array_equal(again[name].view(np.uint8), tensors[name].view(np.uint8))


def test_memory_per_device_by_placement():
    """Engram tables per device: a whole copy replicated, a 1/8 share (rows padded to 8) split or in host memory."""
    from model.sharded import describe_memory_per_device, memory_per_device
    from sharding_worker import engram_config

    cfg = engram_config()
    row = 64 + 2  # FP8 row + one UE8M0 byte per 32 values
    mem = {p: memory_per_device(cfg.replace(engram_placement=p), 2, 4, 1, 1, 64) for p in ("device", "sharded", "host")}
    assert mem["device"]["engram"] == (358 + 522) * row and mem["device"]["engram_host"] == 0
    assert mem["sharded"]["engram"] == (45 + 66) * row and mem["sharded"]["engram_host"] == 0
    assert mem["host"]["engram"] == 0 and mem["host"]["engram_host"] == (45 + 66) * row
    assert mem["device"]["params"] - mem["sharded"]["params"] == (358 + 522 - 45 - 66) * row
    assert mem["sharded"]["params"] - mem["host"]["params"] == (45 + 66) * row
    line = describe_memory_per_device(cfg.replace(engram_placement="host"), 2, 4, 1, 1, 64)
    assert "Engram host (fp8)" in line and "host memory" in line


def test_engram_switch_errors():
    from model import ModelConfig
    from model.runtime import Runtime, make_runtime
    from sharding import ParallelConfig
    from sharding.row_lookup import RowLookup

    cfg = ModelConfig.preset("tiny-v41")
    for field, value in (("engram_placement", "hbm"), ("engram_tables", "fp4"), ("engram_exchange", "ragged")):
        with pytest.raises(ValueError, match=f"{field} must be one of .* got '{value}'"):
            cfg.replace(**{field: value})
    with pytest.raises(ValueError, match="engram_tables='fp8' needs engram_head_dim \\(48\\) to be a multiple of 32"):
        cfg.replace(engram_tables="fp8", engram_head_dim=48)
    mesh = ParallelConfig().make_mesh()
    split = cfg.replace(engram_placement="sharded")
    assert make_runtime(split, mesh).engram == RowLookup(mesh, "all_to_all")
    with pytest.raises(ValueError, match="splits the Engram tables over the mesh: the runtime needs their lookup"):
        Runtime(mesh=mesh).check(split)
    with pytest.raises(ValueError, match="looks up split Engram tables, but engram_placement='device'"):
        Runtime(mesh=mesh, engram=RowLookup(mesh)).check(cfg)
    with pytest.raises(ValueError, match="RowLookup.exchange must be one of"):
        RowLookup(mesh, "ragged")


def test_golden_fp8_host_tables_equal_device(golden_dir):
    """The golden V4.1 checkpoint with its FP8 tables kept as shipped in host memory: the logits of the default
    (dequantised, device) load, bitwise."""
    from model.checkpoint import load_checkpoint

    prompts = np.array(json.loads((golden_dir / "v41" / "inputs.json").read_text())["prompts"])
    want = np.asarray(load_checkpoint(golden_dir / "v41", dtype="float32")(prompts))
    host = load_checkpoint(golden_dir / "v41", dtype="float32", engram_tables="fp8", engram_placement="host")
    assert host.layers[1].engram.embed.host.weight[...].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(host(prompts)), want)
