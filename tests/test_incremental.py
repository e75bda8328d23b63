"""Incremental inference is exact: prefill + decodes, chunked prefill in any (ragged) split and
multi-token decode with rollback all equal the full forward (float32, random weights), for V4
(tiny-v4: CSA r=4, HCA r=16) and V4.1 (tiny-v41: Full/Reuse/Reindex at r=2 and r=1, candidate pool,
Engram history). The prefill lengths straddle the block boundaries. All chunks share one padded
width, so each jitted shape compiles once per preset.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, init_random
from model.cache import allocate, memory_estimate
from model.transformer import decode, prefill

from common import rel_err

WIDTH = 40  # padded chunk width shared by every prefill call below
TOTAL = 48



@pytest.fixture(scope="module", params=["tiny-v4", "tiny-v41"])
def setup(request):
    cfg = ModelConfig.preset(request.param)
    model = init_random(cfg, seed=3)
    tokens = np.random.default_rng(7).integers(2, cfg.vocab_size, (4, TOTAL))
    full = np.asarray(model(tokens))  # [4, 48, V]: causal, so position p depends on tokens <= p only
    return model, tokens, full


def padded(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros((len(rows), WIDTH), np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out, np.array([len(r) for r in rows])


def test_prefill_then_single_token_decodes(setup):
    model, tokens, full = setup
    starts = np.array([15, 16, 17, 32])  # both sides of the r=4 and r=16 boundaries
    cache = allocate(model.config, 4, 64, jnp.float32)
    chunk, lens = padded([tokens[b, :s] for b, s in enumerate(starts)])
    last, cache = prefill(model, cache, chunk, lens)
    assert rel_err(last, full[np.arange(4), starts - 1]) < 1e-5
    for i in range(TOTAL - 32):
        logits, cache = decode(model, cache, tokens[np.arange(4), starts + i])
        assert rel_err(logits, full[np.arange(4), starts + i]) < 1e-5, f"decode step {i}"
    np.testing.assert_array_equal(np.asarray(cache.lengths), starts + TOTAL - 32)


def test_chunked_prefill_any_split_equals_one_shot(setup):
    model, tokens, full = setup
    splits = [[5, 11, 17, 15], [16, 16, 16], [1, 30, 1, 16], [39, 9]]  # per sequence, summing to 48
    cache = allocate(model.config, 4, 64, jnp.float32)
    done = np.zeros(4, int)
    lasts = {}
    for k in range(max(map(len, splits))):
        sizes = np.array([s[k] if k < len(s) else 0 for s in splits])
        chunk, _ = padded([tokens[b, done[b]:done[b] + sizes[b]] for b in range(4)])
        last, cache = prefill(model, cache, chunk, sizes)
        for b in range(4):
            if sizes[b]:
                lasts[b] = np.asarray(last[b])
        done += sizes
    for b in range(4):
        assert rel_err(lasts[b], full[b, TOTAL - 1]) < 1e-5


def test_multi_token_decode_and_rollback(setup):
    """Verify-shaped steps: 3 tokens at once, keep only some (rollback by length), continue."""
    model, tokens, full = setup
    cache = allocate(model.config, 4, 64, jnp.float32)
    chunk, lens = padded([tokens[b, :30] for b in range(4)])
    _, cache = prefill(model, cache, chunk, lens)
    pos = np.full(4, 30)
    keep = np.array([0, 1, 2, 3])
    for _ in range(4):
        draft = np.stack([tokens[b, pos[b]:pos[b] + 3] if pos[b] + 3 <= TOTAL else
                          np.resize(tokens[b, pos[b]:], 3) for b in range(4)])
        logits, cache = decode(model, cache, draft)
        for b in range(4):
            n = min(3, TOTAL - pos[b])
            assert rel_err(logits[b, :n], full[b, pos[b]:pos[b] + n]) < 1e-5
        # accept a different number of rows per sequence, roll the rest back
        accepted = np.minimum(1 + keep % 3, TOTAL - pos)
        pos = pos + accepted
        cache = cache.rollback(pos)
        keep = keep + 1
        if (pos >= TOTAL - 3).any():
            break


def test_memory_estimate_real_configs():
    cfg = ModelConfig.preset("v4-flash")
    m = memory_estimate(cfg, 1 << 16, jnp.bfloat16)
    # bf16 entries: 21 CSA layers x (512 + 128) x 2 B / 4 tokens + 20 HCA x 512 x 2 B / 128 tokens
    assert m["bytes_per_token"] == pytest.approx(21 * 640 * 2 / 4 + 20 * 1024 / 128)
    assert m["fixed_bytes_per_sequence"] > 0
    # trained storage formats (docs/model.md §13.7): V4 3514 B/token, V4.1 890 B/token (global KV only in
    # the four KV sources: 3 x (288 + 68) / 2 + (288 + 68))
    assert memory_estimate(cfg, 1 << 16, packed=True)["bytes_per_token"] == pytest.approx(3514.25)
    v41 = ModelConfig.preset("v41-flash")
    assert memory_estimate(v41, 1 << 16, packed=True)["bytes_per_token"] == pytest.approx(890)
    assert memory_estimate(v41, 1 << 16, jnp.bfloat16)["bytes_per_token"] == pytest.approx(3200)
