"""`kvledger demo` as the tests that disturb its database run it, and what the same run
journals undisturbed: once per test process, on SQLite (the demo is deterministic; its
counts do not depend on the backend or the writer)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

# 4,839 events: the tests cut at 200 events or 30 handles (the 30th is allocated by event 325)
DEMO = ("demo", "--requests", "64", "--max-new-tokens", "24", "--json")  # `kvledger` arguments
COMPARED = ("requests", "handles", "tokens", "cancelled", "events_written", "events_by_type", "appends_by_kind")


def demo_argv(writer: str, url: str) -> list[str]:
    return [sys.executable, "-m", "kvledger", *DEMO, "--writer", writer, "--db", url]


def demo_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with one torch thread: under pytest-xdist the cores are
    shared, and a two-thread model's spinning OpenMP workers slowed a demo 2-4x there."""
    return {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}


@functools.cache
def undisturbed() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        run = subprocess.run(demo_argv("thread", f"sqlite:///{d}/calm.db"), capture_output=True, text=True,
                             timeout=300, cwd=d, env=demo_env())
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(run.stdout)
    return {k: doc[k] for k in COMPARED}


def assert_journaled_as_undisturbed(doc: dict[str, Any]) -> None:
    assert {k: doc[k] for k in COMPARED} == undisturbed()
