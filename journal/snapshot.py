"""The read side of verify: every row of the journal, as stored, in one snapshot.

SqlJournal.snapshot() holds the journal's lock and one read-only transaction for the
whole audit (SQLite: a deferred BEGIN in WAL mode; PostgreSQL: REPEATABLE READ READ
ONLY). Events and receipts are read in keyset pages inside that transaction, so memory
stays bounded and every page sees the same commit point as the receipts and heads.

Records (one per commit since revision 0003) are audited here, where their layout is
known: each one's chain link and CRCs (kvledger.journal.record_format), its positions, and its
lookup rows. What is wrong comes out as StoredDamage, naming the first event concerned;
the events themselves come out as StoredEvent rows whose columns are read from their
bodies (a record stores no columns apart), so verify's other checks run on them alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Protocol

import msgspec

from kvledger.journal.audit import audit_record
from kvledger.journal.contract import (
    ChainAt,
    HeadFacts,
    Integrity,
    StoredDamage,
    StoredEvent,
    StoredReceipt,
)
from kvledger.journal.keys import PREV_INDEXED, PREV_NONE, id_keys, id_runs, stable_key, unpack_prev
from kvledger.journal.port import Snapshot
from kvledger.journal.readback import Damage, Record
from kvledger.journal.record_format import GENESIS, chain
from kvledger.journal.statements import Statements, T
from kvledger.journal.verify_reads import Row

PAGE = 5000


class Call(Protocol):
    """Runs a driver call, mapping driver errors to coded ones (SqlJournal._call)."""

    def __call__(self, fn: Callable[[], T], /) -> T: ...


class SqlSnapshot(Snapshot):
    def __init__(self, sql: Statements, cur: Any, call: Call) -> None:
        self._sql, self._cur, self._call = sql, cur, call  # `call` maps driver errors to codes

    def integrity(self) -> Integrity:
        return self._call(lambda: self._sql.integrity(self._cur))

    def events(self) -> Iterator[StoredEvent | StoredDamage]:
        last = 0
        seen: set[Any] = set()  # the streams with events so far
        for row in self._pages(self._sql.EVENT_PAGES):
            yield StoredEvent(*row)
            last = row[0] if type(row[0]) is int else last
            seen.add(row[2])
        yield from self._records(last, seen)

    RECORDS_PAGE = 256

    def _records(self, last: int, seen: set[Any]) -> Iterator[StoredEvent | StoredDamage]:
        walk = _RecordWalk(last, seen)
        after = None  # the key of the page before
        while True:
            page = self._call(partial(self._sql.page, self._cur, self._sql.RECORD_PAGES, after, self.RECORDS_PAGE))
            walk.needs, walk.firsts = {"streams": {}, "ids": {}}, {}
            for row in page:
                yield from walk.record(row)
            end = page[-1][0] if page and type(page[-1][0]) is int else None
            done = len(page) < self.RECORDS_PAGE or end is None
            yield from self._lookup_rows(walk.needs, walk.firsts, after, None if done else end)
            if done:
                break
            after = end
        for handle, stored in self._call(partial(self._sql.head_pointers, self._cur)):
            yield from walk.head(handle, stored)

    def _lookup_rows(self, needs: dict[str, dict[int, set[Any] | None]], firsts: dict[int, int],
                     after: int | None, upto: int | None) -> Iterator[StoredDamage]:
        """The lookup rows keyed in (after, upto] are exactly the keys those records need
        (None: no bound; a record's keys None: unknown, its record is damaged): a missing
        one hides a record from a stream's or an operation's reads; an extra one is an
        edit. A finding names the record's first event."""
        for name, table in (("streams", "kvl_record_streams"), ("ids", "kvl_record_ids")):
            stored: dict[Any, set[Any]] = {}
            for *key, position in self._call(partial(self._sql.lookup_rows, self._cur, table, after, upto)):
                stored.setdefault(position, set()).add(key[0] if len(key) == 1 else tuple(key))
            want = needs[name]
            for position in sorted(set(stored) | set(want), key=repr):
                keys = want.get(position, set())
                if keys is not None and stored.get(position, set()) != keys:
                    yield StoredDamage(firsts.get(position),
                                       f"the {name} lookup rows of the record ending at {position!r} are "
                                       "not the keys its events and receipts need")

    def receipts(self) -> Iterator[StoredReceipt]:
        for row in self._pages(self._sql.RECEIPT_PAGES):
            yield StoredReceipt(*row)
        for row in self._pages(self._sql.RECORD_PAGES):
            if isinstance(row[3], bytes):
                yield from record_receipts(row[3])

    def heads(self) -> dict[str, HeadFacts]:
        rows = self._call(lambda: self._sql.heads(self._cur, None, None))
        return {row[0]: HeadFacts(*row[1:]) for row in rows}

    def manifest(self, manifest_sha256: str) -> Any:
        return self._call(lambda: self._sql.raw_manifest(self._cur, manifest_sha256))

    def chain_at(self, position: int | None = None) -> ChainAt:
        return self._call(lambda: self._sql.chain_at(self._cur, position))

    def _pages(self, pages: tuple[str, str]) -> Iterator[Row]:
        """Every row `pages` selects, keyed by its first column as stored."""
        after: Any = None  # the key column as stored
        while True:
            rows = self._call(partial(self._sql.page, self._cur, pages, after, PAGE))
            yield from rows
            if len(rows) < PAGE:
                return
            after = rows[-1][0]  # the key column as stored, whatever its type


class _RecordWalk:
    """What the audit of the records carries from one record to the next (the chain so
    far, where the last one ended, each stream's last record) and, for the page being
    read, the lookup keys each record needs; each step of a record is a method."""

    def __init__(self, last: int, seen: set[Any]) -> None:
        self.previous, self.last, self.seen = GENESIS, last, seen  # seen: the streams with events so far
        self.tails: dict[Any, int] = {}  # stream -> the last record since 0006 holding it
        self.damaged: set[int] = set()  # records whose streams are lost with their bytes
        self.record_firsts: dict[int, int] = {}  # such a record -> its first event
        self.needs: dict[str, dict[int, set[Any] | None]] = {"streams": {}, "ids": {}}  # the page's record -> keys
        self.firsts: dict[int, int] = {}  # the page's record (its stored last position) -> its first event

    def record(self, row: Row) -> Iterator[StoredEvent | StoredDamage]:
        """One record's findings and events: its columns, its start, its chain link, its
        bytes (audit_record), its end; then the lookup keys and stream links it needs."""
        stored_last, first, link, body, prev = row
        if not (type(stored_last) is int and type(first) is int and isinstance(link, bytes)
                and isinstance(body, bytes)):
            yield self._unreadable(row)
            return
        at = self.firsts[stored_last] = self.last + 1
        if first != at:
            yield StoredDamage(at, f"the record after position {self.last} says it starts at {first}")
        found = audit_record(body)
        if chain(self.previous, body) != link and not isinstance(found, Damage):
            # (a damaged record's CRCs name the event more precisely than its link)
            yield StoredDamage(at, "the record's bytes or its chain digest are not those committed "
                                   "(its link to the previous record does not hold)")
        self.previous = link
        for i, e in enumerate(found.events):
            yield _stored(at + i, e)
        if isinstance(found, Damage):
            yield self._damaged(at, stored_last, found)
            return
        if stored_last != at + len(found.events) - 1:
            yield StoredDamage(at, f"the record holds positions {at}..{at + len(found.events) - 1} "
                                   f"but is stored as ending at {stored_last}")
        self.last = stored_last
        yield from self._keys(at, stored_last, found, prev)

    def _lost(self, stored_last: int) -> None:
        """A damaged record's lookup rows cannot be checked: what they should be is lost too."""
        self.needs["streams"][stored_last] = self.needs["ids"][stored_last] = None
        self.damaged.add(stored_last)

    def _unreadable(self, row: Row) -> StoredDamage:
        """A record whose columns are not of their types: named, and passed over when its
        end is readable."""
        damage = StoredDamage(self.last + 1, "a record's columns are stored as "
                                             f"{', '.join(type(v).__name__ for v in row)}")
        stored_last, link = row[0], row[2]
        if type(stored_last) is int and stored_last > self.last:
            self.last = stored_last  # the next record starts after it, and links to it: it alone is blamed
            self.previous = link if isinstance(link, bytes) else self.previous
            self._lost(stored_last)
        return damage

    def _damaged(self, at: int, stored_last: int, found: Damage) -> StoredDamage:
        """The event a damaged record's audit names (its first, when the damage is the
        record's own: the header, the tail, a receipt); the events past a damaged one are
        lost with it, and the next record still starts after this one."""
        bad = at + (found.index or 0)
        self.last = stored_last
        self._lost(stored_last)
        if bad > stored_last:  # an event its header claims past its stored end: the record is named
            return StoredDamage(at, found.message)
        return StoredDamage(bad, found.message, replaces=found.index is not None)

    def _keys(self, at: int, stored_last: int, found: Record, prev: Any) -> Iterator[StoredDamage]:
        """The lookup keys a sound record needs: its streams (before 0006, in
        kvl_record_streams; since, linked by its stream_prev) and every event and
        operation id (the receipts' are their events')."""
        names = [_names(e) for e in found.events]
        streams = list(dict.fromkeys(n.stream_id for n in names))
        if prev is None:  # written before 0006: kvl_record_streams indexes its streams
            self.needs["streams"][stored_last] = {stable_key(str(s)) for s in streams}
        else:
            self.needs["streams"][stored_last] = set()
            yield from self._stream_prev(at, stored_last, streams, prev)
        self.seen.update(streams)
        self.needs["ids"][stored_last] = set(id_runs(
            id_keys([str(n.event_id) for n in names]
                    + [str(_receipt_names(r).operation_id) for r in found.receipts])))

    def _stream_prev(self, at: int, stored_last: int, streams: list[Any], prev: Any) -> Iterator[StoredDamage]:
        """A record since 0006 names, for each of its streams, the record before it there."""
        want = [self.tails.get(s, PREV_INDEXED if s in self.seen else PREV_NONE) for s in streams]
        got = unpack_prev(prev) if isinstance(prev, bytes) else None
        if got is None or len(got) != len(want) or any(
                g != w and g not in self.damaged for g, w in zip(got, want)):
            yield StoredDamage(at, f"the stream_prev of the record ending at {stored_last} is "
                                   "not the record before it on each of its streams")
        for s in streams:
            self.tails[s] = stored_last
        self.record_firsts[stored_last] = at

    def head(self, handle: str, stored: Any) -> Iterator[StoredDamage]:
        """A head's pointer is the last record its events are in (or a damaged one)."""
        tail = self.tails.get(handle)
        if stored != tail and not (stored in self.damaged and tail is not None):
            yield StoredDamage(None if tail is None else self.record_firsts[tail],
                               f"the head of {handle!r} names {stored!r} as its last record, "
                               f"its events say {tail!r}")


class _Names(msgspec.Struct):
    event_id: Any = None
    stream_id: Any = None
    stream_position: Any = None
    event_type: Any = None
    schema_version: Any = None
    operation_id: Any = None


class _ReceiptNames(msgspec.Struct):
    operation_id: Any = None
    fingerprint: Any = None
    first_global_position: Any = None
    last_global_position: Any = None


_names_decode = msgspec.json.Decoder(_Names).decode
_receipt_decode = msgspec.json.Decoder(_ReceiptNames).decode


def _names(body: bytes) -> _Names:
    try:
        return _names_decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _Names()  # verify reports the body itself


def _receipt_names(body: bytes) -> _ReceiptNames:
    try:
        return _receipt_decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _ReceiptNames()


def record_receipts(body: bytes) -> Iterator[StoredReceipt]:
    """A stored record's receipts as rows (none from a damaged record: verify reports it
    with the events)."""
    found = audit_record(body)
    if isinstance(found, Damage):
        return
    for r in found.receipts:
        k = _receipt_names(r)
        yield StoredReceipt(k.operation_id, k.fingerprint, k.first_global_position, k.last_global_position, r)


def _stored(position: int, body: bytes) -> StoredEvent:
    """A record's event as a row: its columns are what its body says (a record has no
    other copy of them) and its position the record's."""
    n = _names(body)
    return StoredEvent(position, n.event_id, n.stream_id, n.stream_position, n.event_type, n.schema_version,
                       n.operation_id, body)
