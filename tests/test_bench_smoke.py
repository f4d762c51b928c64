"""CI smoke run of the benchmark harness: `python -m bench --smoke --json` at tiny sizes
must finish, and print every headline key as a number (no thresholds here: CI machines
are too noisy to hold a performance goal; docs/PERFORMANCE.md has the measured ones)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.journal.pgserver import find_bin

ROOT = Path(__file__).resolve().parent.parent
# Figures that need the optional `bench` extra (eventsourcing, psycopg_pool).
PEER_KEYS = {"journal_vs_eventsourcing_sqlite", "journal_vs_eventsourcing_postgres",
             "journal_vs_eventsourcing_sqlite_single", "journal_vs_eventsourcing_postgres_single"}


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _log(stderr: str) -> str:
    """The log without the table: a failing section's traceback, not the figures after it."""
    return "\n".join(x for x in stderr.splitlines() if not x.startswith(("│", "┃")))[-4000:]


@pytest.fixture(scope="module")
def report() -> dict:
    if find_bin() is None and os.environ.get("KVLEDGER_REQUIRE_POSTGRES") != "1":
        pytest.skip("no PostgreSQL server binaries: the harness starts its own server")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--json"], cwd=ROOT,
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, _log(proc.stderr)
    return json.loads(proc.stdout)


def test_every_section_runs(report):
    from bench import SECTIONS

    assert report["mode"] == "smoke"
    assert set(report["sections"]) == {s.name for s in SECTIONS}
    for name, section in report["sections"].items():
        # a section whose module is not written yet is reported, never a crash
        assert section["status"] in ("ok", "missing"), (name, section)


def test_every_key_is_present_and_numeric(report):
    from bench import SECTIONS

    peers = _has("eventsourcing") and _has("psycopg_pool")
    for section in SECTIONS:
        status = report["sections"][section.name]["status"]
        keys = set(section.keys) | {k for k in report["goals"] if k in report and status == "ok"}
        for key in keys:
            assert key in report, key
            value = report[key]
            if status == "missing" or (key in PEER_KEYS and not peers):
                assert value is None, (key, value)
                continue
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
            assert math.isfinite(value), (key, value)


def test_goals_and_absolute_figures_are_reported(report):
    journal = report["figures"]["journal"]
    for backend in ("sqlite", "postgres"):
        for system in ("kvledger", "raw"):
            for mode in ("batch", "single"):
                assert journal[f"{backend}_{system}_{mode}_per_s"] > 0
    for key, goal in report["goals"].items():
        assert goal["op"] in (">=", "<=") and "value" in goal and "met" in goal, key
    machine = report["machine"]
    for field in ("cpu_model", "cpu_count", "python", "sqlite", "postgres", "torch"):
        assert machine[field], field


def test_goals_of_a_peer_not_installed_are_na_with_the_reason():
    """eventsourcing made unimportable (as when it is not installed): its four goals have
    no value and no verdict, in the JSON and in the table, never a pass."""
    if find_bin() is None and os.environ.get("KVLEDGER_REQUIRE_POSTGRES") != "1":
        pytest.skip("no PostgreSQL server binaries: the harness starts its own server")
    code = ("import sys; sys.modules['eventsourcing'] = None\n"
            "from bench.__main__ import main; sys.exit(main(['--smoke', '--only', 'journal', '--json']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _log(proc.stderr)
    report = json.loads(proc.stdout)
    for key in PEER_KEYS:
        goal = report["goals"][key]
        assert report[key] is None and goal["value"] is None and goal["met"] is None, (key, goal)
        assert "eventsourcing not installed" in goal["reason"], goal
        row = next(line for line in proc.stderr.splitlines() if key[:30] in line)
        cells = [c.strip() for c in row.split("\u2502")]
        assert "n/a" in cells and not any(c in ("ok", "yes") for c in cells), row
    # the goals that were measured still have a verdict
    assert report["goals"]["journal_vs_raw_sqlite"]["met"] in (True, False)
