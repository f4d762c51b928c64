"""The read side of verify: every row of the journal, as stored, in one snapshot.

SqlJournal.snapshot() holds the journal's lock and one read-only transaction for the
whole audit (SQLite: a deferred BEGIN in WAL mode; PostgreSQL: REPEATABLE READ READ
ONLY). Events and receipts are read in keyset pages inside that transaction, so memory
stays bounded and every page sees the same commit point as the receipts and heads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Protocol

from kvledger.journal.contract import HeadFacts, Integrity, Snapshot, StoredEvent, StoredReceipt
from kvledger.journal.statements import Row, Statements, T

PAGE = 5000


class Call(Protocol):
    """Runs a driver call, mapping driver errors to coded ones (SqlJournal._call)."""

    def __call__(self, fn: Callable[[], T], /) -> T: ...


class SqlSnapshot(Snapshot):
    def __init__(self, sql: Statements, cur: Any, call: Call) -> None:
        self._sql, self._cur, self._call = sql, cur, call  # `call` maps driver errors to codes

    def integrity(self) -> Integrity:
        return self._call(lambda: self._sql.integrity(self._cur))

    def events(self) -> Iterator[StoredEvent]:
        for row in self._pages(self._sql.EVENT_PAGES):
            yield StoredEvent(*row)

    def receipts(self) -> Iterator[StoredReceipt]:
        for row in self._pages(self._sql.RECEIPT_PAGES):
            yield StoredReceipt(*row)

    def heads(self) -> dict[str, HeadFacts]:
        rows = self._call(lambda: self._sql.heads(self._cur, None, None))
        return {row[0]: HeadFacts(*row[1:]) for row in rows}

    def manifest(self, manifest_sha256: str) -> Any:
        return self._call(lambda: self._sql.raw_manifest(self._cur, manifest_sha256))

    def _pages(self, pages: tuple[str, str]) -> Iterator[Row]:
        after: Any = None  # the key column as stored
        while True:
            rows = self._call(partial(self._sql.page, self._cur, pages, after, PAGE))
            yield from rows
            if len(rows) < PAGE:
                return
            after = rows[-1][0]  # the key column as stored, whatever its type
