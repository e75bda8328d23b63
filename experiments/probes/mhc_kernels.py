"""Tool: one sublayer's mHC at V4-Flash widths (n = 4 streams of D = 4096), the jnp path (model/mhc.py) against the
kernels (pallas_kernels/mhc.py), piece by piece: the coefficients, the collapse, the expand. For each row count it
prints the CUPTI kernel time of every piece (all kernels the piece launches; median of the calls) beside its HBM
floor (bytes read and written once at 4.4 TB/s), and each kernel piece's error against the jnp piece.

    python -m experiments.probes.mhc_kernels                      # GPU; rows 32, 256, 1024, 8192
    python -m experiments.probes.mhc_kernels --rows 64 --interpret   # CPU: the errors only (interpreted kernels)
    python -m experiments.probes.mhc_kernels --rows 256 --coef-tilings 32x4,16x1,32x1,64x2   # the coefficient
                                                      # kernel's rows per program x warps, one row each
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_kernels import cupti_ms
from model.mhc import collapse, expand, hc_coefficients
from pallas_kernels import mhc as K

N, D, HBM = 4, 4096, 4.4e12
EPS = dict(norm_eps=1e-6, hc_eps=1e-6)


def pieces(interpret, block_rows: int = 32, num_warps: int = 4):
    """name -> (jnp function, kernel function, bytes moved per row at the floor); the coefficient kernel tiled
    block_rows x num_warps."""
    tiling = dict(block_rows=block_rows, num_warps=num_warps)
    def ref_coef(x, fn, base, scale, f, carried):
        return hc_coefficients(fn, base, scale, x, sinkhorn_iters=20, **EPS)

    def ker_coef(x, fn, base, scale, f, carried):
        return K.coefficients(x, fn, base, scale, iters=20, interpret=interpret, **tiling, **EPS)

    def ref_collapse(x, fn, base, scale, f, carried):
        return collapse(x, carried)

    def ker_collapse(x, fn, base, scale, f, carried):
        return K.collapse(x, jnp.pad(carried, ((0, 0), (0, K.packed_width(N) - N))), interpret=interpret)

    def ref_expand(x, fn, base, scale, f, carried):
        _, post, comb = hc_coefficients(fn, base, scale, x, sinkhorn_iters=20, **EPS)
        return expand(x, f, post, comb)

    def ker_expand(x, fn, base, scale, f, carried):
        coef = K.coefficients(x, fn, base, scale, iters=20, interpret=interpret, **EPS)
        return K.mix_out(x, f, coef, interpret=interpret)

    x_bytes = N * D * 2
    return {"coefficients": (ref_coef, ker_coef, x_bytes),
            "collapse": (ref_collapse, ker_collapse, x_bytes + D * 2),
            "coefficients + expand": (ref_expand, ker_expand, 3 * x_bytes + D * 2)}


def inputs(rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    m = (2 + N) * N
    return (jnp.asarray(rng.normal(size=(rows, N, D)), jnp.bfloat16),
            jnp.asarray(rng.normal(size=(m, N * D)) * 0.05, jnp.float32),
            jnp.asarray(rng.normal(size=(m,)) * 0.2, jnp.float32),
            jnp.asarray(rng.normal(size=(3,)) * 0.2 + 0.5, jnp.float32),
            jnp.asarray(rng.normal(size=(rows, D)), jnp.bfloat16),
            jnp.asarray(rng.uniform(0.1, 1.0, size=(rows, N)), jnp.float32))


def error(got, want, rows: int) -> str:
    if isinstance(want, tuple):   # the coefficients: (pre, post, comb) against the packed rows
        want = jnp.concatenate([want[0], want[1], want[2].reshape(rows, N * N)], axis=1)
        got = got[:, :want.shape[1]]
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(g)):
        return "non-finite"
    return f"{np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30):.2e}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="32,256,1024,8192", help="token rows (comma list)")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--interpret", action="store_true", help="interpret the kernels (CPU): errors, no times")
    p.add_argument("--coef-tilings", default="", help="also time the coefficients at these ROWSxWARPS tilings of "
                   "its kernel (comma list, e.g. 16x1,32x1)")
    args = p.parse_args(argv)
    specs = [t.split("x") for t in args.coef_tilings.split(",") if t]
    if not all(len(t) == 2 and all(v.isdigit() for v in t) for t in specs):
        raise SystemExit(f"--coef-tilings: a comma list of ROWSxWARPS (e.g. 16x1,32x4), got {args.coef_tilings!r}")
    tilings = [(int(rows), int(warps)) for rows, warps in specs]
    gpu = jax.default_backend() == "gpu"
    interpret = True if args.interpret else None
    print("| rows | piece | jnp us | kernels us | floor us | kernels / floor | rel. error |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = inputs(rows)
        rows_pieces = dict(pieces(interpret))
        for br, warps in tilings:
            rows_pieces[f"coefficients ({br} rows x {warps} warps)"] = pieces(interpret, br, warps)["coefficients"]
        for name, (ref_fn, ker_fn, row_bytes) in rows_pieces.items():
            ref_f, ker_f = jax.jit(ref_fn), jax.jit(ker_fn)
            want, got = ref_f(*xs), ker_f(*xs)
            times = []
            for f in (ref_f, ker_f):
                t = cupti_ms(f, *xs, iterations=args.iterations) if gpu else None
                times.append(float(np.median(t)) * 1e3 if t else float("nan"))
            floor = rows * row_bytes / HBM * 1e6
            print(f"| {rows} | {name} | {times[0]:.1f} | {times[1]:.1f} | {floor:.1f} | {times[1] / floor:.2f} | "
                  f"{error(got, want, rows)} |", flush=True)


if __name__ == "__main__":
    main()
