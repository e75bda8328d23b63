"""Probe: what the FP4 swap kernels' per-call scale preparation costs in XLA, and cheaper spellings.

The swap kernels take each FP4 weight's UE8M0 scales transposed to [E, in/32, out] and as bf16 with the decode's
fold (`pallas_kernels.moe._swap_w`). At 7ec17d7 (part 39) CUPTI showed three transpose fusions per scale tensor,
0.19-0.20 ms each tensor, where the eleventh session's part 35 had one of 0.07 ms (same shapes). Parts 40-41
(H200, gate/up scales): that spelling -- signed 16-bit, two selects -- 0.198 ms in 3 kernels; unsigned with one
select 0.060 in 1 (e8m0_bf16 now); no select at all 0.062; the uint8 transpose alone 0.042.

Variants, CUPTI kernel time per call and the kernels of the compiled module, at V4-Flash's gate/up scales
[256, 2048, 128] and down scales [256, 4096, 64] (uint8):
  current        e8m0_bf16(swapaxes(s), 126)          (moe._swap_w's spelling; int16 and two selects until part 41)
  convert_first  swapaxes(e8m0_bf16(s, 126))
  shift_only     ((swapaxes(s) as uint16 + 126) << 7) bitcast to bf16, no NaN guards
  clamp          min(swapaxes(s) as uint16 + 126, 255) << 7: scales bf16 cannot hold become +inf
  where_u16      one select in uint16: NaN bits where b > 128, else (b + 126) << 7
  lookup         a 256-entry bf16 table indexed by swapaxes(s)
  u8_transpose   swapaxes(s) alone (what holding the scales in the kernel layout would remove)
Run: python -m experiments.probes.moe_fp4_scales   (GPU; on the CPU it only checks the variants agree)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_kernels import cupti_ms
from pallas_kernels.moe import FP4_KERNEL_FOLD as FOLD
from pallas_kernels.moe import e8m0_bf16

TABLE = np.asarray(e8m0_bf16(jnp.arange(256, dtype=jnp.uint8), FOLD))


def current(s):
    return e8m0_bf16(jnp.swapaxes(s, 1, 2), FOLD)


def convert_first(s):
    return jnp.swapaxes(e8m0_bf16(s, FOLD), 1, 2)


def shift_only(s):
    bits = (jnp.swapaxes(s, 1, 2).astype(jnp.uint16) + FOLD) << 7
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def clamp(s):
    bits = jnp.minimum(jnp.swapaxes(s, 1, 2).astype(jnp.uint16) + FOLD, 255) << 7
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def where_u16(s):
    b = jnp.swapaxes(s, 1, 2).astype(jnp.uint16)
    bits = jnp.where(b > 254 - FOLD, jnp.uint16(0x7FC0), (b + FOLD) << 7)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def lookup(s):
    return jnp.asarray(TABLE)[jnp.swapaxes(s, 1, 2)]


def u8_transpose(s):
    return jnp.swapaxes(s, 1, 2)


def main() -> None:
    gpu = jax.default_backend() == "gpu"
    shapes = [(256, 2048, 128), (256, 4096, 64)] if gpu else [(4, 64, 8)]
    rng = np.random.default_rng(0)
    for shape in shapes:
        s = jnp.asarray(rng.integers(110, 129, shape), jnp.uint8)
        print(f"scales {shape} uint8 (ms, CUPTI median of 20; kernels in the compiled module)", flush=True)
        outs = {}
        for fn in (current, convert_first, shift_only, clamp, where_u16, lookup, u8_transpose):
            f = jax.jit(fn)
            hlo = f.lower(s).compile().as_text()
            entry = hlo.split("ENTRY")[-1]
            kernels = len(re.findall(r"^\s*(?:ROOT )?\S+ = \S+ (?:fusion|transpose|copy)\(", entry, re.M))
            outs[fn.__name__] = np.asarray(f(s))
            t = float(np.median(cupti_ms(f, s, iterations=20))) if gpu else float("nan")
            print(f"{fn.__name__:>14} {t:8.4f}  kernels {kernels}", flush=True)
        for name in ("convert_first", "shift_only", "clamp", "where_u16", "lookup"):
            np.testing.assert_array_equal(outs["current"].view(np.uint16), outs[name].view(np.uint16))


if __name__ == "__main__":
    main()
