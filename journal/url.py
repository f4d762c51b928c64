"""Database URLs: parse, validate, redact, and turn driver errors into stable codes.

A password in a URL must never reach a message or a log, so every message here is
built from the redacted form, and driver messages are scrubbed before they leave.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from schemas.errors import ErrorCode, KvLedgerError

DEFAULT_URL = "sqlite:///kvledger.db"
_DRIVERS = {
    "sqlite": "sqlite+pysqlite",
    "sqlite+pysqlite": "sqlite+pysqlite",
    "postgresql": "postgresql+psycopg",
    "postgres": "postgresql+psycopg",
    "postgresql+psycopg": "postgresql+psycopg",
}


def resolve_url(url: str | None) -> str:
    """--db, else KVLEDGER_DB, else the embedded SQLite default."""
    return url or os.environ.get("KVLEDGER_DB") or DEFAULT_URL


def parse_url(raw: str) -> URL:
    try:
        url = make_url(raw)
    except (ArgumentError, ValueError):
        raise KvLedgerError(
            ErrorCode.BAD_DATABASE_URL,
            "cannot parse database URL (expected sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST:PORT/DB)",
        ) from None
    driver = _DRIVERS.get(url.drivername)
    if driver is None:
        raise KvLedgerError(
            ErrorCode.BAD_DATABASE_URL,
            f"unsupported database driver {url.drivername!r} in {redact(url)} "
            "(use sqlite or postgresql+psycopg)",
        )
    url = url.set(drivername=driver)
    if driver.startswith("sqlite") and url.database not in (None, "", ":memory:"):
        parent = Path(url.database).expanduser().resolve().parent
        if not parent.is_dir():
            raise KvLedgerError(
                ErrorCode.BAD_DATABASE_URL, f"directory {parent} of {redact(url)} does not exist"
            )
    if driver.startswith("postgresql") and not url.database:
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL, f"no database name in {redact(url)}")
    return url


def redact(url: URL | str) -> str:
    if isinstance(url, str):
        try:
            url = make_url(url)
        except (ArgumentError, ValueError):
            return "<unparseable URL>"
    return url.render_as_string(hide_password=True)


def scrub(message: str, url: URL) -> str:
    """Remove the password from a driver message, then keep its first line."""
    if url.password:
        message = message.replace(str(url.password), "***")
    return message.strip().splitlines()[0] if message.strip() else "connection failed"


def unreachable(exc: BaseException, url: URL) -> KvLedgerError:
    orig = getattr(exc, "orig", None) or exc
    return KvLedgerError(
        ErrorCode.DATABASE_UNREACHABLE, f"cannot open {redact(url)}: {scrub(str(orig), url)}"
    )
