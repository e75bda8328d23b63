"""V4.1 Engram: n-gram hashing (numpy reference; the same in jnp on 32-bit lanes inside the step) and the gated
memory module (docs/model.md §10).

Hashing (pure function of token ids; int64 in numpy, (hi, lo) uint32 pairs on the device):
  * raw id -> compressed id through a tokenizer-derived map (identity for random models);
  * for position p and look-back s = 0..N-1: tau_s = compressed id at p-s, replaced by the
    compressed pad id once p-s is before the sequence start or a dead (image) position has been
    met at any s' <= s (blocking is sticky);
  * per Engram layer l: mu_{l,s} = 2u+1, u = numpy default_rng(10007*l).integers(0,
    max(1, ((2^63-1) // Vc) // 2), size=N, dtype=int64), Vc = compressed vocab size;
  * rolling hash rho = tau_0 mu_0, then for order n = 2..N: rho ^= tau_{n-1} mu_{n-1};
  * column c = (n-2)*H + h has a prime modulus P_c and row id (rho_n mod P_c) + offset_c,
    offset = exclusive cumsum of P over the layer's columns. Primes: per layer in order, per
    order, starting above engram_vocab_size-1, the next H primes not used before (global set).

Module (per token, streams X [n, D]): v = concat of the C table rows, [K | val] = wkv v with K the
first n*D outputs (one key per stream) and val the last D; per stream i (fp32)
  delta_i = sum_d X_id (q_w*k_w)_id K_id * rsqrt(mean X_i^2 + eps) * rsqrt(mean K_i^2 + eps) / sqrt(D),
  gamma_i = sigmoid(copysign(sqrt(max(|delta_i|, 1e-6)), delta_i)),   X_i <- X_i + gamma_i val.
Parameter names mirror the official checkpoint: `engram.embed.weight` (stored dequantised),
`engram.wkv.weight`, `engram.q_weight`, `engram.k_weight`.
"""

from __future__ import annotations

import functools
import unicodedata
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import reference as ref
from pallas_kernels.invariant import row_blocks
from sharding.row_lookup import RowLookup, take_table

from .config import ENGRAM_PLACEMENTS, ENGRAM_TABLES
from .layers import Linear, normal_init

__all__ = [
    "DEAD",
    "is_prime",
    "next_prime",
    "engram_primes",
    "hash_multipliers",
    "EngramHasher",
    "EngramEmbedding",
    "HostTable",
    "engram_rows",
    "quantize_fp8_rows",
    "dequant_fp8_rows",
    "Engram",
    "engram_gate",
]

FP8_ROW_BLOCK = 32  # values per UE8M0 scale in an FP8 table row (MODEL_SPEC 3.7)
DEAD = -1  # compressed-id marker for a position that takes no part in any n-gram (image token)

