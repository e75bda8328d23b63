"""Expert weight storage: the formats `moe_experts` takes and the layouts the Mosaic GPU swap kernels stream.

Weights stay in their storage format in HBM and are dequantised in registers inside the kernels:
  dense  bf16/f16/f32  w [E, out, in]
  FP8    float8_e4m3fn w [E, out, in] + UE8M0 block scales [E, out/B, in/B] (B = 128 V4, 32 V4.1)
  FP4    E2M1 packed   w int8 [E, out, in/2] (low nibble = even column) + UE8M0 [E, out, in/32]
(scales as float8_e8m0fnu or their uint8 exponent bytes; pallas_kernels/formats.py defines the formats). FP4
weights and scales may also come in the layout the swap kernels stream, which is how the model holds routed
experts': `fp4_kernel_weights` (uint16 [E, out, in/4], each 32-bit word's bits permuted for the register decode)
and `fp4_kernel_scales` (bf16 [E, in/32, out], 2^(b-1)); `fp4_weight_bytes` / `fp4_scale_bytes` give the
checkpoint's bytes back (the Triton and XLA paths read those).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import formats


def as_e8m0_bytes(s: jax.Array) -> jax.Array:
    """UE8M0 scales (float8_e8m0fnu or uint8) -> their uint8 exponent bytes; ValueError for other dtypes."""
    if s.dtype == jnp.float8_e8m0fnu:
        return lax.bitcast_convert_type(s, jnp.uint8)
    if s.dtype != jnp.uint8:
        raise ValueError(f"expert scales must be UE8M0 (float8_e8m0fnu or uint8 exponent bytes), got {s.dtype}")
    return s


def weight_format(w: jax.Array, scale) -> str:
    """'dense' | 'fp8' | 'fp4' from the storage dtype (and whether a scale is given)."""
    if scale is None:
        if w.dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
            return "dense"
        raise ValueError(f"expert weight of dtype {w.dtype} needs its scale")
    if w.dtype == jnp.float8_e4m3fn:
        return "fp8"
    if w.dtype in (jnp.int8, jnp.uint8, jnp.uint16):    # uint16: fp4_kernel_weights
        return "fp4"
    raise ValueError(f"scaled expert weights must be float8_e4m3fn or packed FP4 (int8, or uint16 as "
                     f"fp4_kernel_weights holds it), got {w.dtype}")


def logical_shape(w: jax.Array, fmt: str) -> tuple[int, int, int]:
    """[E, out, in] of expert weights in storage format `fmt` (FP4 in either layout)."""
    return fp4_logical_shape(w) if fmt == "fp4" else w.shape


def expert_bytes(d: int, i: int, fmt: str, fp8_block: int = 128, dense_itemsize: int = 2) -> int:
    """HBM bytes of one expert's three matrices (w1, w3 [I, D], w2 [D, I]) including scales."""
    n = 3 * d * i
    if fmt == "dense":
        return n * dense_itemsize
    if fmt == "fp8":
        return n + 3 * math.ceil(i / fp8_block) * math.ceil(d / fp8_block)
    if fmt == "fp4":
        return n // 2 + n // 32
    raise ValueError(fmt)


