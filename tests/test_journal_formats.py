"""Journals written by earlier record formats read the same with today's code, which
writes record format 7 (decode steps as a block of columns, docs/reference/storage-format.md) and
format 5 for a record with no step. Each fixture holds what its code wrote and printed: the SQLite
file, its export, `replay --json`, `verify --json` and every receipt.

- fixtures/journal_format3 (commit 0823483): format 3, every receipt's fingerprint stored;
- fixtures/journal_format5 (commit 09b1099): format 5, a decode chain's fingerprint
  derived from its events and the record's lists inside its zstd frame;
- fixtures/journal_format6 (commit 978a13f): format 6, decode steps as msgpack rows (18
  of them), records without a step in format 5;
- fixtures/journal_format7 (commit 842dc4f): format 7 as written before the decode batch
  became one value (issue 45), 20 step rows: what a change of the writer must still read
  and export byte for byte.

Same revision (0006), so nothing migrates: verify is clean, replay and export print what
the old code printed, every old receipt is found by its operation id (what makes a
retry of it idempotent), and after today's code appends to it, the journal holds both
formats and still verifies, the old receipts unchanged.
"""

from __future__ import annotations

import json

import pytest

from kvledger.journal import open_journal
from kvledger.journal.audit import decode_record, unpack_record
from kvledger.journal.readback import _compact_decode
from kvledger.journal.record_format import FORMAT
from kvledger.journal.tables import SCHEMA_REVISION
from kvledger.schemas.receipts import receipt_decoder

from stored_rows import FIXTURES, cli, old_journal, reads_as_recorded, sql

TABLES = ("kvl_heads", "kvl_manifests", "kvl_checkpoints", "kvl_records", "kvl_record_ids")
# fixture, the record formats its code wrote (record by record), the receipts it stored
# without a fingerprint, its step rows
OLD = {"format3": (FIXTURES / "journal_format3", [3] * 8, 0, 0),
       "format5": (FIXTURES / "journal_format5", [5] * 8, 18, 0),
       "format6": (FIXTURES / "journal_format6", [5, 6, 6, 6, 6, 6, 6, 5], 0, 18),
       "format7": (FIXTURES / "journal_format7", [5, 7, 7, 7, 5, 7, 7, 5], 0, 20)}


@pytest.fixture(params=list(OLD))
def old(request) -> tuple:
    return OLD[request.param]


@pytest.fixture(params=["sqlite", "postgres"])
def old_url(request, tmp_path, old) -> str:
    """A writable copy of the fixture on the parametrized backend."""
    return old_journal(request, tmp_path, old[0], SCHEMA_REVISION, TABLES)


def receipts(fixture):
    return [receipt_decoder.decode(line) for line in (fixture / "receipts.jsonl").read_bytes().splitlines()]


def formats(url: str) -> list[int]:
    return [unpack_record(bytes(b)).format for (b,) in sql(url, "SELECT body FROM kvl_records ORDER BY last_position")]


def derived(url: str) -> int:
    """Receipts stored without their fingerprint (format 4's mark)."""
    return sum(_compact_decode(r).fingerprint is None
               for (b,) in sql(url, "SELECT body FROM kvl_records")
               for r in decode_record(bytes(b), "t").stored_receipts)


def step_rows(url: str) -> int:
    return sum(decode_record(bytes(b), "t").step_rows for (b,) in sql(url, "SELECT body FROM kvl_records"))


def test_an_old_format_reads_as_the_old_code_read_it(old, old_url, capsys, tmp_path):
    fixture, kinds, marks, rows = old
    assert FORMAT == 7 and formats(old_url) == kinds and derived(old_url) == marks and step_rows(old_url) == rows
    reads_as_recorded(capsys, old_url, fixture, tmp_path, receipts(fixture))


def test_appended_records_verify_beside_old_ones(old, old_url, capsys):
    fixture, kinds, _, rows = old
    code, _, err = cli(capsys, "demo", "--db", old_url, "--requests", "4", "--max-new-tokens", "4", "--seed", "5")
    assert code == 0, err
    now = formats(old_url)
    assert now[:8] == kinds and set(now[8:]) == {FORMAT}  # new records: one format, steps or not
    assert step_rows(old_url) > rows  # the demo's decode chains: rows, their fingerprints rebuilt on read
    code, out, err = cli(capsys, "verify", "--json", "--db", old_url)
    assert code == 0 and json.loads(out)["ok"], err
    with open_journal(old_url) as journal:
        old_receipts = receipts(fixture)
        assert [journal.receipt(r.operation_id) for r in old_receipts] == old_receipts
        new = [r for r in journal.read_receipts() if r.first_global_position > 149]
        assert new and all(len(r.fingerprint) == 64 for r in new)
