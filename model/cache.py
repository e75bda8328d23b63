"""The cache pytree: position-indexed rings and stores (MODEL_SPEC 3.1-3.3, 3.5).

Everything is indexed by absolute position, so chunked prefill, speculative rollback and prefix
resume are length updates:

* SWA ring per layer: kv [B, R_w, Dh], position p in slot p mod R_w, R_w = W + spec_room. The
  slot's position is derived from the sequence length (never stored): slot s holds the latest
  p < length with p = s (mod R_w). Rows written speculatively past the length are simply never
  read; R_w >= W + spec_room keeps them from clobbering live window rows.
* Compressor per compressed layer (and the CSA indexer's own compressor): a ring of raw float32
  projections (a, g) [B, R_c, c*d] (R_c = 2r + spec_room) from which partial blocks are pooled when
  they close, plus the store of finished entries [B, N, d], entry j at index j. A stale entry past
  the length is invisible (queries at p see j < (p+1)//r) and is rewritten when its block closes.
* lengths [B]: tokens already in the cache per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .config import ModelConfig

@struct.dataclass
class CompressorCache:
    proj_a: jax.Array | None  # [B, R_c, c*d] float32 (None: entries derived elsewhere, e.g. V4.1 index keys)
    proj_g: jax.Array | None  # [B, R_c, c*d] float32
    entries: jax.Array  # [B, N, d]


@struct.dataclass
class LayerCache:
    kv: jax.Array  # [B, R_w, Dh] SWA ring
    comp: CompressorCache | None = None
    index: CompressorCache | None = None


@struct.dataclass
class Cache:
    lengths: jax.Array  # [B] int32
    layers: tuple
    tokens: jax.Array | None = None  # [V4.1 Engram] ring of raw token ids [B, R_t] (n-gram history)
    max_len: int = struct.field(pytree_node=False, default=0)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def rollback(self, lengths: jax.Array) -> "Cache":
        """Keep only the first `lengths[b]` positions of each sequence (must not exceed the current)."""
        return self.replace(lengths=jnp.minimum(jnp.asarray(lengths, jnp.int32), self.lengths))


@struct.dataclass
class Step:
    """Where a chunk of S rows lands: row i of sequence b is position start[b] + i, valid iff i < n_new[b]."""

    start: jax.Array  # [B] int32
    n_new: jax.Array  # [B] int32
    positions: jax.Array  # [B, S] int32
    valid: jax.Array  # [B, S] bool

    @staticmethod
    def make(start: jax.Array, n_new: jax.Array, width: int) -> "Step":
        start = jnp.asarray(start, jnp.int32)
        n_new = jnp.asarray(n_new, jnp.int32)
        i = jnp.arange(width, dtype=jnp.int32)[None, :]
        return Step(start=start, n_new=n_new, positions=start[:, None] + i, valid=i < n_new[:, None])

    @property
    def end(self) -> jax.Array:
        return self.start + self.n_new


# ----------------------------------------------------------------------------- ring helpers

def ring_positions(start: jax.Array, size: int) -> jax.Array:
    """Position held by each ring slot given the sequence length `start` [B] -> [B, size] (-1 = empty)."""
    s = jnp.arange(size, dtype=jnp.int32)[None, :]
    last = start[:, None] - 1
    pos = last - jnp.mod(last - s, size)
    return jnp.where(pos >= 0, pos, -1)


def ring_write(ring: jax.Array, rows: jax.Array, step: Step) -> jax.Array:
    """Write the chunk's valid rows [B, S, ...] at slots position mod size (only the last `size` rows)."""
    size = ring.shape[1]
    i = jnp.arange(rows.shape[1], dtype=jnp.int32)[None, :]
    keep = step.valid & (i >= step.n_new[:, None] - size)
    slot = jnp.where(keep, jnp.mod(step.positions, size), size)  # out of range -> dropped
    b = jnp.arange(ring.shape[0])[:, None]
    return ring.at[b, slot].set(rows.astype(ring.dtype), mode="drop")


def ring_gather(ring: jax.Array, positions: jax.Array) -> jax.Array:
    """Rows of `ring` [B, size, ...] for absolute positions [B, K] (caller masks invalid ones)."""
    return jnp.take_along_axis(ring, jnp.mod(positions, ring.shape[1])[..., None], axis=1)


# ----------------------------------------------------------------------------- allocation

@dataclass(frozen=True)
class CacheGeometry:
    """Static sizes of the cache for one config (rings, stores) for a given max length."""

    window_ring: int
    spec_room: int
    max_len: int

    def compressor_ring(self, ratio: int) -> int:
        return 2 * ratio + self.spec_room

    def entries(self, ratio: int) -> int:
        return math.ceil(self.max_len / ratio)


def geometry(cfg: ModelConfig, max_len: int, spec_room: int = 8) -> CacheGeometry:
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds the model's context "
                         f"(max_position_embeddings={cfg.max_position_embeddings})")
    return CacheGeometry(window_ring=cfg.sliding_window + spec_room, spec_room=spec_room, max_len=max_len)


