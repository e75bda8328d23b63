"""[V4.1] Memory per device of a V4.1 model by Engram table placement, on meshes of 1, 2, 4 and 8 devices, from
abstract shapes (no weights, no devices): which layouts fit a device.

For each mesh of n devices (ep = n: the routed experts split over the devices, the batch too; attention and the
other weights replicated) and each placement (model.sharded.memory_per_device): the weights on a device other than
the Engram tables, the Engram tables on the device ("device": a whole copy; "sharded": a 1/n share) and in host
memory ("host": a 1/n share per device, one copy per host), the cache of `--seqs` sequences of `--max-len`
positions per device, their sum against the device's memory (experiments/hardware.py; H200: 139 GiB), and how
many such sequences the rest of the device holds. Weights in the release formats as the model holds them (FP8
dense with block scales, FP8 Engram rows with their scales, FP4 experts with their scales held as bf16: one byte
per 32 values more than the release).

    python -m experiments.engram_memory [--preset v41-flash] [--devices 1,2,4,8] [--seqs 64] [--max-len 32768]
"""

from __future__ import annotations

import argparse

from experiments.bench_report import command_line, environment, revision_label
from experiments.hardware import H200_MEASURED
from experiments.records import save

GIB = 2 ** 30


def rows(preset: str, devices: list[int], seqs: int, max_len: int, capacity: float) -> list[dict]:
    from model import ModelConfig
    from model.sharded import memory_per_device

    base = ModelConfig.preset(preset).replace(dense_weights="fp8", expert_weights="fp4", engram_tables="fp8")
    out = []
    for placement in ("device", "sharded", "host"):
        cfg = base.replace(engram_placement=placement)
        for n in devices:
            m = memory_per_device(cfg, 1, n, 1, seqs, max_len)
            weights = m["params"] - m["engram"]
            total = m["params"] + m["cache"]
            per_seq = m["cache"] / seqs
            out.append({"devices": n, "placement": placement, "weights_gib": weights / GIB,
                        "engram_device_gib": m["engram"] / GIB, "engram_host_gib": m["engram_host"] / GIB,
                        "cache_gib": m["cache"] / GIB, "total_gib": total / GIB, "fits": total <= capacity,
                        "max_seqs": max(0, int((capacity - m["params"]) // per_seq))})
    return out


def table(records: list[dict], env: dict, args, capacity: float) -> str:
    lines = [f"# Memory per device of {args.preset} by Engram placement (abstract shapes)", "",
             f"`{env['command']}` — {revision_label(env)}, "
             f"{env['date_utc']}. Release formats; mesh ep = devices; cache of {args.seqs} x {args.max_len} per "
             f"device; device memory {capacity / GIB:.0f} GiB.", "",
             f"| devices | Engram placement | weights (no Engram) GiB | Engram on device GiB | Engram in host memory "
             f"GiB per device | cache GiB | total GiB | fits | {args.max_len}-token sequences that fit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['devices']} | {r['placement']} | {r['weights_gib']:.1f} | {r['engram_device_gib']:.1f} | "
                     f"{r['engram_host_gib']:.1f} | {r['cache_gib']:.1f} | {r['total_gib']:.1f} | "
                     f"{'yes' if r['fits'] else 'no'} | {r['max_seqs']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="v41-flash")
    p.add_argument("--devices", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--seqs", type=int, default=64, help="sequences per device")
    p.add_argument("--max-len", type=int, default=32768)
    p.add_argument("--tag", default="v41_flash")
    p.add_argument("--out", default=None, help="results directory (default experiments/results)")
    args = p.parse_args(argv)
    capacity = H200_MEASURED["hbm_capacity_bytes"]
    env = environment(command_line(argv, "experiments.engram_memory"))
    records = rows(args.preset, args.devices, args.seqs, args.max_len, capacity)
    save({"env": env, "args": vars(args), "capacity_bytes": capacity, "records": records},
         table(records, env, args, capacity), "engram_memory", args.tag, args.out)


if __name__ == "__main__":
    main()
