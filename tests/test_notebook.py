"""Execute experiments/notebooks/explore.ipynb headless on CPU (nbclient + an ipykernel `python3` kernel).

Skips cleanly where the notebook machinery (nbformat, nbclient, ipykernel, matplotlib) is not installed or
the kernel cannot start; a failing cell fails the test with the cell's error.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "experiments" / "notebooks" / "explore.ipynb"
TIMEOUT_S = 300  # the whole notebook: ~30 s on an idle 2-core CPU, up to ~60 s on a loaded one


@pytest.mark.slow
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
    assert len(images) >= 4, "mHC, indexer, expert-load and acceptance plots"
    for needle in ("max relative difference", "comb row sums", "layers with an indexer", "forced balance",
                   "mean accepted length"):
        assert needle in text, needle
    assert took < TIMEOUT_S
