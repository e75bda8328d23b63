"""Prefix reuse and bounded replay (docs/model.md §13.6, §15, §15.1, §15.2).

`PrefixStore` is a host-resident, size-limited, LRU store of `model.cache.PrefixState`s keyed by token
prefixes at page granularity: the key of a prefix of k pages is a hash chain
key_k = H(key_{k-1} || bytes of page k). A lookup walks the chain of the query's full pages and returns
the longest stored prefix that leaves at least one token to prefill. Each entry keeps its tokens, so a
hash collision is caught by comparing them (never a silent wrong resume).

The store itself is pure Python + numpy: it only reads `state.length` and `state.nbytes`. What a
state holds is `model.cache.export_prefix`'s business ([V4] global KV + compressor carries + SWA rows:
exact resume; [V4.1] global KV + index keys of the sources: the window is rebuilt by encoder replay).
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sharding.apply import shard_batch

if TYPE_CHECKING:  # the store itself never touches jax
    from model.cache import PrefixState

_ROOT = b"jaxinfer-prefix-v1"


def _page_hash(prev: bytes, page: bytes) -> bytes:
    """Key of a prefix = H(key of the prefix one page shorter || this page's int32 token bytes).
    Module-level so that tests can replace it (e.g. to force collisions)."""
    return hashlib.blake2b(prev + page, digest_size=16).digest()


def _as_tokens(tokens) -> np.ndarray:
    t = np.asarray(tokens)
    if t.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of ids, got shape {t.shape}")
    if t.size and not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got {t.dtype}")
    return t.astype("<i4")  # one byte layout whatever the caller's integer type


@dataclass
class _Entry:
    tokens: np.ndarray  # [length] int32: the prefix itself (collision guard)
    state: "PrefixState"
    nbytes: int


class PrefixStore:
    """LRU store of prefix states keyed by page-aligned token prefixes.

    page_size: tokens per page; only prefixes of whole pages are stored and looked up.
    max_bytes / max_entries: capacity (None = unbounded); inserting past it evicts least recently
      used entries (a lookup hit or a re-insert refreshes an entry). An entry larger than max_bytes
      on its own is not stored.
    min_length: hits shorter than this many tokens are not adopted (reported as misses); a hit of exactly
      min_length is adopted. V4.1 encoder replay asks for the sliding window W: it replays the W tokens
      before the hit, and a hit of exactly W replays from position 0, which rebuilds the window exactly (the
      engines described in docs/model.md §15.2 treat hits <= W as misses; adopting H = W costs nothing). Per-lookup
      override with `lookup(tokens, min_length=...)`.

    stats (dict): hits, misses, hit_tokens (sum of adopted hit lengths), short (hits rejected for
    min_length, also counted as misses), collisions (hash matched, tokens did not), inserts,
    evictions, bytes, entries.
    """

    def __init__(self, page_size: int = 16, max_bytes: int | None = None, max_entries: int | None = None,
                 min_length: int = 0):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        for name, v in (("max_bytes", max_bytes), ("max_entries", max_entries)):
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive or None, got {v}")
        self.page_size = page_size
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.min_length = min_length
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # oldest first
        self._bytes = 0
        self._counts = dict(hits=0, misses=0, hit_tokens=0, short=0, collisions=0, inserts=0, evictions=0)

    # ------------------------------------------------------------------ keys
    def page_keys(self, tokens) -> list[bytes]:
        """Keys of the prefixes of 1, 2, ... full pages of `tokens` (partial last page ignored)."""
        t = _as_tokens(tokens)
        keys, key = [], _ROOT
        for k in range(len(t) // self.page_size):
            key = _page_hash(key, t[k * self.page_size:(k + 1) * self.page_size].tobytes())
            keys.append(key)
        return keys

    # ------------------------------------------------------------------ insert / lookup
    def insert(self, tokens, state: "PrefixState") -> bool:
        """Store `state` for the prefix tokens[:state.length] (state.length a positive multiple of
        page_size, <= len(tokens)). Replaces an entry of the same prefix. Returns whether it was stored
        (False only when the entry alone exceeds max_bytes)."""
        t = _as_tokens(tokens)
        length = int(state.length)
        if length <= 0 or length % self.page_size:
            raise ValueError(f"prefix length {length} is not a positive multiple of the page size {self.page_size}")
        if length > len(t):
            raise ValueError(f"state covers {length} tokens but only {len(t)} were given")
        prefix = t[:length].copy()
        nbytes = int(state.nbytes) + prefix.nbytes
        key = self.page_keys(prefix)[-1]
        self._drop(key)
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return False
        self._entries[key] = _Entry(prefix, state, nbytes)
        self._bytes += nbytes
        self._counts["inserts"] += 1
        self._evict()
        return True

    def lookup(self, tokens, min_length: int | None = None) -> tuple[int, "PrefixState | None"]:
        """Longest stored prefix of `tokens` that is shorter than len(tokens) (so at least one token is
        left to prefill) -> (hit length, state), or (0, None) on a miss or a hit shorter than
        `min_length` (default: the store's)."""
        t = _as_tokens(tokens)
        min_length = self.min_length if min_length is None else min_length
        keys = self.page_keys(t)
        for k in range(min(len(keys), (len(t) - 1) // self.page_size), 0, -1):
            entry = self._entries.get(keys[k - 1])
            if entry is None:
                continue
            length = k * self.page_size
            if not np.array_equal(entry.tokens, t[:length]):
                self._counts["collisions"] += 1
                continue  # shorter prefixes have their own keys
            if length < min_length:
                self._counts["short"] += 1
                break
            self._entries.move_to_end(keys[k - 1])
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += length
            return length, entry.state
        self._counts["misses"] += 1
        return 0, None

    # ------------------------------------------------------------------ housekeeping
    def _drop(self, key: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes

    def _evict(self) -> None:
        while self._entries and ((self.max_bytes is not None and self._bytes > self.max_bytes)
                                 or (self.max_entries is not None and len(self._entries) > self.max_entries)):
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self._counts["evictions"] += 1

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens) -> bool:
        """Whether exactly this page-aligned prefix is stored (no LRU refresh, no stats)."""
        t = _as_tokens(tokens)
        if not len(t) or len(t) % self.page_size:
            return False
        entry = self._entries.get(self.page_keys(t)[-1])
        return entry is not None and np.array_equal(entry.tokens, t)

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def stats(self) -> dict:
        return {**self._counts, "bytes": self._bytes, "entries": len(self._entries)}


# ============================================================================ bounded replay
# Decoder-side and encoder-side SWA bounded replay (docs/model.md §15, §15.1, §15.2).


_DRAFTER_EXTRAS = ("residual", "main_hidden", "row_start", "rows")  # what a drafter commit reads of a chunk


@functools.partial(nnx.jit, static_argnames=("last_only", "replay_tail", "write_global", "with_extras"),
                   donate_argnames="cache")
def _chunk(model, tokens, cache, n_new, floor, last_only, replay_tail, write_global, with_extras=False):
    logits, cache, extras = model.step(tokens, cache, n_new, last_only, replay_tail, floor, write_global)
    if with_extras:
        return logits, cache, {k: extras[k] for k in _DRAFTER_EXTRAS if k in extras}
    return logits, cache


def _rows(tokens: np.ndarray, start: np.ndarray, count: np.ndarray, bucket: int = 16) -> np.ndarray:
    """Per-row token slices [start, start+count), padded to a bucketed width (fewer compilations)."""
    width = max(-(-int(count.max()) // bucket) * bucket, bucket)
    out = np.zeros((len(start), width), np.int32)
    for b in range(len(start)):
        out[b, :count[b]] = tokens[b, start[b]:start[b] + count[b]]
    return out


def _batch_input(cache):
    """Host [B, ...] -> a step's input: as it is, or on a mesh spanning processes split over the cache's batch shards
    (the same host arrays on every process)."""
    if cache.lengths.is_fully_addressable:
        return jnp.asarray
    return functools.partial(shard_batch, mesh=cache.lengths.sharding.mesh)


def prefill_with_store(model, cache, tokens: np.ndarray, lengths: np.ndarray, store: PrefixStore,
                       replay_tail: int | None = None, commit=None):
    """Prefill prompts reusing the longest cached prefix of each (docs/model.md §13.6).

    [V4] a hit restores global KV, compressor carries and SWA rows: the resume is exact.
    [V4.1] a hit restores global KV and index keys; encoder-side replay then rebuilds the window state by
    running [H - W, H) with the compressors off (cached global KV read, never rewritten) and the window
    floored at H - W. Hits shorter than the window are not adopted. Each prompt's prefix at its last page
    boundary is stored for later requests. -> (logits of each prompt's last token [B, V], cache, hits [B]).

    commit (speculative decoding, the drafter follows the target): `commit(extras, rows, start, after)` after
    every chunk, with the chunk's drafter extras (`_DRAFTER_EXTRAS`), its tokens `rows` [B, S] (row i at
    position start[b] + i) and `after` [B], the token after each sequence's rows (None for the last chunk:
    the token after the prompt is not drawn yet).
    """
    from model.cache import export_prefix, host_lengths, import_prefix, set_lengths, set_token_history

    cfg = model.config
    v41 = cfg.generation == "v41"
    window = cfg.sliding_window
    put = _batch_input(cache)
    bsz = len(lengths)
    hits = np.zeros(bsz, np.int32)
    for b in range(bsz):
        hit, state = store.lookup(tokens[b, :lengths[b]], min_length=window if v41 else None)
        if state is not None:
            cache = import_prefix(cache, cfg, b, state)
            hits[b] = hit

    def run(start, count, floor, last_only, tail, write_global, last=False):
        rows = _rows(tokens, start, count)
        out = _chunk(model, put(rows), cache, put(count), put(floor), last_only, tail, write_global,
                     commit is not None)
        if commit is not None:
            after = None if last else tokens[np.arange(bsz), np.minimum(start + count, tokens.shape[1] - 1)]
            commit(out[2], rows, start, after)
        return out[0], out[1]

    if v41 and hits.any():  # encoder-side replay of the last window before each hit
        start = np.where(hits > 0, hits - window, 0).astype(np.int32)
        count = np.where(hits > 0, window, 0).astype(np.int32)
        cache = set_lengths(cache, np.where(hits > 0, start, host_lengths(cache)))
        cache = set_token_history(cache, tokens, start)
        _, cache = run(start, count, start, False, None, False)
    # up to the last page boundary before the prompt's end (stored), then the rest
    boundary = np.maximum((lengths - 1) // store.page_size * store.page_size, hits).astype(np.int32)
    first = (boundary - hits).astype(np.int32)
    zeros = np.zeros(bsz, np.int32)
    if first.any():
        _, cache = run(hits, first, zeros, False, replay_tail, True)
        for b in np.nonzero(first)[0]:
            store.insert(tokens[b, :boundary[b]], export_prefix(cache, cfg, int(b), int(boundary[b]),
                                                                include_window=not v41))
    logits, cache = run(boundary, (lengths - boundary).astype(np.int32), zeros, True, replay_tail, True, last=True)
    return logits[:, 0], cache, hits
