"""Opening journals, and creating or migrating them where a command may (the facade, the CLI, recovery).

Which commands may create a database: `init`, and the writing commands (`demo`,
`generate`, `import`, `Ledger.open`) on a new SQLite file. Reading commands open with
`open_existing_journal` and never create one: a missing file is DATABASE_NOT_FOUND.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy.engine import URL

from kvledger import migrations
from kvledger.journal import Journal, SqlJournal, make_engine, parse_url, resolve_url
from kvledger.journal.driver_errors import is_driver_error, translate
from kvledger.journal.url import NATS_PREFIX, redact
from kvledger.schemas.errors import ErrorCode, KvLedgerError


def init_database(raw_url: str | None = None, *, allow_lazy_fsync: bool = False) -> str:
    """Upgrade the database to the head revision; returns the revision. A NATS cell gets
    its stream (journal.nats_admin; `allow_lazy_fsync`: on servers that may not fsync
    every write)."""
    raw = resolve_url(raw_url)
    if raw.startswith(NATS_PREFIX):
        from kvledger.journal.nats_admin import init_cell

        return init_cell(raw, allow_lazy_fsync=allow_lazy_fsync)
    url = parse_url(raw)
    _migrate(url)
    return migrations.head_revision()


def _backend_journal(raw: str) -> Journal | None:
    """A journal of a backend that is no SQL database (NATS), opened by journal.backends;
    None for SQL. Such a journal is made by `kvledger init`, never on the spot."""
    if not raw.startswith(NATS_PREFIX):
        return None
    from kvledger.journal.backends import open_journal

    return open_journal(raw)


def _migrate(url: URL) -> None:
    engine = None
    try:
        engine = make_engine(url)
        migrations.upgrade(engine)
    except Exception as exc:
        if not is_driver_error(exc):
            raise
        raise translate(exc, url) from None
    finally:
        if engine is not None:
            engine.dispose()


def open_or_create_journal(raw_url: str | None = None) -> Journal:
    """Open a journal to write, creating it if it is a new SQLite database (no kvledger
    tables at all: migrated on the spot; kvledger.journal.open_journal refuses it). Anything
    else un-migrated (PostgreSQL, an older revision, an emptied version table, a NATS
    cell) must go through `kvledger init` first."""
    other = _backend_journal(resolve_url(raw_url))
    if other is not None:
        return other
    url = parse_url(resolve_url(raw_url))
    try:
        return SqlJournal(url)
    except KvLedgerError as exc:
        new = exc.details.get("revision") is None and not exc.details.get("journal_tables")
        if exc.code is not ErrorCode.NOT_MIGRATED or url.get_backend_name() != "sqlite" or not new:
            raise
    _migrate(url)  # takes the writer lock: a concurrent initializer of this file goes first
    return SqlJournal(url)


@contextlib.contextmanager
def creating_journal(raw_url: str | None = None) -> Iterator[Journal]:
    """`open_or_create_journal` for a command that is all or nothing (import): a new SQLite file is
    built under a temporary name beside it and takes its own name only if the command
    succeeds, so a refused command leaves no file behind. The final name is taken with
    link(2), which never replaces a file another process created meanwhile."""
    other = _backend_journal(resolve_url(raw_url))
    if other is not None:
        with other:
            yield other
        return
    url = parse_url(resolve_url(raw_url))
    path = _sqlite_path(url)
    if path is None or path.exists() or not os.access(path.parent, os.W_OK):
        # (an unwritable directory: let opening say so, naming the file asked for)
        with open_or_create_journal(url.render_as_string(hide_password=False)) as journal:
            yield journal
        return
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.creating")
    try:
        with open_or_create_journal(url.set(database=str(temp)).render_as_string(hide_password=False)) as journal:
            journal.display_url = redact(url)  # messages name the file the user asked for
            yield journal
        # Closed: the last connection has checkpointed the WAL into the file.
        try:
            os.link(temp, path)
        except FileExistsError:
            raise KvLedgerError(ErrorCode.CONFLICT, f"{redact(url)} was created by another process "
                                "meanwhile: nothing was written to it") from None
    finally:
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(OSError):
                Path(f"{temp}{suffix}").unlink()


def open_existing_journal(raw_url: str | None = None) -> Journal:
    """Open a journal that must already exist: reading commands never create a database."""
    other = _backend_journal(resolve_url(raw_url))
    if other is not None:
        return other
    url = parse_url(resolve_url(raw_url))
    require_existing(url)
    return SqlJournal(url)


def require_existing(url: URL) -> None:
    """DATABASE_NOT_FOUND for a SQLite file that does not exist (connecting would create it)."""
    path = _sqlite_path(url)
    if path is not None and not path.exists():
        raise KvLedgerError(ErrorCode.DATABASE_NOT_FOUND, f"no journal at {redact(url)}")


def _sqlite_path(url: URL) -> Path | None:
    """The file of a SQLite URL; None for PostgreSQL, memory, or a file: URI (which says
    itself, e.g. mode=ro, whether the file may be created)."""
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    if str(url.query.get("uri", "")).lower() in ("true", "1"):
        return None
    return Path(url.database).expanduser()


__all__ = ["creating_journal", "init_database", "open_existing_journal", "open_or_create_journal", "redact",
           "require_existing"]