# ----------------------------------------------------------------------------- primes

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for n < 3.3e24
_SMALL_PRIMES = _MR_BASES + (41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (fixed bases 2..37: exact for every n < 3.3e24, so all of int64)."""
    n = int(n)
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(start: int, used: set[int] | frozenset[int] = frozenset()) -> int:
    """The smallest prime strictly above `start` that is not in `used`."""
    c = int(start) + 1
    while c in used or not is_prime(c):
        c += 1
    return c


@functools.lru_cache(maxsize=32)
def _primes_cached(n_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> tuple:
    used: set[int] = set()
    out = []
    for _ in range(n_layers):
        per_order = []
        for _ in range(max_ngram_size - 1):
            cur, heads = vocab_size - 1, []
            for _ in range(n_heads):
                cur = next_prime(cur, used)
                used.add(cur)
                heads.append(cur)
            per_order.append(tuple(heads))
        out.append(tuple(per_order))
    return tuple(out)


def engram_primes(n_layers: int, max_ngram_size: int, n_heads: int, engram_vocab_size: int) -> np.ndarray:
    """Bucket moduli [n_layers, max_ngram_size-1, n_heads] (int64), drawn as the reference does:
    per layer (in order), per order, restart above engram_vocab_size-1 and take the next n_heads
    primes not handed out before (one global set across layers and orders)."""
    return np.array(_primes_cached(int(n_layers), int(max_ngram_size), int(n_heads), int(engram_vocab_size)),
                    dtype=np.int64).reshape(n_layers, max_ngram_size - 1, n_heads)


def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd multipliers [n_layers, max_ngram_size] (int64), seeded by the *layer id*; bounded so that
    (compressed id) * multiplier cannot overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // int(compressed_vocab_size)) // 2)
    rows = []
    for layer in layer_ids:
        rng = np.random.default_rng(10007 * int(layer))
        u = rng.integers(low=0, high=bound, size=(int(max_ngram_size),), dtype=np.int64)
        rows.append(u * 2 + 1)
    return np.stack(rows).astype(np.int64)


# ----------------------------------------------------------------------------- hashing


def normalize_token_text(text: str) -> str:
    """The compressed-vocabulary key of a decoded token: NFKC -> NFD -> strip accents -> lowercase ->
    collapse whitespace -> strip (docs/model.md §10)."""
    t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    t = "".join(c for c in t if unicodedata.category(c) != "Mn").lower()
    return " ".join(t.split())


def token_map_from_texts(texts: Sequence[str | bytes]) -> np.ndarray:
    """Raw id -> compressed id from each token's decoded text (ids in order of first appearance).

    Equal normalised strings share an id; a token whose bytes are not valid UTF-8 (pass `bytes`)
    keeps its raw form as its own key. For a tokenizer: `[tok.decode([i]) for i in range(vocab)]`.
    """
    keys: dict[Any, int] = {}
    out = np.empty(len(texts), np.int64)
    for i, t in enumerate(texts):
        if isinstance(t, bytes):
            try:
                t = t.decode("utf-8")
            except UnicodeDecodeError:
                key = ("raw", t)
            else:
                key = normalize_token_text(t)
        else:
            key = normalize_token_text(t)
        out[i] = keys.setdefault(key, len(keys))
    return out


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        if isinstance(cfg, Mapping):
            if n in cfg:
                return cfg[n]
        elif hasattr(cfg, n):
            return getattr(cfg, n)
    return default


class EngramHasher:
    """Host-side n-gram hash ids for all Engram layers of a model (numpy only, vectorised).

    tokens [B, T] raw ids -> ids [B, T, n_layers, n_columns] int64 row indices into each layer's
    own table (column offsets already added). Continuing a sequence needs the last
    `max_ngram_size - 1` compressed ids before the chunk (`history` [B, N-1], oldest first,
    `DEAD` = -1 for a dead position); `history=None` means the chunk starts the sequence.
    """

    def __init__(self, layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, engram_vocab_size: int,
                 pad_token_id: int, token_map: np.ndarray, compressed_vocab_size: int | None = None):
        self.layer_ids = tuple(int(l) for l in layer_ids)
        if not self.layer_ids:
            raise ValueError("EngramHasher: engram layer_ids is empty")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"EngramHasher: duplicate engram layer ids {self.layer_ids}")
        if int(max_ngram_size) < 2:
            raise ValueError(f"EngramHasher: max_ngram_size must be >= 2, got {max_ngram_size}")
        if int(n_heads) < 1 or int(engram_vocab_size) < 2:
            raise ValueError(f"EngramHasher: need n_heads >= 1 and engram_vocab_size >= 2, "
                             f"got {n_heads}, {engram_vocab_size}")
        tm = np.asarray(token_map)
        if tm.ndim != 1 or tm.size == 0 or tm.dtype.kind not in "iu":
            raise ValueError(f"EngramHasher: token_map must be a non-empty 1-D integer array, "
                             f"got shape {tm.shape} dtype {tm.dtype}")
        self.token_map = tm.astype(np.int64)
        if self.token_map.min() < 0:
            raise ValueError("EngramHasher: token_map has negative compressed ids")
        vc = int(self.token_map.max()) + 1 if compressed_vocab_size is None else int(compressed_vocab_size)
        if int(self.token_map.max()) >= vc:
            raise ValueError(f"EngramHasher: token_map max {int(self.token_map.max())} >= compressed vocab "
                             f"size {vc}")
        if not 0 <= int(pad_token_id) < self.token_map.size:
            raise ValueError(f"EngramHasher: pad_token_id {pad_token_id} outside token_map of size "
                             f"{self.token_map.size}")
        self.max_ngram_size = int(max_ngram_size)
        self.n_heads = int(n_heads)
        self.engram_vocab_size = int(engram_vocab_size)
        self.compressed_vocab_size = vc
        self.pad_token_id = int(pad_token_id)
        self.pad_id = int(self.token_map[self.pad_token_id])  # compressed pad id
        self.vocab_size = int(self.token_map.size)
        self.n_layers = len(self.layer_ids)
        self.n_columns = (self.max_ngram_size - 1) * self.n_heads
        self.multipliers = hash_multipliers(self.layer_ids, self.max_ngram_size, vc)  # [L, N]
        self.primes = engram_primes(self.n_layers, self.max_ngram_size, self.n_heads,
                                    self.engram_vocab_size)  # [L, N-1, H]
        self.moduli = self.primes.reshape(self.n_layers, self.n_columns)  # [L, C], c = (n-2)*H + h
        self.offsets = np.concatenate([np.zeros((self.n_layers, 1), np.int64),
                                       np.cumsum(self.moduli, axis=1)[:, :-1]], axis=1)  # [L, C]
        self.num_embeddings = tuple(int(s) for s in self.moduli.sum(axis=1))

    # ---------------------------------------------------------------- construction helpers

    @classmethod
    def from_config(cls, config: Any, token_map: np.ndarray | None = None) -> "EngramHasher":
        """From an HF config.json dict (text fields at top level or under `text_config`), the
        reference ModelArgs dict, or any object with those attributes. Without `token_map` the
        identity map of size vocab_size is used, which requires compressed vocab == vocab (random
        models). Checks `engram_num_embeddings` when present."""
        if isinstance(config, Mapping) and isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
        layer_ids = _get(config, "engram_layer_ids")
        if not layer_ids:
            raise ValueError("config has no engram_layer_ids")
        vocab = _get(config, "vocab_size")
        vc = _get(config, "engram_compressed_vocab_size")
        if token_map is None:
            if vocab is None or (vc is not None and int(vc) != int(vocab)):
                raise ValueError(f"config: engram_compressed_vocab_size {vc} != vocab_size {vocab}; the "
                                 "real model needs the tokenizer-derived token_map (docs/model.md §10)")
            token_map = np.arange(int(vocab), dtype=np.int64)
        h = cls(layer_ids=layer_ids,
                max_ngram_size=_get(config, "engram_max_ngram_size"),
                n_heads=_get(config, "engram_n_heads"),
                engram_vocab_size=_get(config, "engram_vocab_size"),
                pad_token_id=_get(config, "engram_pad_token_id", "engram_pad_id", default=2),
                token_map=token_map,
                compressed_vocab_size=vc)
        expected = _get(config, "engram_num_embeddings")
        if expected is not None and tuple(int(x) for x in expected) != h.num_embeddings:
            raise ValueError(f"config engram_num_embeddings {tuple(expected)} != rows derived from the "
                             f"primes {h.num_embeddings}")
        return h

    def table_rows(self, layer_id: int) -> int:
        """Rows of the table of Engram layer `layer_id` (a model layer id, e.g. 1 or 14)."""
        return self.num_embeddings[self._index(layer_id)]

    def layer_index(self, layer_id: int) -> int:
        """Position of model layer `layer_id` on axis 2 of `hash_ids`' output."""
        return self._index(layer_id)

    def _index(self, layer_id: int) -> int:
        try:
            return self.layer_ids.index(int(layer_id))
        except ValueError:
            raise ValueError(f"layer {layer_id} is not an Engram layer (engram layers {self.layer_ids})") from None

    # ---------------------------------------------------------------- hashing

    @property
    def history_len(self) -> int:
        return self.max_ngram_size - 1

    def initial_history(self, batch: int) -> np.ndarray:
        """History for a chunk that starts the sequence: the compressed pad id, [B, N-1]."""
        return np.full((int(batch), self.history_len), self.pad_id, dtype=np.int64)

    def compress(self, tokens, token_mask=None) -> np.ndarray:
        """Raw ids [B, T] -> compressed ids [B, T] int64 (DEAD where token_mask is False)."""
        t = np.asarray(tokens)
        if t.ndim != 2 or t.dtype.kind not in "iu":
            raise ValueError(f"tokens must be an integer array [B, T], got shape {t.shape} dtype {t.dtype}")
        if t.size and (t.min() < 0 or t.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got range "
                             f"[{t.min()}, {t.max()}]")
        c = self.token_map[t.astype(np.int64)]
        if token_mask is not None:
            m = np.asarray(token_mask, dtype=bool)
            if m.shape != t.shape:
                raise ValueError(f"token_mask shape {m.shape} != tokens shape {t.shape}")
            c = np.where(m, c, DEAD)
        return c

    def _check_history(self, history, batch: int) -> np.ndarray:
        if history is None:
            return self.initial_history(batch)
        h = np.asarray(history)
        if h.shape != (batch, self.history_len) or h.dtype.kind not in "iu":
            raise ValueError(f"history must be an integer array [{batch}, {self.history_len}], got "
                             f"shape {h.shape} dtype {h.dtype}")
        h = h.astype(np.int64)
        if h.size and (h.min() < DEAD or h.max() >= self.compressed_vocab_size):
            raise ValueError(f"history entries must be compressed ids in [0, {self.compressed_vocab_size}) "
                             f"or DEAD ({DEAD})")
        return h

    def hash_ids(self, tokens, history=None, token_mask=None) -> np.ndarray:
        """tokens [B, T] raw ids, history [B, N-1] compressed ids preceding position 0 (None = start
        of sequence), token_mask [B, T] bool (False = dead/image position) ->
        ids [B, T, n_layers, n_columns] int64 (row ids into each layer's table)."""
        comp = self.compress(tokens, token_mask)
        bsz, seqlen = comp.shape
        hist = self._check_history(history, bsz)
        n = self.max_ngram_size
        ext = np.concatenate([hist, comp], axis=1)  # [B, N-1+T]; position p sits at column p+N-1
        blocked = np.zeros((bsz, seqlen), dtype=bool)
        rolling = None
        out = np.empty((bsz, seqlen, self.n_layers, n - 1, self.n_heads), dtype=np.int64)
        for s in range(n):
            src = ext[:, n - 1 - s: n - 1 - s + seqlen]  # compressed id at p - s
            blocked |= src == DEAD
            tau = np.where(blocked, self.pad_id, src)  # [B, T]
            prod = tau[:, :, None] * self.multipliers[None, None, :, s]  # [B, T, L]
            if rolling is None:
                rolling = prod
                continue
            rolling = rolling ^ prod
            out[:, :, :, s - 1, :] = rolling[..., None] % self.primes[None, None, :, s - 1, :]
        out = out.reshape(bsz, seqlen, self.n_layers, self.n_columns)
        out += self.offsets[None, None]
        return out

    def next_history(self, tokens, history=None, token_mask=None) -> np.ndarray:
        """History to pass with the chunk that follows `tokens` (the last N-1 compressed ids of
        history ++ compress(tokens), DEAD kept), [B, N-1] int64."""
        comp = self.compress(tokens, token_mask)
        hist = self._check_history(history, comp.shape[0])
        return np.concatenate([hist, comp], axis=1)[:, comp.shape[1]:].copy()

    def hash_chunk(self, tokens, history=None, token_mask=None) -> tuple[np.ndarray, np.ndarray]:
        """(hash_ids(...), next_history(...)) in one call."""
        return (self.hash_ids(tokens, history, token_mask),
                self.next_history(tokens, history, token_mask))

    def history_from_prefix(self, prefix_tokens, token_mask=None) -> np.ndarray:
        """History for resuming after `prefix_tokens` [B, P] (e.g. a prefix-cache hit at P)."""
        return self.next_history(prefix_tokens, None, token_mask)


    def hash_ids_device(self, tokens: jax.Array, history: jax.Array, token_mask: jax.Array | None = None
                        ) -> jax.Array:
        """`hash_ids` inside a jitted step, in jnp integer arithmetic on 32-bit lanes (no x64, no host
        round trip), bit-identical to the numpy hasher.

        tokens [B, T] int raw ids (clipped into the vocab: padding rows may hold anything), history
        [B, N-1] int32 compressed ids before the chunk (DEAD = -1), token_mask [B, T] bool or None
        -> ids [B, T, n_layers, n_columns] int32.

        Each 64-bit product tau * mu (< 2^63 by the multipliers' bound) is held as (hi, lo) uint32 halves;
        the rolling XOR works on the halves; `mod P` runs Horner's rule over s-bit chunks of the 64 bits
        with s = 32 - bits(max P), so every partial value fits 32 bits."""
        if int(self.offsets[:, -1].max() + self.moduli[:, -1].max()) >= 2 ** 31:
            raise ValueError("Engram: table rows exceed int32 ids")
        bits = int(self.moduli.max()).bit_length()
        if bits > 30:
            raise ValueError(f"Engram: bucket moduli of {bits} bits leave no room for 32-bit modular arithmetic")
        tmap = jnp.asarray(self.token_map, jnp.int32)
        comp = jnp.take(tmap, jnp.clip(tokens.astype(jnp.int32), 0, self.vocab_size - 1), axis=0)
        if token_mask is not None:
            comp = jnp.where(token_mask, comp, DEAD)
        n, seqlen = self.max_ngram_size, tokens.shape[1]
        ext = jnp.concatenate([history.astype(jnp.int32), comp], axis=1)  # position p at column p + N - 1
        mu = self.multipliers.astype(np.uint64)                            # [L, N]
        mu_hi, mu_lo = (jnp.asarray((mu >> np.uint64(32)).astype(np.uint32)),
                        jnp.asarray((mu & np.uint64(0xFFFFFFFF)).astype(np.uint32)))
        primes = jnp.asarray(self.primes.astype(np.uint32))               # [L, N-1, H]
        blocked = jnp.zeros(comp.shape, bool)
        rolling, cols = None, []
        for s in range(n):
            src = ext[:, n - 1 - s: n - 1 - s + seqlen]
            blocked = blocked | (src == DEAD)
            tau = jnp.where(blocked, self.pad_id, src).astype(jnp.uint32)[..., None]  # [B, T, 1]
            hi, lo = _mul_wide(tau, mu_lo[None, None, :, s])
            prod = (hi + tau * mu_hi[None, None, :, s], lo)                           # [B, T, L] each
            rolling = prod if rolling is None else (rolling[0] ^ prod[0], rolling[1] ^ prod[1])
            if s:
                cols.append(_mod64(rolling[0][..., None], rolling[1][..., None], primes[None, None, :, s - 1], bits))
        ids = jnp.stack(cols, axis=3).reshape(*comp.shape, self.n_layers, self.n_columns)  # c = (n-2) * H + h
        return ids.astype(jnp.int32) + jnp.asarray(self.offsets.astype(np.int32))


def _mul_wide(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 64-bit product of uint32 arrays as (hi, lo) uint32 halves (16-bit limbs: every partial fits)."""
    a0, a1, b0, b1 = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
    p01, p10 = a0 * b1, a1 * b0
    mid = ((a0 * b0) >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
    return a1 * b1 + (p01 >> 16) + (p10 >> 16) + (mid >> 16), a * b


def _mod64(hi: jax.Array, lo: jax.Array, p: jax.Array, bits: int) -> jax.Array:
    """(hi * 2^32 + lo) mod p for uint32 halves and moduli p < 2^bits: Horner's rule over chunks of
    32 - bits bits, highest first (r < p, so r * 2^width + chunk < 2^32)."""
    width = 32 - bits
    r = jnp.zeros(jnp.broadcast_shapes(hi.shape, p.shape), jnp.uint32)
    top = 64
    while top > 0:
        w = min(width, top)
        pos = top - w
        if pos >= 32:
            chunk = hi >> (pos - 32)
        elif pos + w <= 32:
            chunk = lo >> pos
        else:
            chunk = (lo >> pos) | (hi << (32 - pos))
        r = ((r << w) | (chunk & ((1 << w) - 1))) % p
        top = pos
    return r


# ----------------------------------------------------------------------------- module


def quantize_fp8_rows(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float [..., d] -> (float8_e4m3fn [..., d], UE8M0 exponent bytes uint8 [..., d/32]), traceable: one power-of-two
    scale 2^ceil(log2(amax / 448)) per 32 values of a row (the rule of quant_io.quantize_fp8_rows)."""
    b = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // FP8_ROW_BLOCK, FP8_ROW_BLOCK)
    exp = ref.ue8m0_exponent(jnp.max(jnp.abs(b), axis=-1), ref.FP8_E4M3_MAX)
    q = jnp.clip(jnp.ldexp(b, -exp[..., None]), -ref.FP8_E4M3_MAX, ref.FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(w.shape), (exp + 127).astype(jnp.uint8)


def dequant_fp8_rows(q: jax.Array, scale: jax.Array) -> jax.Array:
    """FP8 rows q [..., d] with UE8M0 bytes scale [..., d/32] -> float32 [..., d] (exact: E4M3 times a power of two)."""
    v = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, FP8_ROW_BLOCK) * ref.e8m0_to_f32(scale)[..., None]
    return v.reshape(q.shape)


def _to_host(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Host)


class HostTable(nnx.Module):
    """A table held in host memory (memory kind pinned_host; on a mesh its rows split over the devices' host
    memory): `weight` [rows, head_dim] as held, and `scale` [rows, head_dim/32] for FP8 rows. Never copied to a
    device whole: lookups gather its rows on the host (sharding.row_lookup.take_rows)."""

    def __init__(self, weight: jax.Array, scale: jax.Array | None = None):
        self.weight = nnx.Param(_to_host(weight))
        self.scale: nnx.Param | None = nnx.data(None) if scale is None else nnx.Param(_to_host(scale))

    @property
    def array(self) -> jax.Array:
        """The held table [rows, head_dim]."""
        return self.weight[...]


class EngramEmbedding(nnx.Module):
    """The n-gram table `embed.weight` [rows, head_dim], looked up by the hasher's ids.

    tables (cfg.engram_tables): "model" holds it dequantised in `dtype` (FP8 x UE8M0 rows are exact in bf16);
    "fp8" as the release ships it, `weight` float8_e4m3fn [rows, head_dim] with `scale` UE8M0 bytes
    [rows, head_dim/32], each gathered row dequantised (`values`). placement (cfg.engram_placement): "device" and
    "sharded" hold nnx.Params `weight` (+ `scale`), replicated or split by rows over a mesh (model/sharded.py pads
    the rows to a multiple of its devices); "host" holds them in `host` (a HostTable; `weight` is None).
    `columns`: per hash column of this layer the id range [lo, hi) it draws from (split-table exchanges size their
    messages by it)."""

    def __init__(self, rows: int, head_dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32, placement: str = "device",
                 tables: str = "model", columns: Sequence[tuple[int, int]] = ()):
        if placement not in ENGRAM_PLACEMENTS:
            raise ValueError(f"Engram table placement must be one of {ENGRAM_PLACEMENTS}, got {placement!r}")
        if tables not in ENGRAM_TABLES:
            raise ValueError(f"Engram tables must be one of {ENGRAM_TABLES}, got {tables!r}")
        self.rows, self.head_dim, self.dtype = int(rows), int(head_dim), dtype
        self.placement, self.tables = placement, tables
        self.columns = tuple((int(lo), int(hi)) for lo, hi in columns)
        held = (normal_init(rngs, (rows, head_dim), 1.0, dtype=dtype),)
        if tables == "fp8":
            held = quantize_fp8_rows(held[0])
        if placement == "host":
            self.weight = nnx.data(None)
            self.scale = nnx.data(None)
            self.host = HostTable(*held)
        else:
            self.weight = nnx.Param(held[0])
            self.scale = nnx.Param(held[1]) if tables == "fp8" else nnx.data(None)
            self.host = nnx.data(None)

    def stored(self) -> tuple[jax.Array, ...]:
        """The arrays as held: (weight,) or (weight, scale), on the device or in host memory."""
        owner = self if self.host is None else self.host
        return tuple(p[...] for p in (owner.weight, owner.scale) if p is not None)

    def values(self, rows: tuple[jax.Array, ...]) -> jax.Array:
        """Gathered rows as held ((weight rows [..., head_dim],) or with their scales) -> [..., head_dim] in dtype."""
        if self.tables == "model":
            return rows[0]
        return dequant_fp8_rows(*rows).astype(self.dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids [...] -> rows [..., head_dim], gathered where the table lives (no mesh exchange: see `engram_rows`)."""
        return self.values(take_table(self.stored(), ids))


def engram_rows(embeds: Sequence[EngramEmbedding], ids: jax.Array, lookup: RowLookup | None
                ) -> list[tuple[jax.Array, ...]]:
    """Every Engram layer's rows as held for ids [B, S, L, C] (layer j's table `embeds[j]`), fetched together at
    the start of a step: through `lookup` (tables split over a mesh, one exchange for all layers), else gathered
    where each table lives -> per layer a tuple of [B, S, C, ...] (its `stored()` arrays' rows)."""
    per_layer = [ids[:, :, j] for j in range(len(embeds))]
    if lookup is None:
        return [take_table(e.stored(), i) for e, i in zip(embeds, per_layer)]
    return lookup([e.stored() for e in embeds], per_layer, [e.columns for e in embeds])


def engram_gate(x: jax.Array, key: jax.Array, qk: jax.Array, eps: float, clamp: float = 1e-6) -> jax.Array:
    """gamma [..., n] = sigmoid(copysign(sqrt(max(|delta|, clamp)), delta)), with
    delta = sum_d x*qk*key * rsqrt(mean x^2 + eps) * rsqrt(mean key^2 + eps) / sqrt(D), all fp32.
    x, key [..., n, D]; qk = q_weight * k_weight [n, D]."""
    h = x.astype(jnp.float32)
    k = key.astype(jnp.float32)
    dim = h.shape[-1]
    rstd = jax.lax.rsqrt(jnp.mean(h * h, axis=-1) + eps) * jax.lax.rsqrt(jnp.mean(k * k, axis=-1) + eps)
    dot = jnp.sum(h * qk.astype(jnp.float32) * k, axis=-1) * rstd * (dim ** -0.5)
    return jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), clamp)), dot))


