"""experiments.trace_gaps on a synthetic profiler timeline: busy time as the union of overlapping kernels, idle
time and the largest gap per device stream, host events ignored."""

import gzip
import json

from experiments.trace_gaps import device_events, gaps, main


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
