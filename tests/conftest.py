"""Test-wide setup: CPU XLA with a cheaper backend optimisation level (compile time dominates the
tiny models' tests; numerics are unchanged), and the location of the shared golden data."""

import os
from pathlib import Path

if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import pytest  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"


@pytest.fixture(scope="session")
def golden_dir():
    """`../shared/golden` (read in place, never copied); tests skip cleanly where it is absent."""
    if not GOLDEN.is_dir():
        pytest.skip(f"golden data not found at {GOLDEN}")
    return GOLDEN
