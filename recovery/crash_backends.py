"""Crash-test backends: a fresh scratch journal per trial, on SQLite (copies of one
migrated file) or on PostgreSQL (databases from a migrated template)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvledger.journal.url import parse_url

if TYPE_CHECKING:
    import psycopg


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
    TABLES = "kvl_events, kvl_heads, kvl_receipts, kvl_manifests, kvl_checkpoints"

    def __init__(self, url: str) -> None:
        self.url = parse_url(url)
        self.prefix = f"kvl_crash_{os.getpid()}"
        self.template = f"{self.prefix}_tmpl"
        self.current: str | None = None
        self.dirty = False
        self.made = 0

    def _connect(self, dbname: str | None) -> psycopg.Connection[tuple[Any, ...]]:  # None: the server's default
        import psycopg

        u = self.url
        conninfo = psycopg.conninfo.make_conninfo(host=u.host, port=u.port, user=u.username,
                                                  password=u.password, dbname=dbname)
        try:
            return psycopg.connect(conninfo, autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            from kvledger.journal.driver_errors import translate

            raise translate(exc, u.set(database=dbname)) from None

    def _url(self, name: str) -> str:
        return self.url.set(database=name).render_as_string(hide_password=False)

    def prepare(self) -> None:
        from kvledger.migrations.storage import init_database

        with self._connect(self.url.database) as conn:  # every connection is closed before a fork
            conn.execute(f'DROP DATABASE IF EXISTS "{self.template}"')  # names built here, not input
            conn.execute(f'CREATE DATABASE "{self.template}"')
        init_database(self._url(self.template))

    def fresh(self, k: int) -> str:
        if self.current is None:
            self.made += 1
            self.current = f"{self.prefix}_{self.made}"
            with self._connect(self.url.database) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.current}" WITH (FORCE)')
                conn.execute(f'CREATE DATABASE "{self.current}" TEMPLATE "{self.template}"')
        elif self.dirty:
            with self._connect(self.current) as conn:
                conn.execute(f"TRUNCATE {self.TABLES}")  # constant table names
        self.dirty = True
        return self._url(self.current)

    def keep(self, k: int) -> str:
        kept, self.current = self.current, None
        return self._url(kept) if kept else ""

    def close(self) -> None:
        with self._connect(self.url.database) as conn:
            if self.current is not None:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.current}" WITH (FORCE)')
            conn.execute(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')
