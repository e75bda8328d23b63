"""Checkpoint I/O and (de)quantisation for DeepSeek-V4 / V4.1 official checkpoints.

Pure numpy + ml_dtypes (no jax, no torch), so it can run in loader processes and tests.

Contents
--------
* A minimal safetensors reader / writer (``read_safetensors``, ``write_safetensors``) that
  memory-maps the file and returns zero-copy numpy views, including the FP8 / E8M0 dtypes that
  ``safetensors.numpy`` cannot represent.
* Sharded-checkpoint helpers (``list_checkpoint_files``, ``iter_checkpoint_tensors``).
* Number formats of MODEL_SPEC §3.7:
    - FP8 = E4M3FN (max 448) weights with one UE8M0 scale per B x B block (B = 128 V4, 32 V4.1),
      scale grid ceil-sized at ragged edges: W[i,j] = fp8[i,j] * 2^(S[i//B, j//B] - 127).
    - FP4 = E2M1 codes packed two per byte (low nibble = even column) in I8/U8 [out, in/2] with
      one UE8M0 scale per 32 inputs [out, in/32]: W[i,j] = e2m1(code) * 2^(S[i, j//32] - 127).
    - FP8 rows (V4.1 Engram tables): E4M3 [rows, d] with one UE8M0 scale per 32 values of a row.
* ``release_fp8``: which tensors the release stores block-scaled FP8 (the one rule the model's
  ``dense_weights="fp8"`` and experiments/roofline.py's "dense" class both use).
* ``dequantize_official``: turns a dict of official-named tensors into logical float32 tensors,
  consuming the ``.scale`` entries.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

__all__ = [
    "E2M1_VALUES",
    "FP8_E4M3_MAX",
    "FP4_E2M1_MAX",
    "read_safetensors",
    "read_safetensors_header",
    "read_safetensors_metadata",
    "write_safetensors",
    "list_checkpoint_files",
    "iter_checkpoint_tensors",
    "e8m0_to_float32",
    "float32_to_e8m0",
    "dequant_fp8_blocks",
    "dequant_fp8_rows",
    "unpack_fp4",
    "pack_fp4",
    "dequant_fp4",
    "quantize_fp8_blocks",
    "quantize_fp8_rows",
    "quantize_fp4",
    "fp4_codes_from_float",
    "infer_fp8_block",
    "release_fp8",
    "official_fp8_gemm",
    "dequantize_official",
]

# --------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------

BF16 = np.dtype(ml_dtypes.bfloat16)
F8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
F8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
F8_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

# safetensors dtype string -> numpy dtype (explicitly little-endian where it matters).
_ST_TO_NP: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": BF16,
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": F8_E4M3,
    "F8_E5M2": F8_E5M2,
    "F8_E8M0": F8_E8M0,
}


def _np_to_st(dtype: np.dtype) -> str:
    dt = np.dtype(dtype)
    for name, ref in _ST_TO_NP.items():
        # Compare ignoring byte order: the writer converts to little-endian itself.
        if dt == ref or (dt.kind == ref.kind and dt.itemsize == ref.itemsize
                         and dt.kind in "iuf" and dt.newbyteorder("<") == ref.newbyteorder("<")):
            return name
    raise ValueError(f"dtype {dt} is not supported by write_safetensors "
                     f"(supported: {sorted(_ST_TO_NP)})")


# ml_dtypes types carry no byte order, and their in-memory layout is the host's. The format is
# little-endian, which is what every supported host (x86-64, aarch64) uses.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("model.quant_io assumes a little-endian host")

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # same limit as the reference safetensors implementation

# --------------------------------------------------------------------------------------------
# safetensors reader
# --------------------------------------------------------------------------------------------


def read_safetensors_header(path) -> tuple[dict, dict, int]:
    """Parse and validate a safetensors header.

    Returns (tensor_entries, metadata, data_start) where tensor_entries maps name ->
    {"dtype", "shape", "data_offsets"} and data_start is the absolute byte offset of the data
    buffer. Raises ValueError (naming the file, and the tensor where relevant) on any
    inconsistency.
    """
    path = os.fspath(path)
    file_size = os.path.getsize(path)
    if file_size < 8:
        raise ValueError(f"{path}: file too small to be safetensors ({file_size} bytes)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n == 0 or n > _MAX_HEADER_BYTES or 8 + n > file_size:
            raise ValueError(f"{path}: invalid header length {n} (file size {file_size})")
        raw = f.read(n)
    if len(raw) != n:
        raise ValueError(f"{path}: truncated header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: __metadata__ is not an object")
    data_start = 8 + n
    data_size = file_size - data_start

    entries: dict[str, dict] = {}
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise ValueError(f"{path}: tensor {name!r}: malformed header entry {info!r}")
        st = info["dtype"]
        if st not in _ST_TO_NP:
            raise ValueError(f"{path}: tensor {name!r}: unknown/unsupported dtype {st!r} "
                             f"(supported: {sorted(_ST_TO_NP)})")
        shape = info["shape"]
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"{path}: tensor {name!r}: invalid shape {shape!r}")
        offs = info["data_offsets"]
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise ValueError(f"{path}: tensor {name!r}: invalid data_offsets {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end <= data_size:
            raise ValueError(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] outside "
                             f"the data buffer of {data_size} bytes (file truncated?)")
        expected = math.prod(shape) * _ST_TO_NP[st].itemsize
        if end - begin != expected:
            raise ValueError(f"{path}: tensor {name!r}: data_offsets span {end - begin} bytes, "
                             f"but {st} {shape} needs {expected}")
        entries[name] = {"dtype": st, "shape": shape, "data_offsets": [begin, end]}
        if end > begin:
            spans.append((begin, end, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"{path}: tensors {n0!r} and {n1!r} overlap in the data buffer")
    return entries, metadata, data_start


def read_safetensors_metadata(path) -> dict:
    """The ``__metadata__`` dict of a safetensors file (empty if absent)."""
    return read_safetensors_header(path)[1]


def read_safetensors(path, names=None) -> dict[str, np.ndarray]:
    """Read a safetensors file into {name: ndarray}, memory-mapped (zero-copy, read-only views).

    ``names`` optionally restricts the result to those tensors (KeyError if one is missing).
    The returned arrays keep the mapping alive; they are plain ``np.ndarray`` views.
    """
    path = os.fspath(path)
    entries, _, data_start = read_safetensors_header(path)
    if names is not None:
        missing = [n for n in names if n not in entries]
        if missing:
            raise KeyError(f"{path}: tensors not in file: {missing}")
        entries = {n: entries[n] for n in names}
    if not entries:
        return {}
    file_size = os.path.getsize(path)
    if file_size > data_start:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        buf = mm[data_start:].view(np.ndarray)
    else:
        buf = np.zeros(0, np.uint8)
    out = {}
    for name, info in entries.items():
        dt = _ST_TO_NP[info["dtype"]]
        begin, end = info["data_offsets"]
        arr = buf[begin:end].view(dt).reshape(info["shape"])
        out[name] = arr
    return out


# --------------------------------------------------------------------------------------------
# safetensors writer
# --------------------------------------------------------------------------------------------


def write_safetensors(path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None):
    """Write {name: ndarray} as a safetensors file (atomically, via a temp file + rename).

    Supports every dtype ``read_safetensors`` reads (incl. bfloat16, float8_e4m3fn, float8_e5m2,
    float8_e8m0fnu). Metadata must be a str->str mapping.
    """
    path = os.fspath(path)
    header: dict = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map str -> str")
        header["__metadata__"] = dict(metadata)
    arrays = []
    offset = 0
    for name, arr in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        a = np.asarray(arr)
        st = _np_to_st(a.dtype)
        target = _ST_TO_NP[st]
        a = np.asarray(a, dtype=target, order="C")  # keeps 0-d shapes, unlike ascontiguousarray
        nbytes = a.nbytes
        header[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        arrays.append(a)
        offset += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)  # pad so the data buffer is 8-byte aligned
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(len(hbytes).to_bytes(8, "little"))
            f.write(hbytes)
            for a in arrays:
                if a.size:
                    f.write(memoryview(a.reshape(-1).view(np.uint8)))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# --------------------------------------------------------------------------------------------
# sharded checkpoints
# --------------------------------------------------------------------------------------------

_INDEX_NAME = "model.safetensors.index.json"


def _load_index(directory: Path):
    idx_path = directory / _INDEX_NAME
    with open(idx_path) as f:
        index = json.load(f)
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict):
        raise ValueError(f"{idx_path}: no 'weight_map' object")
    return idx_path, wm


def list_checkpoint_files(directory) -> list[Path]:
    """The safetensors files of a checkpoint.

    * a ``.safetensors`` file path -> [that file];
    * a directory with ``model.safetensors.index.json`` -> the shards named in its weight_map
      (in first-appearance order); ValueError naming every missing shard;
    * otherwise ``model.safetensors`` if present, else the ``model*.safetensors`` shards, else
      every ``*.safetensors`` in the directory, sorted (other files, e.g. saved outputs, are
      not weights).
    """
    p = Path(directory)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint path {p} does not exist")
    if (p / _INDEX_NAME).is_file():
        idx_path, wm = _load_index(p)
        files = list(dict.fromkeys(wm.values()))
        missing = [f for f in files if not (p / f).is_file()]
        if missing:
            raise ValueError(f"{idx_path}: shard file(s) missing from {p}: {missing}")
        return [p / f for f in files]
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    files = sorted(Path(f) for f in glob.glob(os.path.join(glob.escape(str(p)), "model*.safetensors")))
    files = files or sorted(Path(f) for f in glob.glob(os.path.join(glob.escape(str(p)), "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files (and no {_INDEX_NAME}) in {p}")
    return files


def iter_checkpoint_tensors(directory) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) over all tensors of a checkpoint, one shard at a time (memory-mapped).

    With an index file, each shard's tensors are checked against the weight_map: a tensor listed
    for a shard but absent from it raises ValueError after that shard's tensors were yielded.
    """
    p = Path(directory)
    files = list_checkpoint_files(p)
    wm = None
    if p.is_dir() and (p / _INDEX_NAME).is_file():
        _, wm = _load_index(p)
    for fpath in files:
        tensors = read_safetensors(fpath)
        yield from tensors.items()
        if wm is not None:
            expected = [n for n, f in wm.items() if f == fpath.name]
            missing = [n for n in expected if n not in tensors]
            if missing:
                raise ValueError(f"{fpath}: tensors listed in {_INDEX_NAME} but absent: "
                                 f"{missing[:10]}{' ...' if len(missing) > 10 else ''}")