def _layer_shapes(cfg: ModelConfig, index: int, geo: CacheGeometry, batch: int) -> dict:
    """Per-layer arrays as {name: (shape, kind)} with kind in {"act", "f32"}.

    Global KV lives only in the layers that own a compressor ([V4] every compressed layer, [V4.1]
    KV sources); index keys with their own projection ring in V4 CSA layers, derived from the
    latent (no ring) in V4.1 KV sources.
    """
    spec = cfg.layer_spec(index)
    shapes = {"kv": ((batch, geo.window_ring, cfg.head_dim), "act")}
    if not spec.owns_kv:
        return shapes
    r = spec.compress_ratio
    v4 = cfg.generation == "v4"
    for part, d, on, ring in (("comp", cfg.head_dim, True, True),
                              ("index", cfg.index_head_dim, spec.indexer, v4)):
        if on:
            if ring:
                width = (2 if spec.overlap else 1) * d
                shapes[f"{part}.proj_a"] = ((batch, geo.compressor_ring(r), width), "f32")
                shapes[f"{part}.proj_g"] = ((batch, geo.compressor_ring(r), width), "f32")
            shapes[f"{part}.entries"] = ((batch, geo.entries(r), d), "act")
    return shapes


def allocate_layer(cfg: ModelConfig, index: int, batch: int, max_len: int, dtype=jnp.bfloat16,
                   spec_room: int = 8) -> LayerCache:
    """An empty cache for block `index` (backbone layer or MTP slot)."""
    geo = geometry(cfg, max_len, spec_room)
    arrays = {name: jnp.zeros(shape, dtype if kind == "act" else jnp.float32)
              for name, (shape, kind) in _layer_shapes(cfg, index, geo, batch).items()}

    def comp(part):
        if f"{part}.entries" not in arrays:
            return None
        return CompressorCache(proj_a=arrays.get(f"{part}.proj_a"), proj_g=arrays.get(f"{part}.proj_g"),
                               entries=arrays[f"{part}.entries"])

    return LayerCache(kv=arrays["kv"], comp=comp("comp"), index=comp("index"))


def allocate(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, spec_room: int = 8) -> Cache:
    """An empty cache for `batch` sequences of up to `max_len` positions (backbone layers)."""
    layers = tuple(allocate_layer(cfg, i, batch, max_len, dtype, spec_room) for i in range(cfg.num_layers))
    tokens = None
    if cfg.engram_layer_ids:
        tokens = jnp.zeros((batch, cfg.engram_max_ngram_size - 1 + spec_room), jnp.int32)
    return Cache(lengths=jnp.zeros((batch,), jnp.int32), layers=layers, tokens=tokens, max_len=max_len)


def packed_entry_bytes(cfg: ModelConfig, part: str) -> float:
    """Bytes of one global-KV entry ("comp") or index key ("index") in the trained storage formats
    (MODEL_SPEC 2.7): [V4] FP8 nope + bf16 rope + UE8M0 scales (FlashMLA 584 B row) / MXFP4 keys;
    [V4.1] E2M1 + one E4M3 scale per 16 / MXFP4 (E2M1 + UE8M0 per 32) keys."""
    if part == "index":
        return cfg.index_head_dim / 2 + cfg.index_head_dim / 32
    if cfg.generation == "v4":
        nope = cfg.head_dim - cfg.rope_head_dim
        return nope + 2 * cfg.rope_head_dim + nope / 64 + 1
    return cfg.head_dim / 2 + cfg.head_dim / 16


def memory_estimate(cfg: ModelConfig, max_len: int, dtype=jnp.bfloat16, spec_room: int = 8,
                    packed: bool = False) -> dict:
    """Cache bytes for one sequence: growing stores (per token) and fixed rings (per sequence).

    `packed=True` counts the global KV in the trained storage formats instead of our `dtype` arrays
    (V4.1-Flash: 890 B/token; V4-Flash: 3514 B/token).
    """
    geo = geometry(cfg, max_len, spec_room)
    act = np.dtype(dtype).itemsize
    per_token, fixed = 0.0, 0
    for i in range(cfg.num_layers):
        for name, (shape, kind) in _layer_shapes(cfg, i, geo, 1).items():
            size = int(np.prod(shape)) * (act if kind == "act" else 4)
            if name.endswith("entries"):
                entry = packed_entry_bytes(cfg, name.split(".")[0]) if packed else size / shape[1]
                per_token += entry / cfg.layer_spec(i).compress_ratio
            else:
                fixed += size
    total = fixed + per_token * max_len
    return {"bytes_per_token": per_token, "fixed_bytes_per_sequence": fixed,
            "bytes_per_sequence_at_max_len": total, "max_len": max_len}


def describe_memory(cfg: ModelConfig, max_len: int, batch: int = 1, dtype=jnp.bfloat16, spec_room: int = 8) -> str:
    m = memory_estimate(cfg, max_len, dtype, spec_room)
    gib = 1024 ** 3
    return (f"cache for {cfg.name} ({np.dtype(dtype).name} KV): {m['bytes_per_token']:.1f} B/token growing + "
            f"{m['fixed_bytes_per_sequence'] / 1024 ** 2:.2f} MiB/sequence fixed; "
            f"{batch} x {max_len} tokens = {batch * m['bytes_per_sequence_at_max_len'] / gib:.3f} GiB")
