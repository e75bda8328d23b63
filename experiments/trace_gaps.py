"""Tool: what the device does between kernels, from a profiler timeline (`experiments.bench --trace DIR` writes one
per configuration: DIR/<configuration>/plugins/profile/<stamp>/*.trace.json.gz). For each device stream it prints
the span of the traced steps, the time its kernels keep it busy, the idle time between them, and the largest
gaps with the kernels on either side; divided by --steps (the bench traces two). `--host`: what the host does to
hand each step to the device instead: per call of the jitted step, how long the call takes to return, how long
until the device's first kernel, and the runtime's phases inside the call (`HOST_PHASES`).

    python -m experiments.trace_gaps experiments/results/trace             # every trace under the folder
    python -m experiments.trace_gaps TRACE.trace.json.gz --steps 2 --gaps 5
    python -m experiments.trace_gaps TRACE.trace.json.gz --host
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def _process_names(events: list[dict]) -> dict:
    """pid -> the process's name ("/device:GPU:0", "/host:CPU", ...) from the timeline's metadata events."""
    return {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}


def _label(f: Path, root: Path) -> str:
    """A timeline's name in the tables: its configuration's folder under root, or its file name."""
    return f.relative_to(root).parts[0] if f != root else f.name


def device_events(trace: dict) -> dict[str, list[dict]]:
    """The complete ("X") events of each device stream, by 'process / thread' name, in start order."""
    events = trace["traceEvents"]
    procs = _process_names(events)
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


# The runtime's work inside a call of a jitted step, by the profiler's event names (PJRT / XLA:GPU): the
# executable's inputs prepared, its thunks prepared, the command buffer (CUDA graph) updated for buffers that
# moved, the graph launched. Before them jax reads the arguments until the runtime's first event (RUNTIME).
HOST_PHASES = {"inputs": ("ExecutePrepare",),
               "thunks": ("Thunks::Prepare", "Thunks::Initialize"), "graph update": ("command_buffer::update",),
               "graph launch": ("cuGraphLaunch",)}
STEP_CALL = "PjitFunction("
RUNTIME = "LoadedExecutable::Execute"


def host_calls(trace: dict) -> list[dict]:
    """Each outermost call of a jitted step on a host thread -> {name, dispatch_us (the call until it returns),
    to_device_us (the call's start to the first device kernel after it, where the device was idle when the call
    began; else None: that kernel may be an earlier call's), phases {"jax": the call's start to the runtime's
    first event, then each HOST_PHASES name: us}}, in time order."""
    events = trace["traceEvents"]
    procs = _process_names(events)
    done = [e for e in events if e.get("ph") == "X"]
    device = sorted((e["ts"], e["ts"] + e["dur"]) for e in done if "/device:" in procs.get(e["pid"], ""))
    host = sorted((e for e in done if "/device:" not in procs.get(e["pid"], "")), key=lambda e: (e["ts"], -e["dur"]))
    calls, end = [], -1.0
    for e in host:
        if e["name"].startswith(STEP_CALL) and e["ts"] >= end:   # not nested in the call before
            calls.append(e)
            end = e["ts"] + e["dur"]
    out = []
    for c in calls:
        inside = [e for e in host if e["tid"] == c["tid"] and c["ts"] <= e["ts"] <= c["ts"] + c["dur"]]
        runtime = next((e["ts"] for e in inside if RUNTIME in e["name"]), c["ts"] + c["dur"])
        phases = {"jax": runtime - c["ts"]}
        phases.update({name: sum(e["dur"] for e in inside if any(m in e["name"] for m in marks))
                       for name, marks in HOST_PHASES.items()})
        busy = any(a <= c["ts"] < b for a, b in device)
        first = next((a for a, _ in device if a >= c["ts"]), None)
        out.append({"name": c["name"], "dispatch_us": c["dur"], "phases": phases,
                    "to_device_us": None if busy or first is None else first - c["ts"]})
    return out


def print_host(files: list[Path], root: Path) -> None:
    names = ["jax", *HOST_PHASES]
    print("| trace | call | returns after ms | first kernel after ms | " + " | ".join(f"{n} ms" for n in names) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(names))
    for f in files:
        name = _label(f, root)
        for i, c in enumerate(host_calls(json.load(gzip.open(f)))):
            first = "" if c["to_device_us"] is None else f"{c['to_device_us'] / 1e3:.3f}"
            cols = " | ".join(f"{c['phases'][n] / 1e3:.3f}" for n in names)
            print(f"| {name} | {i + 1}: {c['name'][:40]} | {c['dispatch_us'] / 1e3:.3f} | {first} | {cols} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a .trace.json.gz, or a folder searched for them")
    p.add_argument("--steps", type=int, default=2, help="steps in each trace (per-step figures divide by it)")
    p.add_argument("--gaps", type=int, default=3, help="largest gaps to list per stream")
    p.add_argument("--host", action="store_true", help="the host's side instead: each call of the step, its "
                   "return, the device's first kernel after it and the runtime's phases inside it")
    args = p.parse_args(argv)
    root = Path(args.path)
    files = [root] if root.is_file() else sorted(root.rglob("*.trace.json.gz"))
    if not files:
        raise SystemExit(f"no *.trace.json.gz under {root}")
    if args.host:
        print_host(files, root)
        return
    print("| trace | stream | kernels | span ms / step | busy ms / step | idle ms / step (%) | largest gaps us |")
    print("|---|---|---:|---:|---:|---:|---|")
    for f in files:
        for stream, events in device_events(json.load(gzip.open(f))).items():
            g, n = gaps(events), args.steps
            largest = "; ".join(f"{us:.1f} ({a[:24]} -> {b[:24]})" for us, a, b in g["gaps"][:args.gaps])
            name = _label(f, root)
            idle_share = 100 * g["idle_us"] / g["span_us"]
            print(f"| {name} | {stream} | {len(events) // n} | {g['span_us'] / n / 1e3:.3f} | "
                  f"{g['busy_us'] / n / 1e3:.3f} | {g['idle_us'] / n / 1e3:.3f} ({idle_share:.1f}%) | {largest} |")


if __name__ == "__main__":
    main()