def quantize_experts_fp8(w: np.ndarray, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """float [E, out, in] -> (float8_e4m3fn [E, out, in], uint8 UE8M0 [E, out/B, in/B]) (formats, numpy)."""
    qs = [formats.quantize_fp8_blocks(np.asarray(we, np.float32), block) for we in np.asarray(w)]
    return (jnp.asarray(np.stack([q for q, _ in qs])),
            jnp.asarray(np.stack([s for _, s in qs]).view(np.uint8)))


def quantize_experts_fp4(w: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """float [E, out, in] -> (int8 packed [E, out, in/2], uint8 UE8M0 [E, out, in/32]) (formats, numpy)."""
    qs = [formats.quantize_fp4(np.asarray(we, np.float32)) for we in np.asarray(w)]
    return (jnp.asarray(np.stack([q for q, _ in qs])),
            jnp.asarray(np.stack([s for _, s in qs]).view(np.uint8)))


FP4_GROUP = 16   # packed bytes per UE8M0 scale (32 logical columns)


# FP4 weights as the swap kernels read them ("held words", fp4_kernel_weights): a scale group's 16 bytes of a row
# as four 32-bit held words, each holding 8 weights in slots j = 2w + l with their bits permuted, so that a thread
# of the WGMMA layout decodes its word into four bf16x2 words (decoded word w: lane l from slot 2w + l) with nine
# integer instructions: four rotations and five masks / merges. Decoded word w gets each field of its slots --
# E2M1 bit f (mantissa, exponent low, exponent high, sign) onto bf16 bit FP4_FIELD_BITS[f] (the exponent's low two
# bits, the mantissa's top bit, the sign; lane 1: +16) -- by rotating the held word right by FP4_WORD_SHIFTS[w][f].
# That makes the bf16 value E2M1 x 2^-126 for all 16 codes (0.5 becomes the subnormal 2^-127); the 2^126 is
# folded into the scales (FP4_KERNEL_FOLD: 2^(b-1) for UE8M0 byte b, which bf16 holds for b <= 128, scales <= 2;
# e8m0_bf16 makes the larger ones NaN; the Triton kernels take any scale). Exact where it applies, provided the
# bf16 multiply keeps the subnormal input (bf16 mul has no flush-to-zero in PTX; tests/test_kernels_moe.py
# test_gpu_fp4_half_codes). No layout decodes every word with one rotation each (the field pattern does not tile
# the 16-bit lane); these shifts are one of the cheapest (docs/kernels.md).
FP4_FIELD_BITS = (6, 7, 8, 15)
FP4_WORD_SHIFTS = ((0, 0, 0, 0), (10, 2, 2, 2), (12, 12, 12, 12), (6, 6, 6, 6))
FP4_KERNEL_FOLD = 126


def _word_fields(w: int) -> dict[int, int]:
    """{right rotation: bf16x2 mask} that decoded word w takes from the held word."""
    masks: dict[int, int] = {}
    for bit, shift in zip(FP4_FIELD_BITS, FP4_WORD_SHIFTS[w]):
        masks[shift] = masks.get(shift, 0) | (0x10001 << bit)
    return masks


def fp4_held_bit(j: int, f: int) -> int:
    """Bit of a held 32-bit word that holds E2M1 bit f of its slot j = 2w + l (decoded word w, lane l)."""
    w, lane = divmod(j, 2)
    return (FP4_FIELD_BITS[f] + 16 * lane + FP4_WORD_SHIFTS[w][f]) % 32


def _words_ptx() -> str:
    """Inline PTX: $4 = a held word -> $0..$3 = the four bf16x2 words (E2M1 x 2^-126)."""
    shifts = sorted({s for w in range(4) for s in FP4_WORD_SHIFTS[w]} - {0})
    src = {0: "$4", **{s: f"r{s}" for s in shifts}}
    lines = [".reg .b32 t, " + ", ".join(src[s] for s in shifts) + ";"]
    lines += [f"shf.r.wrap.b32 r{s}, $4, $4, {s};" for s in shifts]
    for w in range(4):
        (s0, m0), *rest = _word_fields(w).items()
        acc = f"${w}" if not rest else "t"
        lines.append(f"and.b32 {acc}, {src[s0]}, {m0:#010x};")
        for n, (s, m) in enumerate(rest):     # (src & mask) | acc
            lines.append(f"lop3.b32 {f'${w}' if n == len(rest) - 1 else 't'}, {src[s]}, {m:#010x}, t, 0xEA;")
    return "{\n" + "\n".join(lines) + "\n}"


E2M1_WORDS_PTX = _words_ptx()


def e2m1_word_decode(q: np.ndarray) -> tuple[np.ndarray, ...]:
    """numpy model of E2M1_WORDS_PTX (for tests): held uint32 words -> the four bf16x2 words, uint32."""
    q = np.asarray(q, np.uint64)
    rotr = lambda s: ((q >> np.uint64(s)) | (q << np.uint64((32 - s) % 32))) & np.uint64(0xFFFFFFFF)  # noqa: E731
    words = []
    for w in range(4):
        word = np.zeros_like(q)
        for s, m in _word_fields(w).items():
            word |= rotr(s) & np.uint64(m)
        words.append(word.astype(np.uint32))
    return tuple(words)


def e8m0_bf16(b: jax.Array, fold: int = 0) -> jax.Array:
    """UE8M0 bytes -> bf16 scales 2^(b - 127 + fold): b + fold = 0 -> the subnormal 2^-127, and NaN for b = 255
    (as reference._e8m0) or where bf16 cannot hold the power (b + fold > 254). Unsigned 16-bit and one select,
    so that XLA fuses it with a transpose of the scales into one kernel (docs/kernels.md)."""
    b = b.astype(jnp.uint16)
    bits = jnp.maximum((b + fold) << 7, jnp.uint16(0x40))
    bits = jnp.where(b > min(254 - fold, 254), jnp.uint16(0x7FC0), bits)
    return lax.bitcast_convert_type(bits, jnp.bfloat16)


FP4_KERNEL_MAX_BYTE = 254 - FP4_KERNEL_FOLD   # the largest UE8M0 byte bf16 holds with that fold (scale 2)


def is_fp4_kernel_layout(s: jax.Array) -> bool:
    """Whether FP4 scales come as fp4_kernel_scales made them (bf16) rather than as UE8M0 bytes (FP4 weights as
    fp4_kernel_weights made them are uint16)."""
    return s.dtype == jnp.bfloat16


def fp4_kernel_scales(s: jax.Array) -> jax.Array:
    """FP4 UE8M0 scales [..., out, in/32] (uint8 or float8_e8m0fnu) -> the swap kernels' operand: bf16
    [..., in/32, out] of 2^(b - 127 + FP4_KERNEL_FOLD) (e8m0_bf16: NaN for b > 128, scales above 2). Models hold
    routed experts' FP4 scales so (model.moe.Experts), so no decode step transposes and converts them; the
    price is 2 bytes per 32 weights instead of 1 (the kernels read the bf16 either way)."""
    if is_fp4_kernel_layout(s):
        return s
    return e8m0_bf16(jnp.swapaxes(as_e8m0_bytes(s), -1, -2), FP4_KERNEL_FOLD)


def fp4_scale_bytes(s: jax.Array) -> jax.Array:
    """FP4 scales in either layout -> UE8M0 bytes uint8 [..., out, in/32]: checkpoint bytes as they are,
    fp4_kernel_scales' back (its NaN -> 255)."""
    if not is_fp4_kernel_layout(s):
        return as_e8m0_bytes(s)
    e = (lax.bitcast_convert_type(s, jnp.uint16) >> 7).astype(jnp.int32) & 0xFF
    return jnp.swapaxes(jnp.where(e == 255, 255, e - FP4_KERNEL_FOLD).astype(jnp.uint8), -1, -2)


def _held_byte_bits(w: int) -> np.ndarray:
    """[256] uint32: the bits of a held word that checkpoint byte b of a group's word w (its nibbles 2c, 2c + 1
    -- weights 8w + 2c, 8w + 2c + 1) fills, for every b (fp4_held_bit, nibbles 2w and 2w + 1 of the held word)."""
    b = np.arange(256)
    bits = np.zeros(256, np.uint32)
    for lane in range(2):
        for f in range(4):
            bits |= (((b >> (4 * lane + f)) & 1) << fp4_held_bit(2 * w + lane, f)).astype(np.uint32)
    return bits


_HELD_BYTE_BITS = np.stack([_held_byte_bits(w) for w in range(4)])      # [w, byte value]


@jax.jit   # compiled once: dispatched op by op, the loader's per-tensor conversion is many times slower
def fp4_kernel_weights(w: jax.Array) -> jax.Array:
    """Packed FP4 weights [..., out, in/2] (int8 / uint8, the checkpoint's E2M1 pairs) -> the swap kernels'
    operand: uint16 [..., out, in/4], each scale group's 16 bytes of a row held as four 32-bit words (two uint16,
    low first). Held word c of a group holds weights 8w + 2c + l (w = 0..3, l = 0, 1) in slot 2w + l, with their
    bits where the register decode finds them (fp4_held_bit), so that decoded word w of the thread holding word c
    is operand column 8w + 2c + l of the WGMMA layout: the weights' own order, the activations need none.
    Models hold routed experts' FP4 weights so (model.moe.Experts); as many bytes as the checkpoint's."""
    if w.dtype == jnp.uint16:
        return w
    *lead, out, half = w.shape
    if w.dtype not in (jnp.int8, jnp.uint8) or half % FP4_GROUP:
        raise ValueError(f"fp4_kernel_weights: packed FP4 [..., out, in/2] int8/uint8 with in/2 a multiple of "
                         f"{FP4_GROUP}, got {w.dtype} {w.shape}")
    byte = w.astype(jnp.uint8).reshape(*lead, out, half // FP4_GROUP, 4, 4)      # [..., out, group, w, c]
    held = jnp.zeros(byte.shape[:-2] + (4,), jnp.uint32)
    for src in range(4):                                                          # held word c |= bits of byte (w, c)
        held = held | jnp.asarray(_HELD_BYTE_BITS[src])[byte[..., src, :].astype(jnp.int32)]
    return lax.bitcast_convert_type(held, jnp.uint16).reshape(*lead, out, half // 2)


@jax.jit   # compiled once, as fp4_kernel_weights
def fp4_weight_bytes(w: jax.Array) -> jax.Array:
    """FP4 weights in either layout -> the checkpoint's packed int8 [..., out, in/2]."""
    if w.dtype != jnp.uint16:
        return w
    *lead, out, quarter = w.shape
    words = lax.bitcast_convert_type(w.reshape(*lead, out, quarter // 8, 4, 2), jnp.uint32)[..., None, :]
    # [..., out, g, 1 (w), c]
    byte = jnp.zeros(words.shape[:-2] + (4, 4), jnp.uint32)                           # [..., out, g, w, c]
    for lane in range(2):
        for f in range(4):
            src = jnp.asarray([fp4_held_bit(2 * s + lane, f) for s in range(4)], jnp.uint32)[:, None]
            byte = byte | (((words >> src) & 1) << (4 * lane + f))
    return byte.astype(jnp.uint8).reshape(*lead, out, 2 * quarter).astype(jnp.int8)


def fp4_logical_shape(w: jax.Array) -> tuple[int, ...]:
    """(..., out, in) of FP4 weights in either layout."""
    return (*w.shape[:-1], (4 if w.dtype == jnp.uint16 else 2) * w.shape[-1])


def swap_operands(fmt: str, w: jax.Array, s) -> tuple[jax.Array, ...]:
    """A weight's swap-kernel operands: (w,), FP8 (w, s), FP4 (fp4_kernel_weights, fp4_kernel_scales): held so by
    the model they go straight in; the checkpoint's bytes cost a conversion per call. bf16 scales save the decode
    kernels, bound by the integer ALU, two integer instructions per scale over bytes."""
    if fmt != "fp4":
        return (w,) if fmt == "dense" else (w, s)
    return fp4_kernel_weights(w), fp4_kernel_scales(s)
