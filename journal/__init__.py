"""The durable journal: the conditional-write append, reads by stream and by global
position, receipts, manifests and projection checkpoints, on SQLite and PostgreSQL."""

from kvledger.journal.contract import (
    Check,
    Guard,
    HeadFacts,
    Journal,
    Operation,
    Rejection,
    StreamWrite,
)
from kvledger.journal.sql import SqlJournal, make_engine, open_journal
from kvledger.journal.tables import SCHEMA_REVISION
from kvledger.journal.url import DEFAULT_URL, parse_url, redact, resolve_url

__all__ = [
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
