"""Prefix reuse (docs/model.md §13.6): export/import of a sequence's resume state and the host
PrefixStore.

* V4 exact resume: a prefix exported at a length that ends inside both a r=4 and a r=16 block, imported
  into a fresh cache of other ring sizes / max_len / row, decodes exactly like the original.
* V4.1 (tiny-v41, Engram history) with the window exported resumes exactly too; lengths that cut a
  KV source's block are refused.
* PrefixStore: longest-prefix lookup, LRU eviction by bytes and by count, min_length, collision guard,
  stats.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, init_random
from model.cache import allocate, export_prefix, import_prefix
from model.transformer import decode, prefill
from sampling import replay
from sampling.replay import PrefixStore

PROMPT = 37  # not a multiple of 4 or 16: the partial blocks' projections must travel
DECODE = 6


def _decode_all(model, cache, tokens):
    out = []
    for t in tokens.T:
        logits, cache = decode(model, cache, jnp.asarray(t))
        out.append(np.asarray(logits))
    return np.stack(out, 1), cache


@pytest.mark.parametrize("preset,prompt_len", [("tiny-v4", PROMPT), ("tiny-v41", 36)])
def test_exact_resume(preset, prompt_len):
    cfg = ModelConfig.preset(preset)
    model = init_random(cfg, seed=0)
    rng = np.random.default_rng(1)
    prompt = rng.integers(2, cfg.vocab_size, (1, prompt_len))
    cont = rng.integers(2, cfg.vocab_size, (1, DECODE))

    cache = allocate(cfg, 1, 48, jnp.float32)
    _, cache = prefill(model, cache, prompt, np.array([prompt_len]))
    state = export_prefix(cache, cfg, 0, prompt_len, include_window=True)
    assert state.length == prompt_len and state.window and state.nbytes > 0
    assert all(isinstance(x, np.ndarray) for l in state.layers for x in (l.kv,) if x is not None)
    if cfg.generation == "v4":  # partial-block carries travel: r=4 overlap -> 4 + 1 rows, r=16 -> 5 rows
        assert state.layers[2].comp.proj_a.shape[0] == 5 and state.layers[3].comp.proj_a.shape[0] == 5
        assert state.layers[2].comp.entries.shape[0] == prompt_len // 4
    else:
        assert state.tokens is not None and list(state.tokens) == list(prompt[0, -3:])
        with pytest.raises(ValueError, match="multiple"):
            export_prefix(cache, cfg, 0, prompt_len - 1, include_window=True)

    # exact: a fresh cache of the same geometry decodes bit for bit like the original
    fresh = import_prefix(allocate(cfg, 1, 48, jnp.float32), cfg, 0, state)
    want, _ = _decode_all(model, cache, cont)
    got, _ = _decode_all(model, fresh, cont)
    np.testing.assert_array_equal(got, want)

    # another geometry (max_len, spec_room, batch) and row: slots are position mod ring size; only the
    # reduction shapes differ (ring / store widths, batch), hence float32 rounding
    other = import_prefix(allocate(cfg, 2, 64, jnp.float32, spec_room=3), cfg, 1, state)
    assert list(np.asarray(other.lengths)) == [0, prompt_len]
    got2, _ = _decode_all(model, other, np.concatenate([cont, cont], 0))
    np.testing.assert_allclose(got2[1], want[0], rtol=0, atol=1e-4)


def test_resume_behind_current_length_and_errors():
    """Export at 35 from a cache already at 37 (rows still in the rings) == the original rolled back to 35."""
    cfg = ModelConfig.preset("tiny-v4")
    model = init_random(cfg, seed=0)
    rng = np.random.default_rng(2)
    prompt = rng.integers(2, cfg.vocab_size, (1, PROMPT))
    cont = rng.integers(2, cfg.vocab_size, (1, DECODE))

    cache = allocate(cfg, 1, 48, jnp.float32)
    _, cache = prefill(model, cache, prompt, np.array([PROMPT]))
    state = export_prefix(cache, cfg, 0, 35, include_window=True)
    resumed = import_prefix(allocate(cfg, 1, 48, jnp.float32), cfg, 0, state)
    with pytest.raises(ValueError, match="holds"):
        export_prefix(cache, cfg, 0, PROMPT + 1, include_window=True)
    with pytest.raises(ValueError, match="no longer in its ring"):
        export_prefix(cache, cfg, 0, 20, include_window=True)  # window rows [12, 20) overwritten
    with pytest.raises(ValueError, match="max_len"):
        import_prefix(allocate(cfg, 1, 32, jnp.float32), cfg, 0, state)
    with pytest.raises(ValueError, match="bfloat16|float32"):
        import_prefix(allocate(cfg, 1, 48, jnp.bfloat16), cfg, 0, state)
    # without the window only the global stores travel
    slim = export_prefix(cache, cfg, 0, 32, include_window=False)
    assert all(l.kv is None for l in slim.layers) and slim.nbytes < state.nbytes

    got, _ = _decode_all(model, resumed, cont)
    want, _ = _decode_all(model, cache.rollback(jnp.array([35])), cont)  # donates `cache`: last
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- PrefixStore

def _state(length: int, nbytes: int = 100):
    return SimpleNamespace(length=length, nbytes=nbytes)


def _toks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n)


def test_longest_prefix_lookup():
    store = PrefixStore(page_size=4)
    t = _toks(20)
    for n in (4, 8, 16):
        store.insert(t, _state(n))
    assert store.lookup(t)[0] == 16
    assert store.lookup(t[:17])[0] == 16
    assert store.lookup(t[:16])[0] == 8  # one token must be left to prefill
    assert store.lookup(t[:15])[0] == 8
    assert store.lookup(t[:13])[0] == 8  # page 3 (12) not stored
    length, state = store.lookup(t[:5])
    assert length == 4 and state.length == 4
    other = t.copy()
    other[5] += 1  # diverges inside page 2
    assert store.lookup(other)[0] == 4
    assert store.lookup(_toks(20, seed=9)) == (0, None)
    assert store.lookup(t.astype(np.int64))[0] == store.lookup(t.astype(np.int16))[0] == 16
    assert t[:8] in store and t[:12] not in store
    with pytest.raises(ValueError, match="page size"):
        store.insert(t, _state(6))
    with pytest.raises(ValueError, match="only"):
        store.insert(t[:8], _state(12))


def test_eviction_by_count_lru():
    store = PrefixStore(page_size=2, max_entries=2)
    a, b, c = _toks(9, 1), _toks(9, 2), _toks(9, 3)
    store.insert(a, _state(8))
    store.insert(b, _state(8))
    assert store.lookup(a)[0] == 8  # a is now most recent
    store.insert(c, _state(8))  # evicts b
    assert store.lookup(b) == (0, None)
    assert store.lookup(a)[0] == 8 and store.lookup(c)[0] == 8
    assert store.stats["evictions"] == 1 and len(store) == 2


def test_eviction_by_bytes_lru():
    per = 100 + 8 * 4  # state bytes + the int32 tokens kept for the collision guard
    store = PrefixStore(page_size=4, max_bytes=3 * per)
    seqs = [_toks(9, s) for s in range(4)]
    for s in seqs[:3]:
        store.insert(s, _state(8))
    assert store.nbytes == 3 * per
    store.lookup(seqs[0])  # refresh 0: LRU order is now 1, 2, 0
    store.insert(seqs[3], _state(8))
    assert store.lookup(seqs[1]) == (0, None)
    assert all(store.lookup(s)[0] == 8 for s in (seqs[0], seqs[2], seqs[3]))
    store.insert(seqs[1], _state(8, nbytes=2 * per - 32))  # needs two slots: evicts 0 and 2 (least recent)
    assert [store.lookup(s)[0] for s in seqs] == [0, 8, 0, 8]
    assert store.nbytes <= 3 * per and store.stats["evictions"] == 3
    assert not store.insert(seqs[0], _state(8, nbytes=10 * per))  # too big on its own: not stored
    assert store.lookup(seqs[0]) == (0, None)
    # re-inserting the same prefix replaces it (bytes not double counted)
    store.insert(seqs[3], _state(8))
    assert len(store) == 2 and store.nbytes == 3 * per


def test_min_length():
    store = PrefixStore(page_size=4, min_length=8)
    t = _toks(20)
    store.insert(t, _state(4))
    assert store.lookup(t) == (0, None)  # a hit shorter than the window is not adopted
    assert store.stats["short"] == 1 and store.stats["misses"] == 1 and store.stats["hits"] == 0
    assert store.lookup(t, min_length=0)[0] == 4
    store.insert(t, _state(8))
    assert store.lookup(t)[0] == 8


def test_collision_guard(monkeypatch):
    monkeypatch.setattr(replay, "_page_hash", lambda prev, page: b"same")  # every prefix collides
    store = PrefixStore(page_size=4)
    a, b = _toks(9, 1), _toks(9, 2)
    store.insert(a, _state(8))
    assert store.lookup(b) == (0, None)
    assert store.stats["collisions"] >= 1
    assert store.lookup(a)[0] == 8
    # the store still holds one entry under the shared key; b replaces it
    store.insert(b, _state(8))
    assert store.lookup(a) == (0, None) and store.lookup(b)[0] == 8


def test_stats():
    store = PrefixStore(page_size=4, max_entries=1)
    t = _toks(13)
    store.insert(t, _state(8, nbytes=50))
    store.lookup(t)
    store.lookup(_toks(13, 5))
    store.insert(t, _state(12, nbytes=70))  # a second prefix of the same tokens: evicts the first
    store.lookup(t)
    s = store.stats
    assert s == {"hits": 2, "misses": 1, "hit_tokens": 8 + 12, "short": 0, "collisions": 0, "inserts": 2,
                 "evictions": 1, "bytes": 70 + 12 * 4, "entries": 1}


@pytest.mark.parametrize("mode", ["prefix", pytest.param("prefix-full", marks=pytest.mark.slow)])
def test_prefix_store_on_a_mesh_matches_one_device(tmp_path, mode):
    """On dp=2 x ep=4 (8 simulated devices, tests/sharding_worker.py): the same greedy tokens as one device with
    prefix reuse, every prompt hitting the second time; V4 plain (~70 s), and in the slow run also MTP speculative
    (V4) and V4.1's encoder-side replay (~4 min in all)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "prefix.json"
    worker = Path(__file__).with_name("sharding_worker.py")
    proc = subprocess.run([sys.executable, str(worker), mode, str(out)], capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case in json.loads(out.read_text()):
        assert case["tokens_equal"], case
        assert case["hits"] == case["hits_one_device"], case
        assert all(h > 0 for h in case["hits"][1]), case
