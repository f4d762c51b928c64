"""Helpers for tests that run the same decode steps twice and compare the journals byte
for byte: ids drawn from the same counter each run, and a fixed commit time."""

from __future__ import annotations

import itertools
import time
import types

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
