"""The one list of journal backends: each implements journal.port.Journal.

Opening a journal by its URL goes through this list, and the contract suite runs
against every entry (tests/conftest.py parametrizes its `backend` fixture over it).
Adding a backend is one module and one entry here: see journal.port.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from sqlalchemy.engine import URL

from kvledger.journal.port import Journal
from kvledger.journal.url import parse_url
from kvledger.schemas.errors import ErrorCode, KvLedgerError


class Backend(NamedTuple):
    name: str  # what tests and messages call it
    schemes: tuple[str, ...]  # the URL backend names it opens (sqlalchemy's get_backend_name)
    opener: str  # "module:callable": opens a migrated journal from its URL string
    # What reading, writing and auditing its journals imports when first done: a process
    # that forks workers (crash trials, racing tests) imports these once, before the fork.
    modules: tuple[str, ...] = ()


BACKENDS: tuple[Backend, ...] = (
    Backend("sqlite", ("sqlite",), "kvledger.journal.sql:open_journal",
            ("kvledger.journal.sql", "kvledger.journal.sqlite", "kvledger.journal.blocks",
             "kvledger.journal.snapshot")),
    Backend("postgres", ("postgresql",), "kvledger.journal.sql:open_journal",
            ("kvledger.journal.sql", "kvledger.journal.postgres", "kvledger.journal.blocks",
             "kvledger.journal.snapshot")),
    Backend("nats", ("nats",), "kvledger.journal.nats:open_journal",
            ("kvledger.journal.nats", "kvledger.journal.nats_audit", "kvledger.journal.blocks")),
)
# Backends that open journals but do not yet pass every test that takes `db_url`, so the
# suite is not parametrized over them (tests/conftest.py adds one named in
# KVLEDGER_TEST_PENDING) until it moves up into BACKENDS.
PENDING: tuple[Backend, ...] = ()


def backend_of(url: URL) -> Backend:
    """The backend that opens `url` (parse_url's)."""
    scheme = url.get_backend_name()
    for b in BACKENDS + PENDING:
        if scheme in b.schemes:
            return b
    raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"no journal backend opens {scheme} URLs "
                        f"(known: {', '.join(s for b in BACKENDS + PENDING for s in b.schemes)})")


def open_journal(raw_url: str) -> Journal:
    """Open a migrated journal. An un-migrated database is NOT_MIGRATED (run `kvledger init`)."""
    module, _, name = backend_of(parse_url(raw_url)).opener.partition(":")
    journal: Journal = getattr(importlib.import_module(module), name)(raw_url)
    return journal


__all__ = ["BACKENDS", "PENDING", "Backend", "backend_of", "open_journal"]
