"""The quantised number formats the kernels decode, in numpy (docs/model.md §14); no jax, no torch.

* UE8M0 scales: float8_e8m0fnu (or its uint8 exponent byte b), value 2^(b-127); byte 255 is NaN.
* FP8 blocks: E4M3FN (max 448) weights with one UE8M0 scale per B x B block (B = 128 V4, 32 V4.1), the scale
  grid ceil-sized at ragged edges: W[i,j] = fp8[i,j] * 2^(S[i//B, j//B] - 127).
* FP8 rows (V4.1 Engram tables): E4M3 [rows, d] with one UE8M0 scale per 32 values of a row.
* FP4: E2M1 codes packed two per byte (low nibble = even column) in int8/uint8 [out, in/2] with one UE8M0
  scale per 32 inputs [out, in/32]: W[i,j] = e2m1(code) * 2^(S[i, j//32] - 127).

Encoders round as the release does (power-of-two scales 2^ceil(log2(amax / qmax)), round to nearest even);
decoders give float32. model.quant_io re-exports these for the checkpoint loader; the kernels' tests and tools
quantise with them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
F8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
F8_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

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


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for positive ints."""
    return -(-a // b)


def block_pair(block) -> tuple[int, int]:
    """An FP8 block size, int B or (B_out, B_in), as the pair (B_out, B_in); ValueError unless positive."""
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
        if (ceil_div(out, b), ceil_div(inn, b)) == tuple(scale_shape):
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
    bo, bi = block_pair(block)
    out, inn = w.shape
    grid = (ceil_div(out, bo), ceil_div(inn, bi))
    if s.shape != grid:
        raise ValueError(f"{_what(name)}: scale grid {s.shape} does not match weight {w.shape} "
                         f"with block {(bo, bi)} (expected {grid})")
    full = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:out, :inn]
    return w * full


def dequant_fp8_rows(weight, scale, block: int = 32, name=None) -> np.ndarray:
    """Row-scaled FP8 -> float32: W[..., j] = fp8[..., j] * s[..., j//block] (V4.1 Engram tables)."""
    w = _weight_to_float32(weight, name)
    s = e8m0_to_float32(scale, name)
    if w.ndim < 1 or s.shape != w.shape[:-1] + (ceil_div(w.shape[-1], block),):
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
    if p.ndim < 1 or s.shape != p.shape[:-1] + (ceil_div(n, block),):
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
    bo, bi = block_pair(block)
    out, inn = w.shape
    go, gi = ceil_div(out, bo), ceil_div(inn, bi)
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
    g = ceil_div(d, block)
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
    g = ceil_div(d, block)
    padded = np.zeros(w.shape[:-1] + (g * block,), np.float32)
    padded[..., :d] = np.abs(w)
    amax = padded.reshape(w.shape[:-1] + (g, block)).max(axis=-1)
    k = _pow2_scale_exponent(amax, FP4_E2M1_MAX, amax_floor)
    kfull = np.repeat(k, block, axis=-1)[..., :d]
    codes = fp4_codes_from_float(np.ldexp(w, -kfull))
    return pack_fp4(codes), float32_to_e8m0(k)