# --------------------------------------------------------------------------------------------
# number formats
# --------------------------------------------------------------------------------------------

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0

#: E2M1 code -> value; code bit 3 is the sign.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def _what(name) -> str:
    return f"tensor {name!r}" if name else "tensor"


def e8m0_to_float32(scale, name=None) -> np.ndarray:
    """Scale factors as float32 multipliers.

    Accepts float8_e8m0fnu (value 2^(b-127); byte 255 = NaN), uint8 exponent bytes (same
    meaning), or any float dtype (already a plain multiplier).
    """
    s = np.asarray(scale)
    if s.dtype == F8_E8M0 or s.dtype == np.uint8:
        b = s.view(np.uint8).astype(np.int32)
        out = np.ldexp(np.float32(1.0), np.minimum(b, 254) - 127).astype(np.float32)
        out[b == 255] = np.nan  # E8M0 has no infinity; 0xFF is NaN
        return out
    if s.dtype.kind == "f" or s.dtype in (BF16, F8_E4M3, F8_E5M2):
        return s.astype(np.float32)
    raise ValueError(f"{_what(name)}: unsupported scale dtype {s.dtype} "
                     "(expected float8_e8m0fnu, uint8 exponent bytes or a float dtype)")


def float32_to_e8m0(exponent) -> np.ndarray:
    """Integer exponents e in [-127, 127] -> float8_e8m0fnu (byte e + 127)."""
    e = np.asarray(exponent)
    if e.size and (e.min() < -127 or e.max() > 127):
        raise ValueError("E8M0 exponent out of range [-127, 127]")
    return (e.astype(np.int32) + 127).astype(np.uint8).view(F8_E8M0)


