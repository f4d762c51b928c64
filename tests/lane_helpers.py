"""Helpers for tests that run the same decode steps twice and compare the journals byte
for byte: ids drawn from the same counter each run, a fixed commit time, and a watch on
what the service appends."""

from __future__ import annotations

import itertools
import time
import types
from collections.abc import Callable
from typing import Any

import pytest

from kvledger.engine import ids
from kvledger.journal import sql as journal_sql


def same_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.ids' own form (a prefix and a counter, not seeded), from the same start."""
    monkeypatch.setattr(ids, "_prefix", "5eed0000000000aa")
    monkeypatch.setattr(ids, "_counter", itertools.count(1 << 40))


def fixed_commit_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit time a record and its receipts keep (time.time_ns in journal.sql)."""
    clock = types.SimpleNamespace(time_ns=lambda: 1_790_000_000_000_000_000, monotonic=time.monotonic,
                                  sleep=time.sleep)
    monkeypatch.setattr(journal_sql, "time", clock)


def fresh_url(backend: str, tmp_path, request: pytest.FixtureRequest, name: str) -> str:
    """Another fresh journal on the parametrized backend."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path}/{name}.db"
    return request.getfixturevalue("pg_admin").create()


def watch_appends(journal: Any, seen: Callable[[list[Any], list[Any]], None]) -> None:
    """`seen(operations, results)` for each append the journal is asked for, once its
    results are known: append, append_deferred, and append_run (a run as its
    operations), counted once though a backend's append_run appends them itself."""
    append, deferred, append_run = journal.append, journal.append_deferred, journal.append_run
    inside = [False]

    def told(ops: list[Any], results: list[Any]) -> list[Any]:
        if not inside[0]:
            seen(ops, results)
        return results

    def watched_run(run: Any, ops: list[Any], **kw: Any) -> Callable[[], list[Any]]:
        inside[0] = True
        try:
            wait = append_run(run, ops, **kw)
        finally:
            inside[0] = False
        return lambda: told([*run.operations(), *ops], wait())

    def watched_deferred(ops: list[Any]) -> Callable[[], list[Any]]:
        wait = deferred(ops)
        if inside[0]:
            return wait
        return lambda: told(list(ops), wait())

    journal.append = lambda ops: told(list(ops), append(ops))
    journal.append_deferred = watched_deferred
    journal.append_run = watched_run
