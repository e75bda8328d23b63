"""[V4.1] What fetching the Engram rows costs per step, by table placement, at V4.1 widths.

A step hashes its tokens at the start and fetches every Engram layer's rows at once (model/engram.py
`engram_rows`): 2 layers x 24 columns of FP8 rows (256 E4M3 bytes + 8 UE8M0 bytes), dequantised to bf16. This
times that fetch for T tokens per step (decode: the batch x the verify rows; prefill: the chunk) for each way of
holding the tables:

    device          a whole copy in device memory (replicated placement), a local gather
    host            the tables in host memory (pinned_host), gathered by a host computation inside the program
                    and copied to the device (engram_placement="host")
    host_callback   the synchronous alternative that host placement replaces: a Python callback gathers the rows
                    with numpy (jax.pure_callback), for comparison
    sharded/EX      rows split over every local device, fetched by the exchange EX (engram_placement="sharded";
                    with more than one device)
    host/EX         host tables split over the devices' host memory, the same exchanges (more than one device)

`alone` is the fetch by itself; `beside_work` runs it in one program beside a fixed device workload (a chain of
square GEMMs, about a layer's worth: the first Engram layer's rows are needed after embedding and layer 0, the
second's after layer 13) and `added_to_work` is the time it adds to that workload, i.e. the part of the fetch that
the device's other work did not hide. Tables hold `--rows` rows each (the real ones hold 384M: 2 x 101 GB; a
gather's cost per row does not depend on the table's size once it is far beyond the caches and the TLB's reach),
ids uniform within each column's range.

    python -m experiments.bench_engram [--rows 4000000] [--tokens 1,256,4096] [--placements ...] [--tag cpu]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_report import command_line, environment, revision_label
from experiments.records import save

COLUMNS, LAYERS, HEAD_DIM = 24, 2, 256   # V4.1-Flash: 3 n-gram orders x 8 heads, layers 1 and 14, 256-wide rows
SCALES = HEAD_DIM // 32
PLACEMENTS = ("device", "host", "host_callback", "sharded/all_to_all", "sharded/all_gather", "host/all_to_all",
              "host/all_gather")


def make_tables(rows: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """LAYERS tables as shipped: (E4M3 rows [R, 256], UE8M0 bytes [R, 8]), random bytes of finite values."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(LAYERS):
        w = rng.integers(0, 0x7E, (rows, HEAD_DIM), dtype=np.uint8)   # E4M3 bytes below NaN
        out.append((w.view(ml_dtypes.float8_e4m3fn), rng.integers(100, 140, (rows, SCALES), dtype=np.uint8)))
    return out


def columns_of(rows: int) -> tuple[tuple[int, int], ...]:
    """The table's 24 column ranges, equal shares of its rows (the real ones are 24 primes near 16M)."""
    edges = np.linspace(0, rows, COLUMNS + 1).astype(np.int64)
    return tuple((int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]))


def make_ids(tokens: int, rows: int, seed: int) -> np.ndarray:
    """[T, LAYERS, COLUMNS] int32 ids, uniform within each column's range."""
    rng = np.random.default_rng(seed)
    lo, hi = np.array(columns_of(rows)).T
    return (lo + (rng.random((tokens, LAYERS, COLUMNS)) * (hi - lo)).astype(np.int64)).astype(np.int32)


def fetch_function(placement: str, tables_np, mesh):
    """(fetch(tables, ids [T, L, C]) -> bf16 rows [T, L, C, 256], the tables placed for it)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from model.engram import dequant_fp8_rows
    from sharding.row_lookup import HOST_MEMORY, SPLIT, RowLookup, take_table

    rows = tables_np[0][0].shape[0]
    cols = columns_of(rows)
    kind, _, exchange = placement.partition("/")
    dev = jax.devices()[0]
    values = lambda held: dequant_fp8_rows(*held).astype(jnp.bfloat16)  # noqa: E731

    if placement == "host_callback":
        def gather(ids):
            return tuple(np.stack([t[a][np.asarray(ids)[:, j]] for j, t in enumerate(tables_np)], 1) for a in (0, 1))

        shapes = lambda ids: (jax.ShapeDtypeStruct((*ids.shape, HEAD_DIM), tables_np[0][0].dtype),  # noqa: E731
                              jax.ShapeDtypeStruct((*ids.shape, SCALES), jnp.uint8))
        return jax.jit(lambda tables, ids: values(jax.pure_callback(gather, shapes(ids), ids))), ()
    if exchange:
        if mesh is None:
            raise ValueError(f"{placement}: split tables need more than one device")
        split = NamedSharding(mesh, P(SPLIT), memory_kind=HOST_MEMORY if kind == "host" else None)
        pad = -rows % mesh.devices.size
        placed = [tuple(jax.device_put(np.pad(a, ((0, pad), (0, 0))), split) for a in t) for t in tables_np]
        look = RowLookup(mesh, exchange)

        def fetch(tables, ids):
            got = look(list(tables), [ids[:, j] for j in range(LAYERS)], [cols] * LAYERS)
            return jnp.stack([values(g) for g in got], 1)

        return jax.jit(fetch), placed
    where = jax.sharding.SingleDeviceSharding(dev, memory_kind=HOST_MEMORY if kind == "host" else None)
    placed = [tuple(jax.device_put(a, where) for a in t) for t in tables_np]
    return jax.jit(lambda tables, ids: jnp.stack([values(take_table(t, ids[:, j])) for j, t in enumerate(tables)],
                                                 1)), placed


def timed(fn, *args, repeats: int) -> float:
    """Median wall-clock ms of `fn(*args)` (compiled and warmed first)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def workload(size: int, chain: int):
    """A device workload to hide a fetch behind: `chain` dependent [size, size] bf16 GEMMs."""
    def work(a):
        for _ in range(chain):
            a = (a @ a) * (1.0 / size)
        return a
    return work


