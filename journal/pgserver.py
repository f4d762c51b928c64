"""A throwaway PostgreSQL cluster for tests, benchmarks and crash trials, and scratch
databases on any server.

The server refuses to run as root, so as root every server command runs through
`runuser -u postgres`. The cluster listens on 127.0.0.1 only, on a free port, with
trust authentication, and is deleted on stop.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import psycopg
from sqlalchemy.engine import URL, make_url

BIN_DIRS = [os.environ.get("KVLEDGER_PG_BIN", ""), "/usr/lib/postgresql/15/bin",
            "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/17/bin"]


def find_bin() -> Path | None:
    for d in BIN_DIRS:
        if d and (Path(d) / "pg_ctl").exists():
            return Path(d)
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


def conninfo(url: str | URL, **override: str | int | None) -> str:
    """The libpq conninfo of a SQLAlchemy PostgreSQL URL (psycopg cannot read the
    `postgresql+psycopg://` form), as the journal's engine reads it: the query's libpq
    options too (a Unix socket's directory as `host`, `sslmode`, ...); fields overridden
    by keyword, e.g. dbname=."""
    u = make_url(url).set(drivername="postgresql+psycopg")
    _, fields = u.get_dialect()().create_connect_args(u)
    fields.update(override)
    return psycopg.conninfo.make_conninfo("", **fields)  # None values are left out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # (host, port) for AF_INET
        return port


class ThrowawayPostgres:
    def __init__(self, *, fsync: bool = True) -> None:
        self.fsync = fsync
        self.bin = find_bin()
        self.dir: Path | None = None
        self.port = 0
        self.options = ""  # the server's -o options, as start() gave them (a restart gives them again)

    def _run(self, *cmd: str) -> None:
        argv = list(cmd)
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        subprocess.run(argv, check=True, capture_output=True, text=True)

    def start(self) -> ThrowawayPostgres:
        if self.bin is None:
            raise RuntimeError("PostgreSQL server binaries not found (set KVLEDGER_PG_BIN)")
        self.dir = Path(tempfile.mkdtemp(prefix="kvledger-pg-"))
        data, sock = self.dir / "data", self.dir / "sock"
        sock.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            shutil.chown(sock, "postgres", "postgres")
        self._run(str(self.bin / "initdb"), "-D", str(data), "-U", "postgres",
                  "--auth=trust", "-E", "UTF8", "--no-sync")
        self.port = _free_port()
        opts = (f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={sock} "
                f"-c fsync={'on' if self.fsync else 'off'} -c max_connections=200 "
                "-c shared_buffers=128MB")
        if not self.fsync:
            opts += " -c synchronous_commit=off -c full_page_writes=off"
        self.options = opts
        self._run(str(self.bin / "pg_ctl"), "-D", str(data), "-l", str(self.dir / "log"),
                  "-o", opts, "-w", "-t", "60", "start")
        return self

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """An empty database (ScratchDatabases makes migrated ones)."""
        with psycopg.connect(conninfo(self.url()), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # test-chosen names
        return self.url(name)

    def stop(self) -> None:
        if self.dir is None or self.bin is None:  # (a dir means start() found the binaries)
            return
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def __enter__(self) -> ThrowawayPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ScratchDatabases:
    """Fresh databases beside `admin_url` on one server (needs CREATEDB). A migrated one is
    created from one migrated template: CREATE DATABASE ... TEMPLATE copies files, far
    faster than running the migrations per database. `migrate` brings a URL to the head
    revision (migrations.storage.init_database: that layer sits above this one)."""

    def __init__(self, admin_url: str | URL, prefix: str, migrate: Callable[[str], object]) -> None:
        self.admin = make_url(admin_url)
        self.template = f"{prefix}_tmpl"
        self.migrate = migrate
        self.has_template = False

    def url(self, name: str) -> str:
        return self.admin.set(database=name).render_as_string(hide_password=False)

    def connect(self, dbname: str | None = None) -> psycopg.Connection:
        """An autocommit connection to `dbname` (default: the admin database)."""
        dbname = dbname or self.admin.database
        try:
            return psycopg.connect(conninfo(self.admin, dbname=dbname), autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            from kvledger.journal.driver_errors import translate

            raise translate(exc, self.admin.set(database=dbname)) from None

    def prepare(self) -> None:
        """(Re)create the migrated template. The admin connection is closed before
        migrating, and when this returns (crash trials fork after it)."""
        with self.connect() as conn:  # names built here, not input
            conn.execute(f'DROP DATABASE IF EXISTS "{self.template}"')
            conn.execute(f'CREATE DATABASE "{self.template}"')
        self.migrate(self.url(self.template))
        self.has_template = True

    def create(self, name: str, *, migrated: bool = True) -> str:
        """A fresh database `name` (replacing one of that name), migrated or empty; its URL."""
        if migrated and not self.has_template:
            self.prepare()
        template = f' TEMPLATE "{self.template}"' if migrated else ""
        with self.connect() as conn:  # names built by the callers, not input
            # PostgreSQL 15 WAL-logs every page of the template by default: copying the
            # files halves the time a test database costs.
            strategy = " STRATEGY = FILE_COPY" if migrated and conn.info.server_version >= 150000 else ""
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"{template}{strategy}')
        return self.url(name)

    def drop(self, *names: str) -> None:
        with self.connect() as conn:
            for name in names:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        """Drops the template (the databases made from it stay)."""
        if self.has_template:
            self.drop(self.template)
            self.has_template = False
