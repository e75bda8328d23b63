"""Where the small experiment scripts put their results: `<prefix>_<stamp>_<tag>.json` (the record) and
`.md` (its table) under experiments/results (or `out_dir`), copied to $OUT when that is set (the device
machine sends $OUT back)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from experiments.bench import RESULTS_DIR, copy_to_out


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
