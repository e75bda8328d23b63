"""experiments/records.py refloor: a recorded step against today's roofline, at both ceilings."""

import json

import pytest

from experiments import records
from experiments.hardware import H200_DATASHEET
from experiments.roofline import roofline
from model import ModelConfig


def bench_record(phase="decode", mode="deepinfer", batch=4, context=64, median_ms=2.0, **over) -> dict:
    rows = 256 if phase == "prefill" else 4
    rec = {"key": {"phase": phase, "mode": mode, "batch": batch, "context": context, "new_tokens": rows,
                   "num_draft": 0 if phase == "prefill" else 3, "step": "prefill" if phase == "prefill" else
                   ("verify" if mode == "deepinfer" else "spec"), "replay": False, "mesh": [1, 1, 1]},
           "preset": "tiny-v4", "layers": ModelConfig.preset("tiny-v4").num_layers, "dtype": "float32",
           "moe_impl": "reference", "attention_impl": "reference", "expert_weights": "fp4",
           "dense_weights": "model", "status": "ok", "step_ms": {"median": median_ms},
           "roofline": {"floor_ms": 1.0, "ceilings": {"hbm_Bps": 3.4e12, "bf16_flops": 700e12,
                                                      "fp8_flops": 1116e12}}}
    rec.update(over)
    return rec


@pytest.mark.parametrize("phase,mode", [("decode", "deepinfer"), ("prefill", "deepinfer"), ("decode", "realistic")])
def test_refloor_matches_the_roofline_at_both_ceilings(phase, mode):
    rec = bench_record(phase, mode)
    got = records.refloor(rec)
    cfg = ModelConfig.preset("tiny-v4").replace(expert_weights="fp4")
    rows = 256 if phase == "prefill" else 4
    args = (cfg, phase, 4, 64, rows, "bf16-fp4-experts", "bf16", (1, 1, 1))
    kw = {"forced_balance": mode == "deepinfer", "drafter": mode == "realistic"}
    for name, ceilings in (("measured", None), ("datasheet", H200_DATASHEET)):
        floor = roofline(*args, ceilings=ceilings, **kw)["totals"]["floor_s"] * 1e3
        assert got[name]["floor_ms"] == pytest.approx(floor)
        assert got[name]["fraction"] == pytest.approx(floor / 2.0)
    assert got["datasheet"]["floor_ms"] < got["measured"]["floor_ms"]
    assert got["recorded"] == {"floor_ms": 1.0, "fraction": 0.5, "ceilings": "3.40 TB/s, 700 / 1116"}
    assert ("mfu" in got["measured"]) == (phase == "prefill")


def test_refloor_file_reads_bench_sweep_and_peer_files(tmp_path, capsys):
    bench = tmp_path / "bench_x.json"
    bench.write_text(json.dumps([bench_record(), bench_record(status="refused")]))
    sweep = tmp_path / "sweep_x.jsonl"
    sweep.write_text("\n".join(json.dumps(bench_record(batch=b)) for b in (2, 8)) + "\n")
    peer = tmp_path / "peer_hf_x.json"
    peer.write_text(json.dumps({"meta": {"config": "tiny-v4", "layers": 6, "transformers": "5.24"},
                                "records": [{"phase": "decode", "batch": 2, "context": 32, "rows": 4,
                                             "median_s": 0.01, "roofline": {"floor_s": 0.001, "fraction": 0.1}}]}))
    rows = records.main(["--refloor", str(bench), str(sweep), str(peer)])
    assert [r["file"] for r in rows] == ["bench_x.json", "sweep_x.jsonl", "sweep_x.jsonl", "peer_hf_x.json"]
    peer_row = rows[-1]
    assert peer_row["measured"]["floor_ms"] == pytest.approx(
        roofline(ModelConfig.preset("tiny-v4"), "decode", 2, 32, 4, "bf16")["totals"]["floor_s"] * 1e3)
    table = capsys.readouterr().out
    assert len(table.strip().splitlines()) == 2 + len(rows) and "tiny-v4 bf16 dense + fp4 experts" in table


def test_refloor_rejects_what_is_not_a_record(tmp_path):
    with pytest.raises(ValueError, match="not a finished bench.py record: no key, step_ms"):
        records.refloor({"preset": "tiny-v4"})
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"records": []}))
    with pytest.raises(ValueError, match="not a bench.py, sweep or peer_hf.py results file"):
        records.load(bad)
