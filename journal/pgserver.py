"""A throwaway PostgreSQL cluster for tests, benchmarks and crash trials.

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
from pathlib import Path

import psycopg

BIN_DIRS = [os.environ.get("KVLEDGER_PG_BIN", ""), "/usr/lib/postgresql/15/bin",
            "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/17/bin"]


def find_bin() -> Path | None:
    for d in BIN_DIRS:
        if d and (Path(d) / "pg_ctl").exists():
            return Path(d)
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


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
        self._run(str(self.bin / "pg_ctl"), "-D", str(data), "-l", str(self.dir / "log"),
                  "-o", opts, "-w", "-t", "60", "start")
        return self

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str, template: str | None = None) -> str:
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                             autocommit=True) as conn:
            if template:
                conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')  # test-chosen names
            else:
                conn.execute(f'CREATE DATABASE "{name}"')
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