def _weight_to_float32(w, name=None, *, raw_bytes_as=F8_E4M3) -> np.ndarray:
    w = np.asarray(w)
    if w.dtype in (np.uint8, np.int8):
        w = w.view(raw_bytes_as)
    if w.dtype.kind == "f" or w.dtype in (BF16, F8_E4M3, F8_E5M2, F8_E8M0):
        return w.astype(np.float32)
    raise ValueError(f"{_what(name)}: unsupported weight dtype {w.dtype}")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _block_pair(block) -> tuple[int, int]:
    if isinstance(block, (tuple, list)):
        bo, bi = (int(x) for x in block)
    else:
        bo = bi = int(block)
    if bo <= 0 or bi <= 0:
        raise ValueError(f"block size must be positive, got {block!r}")
    return bo, bi


def infer_fp8_block(weight_shape, scale_shape, name=None, max_block: int = 1 << 16) -> int:
    """Smallest power of two B with scale_shape == (ceil(out/B), ceil(in/B)).

    For powers of two the answer is unique unless the grid is 1x1, where every B >= max(out, in)
    gives the same dequantisation. ValueError naming the tensor if none fits.
    """
    if len(weight_shape) != 2 or len(scale_shape) != 2:
        raise ValueError(f"{_what(name)}: FP8 block weight/scale must be 2-D, got "
                         f"{tuple(weight_shape)} / {tuple(scale_shape)}")
    out, inn = weight_shape
    b = 1
    while b <= max_block:
        if (_ceil_div(out, b), _ceil_div(inn, b)) == tuple(scale_shape):
            return b
        b *= 2
    raise ValueError(f"{_what(name)}: no power-of-two block size B maps weight {tuple(weight_shape)} "
                     f"onto scale grid {tuple(scale_shape)} (ceil(out/B), ceil(in/B))")


