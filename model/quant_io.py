"""Checkpoint I/O and (de)quantisation for DeepSeek-V4 / V4.1 official checkpoints.

Pure numpy + ml_dtypes (no jax, no torch), so it can run in loader processes and tests.

Contents
--------
* A minimal safetensors reader / writer (``read_safetensors``, ``write_safetensors``) that
  memory-maps the file and returns zero-copy numpy views, including the FP8 / E8M0 dtypes that
  ``safetensors.numpy`` cannot represent.
* Sharded-checkpoint helpers (``list_checkpoint_files``, ``iter_checkpoint_tensors``).
* The number formats of docs/model.md §14 (UE8M0 scales, FP8 blocks and rows, packed FP4), defined by the
  kernels' leaf ``pallas_kernels.formats`` and re-exported here for the loader.
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

import numpy as np

from pallas_kernels.formats import (BF16, E2M1_VALUES, F8_E4M3, F8_E5M2, F8_E8M0, FP4_E2M1_MAX, FP8_E4M3_MAX,
                                    block_pair, ceil_div, dequant_fp4, dequant_fp8_blocks, dequant_fp8_rows,
                                    e8m0_to_float32, float32_to_e8m0, fp4_codes_from_float, infer_fp8_block,
                                    pack_fp4, quantize_fp4, quantize_fp8_blocks, quantize_fp8_rows, unpack_fp4)

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
# which tensors the release stores FP8
# --------------------------------------------------------------------------------------------

# Official names (docs/model.md §14, §17.1) of the block-scaled FP8 matrices of both generations, in every
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
    rounds with act_quant (docs/model.md §14): the release's FP8 matrices except `attn.wo_a`, which it
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
                bo, bi = block_pair(fp8_block)
                if s.shape == (ceil_div(w.shape[0], bo), ceil_div(w.shape[1], bi)):
                    return dequant_fp8_blocks(w, s, (bo, bi), name=wname)
            else:
                try:
                    b = infer_fp8_block(w.shape, s.shape, wname)
                except ValueError:
                    pass
                else:
                    return dequant_fp8_blocks(w, s, b, name=wname)
        # Per-row scales, one per 32 values (V4.1 Engram tables).
        if w.ndim >= 1 and s.shape == w.shape[:-1] + (ceil_div(w.shape[-1], 32),):
            return dequant_fp8_rows(w, s, 32, name=wname)
        raise ValueError(f"tensor {wname!r}: FP8 weight {w.shape} and scale {s.shape} match "
                         "neither a square block grid nor per-32 row scales"
                         + (f" (fp8_block={fp8_block})" if fp8_block is not None else ""))
    if w.dtype in _PACKED_DTYPES:
        n = w.shape[-1] * 2 if w.ndim else 0
        if w.ndim == 2 and s.shape == (w.shape[0], ceil_div(n, fp4_block)):
            return dequant_fp4(w, s, fp4_block, name=wname)
        raise ValueError(f"tensor {wname!r}: packed FP4 weight {w.shape} expects a scale of shape "
                         f"{(w.shape[0] if w.ndim else 0, ceil_div(n, fp4_block))}, got {s.shape}")
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