def run(args) -> list[dict]:
    tables_np = make_tables(args.rows)
    mesh = None
    if jax.device_count() > 1:
        from sharding import ParallelConfig
        mesh = ParallelConfig(ep=jax.device_count()).make_mesh()
    work = workload(args.work_size, args.work_chain)
    a = jnp.ones((args.work_size, args.work_size), jnp.bfloat16)
    work_ms = timed(jax.jit(work), a, repeats=args.repeats)
    records = []
    for placement in args.placements:
        if "/" in placement and mesh is None:
            continue
        fetch, placed = fetch_function(placement, tables_np, mesh)
        both = jax.jit(lambda t, i, a: (fetch(t, i), work(a)))
        for tokens in args.tokens:
            ids = jnp.asarray(make_ids(tokens, args.rows, tokens))
            if mesh is not None and "/" in placement and tokens % mesh.devices.size == 0:
                from sharding import batch_sharding
                ids = jax.device_put(ids, batch_sharding(mesh, 3))
            alone = timed(fetch, placed, ids, repeats=args.repeats)
            beside = timed(both, placed, ids, a, repeats=args.repeats)
            rows = tokens * LAYERS * COLUMNS
            records.append({"placement": placement, "tokens": tokens, "rows_fetched": rows,
                            "bytes_fetched": rows * (HEAD_DIM + SCALES), "alone_ms": alone, "beside_work_ms": beside,
                            "work_ms": work_ms, "added_to_work_ms": beside - work_ms,
                            "devices": 1 if "/" not in placement else int(mesh.devices.size)})
            print(f"{placement:20s} T={tokens:5d}: alone {alone:8.3f} ms, added to {work_ms:.2f} ms of work "
                  f"{beside - work_ms:8.3f} ms", flush=True)
    return records


def table(records: list[dict], env: dict, args) -> str:
    work_ms = records[0]["work_ms"] if records else float("nan")
    lines = [f"# Engram row fetch per step ({env['device']} x {env['device_count']}, jax {env['jax']})", "",
             f"`{env['command']}` — {revision_label(env)}, "
             f"{env['date_utc']}. Tables of {args.rows} rows x (256 + 8) B, {LAYERS} layers x {COLUMNS} columns, "
             f"dequantised to bf16; work: {args.work_chain} x {args.work_size}^2 bf16 GEMMs ({work_ms:.2f} ms).", "",
             "| placement | tokens | rows | MB | alone ms | added to the work ms |",
             "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['placement']} | {r['tokens']} | {r['rows_fetched']} | {r['bytes_fetched'] / 1e6:.2f} | "
                     f"{r['alone_ms']:.3f} | {r['added_to_work_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4_000_000, help="rows per table (real: 384M)")
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 256, 4096],
                   help="tokens per step")
    p.add_argument("--placements", type=lambda s: s.split(","), default=list(PLACEMENTS))
    p.add_argument("--work-size", type=int, default=None, help="GEMM size of the workload (GPU 8192, CPU 512)")
    p.add_argument("--work-chain", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tag", default=None)
    p.add_argument("--out", default=None, help="results directory (default experiments/results)")
    args = p.parse_args(argv)
    bad = [x for x in args.placements if x not in PLACEMENTS]
    if bad:
        raise SystemExit(f"unknown placements {bad}; choose from {PLACEMENTS}")
    gpu = jax.default_backend() == "gpu"
    args.work_size = args.work_size or (8192 if gpu else 512)
    env = environment(command_line(argv, "experiments.bench_engram"))
    records = run(args)
    save({"env": env, "args": vars(args), "records": records}, table(records, env, args), "bench_engram",
         args.tag or ("gpu" if gpu else "cpu"), args.out)


if __name__ == "__main__":
    main()
