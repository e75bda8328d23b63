"""Tool: what the device does between kernels, from a profiler timeline (`experiments.bench --trace DIR` writes one
per configuration: DIR/<configuration>/plugins/profile/<stamp>/*.trace.json.gz). For each device stream it prints
the span of the traced steps, the time its kernels keep it busy, the idle time between them, and the largest
gaps with the kernels on either side; divided by --steps (the bench traces two).

    python -m experiments.trace_gaps experiments/results/trace             # every trace under the folder
    python -m experiments.trace_gaps TRACE.trace.json.gz --steps 2 --gaps 5
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def device_events(trace: dict) -> dict[str, list[dict]]:
    """The complete ("X") events of each device stream, by 'process / thread' name, in start order."""
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    streams: dict[str, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and "/device:" in procs.get(e["pid"], ""):
            streams.setdefault(f"{procs[e['pid']]} / {threads.get((e['pid'], e.get('tid')), '?')}", []).append(e)
    return {k: sorted(v, key=lambda e: e["ts"]) for k, v in streams.items()}


def gaps(events: list[dict]) -> dict:
    """Span, busy (the union of the kernels' intervals) and idle time in us, and the gaps largest first
    [(us, kernel before, kernel after)]."""
    span = max(e["ts"] + e["dur"] for e in events) - events[0]["ts"]
    busy, end, holes = 0.0, events[0]["ts"], []
    for prev, e in zip([None] + events[:-1], events):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if start > end:   # never the first event: `end` starts at its start
            holes.append((start - end, prev["name"], e["name"]))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "gaps": sorted(holes, reverse=True)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a .trace.json.gz, or a folder searched for them")
    p.add_argument("--steps", type=int, default=2, help="steps in each trace (per-step figures divide by it)")
    p.add_argument("--gaps", type=int, default=3, help="largest gaps to list per stream")
    args = p.parse_args(argv)
    root = Path(args.path)
    files = [root] if root.is_file() else sorted(root.rglob("*.trace.json.gz"))
    if not files:
        raise SystemExit(f"no *.trace.json.gz under {root}")
    print("| trace | stream | kernels | span ms / step | busy ms / step | idle ms / step (%) | largest gaps us |")
    print("|---|---|---:|---:|---:|---:|---|")
    for f in files:
        for stream, events in device_events(json.load(gzip.open(f))).items():
            g, n = gaps(events), args.steps
            largest = "; ".join(f"{us:.1f} ({a[:24]} -> {b[:24]})" for us, a, b in g["gaps"][:args.gaps])
            name = f.relative_to(root).parts[0] if f != root else f.name
            idle_share = 100 * g["idle_us"] / g["span_us"]
            print(f"| {name} | {stream} | {len(events) // n} | {g['span_us'] / n / 1e3:.3f} | "
                  f"{g['busy_us'] / n / 1e3:.3f} | {g['idle_us'] / n / 1e3:.3f} ({idle_share:.1f}%) | {largest} |")


if __name__ == "__main__":
    main()
