"""Where the small experiment scripts put their results: `<prefix>_<stamp>_<tag>.json` (the record) and
`.md` (its table) under experiments/results (or `out_dir`), copied to $OUT when that is set (the device
machine sends $OUT back)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def save(record: dict, table: str, prefix: str, tag: str, out_dir: str | Path | None = None) -> list[Path]:
    """Write the JSON record and the markdown table; print the table. -> the JSON paths written."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dirs = [Path(out_dir) if out_dir else RESULTS] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    written = []
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        base = d / f"{prefix}_{stamp}_{tag}"
        base.with_suffix(".json").write_text(json.dumps(record, indent=1))
        base.with_suffix(".md").write_text(table)
        written.append(base.with_suffix(".json"))
    print(table)
    return written
