"""Shared fixtures: a real PostgreSQL server (throwaway, or KVLEDGER_TEST_POSTGRES_URL)
and a `db_url` fixture that runs a test once per backend."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvledger.journal.pgserver import ScratchDatabases, ThrowawayPostgres, find_bin
from kvledger.migrations.storage import init_database

REQUIRE_PG = os.environ.get("KVLEDGER_REQUIRE_POSTGRES") == "1"
_names = itertools.count()


class PgAdmin:
    """Creates one fresh database per test, migrated ones from a migrated template."""

    def __init__(self, admin_url: str, server: ThrowawayPostgres | None) -> None:
        self.admin_url = admin_url  # postgresql+psycopg://user@host:port/db
        self.server = server
        self.scratch = ScratchDatabases(admin_url, f"kvl_template_{os.getpid()}", init_database)

    def create(self, migrated: bool = True) -> str:
        return self.scratch.create(f"kvl_test_{os.getpid()}_{next(_names)}", migrated=migrated)


@pytest.fixture(scope="session")
def pg_admin():
    url = os.environ.get("KVLEDGER_TEST_POSTGRES_URL")
    if url:
        yield PgAdmin(url, None)
        return
    reason = None
    if find_bin() is None:
        reason = "no PostgreSQL server binaries (set KVLEDGER_TEST_POSTGRES_URL)"
    server = None
    if reason is None:
        try:
            server = ThrowawayPostgres(fsync=False).start()
        except Exception as exc:  # noqa: BLE001 - whatever stops the server starting is the reason reported
            reason = f"cannot start a throwaway PostgreSQL: {exc}"
    if reason:
        if REQUIRE_PG:
            pytest.fail(f"KVLEDGER_REQUIRE_POSTGRES=1 but {reason}")
        pytest.skip(reason)
    yield PgAdmin(server.url(), server)
    server.stop()


@pytest.fixture(scope="session")
def model():
    """The default seeded model (read-only: tests must not change its weights)."""
    from kvledger.worker.model import DEFAULT_CONFIG, Transformer

    return Transformer.from_config(DEFAULT_CONFIG, seed=0)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request) -> str:
    return request.param


@pytest.fixture
def db_url(backend, tmp_path, request) -> str:
    """A fresh, migrated journal database on the parametrized backend."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path}/journal.db"
        init_database(url)
        return url
    return request.getfixturevalue("pg_admin").create()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say per backend how many parametrized cases ran, so a CI log shows PostgreSQL
    was really exercised (not skipped)."""
    counts: dict[str, dict[str, int]] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(rep, "nodeid", "")
            for backend in ("sqlite", "postgres"):
                if f"[{backend}" in nodeid or f"-{backend}]" in nodeid or f"-{backend}-" in nodeid:
                    counts.setdefault(backend, {}).setdefault(outcome, 0)
                    counts[backend][outcome] += 1
    if counts:
        parts = [f"{b}: " + ", ".join(f"{n} {o}" for o, n in sorted(c.items())) for b, c in sorted(counts.items())]
        terminalreporter.write_line("kvledger backends -> " + " | ".join(parts))
