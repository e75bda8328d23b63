"""Execute experiments/notebooks/explore.ipynb headless on CPU (nbclient + an ipykernel `python3` kernel), in the
default test run, and check the trained pair it loads (experiments/notebooks/tiny_markov/).

The notebook run skips cleanly where the notebook machinery (nbformat, nbclient, ipykernel, matplotlib) is not installed or
the kernel cannot start; a failing cell fails the test with the cell's error.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "experiments" / "notebooks" / "explore.ipynb"
TIMEOUT_S = 300  # the whole notebook: ~70 s on 2 CPU cores (most of it compiling), more on a loaded machine


def test_explore_notebook_runs_headless():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    from jupyter_client.kernelspec import NoSuchKernel

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # the kernel inherits this process's environment (conftest's CPU XLA flags); the notebook selects
    # matplotlib's inline backend itself, so figures come back as PNG outputs without a display
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    t0 = time.perf_counter()
    try:
        client.execute()
    except NoSuchKernel as e:
        pytest.skip(f"no python3 Jupyter kernel: {e}")
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"notebook cell failed:\n{str(e)[-4000:]}")
    except (RuntimeError, TimeoutError) as e:
        if "kernel" in str(e).lower() and "died" not in str(e).lower():
            pytest.skip(f"the Jupyter kernel could not start here: {e}")
        raise
    took = time.perf_counter() - t0
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert len(images) >= 6, "mHC, indexer, expert loads, acceptance, step breakdown and roofline figures"
    for needle in ("max relative difference", "comb row sums", "layers with an indexer", "forced balance",
                   "mean accepted length", "host gap", "v41-flash prefill", "notebook ran in"):
        assert needle in text, needle
    accepted = float(re.search(r"verify steps, mean accepted length ([\d.]+)", text).group(1))
    assert accepted > 2.5, f"the trained drafter should be accepted most of the time, got {accepted}"
    assert took < TIMEOUT_S


PAIR = NOTEBOOK.parent / "tiny_markov"


def test_trained_pair_is_small_and_is_what_its_recipe_builds():
    """The notebook's committed pair: under 1 MB, the configuration experiments/notebooks/tiny_markov.py trains,
    and a record saying its drafter was learnt (accepted length well above the untrained drafter's)."""
    from experiments.notebooks.tiny_markov import config
    from model.checkpoint import load_checkpoint

    size = sum(f.stat().st_size for f in PAIR.iterdir())
    assert size < 1_000_000, f"{PAIR}: {size} bytes"
    model = load_checkpoint(PAIR, dtype="float32")
    assert model.config.to_official_dict() == config().to_official_dict()
    rec = json.loads((PAIR / "train_record.json").read_text())
    assert rec["config"] == config().name and rec["saved_dtype"] == "bfloat16"
    assert rec["target_loss_last10"] < rec["entropy_floor"] + 0.15, "the target learnt the Markov language"
    assert rec["acceptance_before"]["mean_accepted_length"] < 1.5 < 3.0 < rec["acceptance_after"]["mean_accepted_length"]
    assert rec["acceptance_after"]["equals_plain_greedy"]


@pytest.mark.slow
def test_trained_pair_recipe_runs(tmp_path):
    """experiments/notebooks/tiny_markov.py end to end on a few steps (the committed pair took 300 + 200)."""
    from experiments.notebooks.tiny_markov import build
    from model.checkpoint import load_checkpoint

    rec = build(tmp_path, target_steps=2, drafter_steps=2)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors", "train_record.json"}
    assert load_checkpoint(tmp_path, dtype="float32").config.num_mtp_layers == 1
    assert rec["acceptance_after"]["equals_plain_greedy"]