def dequant_fp8_blocks(weight, scale, block=None, name=None) -> np.ndarray:
    """Block-scaled FP8 -> float32: W[i,j] = fp8[i,j] * s[i//B, j//B].

    weight: float8_e4m3fn [out, in] (uint8/int8 are taken as raw E4M3 bytes; float dtypes as
    values). scale: [ceil(out/B), ceil(in/B)] as float8_e8m0fnu, uint8 exponent bytes, or float
    multipliers. block: int, (B_out, B_in) or None (inferred, see ``infer_fp8_block``).
    """
    w = _weight_to_float32(weight, name)
    s = e8m0_to_float32(scale, name)
    if w.ndim != 2 or s.ndim != 2:
        raise ValueError(f"{_what(name)}: FP8 block weight/scale must be 2-D, got "
                         f"{w.shape} / {s.shape}")
    if block is None:
        block = infer_fp8_block(w.shape, s.shape, name)
    bo, bi = _block_pair(block)
    out, inn = w.shape
    grid = (_ceil_div(out, bo), _ceil_div(inn, bi))
    if s.shape != grid:
        raise ValueError(f"{_what(name)}: scale grid {s.shape} does not match weight {w.shape} "
                         f"with block {(bo, bi)} (expected {grid})")
    full = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:out, :inn]
    return w * full


def dequant_fp8_rows(weight, scale, block: int = 32, name=None) -> np.ndarray:
    """Row-scaled FP8 -> float32: W[..., j] = fp8[..., j] * s[..., j//block] (V4.1 Engram tables)."""
    w = _weight_to_float32(weight, name)
    s = e8m0_to_float32(scale, name)
    if w.ndim < 1 or s.shape != w.shape[:-1] + (_ceil_div(w.shape[-1], block),):
        raise ValueError(f"{_what(name)}: row scale {s.shape} does not match weight {w.shape} "
                         f"with {block} values per scale")
    full = np.repeat(s, block, axis=-1)[..., : w.shape[-1]]
    return w * full


def unpack_fp4(packed) -> np.ndarray:
    """Packed E2M1 [..., n/2] (int8/uint8) -> codes uint8 [..., n]; low nibble = even column."""
    p = np.asarray(packed)
    if p.dtype not in (np.int8, np.uint8):
        raise ValueError(f"packed FP4 must be int8/uint8, got {p.dtype}")
    b = p.view(np.uint8)
    codes = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.uint8)
    codes[..., 0::2] = b & 0x0F
    codes[..., 1::2] = b >> 4
    return codes


