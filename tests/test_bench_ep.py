"""experiments/bench_ep.py on 4 simulated CPU devices: the expert-parallel MoE block timed whole and with
its transport alone (impl="comm_only"), for all-to-all dispatch and replicate-and-reduce."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from common import simulated_devices_env

ROOT = Path(__file__).resolve().parents[1]


def test_full_and_transport_alone(tmp_path):
    env = simulated_devices_env(4, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "experiments.bench_ep", "--small", "--mesh", "2,2,1", "--tokens", "16,6",
           "--transport", "gather", "--impl", "reference", "--repeats", "2", "--warmup", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skip 6 tokens" in proc.stdout  # not a multiple of dp*ep
    out = json.loads(next(tmp_path.glob("bench_ep_*.json")).read_text())
    assert {(r["tokens"], r["path"]) for r in out["records"]} == {(16, "all_to_all/gather"), (16, "replicate")}
    for r in out["records"]:
        assert r["full_ms"] > 0 and r["comm_ms"] > 0 and r["comm_share"] == r["comm_ms"] / r["full_ms"]
    assert out["meta"]["experts"] == 16 and out["meta"]["devices"].startswith("4 x")
