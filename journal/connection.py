"""The SQL journal's connection: the engine for a URL (SQLite's pragmas, PostgreSQL's
polling connect) and the lock around the journal's one connection."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import NullPool, StaticPool

PG_CONNECT_TIMEOUT_S = 5  # a dead server is an error in seconds, not a hang


def make_engine(url: URL) -> Engine:
    if url.drivername.startswith("sqlite"):
        memory = url.database in (None, "", ":memory:")
        engine = create_engine(
            url,
            poolclass=StaticPool if memory else NullPool,
            connect_args={"check_same_thread": False, "timeout": 60},
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    from kvledger.journal.postgres import polling_connect

    engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S})
    event.listen(engine, "do_connect", polling_connect)
    return engine


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # Small pages waste less of compressed records and small index rows than 4 KB ones.
    # Takes effect on a new file only (an existing one keeps its pages); before WAL, which
    # fixes the page size.
    cur.execute("PRAGMA page_size=1024")
    # WAL lets readers run beside the writer; FULL fsyncs the WAL at every commit, which
    # is what makes an acknowledged commit survive power loss (kill -9 alone can't tell).
    _retry_busy(lambda: cur.execute("PRAGMA journal_mode=WAL"))
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA busy_timeout=60000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _retry_busy(fn: Callable[[], Any], seconds: float = 60.0) -> Any:
    """Switching a new file to WAL needs an exclusive lock, and SQLite refuses it at once
    (SQLITE_BUSY without calling the busy handler) while another process is opening the
    same new file: retry for as long as the busy timeout would have waited."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF not in (5, 6) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def lost(conn: Any) -> bool:
    """Whether the server ended this driver connection (a restart, an idle timeout, a
    terminated session): psycopg marks it closed or broken; SQLite's are never lost so."""
    return getattr(conn, "broken", False) is True or getattr(conn, "closed", False) is True


def stuck(conn: Any) -> bool:
    """Whether a connection a call just failed on is left unable to serve the next: a
    command still in progress, a transaction open or failed (psycopg's transaction
    status, IDLE when it can). Asked after a failure only: a deferred COMMIT in flight
    on the committer thread is a command in progress too. SQLite's never are."""
    info = getattr(conn, "info", None)
    return info is not None and info.transaction_status.name != "IDLE"


class ConnectionLock:
    """The lock of the journal's one connection: reentrant, as the journal's own methods
    nest. Between append_deferred and its wait the connection is mid-COMMIT on the
    committer thread while the caller's thread still holds this lock, so an entry by that
    thread (a worker's on_step reading the journal while its next batch is built) first
    waits for the COMMIT to finish; it never shares the connection with it. Other
    threads wait for the release, as with any lock."""

    __slots__ = ("_lock", "committing")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.committing: Future[Any] | None = None  # the deferred COMMIT in flight, if any

    def acquire(self) -> None:
        self._lock.acquire()
        committing = self.committing
        if committing is not None:
            wait_for((committing,))  # its outcome is the deferred wait's to report

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
