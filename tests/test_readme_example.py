"""README.md's runnable examples run as written.

The marker: a fenced ```python block whose opening fence is the line right after an HTML
comment line `<!-- runnable -->` (invisible on the rendered page). Each such block runs
alone, in a fresh Python subprocess whose working directory is an empty temp dir (so a
`sqlite:///kv.db` lands there), and must exit 0; a failure shows the block's output.
Blocks without the marker (they need a model or a name from an earlier block) are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- runnable -->"
_BLOCK = re.compile(r"^" + re.escape(MARKER) + r"[ \t]*\n```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def runnable_blocks(text: str) -> list[str]:
    return _BLOCK.findall(text)


def test_the_marker_picks_only_marked_python_blocks():
    text = f"{MARKER}\n```python\nprint(1)\n```\n\n```python\nnot run\n```\n{MARKER}\n```bash\nls\n```\n"
    assert runnable_blocks(text) == ["print(1)\n"]


def test_the_readme_marks_its_python_api_example():
    blocks = runnable_blocks(README.read_text())
    assert any("Ledger.open" in b for b in blocks), "the Python API example lost its runnable marker"
    markers = [line for line in README.read_text().splitlines() if line.strip() == MARKER]
    assert len(markers) == len(blocks), "a marker line that is not followed by a python block"


@pytest.mark.parametrize("index", range(len(runnable_blocks(README.read_text()))))
def test_readme_block_runs(index, tmp_path):
    code = runnable_blocks(README.read_text())[index]
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={k: v for k, v in os.environ.items() if k != "KVLEDGER_DB"})
    assert r.returncode == 0, f"README block {index} failed (exit {r.returncode}):\n{code}\n--- stdout\n" \
                              f"{r.stdout}\n--- stderr\n{r.stderr}"
