"""README.md's example runs verbatim: the ```python block under "## Example", executed as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def example_code() -> str:
    """The first ```python block of README.md's "## Example" section."""
    text = README.read_text()
    section = re.search(r"^## Example\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no '## Example' section"
    block = re.search(r"^```python\n(.*?)^```", section.group(1), re.S | re.M)
    assert block, "README.md's Example section has no ```python block"
    return block.group(1)


def test_readme_example_runs(capsys):
    code = example_code()
    assert "from model import ModelConfig, init_random, load_checkpoint" in code   # the public API (DESIGN.md)
    assert "from sampling import generate" in code
    namespace: dict = {}
    exec(compile(code, f"{README}:Example", "exec"), namespace)
    out = namespace["out"]
    assert out.tokens.shape == (2, 16) and namespace["logits"].shape[:2] == (1, 4)
    assert capsys.readouterr().out  # it prints the tokens and stats
