"""The journal contract (tests/test_journal_contract.py) run against the NATS backend on
a three-server cluster, until it is registered in journal.backends (then conftest's
`db_url` runs every backend test on it). The contract's tests that reach into SQL
(stored rows of an old schema, the SQL committer thread) are not run here."""

from __future__ import annotations

import pytest
import test_journal_contract as contract
from nats_cluster import nats_url  # noqa: F401  # a fixture

from kvledger.journal.nats import NatsJournal

SQL_ONLY = {"test_old_schema_version_is_read_back_upgraded",
            "test_the_appending_thread_reads_only_after_its_deferred_commit"}
for _name in dir(contract):
    if _name.startswith("test_") and _name not in SQL_ONLY:
        globals()[_name] = getattr(contract, _name)


@pytest.fixture(autouse=True)
def _open_nats(monkeypatch):
    """The contract opens journals by URL through the SQL opener: here, NATS's."""
    monkeypatch.setattr(contract, "open_or_create_journal", NatsJournal)


@pytest.fixture
def db_url(nats_url):  # noqa: F811
    return nats_url


@pytest.fixture
def journal(db_url):
    j = NatsJournal(db_url)
    yield j
    j.close()