class Engram(nnx.Module):
    """One Engram layer (docs/model.md §10), applied to the residual streams before its block.

    x [B, T, n, D], ids [B, T, C] (this layer's slice of `EngramHasher.hash_ids`), optional
    token_mask [B, T] (False -> gate 0) -> x + gamma * val, computed in fp32, cast to x.dtype.
    """

    def __init__(self, dim: int, hc_mult: int, n_columns: int, head_dim: int, rows: int, norm_eps: float, *,
                 rngs: nnx.Rngs, dtype=jnp.float32, embed_dtype=None, placement: str = "device", tables: str = "model",
                 columns: Sequence[tuple[int, int]] = ()):
        self.dim = int(dim)
        self.hc_mult = int(hc_mult)
        self.n_columns = int(n_columns)
        self.head_dim = int(head_dim)
        self.eps = float(norm_eps)
        self.clamp_value = 1e-6
        self.embed = EngramEmbedding(rows, head_dim, rngs=rngs, dtype=dtype if embed_dtype is None else embed_dtype,
                                     placement=placement, tables=tables, columns=columns)
        self.wkv = Linear(self.n_columns * self.head_dim, self.dim * (self.hc_mult + 1), rngs=rngs, dtype=dtype)
        self.q_weight = nnx.Param(normal_init(rngs, (self.hc_mult, self.dim), 0.3, mean=1.0))
        self.k_weight = nnx.Param(normal_init(rngs, (self.hc_mult, self.dim), 0.3, mean=1.0))
        self.batch_invariant = False  # cfg.batch_invariant: the gate's sums on fixed blocks of tokens

    @classmethod
    def from_hasher(cls, hasher: EngramHasher, layer_id: int, dim: int, hc_mult: int, head_dim: int,
                    norm_eps: float, *, rngs: nnx.Rngs, dtype=jnp.float32, embed_dtype=None,
                    placement: str = "device", tables: str = "model") -> "Engram":
        j = hasher.layer_index(layer_id)
        columns = tuple(zip(hasher.offsets[j], hasher.offsets[j] + hasher.moduli[j]))
        return cls(dim, hc_mult, hasher.n_columns, head_dim, hasher.table_rows(layer_id), norm_eps,
                   rngs=rngs, dtype=dtype, embed_dtype=embed_dtype, placement=placement, tables=tables, columns=columns)

    def key_value(self, ids: jax.Array, rows: tuple[jax.Array, ...] | None = None) -> tuple[jax.Array, jax.Array]:
        """ids [..., C] (or their rows as held, fetched ahead: `engram_rows`) -> keys [..., n, D] (fp32), value
        [..., D] (fp32)."""
        if ids.shape[-1] != self.n_columns:
            raise ValueError(f"Engram: ids have {ids.shape[-1]} columns, expected {self.n_columns}")
        rows = self.embed(ids) if rows is None else self.embed.values(rows)  # [..., C, hd]
        v = rows.reshape(*rows.shape[:-2], self.n_columns * self.head_dim)
        kv = self.wkv(v)
        nd = self.hc_mult * self.dim
        key = kv[..., :nd].astype(jnp.float32).reshape(*kv.shape[:-1], self.hc_mult, self.dim)
        return key, kv[..., nd:].astype(jnp.float32)

    def __call__(self, x: jax.Array, ids: jax.Array, token_mask: jax.Array | None = None,
                 rows: tuple[jax.Array, ...] | None = None) -> jax.Array:
        """rows: this layer's rows for `ids` as held, fetched ahead (`engram_rows`); None gathers them here."""
        if x.shape[-2:] != (self.hc_mult, self.dim):
            raise ValueError(f"Engram: x has trailing shape {x.shape[-2:]}, expected {(self.hc_mult, self.dim)}")
        if ids.shape[:-1] != x.shape[:-2]:
            raise ValueError(f"Engram: ids leading shape {ids.shape[:-1]} != x leading shape {x.shape[:-2]}")
        key, value = self.key_value(ids, rows)
        qk = self.q_weight[...].astype(jnp.float32) * self.k_weight[...].astype(jnp.float32)
        def gate_of(x, key):
            return engram_gate(x, key, qk, self.eps, self.clamp_value)  # [..., n]
        gate = row_blocks(gate_of, x, key, lead=x.ndim - 2) if self.batch_invariant else gate_of(x, key)
        if token_mask is not None:
            gate = jnp.where(token_mask[..., None], gate, 0.0)
        h = x.astype(jnp.float32)
        return (h + gate[..., None] * value[..., None, :]).astype(x.dtype)
