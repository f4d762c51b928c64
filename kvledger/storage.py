"""Opening and migrating journals for the facade and the CLI."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

import migrations
from journal import SqlJournal, make_engine, parse_url, resolve_url
from journal.url import redact, unreachable
from schemas.errors import ErrorCode, KvLedgerError


def init_database(raw_url: str | None = None) -> str:
    """Upgrade the database to the head revision; returns the revision."""
    url = parse_url(resolve_url(raw_url))
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        migrations.upgrade(engine)
    except (DBAPIError, SQLAlchemyError) as exc:
        raise unreachable(exc, url) from None
    finally:
        engine.dispose()
    return migrations.head_revision()


def open_journal(raw_url: str | None = None) -> SqlJournal:
    """Open a journal. A new SQLite file is initialized on the spot; PostgreSQL must
    have been migrated with `kvledger init` first."""
    url = parse_url(resolve_url(raw_url))
    try:
        return SqlJournal(url)
    except KvLedgerError as exc:
        if exc.code is not ErrorCode.NOT_MIGRATED or url.get_backend_name() != "sqlite":
            raise
    init_database(url.render_as_string(hide_password=False))
    return SqlJournal(url)


def open_existing_journal(raw_url: str | None = None) -> SqlJournal:
    """Open a journal that must already exist: reading commands never create a database."""
    url = parse_url(resolve_url(raw_url))
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        if not Path(url.database).expanduser().exists():
            raise KvLedgerError(ErrorCode.DATABASE_UNREACHABLE, f"no journal at {redact(url)}")
    return SqlJournal(url)


__all__ = ["init_database", "open_existing_journal", "open_journal", "redact"]
