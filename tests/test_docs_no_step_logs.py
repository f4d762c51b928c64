"""No page of docs/ (nor README.md) and no module of the package points into the retired
step logs: "docs/COMPACT.md, step 21", "PERFORMANCE.md steps 12 and 21", "step 9 of
docs/PERFORMANCE.md". A reference names a page that exists and says why in its own words
(docs/decisions/ keeps the why). Only such pointers are caught: a "decode step", "step 5"
of a run, or a guide's "Step 1" do not name a log."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LOG = r"(?:docs/)?(?:PERFORMANCE|COMPACT)(?:\.md)?"
_STEP = r"\b[Ss]teps? \d+"
# a log named and a step number within one sentence-sized window, either way round
POINTER = re.compile(rf"{_LOG}[^.;]{{0,80}}?{_STEP}|{_STEP}[^.;]{{0,40}}?\bof {_LOG}|^#+ Step \d+", re.M)


def flattened(text: str) -> str:
    """The text with each line's indentation and comment marks gone and the lines joined, so
    a pointer that wraps (`docs/COMPACT.md,` then `# step 23`) reads as one phrase."""
    return " ".join(re.sub(r"^\s*#*\s*", "", line) for line in text.splitlines())


def pointers(text: str) -> list[str]:
    """Each pointer into a step log, once."""
    return list(dict.fromkeys(m.group(0) for source in (text, flattened(text)) for m in POINTER.finditer(source)))


def package_files() -> list[Path]:
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def test_the_pattern_names_log_pointers_and_nothing_else():
    assert pointers("see docs/COMPACT.md, step 21, for why") == ["docs/COMPACT.md, step 21"]
    assert pointers("# lists and loops (~40 array calls: docs/COMPACT.md,\n    # step 23).\n")
    assert pointers("as step 9 of docs/PERFORMANCE.md measured")
    assert pointers("## Step 12: a decode step stored as one row\n")
    assert pointers("(docs/PERFORMANCE.md, steps 12 and 21)")
    for fine in ("each decode step writes three events", "the record is damaged at step 5",
                 "Step 1: install kvledger", "docs/PERFORMANCE.md has the figures. Each step 3 events",
                 "every 64 steps a commit (PERFORMANCE.md)"):
        assert not pointers(fine), fine


def test_no_page_or_module_points_into_a_step_log():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *package_files()]
    assert len(files) > 100  # the walk reaches the package
    found = [f"{p.relative_to(ROOT)}: {hit!r}" for p in files for hit in pointers(p.read_text())]
    assert not found, "\n".join(found)
