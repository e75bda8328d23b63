"""experiments.trace_gaps on a synthetic profiler timeline: busy time as the union of overlapping kernels, idle
time and the largest gap per device stream, host events ignored; and the host's side: each call of the step and
its phases."""

import gzip
import json

from experiments.trace_gaps import device_events, gaps, host_calls, main


def _trace():
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    kernels = [("a", 0, 10), ("b", 5, 10), ("c", 20, 5), ("d", 40, 10)]   # b overlaps a; gaps 5 and 15 us
    return {"traceEvents": meta + [{"ph": "X", "pid": 1, "tid": 7, "name": n, "ts": t, "dur": d} for n, t, d in kernels]
            + [{"ph": "X", "pid": 2, "tid": 1, "name": "host", "ts": 0, "dur": 100}]}


def test_gaps_of_one_stream():
    streams = device_events(_trace())
    assert list(streams) == ["/device:GPU:0 / Stream #7"]
    g = gaps(streams["/device:GPU:0 / Stream #7"])
    assert (g["span_us"], g["busy_us"], g["idle_us"]) == (50, 30, 20)
    assert g["gaps"] == [(15, "c", "d"), (5, "b", "c")]


def test_cli_reads_a_folder(tmp_path, capsys):
    d = tmp_path / "decode_b_64" / "plugins" / "profile" / "stamp"
    d.mkdir(parents=True)
    with gzip.open(d / "vm.trace.json.gz", "wt") as f:
        json.dump(_trace(), f)
    main([str(tmp_path), "--steps", "2"])
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("| decode_b_64 | /device:GPU:0 / Stream #7 | 2 | 0.025 | 0.015 | 0.010 (40.0%) | 15.0 (c -> d)")


def _host_trace():
    """Two calls of a step on the host (the second nested in a copy of itself, as jax's profiler writes it) and
    the device's kernels: the first call finds the device idle, the second finds it busy."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    host = [("PjitFunction(jit(f))", 0, 100), ("PjitFunction(jit(f))", 1, 98),
            ("PjRtCApiLoadedExecutable::Execute", 30, 60), ("CommonPjRtLoadedExecutable::ExecutePrepare", 32, 8),
            ("Thunks::Prepare", 42, 4),
            ("command_buffer::update", 50, 10), ("cuGraphLaunch (CudaGraph:1)", 62, 20),
            ("PjitFunction(jit(f))", 150, 50), ("PjRtCApiLoadedExecutable::Execute", 160, 30)]
    device = [("k1", 70, 90), ("k2", 160, 60)]
    return {"traceEvents": meta + [{"ph": "X", "pid": 2, "tid": 1, "name": n, "ts": t, "dur": d} for n, t, d in host]
            + [{"ph": "X", "pid": 1, "tid": 7, "name": n, "ts": t, "dur": d} for n, t, d in device]}


def test_host_calls_and_their_phases():
    first, second = host_calls(_host_trace())
    assert first["dispatch_us"] == 100 and first["to_device_us"] == 70
    assert first["phases"] == {"jax": 30, "inputs": 8, "thunks": 4, "graph update": 10, "graph launch": 20}
    assert second["dispatch_us"] == 50 and second["to_device_us"] is None   # k1 still runs when it starts
    assert second["phases"]["jax"] == 10 and second["phases"]["graph launch"] == 0
