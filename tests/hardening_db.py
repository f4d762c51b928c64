"""Helpers of the database-hardening tests (tests/test_hardening_urls.py,
tests/test_hardening_errors.py): run the CLI, check a refusal, snapshot a journal, and a
PostgreSQL role that logs in with a password on the test server."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import subprocess
import sys
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from kvledger.cli import main
from kvledger.journal.pgserver import conninfo
from kvledger.schemas.errors import ErrorCode

ROOT = Path(__file__).resolve().parents[1]
CODES = {c.value for c in ErrorCode}


def cli(*args: str) -> tuple[int, str, str]:
    """`kvledger ARGS` in this process: (exit status, stdout, stderr)."""
    # Text streams over bytes: commands write JSON to sys.stdout.buffer.
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace") for _ in "12")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    out.flush()
    err.flush()
    return code, out.buffer.getvalue().decode(), err.buffer.getvalue().decode()


def cli_process(*args: str, env: dict | None = None, user: str | None = None,
                cwd: str | None = None) -> tuple[int, str, str]:
    """`kvledger ARGS` as a subprocess (optionally as another user)."""
    p = subprocess.run([sys.executable, "-m", "kvledger", *args], capture_output=True, text=True,
                       timeout=300, cwd=cwd, user=user,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    return p.returncode, p.stdout, p.stderr


def refused(result: tuple[int, str, str], code: str, *secrets: str, status: int = 2) -> str:
    """Assert a refusal: `status`, exactly one stderr line starting with `code:`, no
    traceback, and no secret anywhere in the output. Returns the line."""
    rc, out, err = result
    lines = err.splitlines()
    assert rc == status, (rc, out, err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{code}: "), err
    assert "Traceback" not in out + err
    for secret in secrets:
        assert secret not in out + err, (secret, out, err)
    return lines[0]


def snapshot(url: str) -> object:
    """What must not change: the bytes of a SQLite journal's files, or every row of a
    PostgreSQL journal's tables (and which tables exist)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        path = Path(u.database)
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(path.parent.glob(path.name + "*")) if p.is_file()}
    with psycopg.connect(conninfo(url)) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename")]
        rows = {}
        for t in tables:  # names read from the catalog of a test database
            rows[t] = sorted(map(repr, conn.execute(f'SELECT * FROM "{t}"').fetchall()))
    return rows


def execute(url: str, *statements: str) -> None:
    """Run statements on a journal database behind kvledger's back (test set-up)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        import sqlite3

        conn = sqlite3.connect(u.database)
        try:
            for s in statements:
                conn.execute(s)
            conn.commit()
        finally:
            conn.close()
        return
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        for s in statements:
            conn.execute(s)


PASSWORD_ROLE = "kvl_pw_role"
PASSWORD = "Pw-9fQx2LmZ"


def password_role(pg_admin) -> str | None:
    """A role that must log in with PASSWORD over TCP (scram-sha-256) on the throwaway
    test server, whose own roles are trusted. Returns its URL without the password (to a
    database named `postgres`), or None when the server is not ours to reconfigure."""
    if pg_admin.server is None:
        return None
    admin = make_url(pg_admin.admin_url)
    with psycopg.connect(conninfo(pg_admin.admin_url), autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (PASSWORD_ROLE,)).fetchone()
        if not exists:
            conn.execute(f"CREATE ROLE {PASSWORD_ROLE} LOGIN SUPERUSER PASSWORD '{PASSWORD}'")  # constants
            hba = Path(conn.execute("SHOW hba_file").fetchone()[0])
            text = hba.read_text()
            line = f"host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256\n"
            if line not in text:
                hba.write_text(line + text)  # first match wins: before the trust lines
            conn.execute("SELECT pg_reload_conf()")
    return admin.set(username=PASSWORD_ROLE, password=None).render_as_string(hide_password=False)
