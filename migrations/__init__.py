"""Alembic environment and versions for the journal tables.

`upgrade(engine)` brings a database to head; `kvledger init` calls it. It decides from
the database's state, read under a lock so two initializing processes take turns:
  - a revision this code does not know: DATABASE_TOO_NEW, nothing touched;
  - journal tables but no recorded revision (an emptied or dropped version table): if the
    tables are exactly the head schema, record head (stamp); else SCHEMA_MISMATCH;
  - otherwise run the migrations from the recorded revision (or from nothing) to head.
On PostgreSQL it then sets the tables' storage parameters (`_tune_postgres`), in the same
transaction; a role that does not own the tables is warned that a setting is left, and its
init still succeeds.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import inspect
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from kvledger.journal.tables import JOURNAL_TABLES, REVISIONS, VERSION_TABLE, metadata, too_new
from kvledger.journal.url import redact
from kvledger.schemas.errors import ErrorCode, KvLedgerError

if TYPE_CHECKING:  # alembic is imported where a migration runs: opening a journal never needs it
    from alembic.config import Config
    from alembic.script import ScriptDirectory

# pg_advisory_xact_lock key of `kvledger init` (any constant; this one names the purpose).
_PG_INIT_LOCK = zlib.crc32(b"kvledger init") - 2**31

HERE = Path(__file__).resolve().parent


def _config() -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("version_table", VERSION_TABLE)
    return cfg


def _scripts() -> ScriptDirectory:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_config())


def head_revision() -> str:
    return _scripts().get_current_head() or ""


def known_revisions() -> tuple[str, ...]:
    """The revisions of migrations/versions, oldest first."""
    return tuple(reversed([s.revision for s in _scripts().walk_revisions()]))


def upgrade(engine: Engine, revision: str = "head") -> None:
    cfg = _config()
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            # pysqlite runs DDL outside a transaction (each CREATE commits alone): make the
            # whole migration one IMMEDIATE transaction instead, so a second process
            # initializing the same new file waits for it, then finds it migrated.
            # the sqlite3 connection (a driver's: typed Any); None only once invalidated
            raw: Any = conn.connection.driver_connection
            level, raw.isolation_level = raw.isolation_level, None
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:  # transactional DDL; the lock makes concurrent inits take turns
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(%(k)s)", {"k": _PG_INIT_LOCK})
        try:
            # env.py uses this connection: no URL (and no password) ever enters alembic's config.
            cfg.attributes["connection"] = conn
            _migrate(conn, cfg, revision)
            if not sqlite:
                _tune_postgres(conn)
            conn.commit()
        finally:
            if sqlite:
                raw.isolation_level = level


# Storage parameters: physical settings, not schema (no revision; compare_metadata does
# not see them), so every `kvledger init` sets them, on a new database and on one made
# before. kvl_heads: every commit updates the row of each handle it writes, once. At the
# default fillfactor a page has no room for the new version: it goes to another page,
# gets an entry in both indexes, and the dead one waits for VACUUM. Half-full pages keep
# each new version on its page (a HOT update: no index entry, the old version pruned at
# the next visit): docs/decisions/postgres-storage.md.
_HEADS_FILLFACTOR = "fillfactor=50"  # as pg_class.reloptions spells it, and ALTER TABLE takes it


def _tune_postgres(conn: Connection) -> None:
    options = conn.exec_driver_sql("SELECT reloptions FROM pg_class WHERE oid = 'kvl_heads'::regclass").scalar()
    if _HEADS_FILLFACTOR in (options or ()):
        return
    try:
        # A savepoint: a role that may write the journal but does not own its tables
        # (so could not alter them) still gets its init; the setting waits for the owner's.
        with conn.begin_nested():
            # takes SHARE UPDATE EXCLUSIVE: a running writer's updates go on; pages already
            # full are left as they are (no rewrite) and fill to the new mark as they turn over
            conn.exec_driver_sql("ALTER TABLE kvl_heads SET (" + _HEADS_FILLFACTOR + ")")  # constants only
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) != "42501":  # insufficient_privilege
            raise
        logging.getLogger("kvledger.migrations").warning(
            "kvl_heads storage parameter (%s) not set: this role does not own the table; run `kvledger init` "
            "as its owner once (head updates stay slower until then)", _HEADS_FILLFACTOR)


def _migrate(conn: Connection, cfg: Config, revision: str) -> None:
    from alembic import command
    from alembic.migration import MigrationContext

    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    current = context.get_current_revision()
    where = redact(conn.engine.url)
    if current is not None and current not in REVISIONS:
        raise too_new(current, where)
    tables = set(inspect(conn).get_table_names()) & set(JOURNAL_TABLES)
    if current is None and tables:
        from alembic.autogenerate import compare_metadata

        if compare_metadata(context, metadata):
            raise KvLedgerError(
                ErrorCode.SCHEMA_MISMATCH,
                f"{where} has journal tables ({', '.join(sorted(tables))}) but no recorded revision, "
                f"and they are not the tables of revision {REVISIONS[-1]}: nothing was changed; "
                "restore the database from a backup (or export what verify accepts and import it)",
            )
        command.stamp(cfg, revision)  # the tables are head's: record that, change nothing else
        return
    command.upgrade(cfg, revision)
