"""Experiment records: where the scripts write them, and what today's roofline makes of a recorded step.

`save` writes `<prefix>_<stamp>_<tag>.json` (the record) and `.md` (its table) under experiments/results (or
`out_dir`), copied to $OUT when that is set (the device machine sends $OUT back).

`refloor` recomputes the floor of a recorded model step with experiments/roofline.py as it is now, at the best
measured and at the datasheet ceilings (experiments/hardware.py), so that a record made under older ceilings or
an older cost model reads against today's. A record's point maps to the roofline call as
`experiments.bench_floor.roofline_of` does (the same config, phase, batch, context, rows, weight format and mesh;
forced balance in benchmark mode; the drafter for a whole speculative step). It reads bench.py records (a JSON list), sweep
results (JSON lines) and peer_hf.py records (`{"meta", "records"}`: bf16 weights, uniform routing, one device):

    python -m experiments.records --refloor experiments/results/bench_<stamp>_gpu_<tag>.json [FILE ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.bench_report import RESULTS_DIR, copy_to_out


def save(record: dict, table: str, prefix: str, tag: str, out_dir: str | Path | None = None) -> list[Path]:
    """Write the JSON record and the markdown table (copied to $OUT); print the table. -> both paths."""
    d = Path(out_dir) if out_dir else RESULTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    base = d / f"{prefix}_{time.strftime('%Y%m%d-%H%M%S')}_{tag}"
    paths = [base.with_suffix(".json"), base.with_suffix(".md")]
    paths[0].write_text(json.dumps(record, indent=1))
    paths[1].write_text(table)
    copy_to_out(paths)
    print(table)
    return paths


# ----------------------------------------------------------------------------------------------- refloor

def load(path: str | Path) -> list[dict]:
    """The records of a results file: bench.py's JSON list, a sweep's JSON lines, or peer_hf.py's
    {"meta", "records"} (each of its records gets the meta under "peer_meta")."""
    text = Path(path).read_text()
    if Path(path).suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if isinstance(data, list):
        return data
    if isinstance(data, dict) and "records" in data and "transformers" in data.get("meta", {}):
        return [dict(r, peer_meta=data["meta"]) for r in data["records"]]
    raise ValueError(f"{path}: not a bench.py, sweep or peer_hf.py results file (a JSON list, JSON lines, or "
                     f"peer_hf's {{'meta', 'records'}})")


def _bench_point(rec: dict):
    """(cfg, Point) of a bench.py / sweep record, as the run built them."""
    from model import ModelConfig

    from experiments.bench import Point, resolve_config

    missing = [k for k in ("key", "preset", "step_ms") if k not in rec]
    if missing:
        raise ValueError(f"not a finished bench.py record: no {', '.join(missing)}")
    layers = rec.get("layers")
    if layers == ModelConfig.preset(rec["preset"]).num_layers:
        layers = None
    cfg = resolve_config(rec["preset"], layers, rec.get("moe_impl"), rec.get("attention_impl"),
                         rec.get("expert_weights"), rec.get("dense_weights"), rec.get("engram_vocab_size"),
                         rec.get("head_dtype"), rec.get("index_key_format"))
    k = rec["key"]
    p = Point(k["phase"], k["mode"], k["batch"], k["context"], k["new_tokens"], k.get("num_draft", 3),
              "" if k["phase"] == "prefill" else k.get("step", ""), k.get("replay", False), tuple(k["mesh"]))
    return cfg, p


def refloor(rec: dict) -> dict:
    """One finished record's step against today's roofline.

    -> {"point", "median_ms", "recorded": {floor_ms, fraction, ceilings}, "measured" / "datasheet": {floor_ms,
    fraction, mfu (prefill)}}: floor and fraction (floor / median) at the best measured and datasheet ceilings.
    """
    from experiments.hardware import H200_DATASHEET, H200_MEASURED

    if "peer_meta" in rec:
        return _refloor_peer(rec)
    from experiments.bench_floor import roofline_of
    from experiments.roofline_formats import uniform_mma

    cfg, p = _bench_point(rec)
    line, frac, extra = roofline_of(cfg, rec.get("dtype", "bfloat16"), p, rec)
    med_ms = rec["step_ms"]["median"]
    out = {"point": f"{cfg.name} {_weights(rec)}: {p.label()}", "median_ms": med_ms,
           "recorded": _recorded(rec.get("roofline"), med_ms),
           "measured": {"floor_ms": line["floor_ms"], "fraction": frac},
           "datasheet": {"floor_ms": line["datasheet"]["floor_ms"], "fraction": line["datasheet"]["fraction"]}}
    if p.phase == "prefill":
        mma = uniform_mma(line["weight_format"]) + "_flops"
        flops_s = line["flops_per_device"] / (med_ms / 1e3)
        out["measured"]["mfu"] = flops_s / H200_MEASURED[mma]
        out["datasheet"]["mfu"] = flops_s / H200_DATASHEET[mma]
    return out


def _refloor_peer(rec: dict) -> dict:
    from model import ModelConfig

    from experiments.hardware import H200_DATASHEET
    from experiments.layer_scaling import scale_layers
    from experiments.roofline import roofline

    meta = rec["peer_meta"]
    cfg = ModelConfig.preset(meta["config"])
    if meta.get("layers") and meta["layers"] != cfg.num_layers:
        cfg = scale_layers(cfg, meta["layers"])
    med_ms = rec["median_s"] * 1e3
    out = {"point": f"{cfg.name} HF peer (bf16): {rec['phase']} b={rec['batch']} ctx={rec['context']} "
                    f"rows={rec['rows']}", "median_ms": med_ms,
           "recorded": {"floor_ms": rec["roofline"]["floor_s"] * 1e3, "fraction": rec["roofline"]["fraction"],
                        "ceilings": None}}
    for name, ceilings in (("measured", None), ("datasheet", H200_DATASHEET)):
        floor = roofline(cfg, rec["phase"], rec["batch"], rec["context"], rec["rows"], "bf16",
                         ceilings=ceilings)["totals"]["floor_s"] * 1e3
        out[name] = {"floor_ms": floor, "fraction": floor / med_ms}
    return out


def _weights(rec: dict) -> str:
    dense = "fp8 dense" if rec.get("dense_weights") == "fp8" else "bf16 dense"
    return f"{dense} + {'fp4' if rec.get('expert_weights') == 'fp4' else 'bf16'} experts"


def _recorded(roof: dict | None, med_ms: float) -> dict:
    if not roof:
        return {"floor_ms": None, "fraction": None, "ceilings": None}
    c = roof.get("ceilings") or {}
    ceil = (f"{c['hbm_Bps'] / 1e12:.2f} TB/s, {c['bf16_flops'] / 1e12:.0f} / {c['fp8_flops'] / 1e12:.0f}"
            if c else None)
    return {"floor_ms": roof["floor_ms"], "fraction": roof["floor_ms"] / med_ms, "ceilings": ceil}


def refloor_file(path: str | Path) -> list[dict]:
    """refloor() of every finished ("ok") record of a results file, each with its "file"."""
    return [dict(refloor(r), file=Path(path).name) for r in load(path) if r.get("status", "ok") == "ok"]


def refloor_markdown(rows: list[dict]) -> str:
    def pct(x):
        return "" if x is None else f"{100 * x:.1f}%"

    def ms(x):
        return "" if x is None else f"{x:.3f}"

    out = ["| file | point | median ms | recorded floor ms (ceilings: HBM, bf16 / FP8) | % | floor ms, best measured "
           "| % | MFU | floor ms, datasheet | % | MFU |", "|" + "---|" * 12]
    for r in rows:
        rec, m, d = r["recorded"], r["measured"], r["datasheet"]
        out.append(f"| {r['file']} | {r['point']} | {r['median_ms']:.3f} | {ms(rec['floor_ms'])}"
                   f"{' (' + rec['ceilings'] + ')' if rec['ceilings'] else ''} | {pct(rec['fraction'])} "
                   f"| {ms(m['floor_ms'])} | {pct(m['fraction'])} | {pct(m.get('mfu'))} "
                   f"| {ms(d['floor_ms'])} | {pct(d['fraction'])} | {pct(d.get('mfu'))} |")
    return "\n".join(out) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.records", description=__doc__.split("\n\n")[0])
    p.add_argument("--refloor", nargs="+", required=True, metavar="FILE",
                   help="bench.py / sweep / peer_hf.py results files: their steps against today's roofline")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a markdown table")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = [row for path in args.refloor for row in refloor_file(path)]
    print(json.dumps(rows, indent=1) if args.json else refloor_markdown(rows))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
