"""Crash-test backends: a fresh scratch journal per trial, on SQLite (copies of one
migrated file), on PostgreSQL (databases from a migrated template) or on NATS (a cell
of its own on the named cluster)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from kvledger.journal.tables import JOURNAL_TABLES
from kvledger.journal.url import parse_url
from kvledger.schemas.errors import KvLedgerError


class Backend:
    name = ""

    def prepare(self) -> None: ...
    def fresh(self, k: int) -> str: raise NotImplementedError  # noqa: E704 - an abstract one-liner
    def release(self, k: int) -> None: ...  # the trial passed: its journal may go
    def keep(self, k: int) -> str: return ""  # noqa: E704 - the trial failed: keep its journal
    def close(self) -> None: ...


class SqliteBackend(Backend):
    """Trial journals are copies of one migrated file, in a scratch directory next to
    the named database (or in a temp directory)."""

    name = "sqlite"

    def __init__(self, url: str, workdir: Path) -> None:
        self.dir = workdir / "journals"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.template = self.dir / "template.db"

    def prepare(self) -> None:
        from kvledger.migrations.storage import init_database

        init_database(f"sqlite:///{self.template}")  # engine disposed: nothing open at fork

    def path(self, k: int) -> Path:
        return self.dir / f"trial-{k:05d}.db"

    def fresh(self, k: int) -> str:
        shutil.copyfile(self.template, self.path(k))
        return f"sqlite:///{self.path(k)}"

    def release(self, k: int) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path(k)}{suffix}").unlink(missing_ok=True)

    def keep(self, k: int) -> str:
        return f"sqlite:///{self.path(k)}"

    def close(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.template}{suffix}").unlink(missing_ok=True)


class PostgresBackend(Backend):
    """Trial journals live in a scratch database created from a migrated template next
    to the named one (needs CREATEDB). A passing trial's journal is emptied (TRUNCATE)
    for the next trial; a failing one is kept and the next trial gets a new database."""

    name = "postgresql"
    TABLES = ", ".join(JOURNAL_TABLES)

    def __init__(self, url: str) -> None:
        from kvledger.journal.pgserver import ScratchDatabases
        from kvledger.migrations.storage import init_database

        self.prefix = f"kvl_crash_{os.getpid()}"
        self.scratch = ScratchDatabases(parse_url(url), self.prefix, init_database)
        self.current: str | None = None
        self.dirty = False
        self.made = 0

    def prepare(self) -> None:
        self.scratch.prepare()  # every connection is closed before a fork

    def fresh(self, k: int) -> str:
        if self.current is None:
            self.made += 1
            self.current = f"{self.prefix}_{self.made}"
            self.scratch.create(self.current)
        elif self.dirty:
            with self.scratch.connect(self.current) as conn:
                conn.execute(f"TRUNCATE {self.TABLES}")  # constant table names
        self.dirty = True
        return self.scratch.url(self.current)

    def keep(self, k: int) -> str:
        kept, self.current = self.current, None
        return self.scratch.url(kept) if kept else ""

    def close(self) -> None:
        self.scratch.drop(*([self.current] if self.current is not None else []), self.scratch.template)


class NatsBackend(Backend):
    """Trial journals are cells of their own on the named cell's cluster (`<cell>-x<pid>-<k>`),
    each made by init with the URL's options; a passing trial's stream is deleted, and so is
    the current one when the run stops early. The trials kill processes, never a server, so
    the servers' fsync policy cannot change what they check: the cells are made whatever it is."""

    name = "nats"

    def __init__(self, url: str) -> None:
        self.named = url
        head, _, query = url.partition("?")
        self.base, _, cell = head.rpartition("/")
        self.query = f"?{query}" if query else ""
        self.prefix = f"{cell[:32]}-x{os.getpid()}"
        self.current: int | None = None  # the trial whose cell is made and neither released nor kept

    def prepare(self) -> None:
        from kvledger.journal.nats_client import NatsClient

        NatsClient(parse_url(self.named)).close()  # the servers answer; nothing left open at fork

    def cell(self, k: int) -> str:
        return f"{self.prefix}-{'b' if k < 0 else k}"

    def url(self, k: int) -> str:
        return f"{self.base}/{self.cell(k)}{self.query}"

    def fresh(self, k: int) -> str:
        from kvledger.journal.nats_admin import init_cell

        self.current = k
        init_cell(self.url(k), allow_lazy_fsync=True)  # its client is closed again: nothing open at fork
        return self.url(k)

    def release(self, k: int) -> None:
        from kvledger.journal.nats import STREAM_PREFIX
        from kvledger.journal.nats_client import NatsClient

        self.current = None
        client = NatsClient(parse_url(self.url(k)))
        try:
            client.api(f"STREAM.DELETE.{STREAM_PREFIX}{self.cell(k)}")
        finally:
            client.close()

    def keep(self, k: int) -> str:
        self.current = None
        return self.url(k)

    def close(self) -> None:
        if self.current is not None:
            with contextlib.suppress(KvLedgerError):  # the servers went away: the run's own error says so
                self.release(self.current)
