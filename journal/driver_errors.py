"""Driver errors (sqlite3, psycopg, SQLAlchemy) as KvLedgerError with a stable code.

The one place where a database failure becomes a code: the journal applies `translate`
at its boundary (opening, reading, writing, migrating), and the CLI applies it as a
last resort, so no driver traceback reaches a user and exit status 1 stays "findings".

Messages are our own words: what was being opened (journal.url.describe: the file, or
host, port and database), what went wrong, and the driver's error class and stable error
code (SQLITE_NOTADB, SQLSTATE 28P01). A driver's message text is never shown: it can
quote a password (a DSN, a query option) and no amount of search-and-replace in it is
safe. It is only *read* where a driver has no code for the case (a PostgreSQL
connection refused before any SQLSTATE, SQLite's "no such table").
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError

from kvledger.journal.faults import FaultInjected
from kvledger.journal.url import describe
from kvledger.schemas.errors import ErrorCode, KvLedgerError

E = ErrorCode

# Primary SQLite result codes (extended codes carry them in the low byte).
_SQLITE = {
    3: (E.PERMISSION_DENIED, "access permission denied"),  # SQLITE_PERM
    5: (E.DATABASE_BUSY, "the database stayed locked by another connection"),  # SQLITE_BUSY
    6: (E.DATABASE_BUSY, "a table stayed locked"),  # SQLITE_LOCKED
    8: (E.DATABASE_READ_ONLY, "the database is read-only here"),  # SQLITE_READONLY
    11: (E.NOT_A_DATABASE, "the file is corrupt"),  # SQLITE_CORRUPT
    13: (E.DATABASE_FULL, "the disk is full"),  # SQLITE_FULL
    18: (E.FIELD_TOO_LARGE, "a value is larger than SQLite allows"),  # SQLITE_TOOBIG
    19: (E.CONSTRAINT_VIOLATION, "a row broke a table constraint"),  # SQLITE_CONSTRAINT
    23: (E.PERMISSION_DENIED, "access denied by the authorizer"),  # SQLITE_AUTH
    26: (E.NOT_A_DATABASE, "the file is not a SQLite database"),  # SQLITE_NOTADB
}

# SQLSTATEs (exact, then by class: the first two characters).
_SQLSTATE = {
    "22001": (E.FIELD_TOO_LARGE, "a value is longer than its column allows"),
    "25006": (E.DATABASE_READ_ONLY, "the transaction is read-only"),
    "3D000": (E.DATABASE_NOT_FOUND, "the database does not exist"),
    "42P01": (E.TABLE_MISSING, "a journal table is missing (dropped after migration?)"),
    "42703": (E.SCHEMA_MISMATCH, "a journal column is missing"),
    "42501": (E.PERMISSION_DENIED, "the role lacks a privilege"),
    "40001": (E.DATABASE_BUSY, "a serialization failure"),
    "40P01": (E.DATABASE_BUSY, "a deadlock"),
    "55P03": (E.DATABASE_BUSY, "a lock was not available"),
    "57014": (E.DATABASE_BUSY, "a statement timed out or was cancelled"),
    "53100": (E.DATABASE_FULL, "the server's disk is full"),
    "53300": (E.DATABASE_BUSY, "the server has no free connection"),
    "57P01": (E.DATABASE_UNREACHABLE, "the server is shutting down"),
    "57P02": (E.DATABASE_UNREACHABLE, "the server is shutting down"),
    "57P03": (E.DATABASE_UNREACHABLE, "the server is not accepting connections yet"),
}
_SQLSTATE_CLASS = {
    "08": (E.DATABASE_UNREACHABLE, "the connection failed"),
    "22": (E.INVALID_ARGUMENT, "the database refused a value"),
    "23": (E.CONSTRAINT_VIOLATION, "a row broke a table constraint"),
    "28": (E.DATABASE_AUTH_FAILED, "the server refused the credentials"),
}

# libpq reports a refused connection before any SQLSTATE exists: these fragments of its
# (English) text tell an authentication failure and a missing database from a server
# that cannot be reached. Anything else stays DATABASE_UNREACHABLE.
_PG_CONNECT = (
    (("password authentication failed", "no password supplied", "authentication failed",
      "role \"", "pg_hba.conf", "fe_sendauth", "scram"),
     (E.DATABASE_AUTH_FAILED, "the server refused the credentials")),
    (("database \"",), (E.DATABASE_NOT_FOUND, "the database does not exist")),
    # 'invalid sslmode value: "x"', 'invalid integer value "x" for connection option "y"':
    # libpq checks option values only as it connects (url.parse_url checks their names)
    ((' value: "', 'for connection option "'), (E.BAD_DATABASE_URL, "libpq refuses an option value of the URL")),
)


def is_driver_error(exc: BaseException) -> bool:
    """An exception that comes from the database layer (or a simulated one)."""
    if isinstance(exc, (SQLAlchemyError, sqlite3.Error, FaultInjected)):
        return True
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return False
    return isinstance(exc, psycopg.Error)


def release(proxy: Any) -> None:
    """Give a pooled connection (SQLAlchemy's raw_connection) back. The pool rolls back
    what it gets back, and when that fails (the server ended the session, or went away
    in the middle of a transaction) it logs the failure with its traceback on the
    "sqlalchemy.pool" logger: on stderr, before the command's coded line. The
    rollback is done here first; a connection that cannot even roll back is
    invalidated: closed without a reset, the way SQLAlchemy drops a disconnected one."""
    conn = proxy.driver_connection
    if conn is None:  # already invalidated
        proxy.close()
        return
    try:
        conn.rollback()
    except Exception as exc:  # a driver error here: the connection is gone (anything else is raised)
        if not is_driver_error(exc):
            raise
        proxy.invalidate()  # closes the driver's connection; the pool resets nothing
        return
    proxy.close()


def translate(exc: BaseException, url: URL | None) -> KvLedgerError:
    """The KvLedgerError for a driver error on `url` (None: the database is not known)."""
    if isinstance(exc, KvLedgerError):
        return exc
    where = describe(url) if url is not None else "the database"
    if isinstance(exc, FaultInjected):  # a test's stand-in for a failed driver call
        return KvLedgerError(E.DATABASE_UNREACHABLE, f"{where}: {exc} (FaultInjected)")
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        exc = exc.orig
    elif isinstance(exc, ArgumentError):  # SQLAlchemy refused the URL or its options
        return KvLedgerError(E.BAD_DATABASE_URL, f"{where}: the URL or one of its options is not valid "
                                                 f"({type(exc).__name__})")
    if isinstance(exc, sqlite3.Error):
        code, what, tag = _sqlite(exc, url)
    else:
        code, what, tag = _postgres(exc)
    return KvLedgerError(code, f"{where}: {what} ({type(exc).__name__}{tag})")


def _sqlite(exc: sqlite3.Error, url: URL | None) -> tuple[ErrorCode, str, str]:
    number = getattr(exc, "sqlite_errorcode", None)
    name = getattr(exc, "sqlite_errorname", None)
    tag = f", {name}" if name else ""
    if number is None:  # raised by the sqlite3 module itself (closed connection, binding)
        return E.DATABASE_ERROR, "the SQLite driver refused the call", tag
    primary = number & 0xFF
    if primary == 14:  # SQLITE_CANTOPEN: say why, from the path itself
        return (*_cannot_open(url), tag)
    if primary == 1:  # SQLITE_ERROR: generic; the schema cases have no code of their own
        text = str(exc)
        if text.startswith("no such table"):
            return E.TABLE_MISSING, "a journal table is missing (dropped after migration?)", tag
        if text.startswith("no such column") or "has no column named" in text:
            return E.SCHEMA_MISMATCH, "a journal column is missing", tag
    code, what = _SQLITE.get(primary, (E.DATABASE_ERROR, "SQLite reported an error"))
    return code, what, tag


def _cannot_open(url: URL | None) -> tuple[ErrorCode, str]:
    name = url.database if url is not None else None
    if not name:
        return E.DATABASE_UNREACHABLE, "cannot open the file"
    if name.startswith("file:"):  # a SQLite URI (uri=true): file:PATH?mode=ro...
        name = name[len("file:"):].split("?", 1)[0]
    try:
        return _why_not_open(Path(name).expanduser())
    except (OSError, ValueError):  # a name the OS refuses even to look up (too long, NUL)
        return E.DATABASE_UNREACHABLE, "cannot open the file (the OS refuses its name)"


def _why_not_open(path: Path) -> tuple[ErrorCode, str]:
    if path.is_dir():
        return E.NOT_A_DATABASE, "the path is a directory, not a database file"
    if path.exists():
        if not os.access(path, os.R_OK):
            return E.PERMISSION_DENIED, "the file is not readable by this user"
        if not os.access(path.parent, os.W_OK):
            return E.DATABASE_READ_ONLY, "its directory is read-only (WAL needs to create files beside it)"
        return E.DATABASE_UNREACHABLE, "cannot open the file"
    if not os.access(path.parent, os.W_OK):
        return E.DATABASE_READ_ONLY, "its directory is read-only: the file cannot be created"
    return E.DATABASE_NOT_FOUND, "no such file (and the URL does not let SQLite create it)"


def _postgres(exc: BaseException) -> tuple[ErrorCode, str, str]:
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate:
        found = _SQLSTATE.get(sqlstate) or _SQLSTATE_CLASS.get(sqlstate[:2])
        code, what = found or (E.DATABASE_ERROR, "the server reported an error")
        return code, what, f", SQLSTATE {sqlstate}"
    try:
        import psycopg
    except ImportError:  # pragma: no cover
        return E.DATABASE_ERROR, "the database reported an error", ""
    if isinstance(exc, psycopg.OperationalError):
        text = str(exc).lower()
        for fragments, found in _PG_CONNECT:
            if any(f in text for f in fragments):
                return (*found, "")
        return E.DATABASE_UNREACHABLE, "cannot connect, or the connection was lost", ""
    if isinstance(exc, psycopg.InterfaceError):
        return E.DATABASE_UNREACHABLE, "the connection is closed or broken", ""
    if isinstance(exc, SQLAlchemyError):
        return E.DATABASE_ERROR, "the database layer reported an error", ""
    return E.DATABASE_ERROR, "the database reported an error", ""


__all__ = ["is_driver_error", "release", "translate"]
