"""experiments/compile_time.py: bench.py's prefill and verify programs compiled on abstract weights and
caches (nothing allocated), with trace/lower and compile times recorded."""

from __future__ import annotations

import json

from experiments import compile_time


def test_compiles_abstract_steps(tmp_path):
    out = compile_time.main(["--preset", "tiny-v4", "--layers", "3", "--context", "40", "--new-tokens", "8",
                             "--decode-batch", "2", "--out", str(tmp_path)])
    assert [r["step"] for r in out["records"]] == ["prefill", "verify"]
    assert [(r["batch"], r["rows"]) for r in out["records"]] == [(1, 8), (2, 4)]
    assert all(r["compile_s"] > 0 and r["trace_lower_s"] > 0 for r in out["records"])
    assert out["meta"]["layers"] == 3
    saved = json.loads(next(tmp_path.glob("compile_time_*.json")).read_text())
    assert saved["records"] == out["records"]
