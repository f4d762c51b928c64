"""docs/reference/cli.md and docs/reference/events.md are generated (tools/docs_reference.py)
from the argparse parsers and the event union's JSON Schema: a page that differs from what
the generator makes now is stale, and this test names it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "tools" / "docs_reference.py")
assert _spec is not None and _spec.loader is not None
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


@pytest.mark.parametrize("page", ["cli", "events"])
def test_the_generated_reference_page_is_current(page):
    path = {"cli": gen.CLI_PAGE, "events": gen.EVENTS_PAGE}[page]
    make = gen.PAGES[path]
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: run python tools/docs_reference.py"
    assert path.read_text() == make(), f"{path.relative_to(ROOT)} is stale: run python tools/docs_reference.py"


def test_a_new_option_shows_on_the_cli_page(monkeypatch):
    # The check can fail: an option added to a parser makes the page it was generated into stale.
    import kvledger.cli

    build = kvledger.cli.build_parser

    def with_one_more():
        parser = build()
        parser.add_argument("--brand-new-option", help="an option the page does not list yet")
        return parser

    monkeypatch.setattr(kvledger.cli, "build_parser", with_one_more)
    assert "--brand-new-option" in gen.cli_markdown()
    assert gen.stale() == [gen.CLI_PAGE]


def test_every_event_type_has_its_section():
    import msgspec

    from kvledger.schemas.events import Event

    text = gen.EVENTS_PAGE.read_text()
    tags = msgspec.json.schema(Event)["discriminator"]["mapping"]
    assert len(tags) >= 14
    for tag, ref in tags.items():
        name = ref.rsplit("/", 1)[-1]
        assert f"| `{tag}` | [{name}](#{name.lower()}) |" in text and f"### {name}\n" in text
