"""Verify's snapshot of a NATS journal (journal.nats): every read bounded by the stream
sequence of the last record when the audit began. The stream denies delete and purge,
so what is stored up to that sequence cannot change under the audit, and a writer
committing meanwhile lands after it: the snapshot SQL gets from one read transaction.

The records are audited by the SQL backends' own walk (journal.snapshot._RecordWalk:
chain links, CRCs, positions, each stream's links); the links a NATS record and head
store are stream sequences, which the walk is given as the positions they name.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Protocol

from kvledger.journal.contract import ChainAt, HeadFacts, Integrity, StoredDamage, StoredEvent, StoredReceipt
from kvledger.journal.keys import PREV_NONE, pack_prev, unpack_prev
from kvledger.journal.nats_client import Msg, NatsClient
from kvledger.journal.nats_heads import Rec, Tail, head_decode
from kvledger.journal.port import Snapshot
from kvledger.journal.record_format import GENESIS
from kvledger.journal.snapshot import _RecordWalk, record_receipts


class Reads(Protocol):
    """What the audit reads through its journal (journal.nats.NatsJournal)."""

    client: NatsClient
    stream: str
    prefix: str
    records_subject: str
    _lock: threading.RLock

    def _subjects(self, wildcard: str) -> list[str]: ...

    def _record_seq_after(self, position: int, tail: Tail | None = None) -> int | None: ...

    def _record_at(self, seq: int) -> Rec: ...

    def record_msgs(self, start: int, upto: int | None = None) -> Iterator[Msg]: ...

    def manifest(self, manifest_sha256: str) -> bytes | None: ...


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def _hex(text: str | None) -> bytes | None:
    try:
        return None if text is None else bytes.fromhex(text)
    except ValueError:
        return None


class NatsSnapshot(Snapshot):
    def __init__(self, journal: Reads, tail: Tail, upto: int) -> None:
        # the last record, and the stream's last sequence (its commit's heads come after it)
        self._j, self._tail, self._upto = journal, tail, upto
        self._positions: dict[int, int] = {PREV_NONE: PREV_NONE}  # record's stream sequence -> its last position

    def _record_msgs(self) -> Iterator[Msg]:
        return self._j.record_msgs(1, self._tail.seq)

    def integrity(self) -> Integrity:
        info = self._j.client.api(f"STREAM.INFO.{self._j.stream}")
        lost = ((info.get("state") or {}).get("lost") or {}).get("msgs") or []
        return Integrity("jetstream stream state", tuple(f"the stream lost message {seq}" for seq in lost[:100]))

    def events(self) -> Iterator[StoredEvent | StoredDamage]:
        walk = _RecordWalk(0, set())
        for msg in self._record_msgs():
            h = msg.headers
            last, prev = _int(h.get("Kvl-Last")), _hex(h.get("Kvl-Prev"))
            seqs = None if prev is None else unpack_prev(prev)
            # the walk checks links as positions: each stream sequence as the record's it names
            links = None if seqs is None else pack_prev([self._positions.get(s, -2 - s) for s in seqs])
            yield from walk.record((last, _int(h.get("Kvl-First")), _hex(h.get("Kvl-Chain")), msg.data, links))
            if last is not None:
                self._positions[msg.seq] = last
        for handle, record in self._head_records().items():
            yield from walk.head(handle, self._positions.get(record, -2 - record))

    def _heads(self) -> Iterator[tuple[str, int, HeadFacts]]:
        """(handle, its record's stream sequence, facts) of every head as of the snapshot."""
        j = self._j
        if self._upto == 0:  # an empty stream when the audit began (a bound of 0 would be no bound)
            return
        subjects = j._subjects(f"{j.prefix}.h.*")
        for i in range(0, len(subjects), 1000):
            chunk = subjects[i:i + 1000]
            msgs: list[Msg | None] = list(j.client.get_each(j.stream, [{"last_by_subj": s} for s in chunk]))
            later = [s for s, m in zip(chunk, msgs) if m is not None and m.seq > self._upto]
            if later:  # moved since the audit began: as they were then (a replica's, bounded)
                msgs = [m for m in msgs if m is not None and m.seq <= self._upto]
                msgs += j.client.get_many(j.stream, {"multi_last": later, "batch": len(later), "up_to_seq": self._upto})
            for msg in msgs:
                found = None if msg is None else head_decode(msg.data)
                if msg is not None and found is not None:
                    yield found[0], msg.seq - found[1], found[2]

    def _head_records(self) -> dict[str, int]:
        return {h: record for h, record, _ in self._heads()}

    def receipts(self) -> Iterator[StoredReceipt]:
        for msg in self._record_msgs():
            yield from record_receipts(msg.data)

    def heads(self) -> dict[str, HeadFacts]:
        return dict(sorted((h, facts) for h, _, facts in self._heads()))

    def manifest(self, manifest_sha256: str) -> Any:
        return self._j.manifest(manifest_sha256)

    def chain_at(self, position: int | None = None) -> ChainAt:
        j = self._j
        tail = self._tail
        at = tail.last if position is None else position
        digest: bytes | None = None
        if at == 0:
            digest = GENESIS
        elif at <= tail.last:
            seq = j._record_seq_after(at - 1, tail)
            rec = None if seq is None else j._record_at(seq)
            digest = rec.chain if rec is not None and rec.last == at else None
        records = [r for _, r, _ in self._heads()]
        named = None
        if records:
            msg = j.client.get(j.stream, {"seq": max(records)})
            named = _int(msg.headers.get("Kvl-Last")) if msg is not None else None
        return ChainAt(tail.last, at, digest, named)


__all__ = ["NatsSnapshot"]
