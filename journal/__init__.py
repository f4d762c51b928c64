"""The durable journal: the conditional-write append, reads by stream and by global
position, receipts, manifests and projection checkpoints, on SQLite and PostgreSQL.

journal.port says what a backend does, journal.backends lists the backends, and this
package's names are the entry points the layers above use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.schemas import lazy

if TYPE_CHECKING:
    from kvledger.journal.backends import BACKENDS, open_journal
    from kvledger.journal.contract import Check, Guard, HeadFacts, Operation, Rejection, StreamWrite
    from kvledger.journal.port import Journal
    from kvledger.journal.sql import SqlJournal, make_engine
    from kvledger.journal.tables import SCHEMA_REVISION
    from kvledger.journal.url import DEFAULT_URL, parse_url, redact, resolve_url

# Loaded when first used: a module of this layer (journal.tuning, journal.url) is imported
# without the backends, and a command's parser and `--help` without SQLAlchemy.
__getattr__ = lazy.exports(__name__, {
    "backends": ("BACKENDS", "open_journal"),
    "contract": ("Check", "Guard", "HeadFacts", "Operation", "Rejection", "StreamWrite"),
    "port": ("Journal",),
    "sql": ("SqlJournal", "make_engine"),
    "tables": ("SCHEMA_REVISION",),
    "url": ("DEFAULT_URL", "parse_url", "redact", "resolve_url"),
})

__all__ = [
    "BACKENDS",
    "DEFAULT_URL",
    "SCHEMA_REVISION",
    "Check",
    "Guard",
    "HeadFacts",
    "Journal",
    "Operation",
    "Rejection",
    "SqlJournal",
    "StreamWrite",
    "make_engine",
    "open_journal",
    "parse_url",
    "redact",
    "resolve_url",
]
