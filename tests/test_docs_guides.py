"""The guides' runnable examples run as written.

The marker is README's (tests/test_readme_example.py): a fenced ```python or ```bash block
whose opening fence is the line right after `<!-- runnable -->`. A guide is a walk-through,
so its marked blocks run in order, in one fresh temp dir per guide (a later block may use
what an earlier one wrote): python blocks in a fresh interpreter, bash blocks under
`bash -euo pipefail` with this venv's `kvledger` first on PATH. Each must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

GUIDES = Path(__file__).resolve().parents[1] / "docs" / "guides"
MARKER = "<!-- runnable -->"
_BLOCK = re.compile(r"^" + re.escape(MARKER) + r"[ \t]*\n```(python|bash)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
# Guides whose walk-through runs here (the PostgreSQL one needs a server and its roles).
EXPECTED = {"hf-model.md", "kv-events.md", "recover-after-crash.md", "reconcile-telemetry.md"}


def runnable_blocks(text: str) -> list[tuple[str, str]]:
    return _BLOCK.findall(text)


def test_the_marker_picks_marked_python_and_bash_blocks():
    text = (f"{MARKER}\n```python\nprint(1)\n```\n\n```python\nnot run\n```\n{MARKER}\n```bash\nls\n```\n"
            f"{MARKER}\n```sql\nSELECT 1;\n```\n")
    assert runnable_blocks(text) == [("python", "print(1)\n"), ("bash", "ls\n")]


def test_the_guides_mark_their_walk_throughs():
    marked = {p.name for p in GUIDES.glob("*.md") if runnable_blocks(p.read_text())}
    assert marked == EXPECTED, "a guide lost (or gained) its runnable marker: update EXPECTED with it"
    for p in GUIDES.glob("*.md"):
        markers = [line for line in p.read_text().splitlines() if line.strip() == MARKER]
        assert len(markers) == len(runnable_blocks(p.read_text())), f"{p.name}: a marker not before a block"


def _run(lang: str, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_DB", "KVLEDGER_FAULTS"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("guide", sorted(EXPECTED))
def test_guide_walk_through_runs(guide, tmp_path):
    for i, (lang, code) in enumerate(runnable_blocks((GUIDES / guide).read_text())):
        r = _run(lang, code, tmp_path)
        assert r.returncode == 0, (f"{guide} block {i} ({lang}) failed (exit {r.returncode}):\n{code}\n"
                                   f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
