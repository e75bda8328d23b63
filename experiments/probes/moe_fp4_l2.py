"""Probe: is the FP4 decode kernel bound by its own instruction stream or by feeding it from HBM?

The same Mosaic GPU swap kernels (decode tiles, V4-Flash expert widths) run twice per config:
  hbm - 256 experts, each owning one 16-token tile: every tile streams its expert's weights from HBM once
        (bench_moe's balanced decode);
  l2  - 2 experts (25 MB of FP4 weights, inside the H200's 50 MB L2) owning all the tiles: the same weight
        bytes per tile, but re-read from L2 by every tile.
Each line gives the gate/up and down kernels' CUPTI ms and the weight bytes they streamed per second (packed
E2M1 plus the held bf16 scales, times the tiles). If `l2` streams much faster than `hbm`, the kernels wait on
HBM (access pattern, latency); if about as fast, they are bound by their own instructions.

  python -m experiments.probes.moe_fp4_l2 [--configs JSON-list-of-MgpuConfig-fields]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_moe import D, I, LIMIT, time_fn
from pallas_kernels import moe as PK

DEFAULT = [dict(block_m=16, block_n=128, block_k=64, block_n_down=128, block_k_down=64, max_concurrent_steps=6,
                swap_ab=True, warp_specialized=False),
           dict(block_m=16, block_n=256, block_k=64, block_n_down=256, block_k_down=64, max_concurrent_steps=4,
                swap_ab=True, warp_specialized=False)]


def held_weights(e: int, key):
    """Random FP4 experts as the model holds them: (w1, w2, w3) fp4_kernel_weights, their fp4_kernel_scales."""
    ks = iter(jax.random.split(key, 6))

    def draw(n, m, per, lo, hi):
        return jax.random.randint(next(ks), (e, n, m // per), lo, hi)

    shapes = ((I, D), (D, I), (I, D))
    return tuple(PK.fp4_kernel_weights(draw(n, m, 2, -128, 128).astype(jnp.int8)) for n, m in shapes), \
        tuple(PK.fp4_kernel_scales(draw(n, m, 32, 119, 123).astype(jnp.uint8)) for n, m in shapes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=json.dumps(DEFAULT), help="JSON list of MgpuConfig fields")
    a = p.parse_args()
    per_matrix = I * D // 2 + I * D // 32 * 2          # packed bytes + bf16 scales of one [I, D] matrix
    for fields in json.loads(a.configs):
        cfg = PK.MgpuConfig(**fields)
        for name, e, tokens, k in (("hbm", 256, 1024, 4), ("l2", 2, 16 * 192, 2)):   # 16 rows per expert / 192 tiles
            ws, ss = held_weights(e, jax.random.key(e))
            rng = np.random.default_rng(0)
            ids = PK.forced_balance(tokens, e, k) if e > k else jnp.tile(jnp.arange(k, dtype=jnp.int32), (tokens, 1))
            w = jnp.asarray(rng.uniform(0.1, 0.3, (tokens, k)), jnp.float32)
            x = jnp.asarray(rng.standard_normal((tokens, D)), jnp.bfloat16)
            f = jax.jit(lambda x, ids, w, ws, ss: PK.moe_experts(x, ids, w, *ws, LIMIT, scales=ss, backend="mgpu",
                                                                 config=cfg))
            _, total, _, kernels, _, _ = time_fn(f, (x, ids, w, ws, ss), 10)
            tiles = int(np.sum(-(-np.bincount(np.asarray(ids).ravel(), minlength=e) // cfg.block_m)))
            mosaic = [t for n, t in kernels if "mosaic" in n]
            gate_up, down = mosaic[0], mosaic[-1]
            rate = lambda nbytes, ms: nbytes * tiles / (ms * 1e-3) / 1e12  # noqa: E731
            print(f"{name:3s} E={e:3d} tiles={tiles:4d} bn={cfg.block_n} steps={cfg.max_concurrent_steps}: "
                  f"gate/up {gate_up:.3f} ms = {rate(2 * per_matrix, gate_up):.2f} TB/s, down {down:.3f} ms = "
                  f"{rate(per_matrix, down):.2f} TB/s (block {total:.3f} ms)", flush=True)


if __name__ == "__main__":
    main()
