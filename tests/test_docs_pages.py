"""The docs a user reads hold together: every relative link in README.md and docs/ names a
file that exists (and a heading that exists, when it names one), and docs/ without its
generated reference pages stays under 1,500 lines (issue 47: a guide, not a notebook)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"docs/reference/cli.md", "docs/reference/events.md"}
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    found = []
    for target in _LINK.findall(_FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # a URL: not checked here
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            found.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            found.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return found


def test_every_relative_link_resolves():
    broken = [b for page in pages() for b in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_the_link_check_finds_a_broken_one(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n[ok](a.md#top) [gone](b.md) [bad](a.md#nowhere) [web](https://x.y/z)\n"
                                   "```text\n[in a fence](c.md)\n```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken_links(tmp_path / "a.md") == ["a.md: b.md (no such file)", "a.md: a.md#nowhere (no such heading)"]
    finally:
        ROOT = saved


def test_docs_without_generated_pages_stay_under_1500_lines():
    counted = [p for p in (ROOT / "docs").rglob("*.md") if str(p.relative_to(ROOT)) not in GENERATED]
    total = sum(len(p.read_text().splitlines()) for p in counted)
    assert total < 1500, f"docs/ holds {total} lines without its generated reference pages"
