"""Tool: how far a sequence's logits move with its batch-mates, with ModelConfig.batch_invariant off and on
(docs/batch_invariance.md). For each model and dtype: the max |difference| between a prompt's logits alone and the
same prompt at row ROW of a batch of BATCH (the other rows random tokens), for the default path and for the
batch-invariant one (0.0 is bitwise equal). Models: the golden checkpoints (`--golden`, default ../shared/golden)
or presets with random weights.

    python -m experiments.probes.batch_invariance                    # golden v4 and v41, float32 and bfloat16
    python -m experiments.probes.batch_invariance --models tiny-v4 --dtypes bfloat16
    python -m experiments.probes.batch_invariance --golden /path/to/shared/golden

Writes experiments/results/batch_invariance_<stamp>_<backend>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import jax
import numpy as np

from model import ModelConfig, init_random, load_checkpoint

GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"
RESULTS = Path(__file__).resolve().parents[1] / "results"
BATCH, ROW = 6, 3


def build(golden: Path, name: str, dtype: str, batch_invariant: bool):
    """A golden checkpoint ("v4", "v41") or a preset with random weights (seed 0)."""
    if name in ("v4", "v41"):
        if not (golden / name).is_dir():
            raise ValueError(f"golden checkpoint {name!r} not found under {golden} (pass --golden DIR)")
        return load_checkpoint(golden / name, dtype=dtype, batch_invariant=batch_invariant)
    return init_random(ModelConfig.preset(name).replace(batch_invariant=batch_invariant), seed=0, dtype=dtype)


def prompt_of(golden: Path, name: str, vocab: int, length: int) -> np.ndarray:
    """The golden model's first prompt, else random tokens. -> [1, S] int."""
    inputs = golden / name / "inputs.json"
    if inputs.is_file():
        return np.asarray(json.loads(inputs.read_text())["prompts"])[:1]
    return np.random.default_rng(0).integers(3, vocab - 2, (1, length))


def measure(golden: Path, name: str, dtype: str, length: int) -> dict:
    rec = {"model": name, "dtype": dtype, "batch": BATCH, "row": ROW}
    for on in (False, True):
        model = build(golden, name, dtype, on)
        seq = prompt_of(golden, name, model.config.vocab_size, length)
        batch = np.random.default_rng(1).integers(3, model.config.vocab_size - 2, (BATCH, seq.shape[1]))
        batch[ROW] = seq[0]
        alone = np.asarray(model(seq), np.float32)[0]
        inside = np.asarray(model(batch), np.float32)[ROW]
        rec["max_abs_" + ("on" if on else "off")] = float(np.max(np.abs(alone - inside)))
        rec["prompt_length"] = int(seq.shape[1])
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="v4,v41", help="golden names (v4, v41) or presets, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--golden", type=Path, default=GOLDEN, help="the golden checkpoints' directory")
    p.add_argument("--length", type=int, default=20, help="prompt length for the presets (golden: its prompt)")
    a = p.parse_args()
    recs = [measure(a.golden, m, d, a.length) for m in a.models.split(",") for d in a.dtypes.split(",")]
    backend = jax.default_backend()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"batch_invariance_{stamp}_{backend}.json"
    path.write_text(json.dumps({"tool": "experiments.probes.batch_invariance", "backend": backend,
                                "jax": jax.__version__, "records": recs}, indent=1) + "\n")
    print(f"| model | dtype | max abs, alone vs row {ROW} of {BATCH}: switch off | switch on |\n|---|---|---|---|")
    for r in recs:
        print(f"| {r['model']} | {r['dtype']} | {r['max_abs_off']:.3g} | {r['max_abs_on']:.3g} |")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