def pack_fp4(codes) -> np.ndarray:
    """Codes uint8 [..., n] (0..15, n even) -> packed int8 [..., n/2]; even column in low nibble."""
    c = np.asarray(codes)
    if c.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {c.shape}")
    if c.size and (c.min() < 0 or c.max() > 15):
        raise ValueError("FP4 codes must be in 0..15")
    c = c.astype(np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(np.int8)


def dequant_fp4(packed, scale, block: int = 32, name=None) -> np.ndarray:
    """Packed FP4 [out, in/2] + scale [out, ceil(in/block)] -> float32 [out, in]:
    W[i,j] = e2m1(code[i,j]) * s[i, j//block]."""
    p = np.asarray(packed)
    if p.dtype not in (np.int8, np.uint8):
        raise ValueError(f"{_what(name)}: packed FP4 weight must be int8/uint8, got {p.dtype}")
    s = e8m0_to_float32(scale, name)
    n = p.shape[-1] * 2 if p.ndim else 0
    if p.ndim < 1 or s.shape != p.shape[:-1] + (_ceil_div(n, block),):
        raise ValueError(f"{_what(name)}: FP4 scale {s.shape} does not match packed weight "
                         f"{p.shape} (logical {p.shape[:-1] + (n,)}, {block} values per scale)")
    vals = E2M1_VALUES[unpack_fp4(p)]
    full = np.repeat(s, block, axis=-1)[..., :n]
    return vals * full


# ---------------------------------------------------------------- encoders


def _ceil_log2_pow2(x: np.ndarray) -> np.ndarray:
    """Exact ceil(log2(x)) for positive finite float32 x (via frexp, no log rounding)."""
    m, e = np.frexp(x.astype(np.float32))
    return np.where(m == 0.5, e - 1, e).astype(np.int32)


def _pow2_scale_exponent(amax: np.ndarray, qmax: float, amax_floor: float) -> np.ndarray:
    """Exponent k of the power-of-two scale 2^ceil(log2(amax/qmax)), clamped into E8M0 range.

    amax is first floored at amax_floor; blocks whose amax is still 0 get k = 0 (scale 1).
    Clamping k up to -127 is safe (values still fit in qmax).
    """
    a = np.maximum(amax.astype(np.float32), np.float32(amax_floor))
    pos = a > 0
    k = np.zeros(a.shape, np.int32)
    if pos.any():
        k[pos] = _ceil_log2_pow2(a[pos] / np.float32(qmax))
    if not np.all(np.isfinite(a)):
        raise ValueError("cannot quantise non-finite values")
    return np.clip(k, -127, 127)


def quantize_fp8_blocks(w, block=128, amax_floor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/B), ceil(in/B)]).

    Scale per block = 2^ceil(log2(amax/448)); values are cast with round-to-nearest-even.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8_blocks expects a 2-D array, got {w.shape}")
    bo, bi = _block_pair(block)
    out, inn = w.shape
    go, gi = _ceil_div(out, bo), _ceil_div(inn, bi)
    padded = np.zeros((go * bo, gi * bi), np.float32)
    padded[:out, :inn] = np.abs(w)
    amax = padded.reshape(go, bo, gi, bi).max(axis=(1, 3))
    k = _pow2_scale_exponent(amax, FP8_E4M3_MAX, amax_floor)
    kfull = np.repeat(np.repeat(k, bo, axis=0), bi, axis=1)[:out, :inn]
    q = np.clip(np.ldexp(w, -kfull), -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(np.float32)
    return q.astype(F8_E4M3), float32_to_e8m0(k)


def quantize_fp8_rows(w, block: int = 32, amax_floor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """float [..., d] -> (float8_e4m3fn [..., d], float8_e8m0fnu [..., ceil(d/block)])."""
    w = np.asarray(w, dtype=np.float32)
    d = w.shape[-1]
    g = _ceil_div(d, block)
    padded = np.zeros(w.shape[:-1] + (g * block,), np.float32)
    padded[..., :d] = np.abs(w)
    amax = padded.reshape(w.shape[:-1] + (g, block)).max(axis=-1)
    k = _pow2_scale_exponent(amax, FP8_E4M3_MAX, amax_floor)
    kfull = np.repeat(k, block, axis=-1)[..., :d]
    q = np.clip(np.ldexp(w, -kfull), -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(np.float32)
    return q.astype(F8_E4M3), float32_to_e8m0(k)


# Decision boundaries between consecutive E2M1 magnitudes (codes c, c+1). On a tie the even
# code wins: boundaries after an even code use '>', after an odd code '>='.
_E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)


def fp4_codes_from_float(x) -> np.ndarray:
    """Round float values (already divided by their scale) to E2M1 codes uint8 0..15.

    Round to nearest, ties to the even code; |x| > 6 saturates to +-6; the sign bit is kept
    (so negative values that round to zero give code 8 = -0).
    """
    x = np.asarray(x, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError("cannot quantise non-finite values to FP4")
    a = np.abs(x)
    mag = np.zeros(x.shape, np.uint8)
    for c, bnd in enumerate(_E2M1_BOUNDS):
        mag += (a > bnd) if c % 2 == 0 else (a >= bnd)
    return mag | (np.signbit(x).astype(np.uint8) << 3)


def quantize_fp4(w, block: int = 32, amax_floor: float = 6.0 * 2.0 ** -126) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (packed int8 [out, in/2], float8_e8m0fnu [out, ceil(in/block)]).

    Scale per block = 2^ceil(log2(max(amax, amax_floor)/6)); nearest E2M1 code, ties to even.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim < 1 or w.shape[-1] % 2:
        raise ValueError(f"quantize_fp4 needs an even last dimension, got {w.shape}")
    d = w.shape[-1]
    g = _ceil_div(d, block)
    padded = np.zeros(w.shape[:-1] + (g * block,), np.float32)
    padded[..., :d] = np.abs(w)
    amax = padded.reshape(w.shape[:-1] + (g, block)).max(axis=-1)
    k = _pow2_scale_exponent(amax, FP4_E2M1_MAX, amax_floor)
    kfull = np.repeat(k, block, axis=-1)[..., :d]
    codes = fp4_codes_from_float(np.ldexp(w, -kfull))
    return pack_fp4(codes), float32_to_e8m0(k)


# --------------------------------------------------------------------------------------------
# which tensors the release stores FP8
# --------------------------------------------------------------------------------------------

# Official names (MODEL_SPEC 2.13 / 3.7) of the block-scaled FP8 matrices of both generations, in every
# block incl. the MTP / DSpark ones: attention wq_a, wq_b, wkv, wo_a (which the official code dequantises
# at load), wo_b; indexer wq_b; shared expert w1..w3; [V4.1] Engram wkv; [V4] MTP e_proj, h_proj; DSpark
# main_proj. Routed experts are FP4; everything else (embed, head, compressors, router, weights_proj, V4.1
# wk, Markov / confidence heads, norms, mHC) BF16 or fp32; the Engram tables are FP8 rows (per 32 values).
_RELEASE_FP8 = re.compile(r"(?:.+\.)?(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b"
                          r"|ffn\.shared_experts\.w[123]|engram\.wkv|e_proj|h_proj|main_proj)\.weight")


def release_fp8(name: str) -> bool:
    """True for the official `<module>.weight` names the release stores as FP8 E4M3 + UE8M0 block scales
    (`<module>.scale`, [ceil(out/B), ceil(in/B)], B = 128 V4 / 32 V4.1)."""
    return _RELEASE_FP8.fullmatch(name) is not None


def official_fp8_gemm(name: str) -> bool:
    """True for the `<module>.weight` matrices the official inference multiplies as FP8 GEMMs, whose inputs it
    rounds with act_quant (MODEL_SPEC 3.7): the release's FP8 matrices except `attn.wo_a`, which it
    dequantises to bf16 at load (convert.py)."""
    return release_fp8(name) and not name.endswith("attn.wo_a.weight")


# --------------------------------------------------------------------------------------------
# official checkpoint -> logical float32 tensors
# --------------------------------------------------------------------------------------------

_FP8_DTYPES = (F8_E4M3, F8_E5M2)
_PACKED_DTYPES = (np.dtype(np.int8), np.dtype(np.uint8))


def _dequant_pair(wname: str, w: np.ndarray, s: np.ndarray, fp8_block, fp4_block: int) -> np.ndarray:
    s = np.asarray(s)
    if w.dtype in _FP8_DTYPES:
        if w.ndim == 2 and s.ndim == 2:
            if fp8_block is not None:
                bo, bi = _block_pair(fp8_block)
                if s.shape == (_ceil_div(w.shape[0], bo), _ceil_div(w.shape[1], bi)):
                    return dequant_fp8_blocks(w, s, (bo, bi), name=wname)
            else:
                try:
                    b = infer_fp8_block(w.shape, s.shape, wname)
                except ValueError:
                    pass
                else:
                    return dequant_fp8_blocks(w, s, b, name=wname)
        # Per-row scales, one per 32 values (V4.1 Engram tables).
        if w.ndim >= 1 and s.shape == w.shape[:-1] + (_ceil_div(w.shape[-1], 32),):
            return dequant_fp8_rows(w, s, 32, name=wname)
        raise ValueError(f"tensor {wname!r}: FP8 weight {w.shape} and scale {s.shape} match "
                         "neither a square block grid nor per-32 row scales"
                         + (f" (fp8_block={fp8_block})" if fp8_block is not None else ""))
    if w.dtype in _PACKED_DTYPES:
        n = w.shape[-1] * 2 if w.ndim else 0
        if w.ndim == 2 and s.shape == (w.shape[0], _ceil_div(n, fp4_block)):
            return dequant_fp4(w, s, fp4_block, name=wname)
        raise ValueError(f"tensor {wname!r}: packed FP4 weight {w.shape} expects a scale of shape "
                         f"{(w.shape[0] if w.ndim else 0, _ceil_div(n, fp4_block))}, got {s.shape}")
    raise ValueError(f"tensor {wname!r}: dtype {w.dtype} cannot carry a .scale "
                     "(expected float8_e4m3fn or int8/uint8 packed FP4)")


def dequantize_official(tensors: Mapping[str, np.ndarray], *, fp8_block=None,
                        fp4_block: int = 32) -> dict[str, np.ndarray]:
    """Official-named checkpoint tensors -> logical tensors (float32 for floats, ints unchanged).

    * ``X.weight`` float8_e4m3fn + ``X.scale`` -> FP8 block dequant (B inferred unless
      ``fp8_block`` is given) or, if the scale is [rows, d/32], per-row FP8 (Engram tables).
    * ``X.weight`` int8/uint8 [out, in/2] + ``X.scale`` [out, in/32] -> FP4 dequant [out, in].
    * other float dtypes (BF16/F16/F32/F64/E8M0 not used as a scale) -> float32;
      integer/bool tensors pass through unchanged.
    The ``.scale`` entries are consumed. ValueError naming the tensor for a ``.scale`` without its
    ``.weight``, an FP8 / packed-int8 ``.weight`` without its scale, or mismatching shapes.
    """
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if name.endswith(".scale"):
            wname = name[: -len(".scale")] + ".weight"
            if wname not in tensors:
                raise ValueError(f"tensor {name!r}: scale without its weight {wname!r}")
            continue
        a = np.asarray(arr)
        sname = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
        if sname is not None and sname in tensors:
            out[name] = _dequant_pair(name, a, tensors[sname], fp8_block, fp4_block)
            continue
        if a.dtype in _FP8_DTYPES:
            raise ValueError(f"tensor {name!r}: FP8 tensor without its scale "
                             f"{sname or name + '.scale'!r}")
        if a.dtype in _PACKED_DTYPES and sname is not None:
            raise ValueError(f"tensor {name!r}: {a.dtype} (packed FP4) weight without its "
                             f"scale {sname!r}")
        if a.dtype.kind == "f" or a.dtype in (BF16, F8_E8M0):
            out[name] = e8m0_to_float32(a) if a.dtype == F8_E8M0 else a.astype(np.float32, copy=False)
        elif a.dtype.kind in "iub":
            out[name] = a
        else:
            raise ValueError(f"tensor {name!r}: unsupported dtype {a.dtype}")
    return out
