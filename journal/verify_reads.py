"""The SQL verify reads, shared by both backends: one read-only snapshot, every column as
stored (journal.statements.Statements has them through `VerifyReads`), and reading a
stored value as the type it must have (a damaged row can hold anything).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import msgspec

from kvledger.journal.contract import ChainAt, Integrity
from kvledger.journal.readback import Record
from kvledger.journal.record_format import GENESIS
from kvledger.schemas.errors import ErrorCode, KvLedgerError

Row = tuple[Any, ...]  # a row as the driver returned it (a damaged row can hold anything)


class VerifyReads(abc.ABC):
    """What `kvledger verify` reads; the rest of Statements supplies the abstract four."""

    @abc.abstractmethod
    def q(self, sql: str) -> str: ...

    @abc.abstractmethod
    def last_position(self, cur: Any) -> int: ...

    @abc.abstractmethod
    def records_after(self, cur: Any, after: int, fold: bool = False) -> Iterator[tuple[int, Record]]: ...

    @abc.abstractmethod
    def _manifest_body(self, cur: Any, stored: bytes) -> bytes: ...

    # -- verify: one read-only snapshot, every column as stored ------------------------
    @abc.abstractmethod
    def begin_read(self) -> Any:
        """Open a read-only transaction whose reads all see one snapshot; return its cursor."""

    def end_read(self, cur: Any) -> None:
        try:
            cur.execute("ROLLBACK")  # it wrote nothing
        finally:
            cur.close()

    @abc.abstractmethod
    def integrity(self, cur: Any) -> Integrity: ...

    # Keyset pages, as (first page, each next page). The first page has no lower bound,
    # so a row whose key was edited to zero or below is read too (a `> 0` bound would
    # hide it from the audit).
    EVENT_PAGES = (
        "SELECT global_position, event_id, stream_id, stream_position, event_type, schema_version, "
        "operation_id, body FROM kvl_events ORDER BY global_position LIMIT ?",
        "SELECT global_position, event_id, stream_id, stream_position, event_type, schema_version, "
        "operation_id, body FROM kvl_events WHERE global_position > ? ORDER BY global_position LIMIT ?",
    )
    RECEIPT_PAGES = (
        "SELECT operation_id, fingerprint, first_global_position, last_global_position, body "
        "FROM kvl_receipts ORDER BY operation_id LIMIT ?",
        "SELECT operation_id, fingerprint, first_global_position, last_global_position, body "
        "FROM kvl_receipts WHERE operation_id > ? ORDER BY operation_id LIMIT ?",
    )

    RECORD_PAGES = (
        "SELECT last_position, first_position, chain, body, stream_prev FROM kvl_records "
        "ORDER BY last_position LIMIT ?",
        "SELECT last_position, first_position, chain, body, stream_prev FROM kvl_records WHERE last_position > ? "
        "ORDER BY last_position LIMIT ?",
    )

    def chain_at(self, cur: Any, position: int | None) -> ChainAt:
        """Where the journal ends, and its record chain at `position` (None: at its end):
        the chain digest of the record ending there, GENESIS where no record ends at or
        before it (position 0, or the events of an import or of before revision 0003),
        None where no commit ends there (inside a record, or past the end)."""
        last = self.last_position(cur)
        at = last if position is None else position
        cur.execute(self.q("SELECT last_position, first_position, chain FROM kvl_records WHERE last_position >= ? "
                           "ORDER BY last_position LIMIT 1"), (at,))
        row = cur.fetchone()
        digest: bytes | None = None
        if row is not None and row[0] == at:
            digest = bytes(row[2]) if isinstance(row[2], (bytes, bytearray, memoryview)) else None
        elif at <= last and (row is None or type(row[1]) is not int or row[1] > at):
            cur.execute(self.q("SELECT 1 FROM kvl_records WHERE last_position < ? LIMIT 1"), (at,))
            digest = GENESIS if cur.fetchone() is None else None
        cur.execute("SELECT max(last_record) FROM kvl_heads")
        named = cur.fetchone()[0]
        return ChainAt(last, at, digest, named if type(named) is int else None)

    def head_pointers(self, cur: Any) -> list[Row]:
        """(handle_id, last_record) of every head, as stored."""
        cur.execute("SELECT handle_id, last_record FROM kvl_heads")
        rows: list[Row] = cur.fetchall()
        return rows

    LOOKUP_TABLES = {"kvl_record_streams": "stream_key", "kvl_record_ids": "first_key, last_key"}

    def lookup_rows(self, cur: Any, table: str, after: int | None, upto: int | None) -> list[Row]:
        """(key columns..., last_position) rows of a records lookup table with
        last_position in (after, upto]; None: unbounded on that side."""
        key = self.LOOKUP_TABLES[table]  # one of two constant names: never input
        where = " AND ".join(c for c, v in (("last_position > ?", after), ("last_position <= ?", upto))
                             if v is not None)
        params = [v for v in (after, upto) if v is not None]
        cur.execute(self.q(f"SELECT {key}, last_position FROM {table}" + (f" WHERE {where}" if where else "")),
                    params)
        rows: list[Row] = cur.fetchall()
        return rows

    def page(self, cur: Any, pages: tuple[str, str], after: Any, limit: int) -> list[Row]:
        """Rows after key `after` (None: from the start), at most `limit`."""
        if after is None:
            cur.execute(self.q(pages[0]), (limit,))
        else:
            cur.execute(self.q(pages[1]), (after, limit))
        rows: list[Row] = cur.fetchall()
        return rows

    def raw_manifest(self, cur: Any, manifest_sha256: str) -> Any:
        """The stored body as it is (verify names a TEXT one), inflated when compressed."""
        cur.execute(self.q("SELECT body FROM kvl_manifests WHERE manifest_sha256 = ?"), (manifest_sha256,))
        row = cur.fetchone()
        if row is None or not isinstance(row[0], (bytes, bytearray, memoryview)):
            return None if row is None else row[0]
        return self._manifest_body(cur, bytes(row[0]))

    def receipt_bodies_after(self, cur: Any, after: int, limit: int) -> list[tuple[int, bytes]]:
        cur.execute(
            self.q("SELECT first_global_position, body FROM kvl_receipts "
                   "WHERE first_global_position > ? ORDER BY first_global_position LIMIT ?"),
            (after, limit),
        )
        rows = [(stored_int(p, "a receipt position"), stored_bytes(b, f"the receipt at position {p}"))
                for p, b in cur.fetchall()]
        if len(rows) < limit:
            # A record's receipts start inside it: the records that can hold one past
            # `start` are those that end past it.
            start = rows[-1][0] if rows else after
            for _, record in self.records_after(cur, start):
                rows += (pr for pr in ((_receipt_first(r), r) for r in record.receipts) if pr[0] > start)
                if len(rows) >= limit:
                    break
        return rows[:limit]


def stored_bytes(value: Any, what: str) -> bytes:
    """A BLOB/bytea column value as bytes. SQLite keeps whatever type a row was written
    with, so an edited row can hold TEXT: that is a damaged journal, not a driver error."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"{what} is stored as {type(value).__name__}, "
                                                   "not bytes (run `kvledger verify`)")


def stored_int(value: Any, what: str) -> int:
    if type(value) is int:
        return value
    raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"{what} is stored as {type(value).__name__} "
                                                   f"{str(value)[:40]!r} (run `kvledger verify`)")


class _ReceiptFirst(msgspec.Struct):
    first_global_position: int


_receipt_first_decode = msgspec.json.Decoder(_ReceiptFirst).decode


def _receipt_first(body: bytes) -> int:
    return _receipt_first_decode(body).first_global_position
