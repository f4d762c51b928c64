"""The NATS JetStream journal: kvledger's journal contract (journal.port) on one JetStream
stream per cell, for a fleet's journal replicated across servers.

Why it holds the contract, and how it is laid out:

- One stream `KVL_<cell>` (file storage, R3 by default, deny delete and purge,
  allow_atomic, allow_direct) with subjects under `kvl.<cell>.`:
  `r` a record per commit, `h.<handle>` a handle's head, `m.<sha256>` a manifest,
  `c.<name>` a projection's checkpoint (ids that are not subject tokens are hashed, see
  `token`).
- A commit is one atomic batch (all stored or none): the commit's record, built by the
  same code and in the same format and chain as the SQL backends' (journal.record_rows),
  then each head it changes, then its new manifests. The record is published with
  `Nats-Expected-Last-Subject-Sequence` on `r`: a compare-and-set on the last record,
  which serializes the cell's writers as SQL's writer lock does, so global positions stay
  gapless and the chain linear. Each head message expects its subject's last sequence as
  read (0: the handle must not exist), the guard the SQL backends check in a row; the
  decision itself (journal.batching's rounds, phantoms, retries) runs in memory on the
  heads read, exactly as on SQL. A refused expectation means another writer committed
  first: the batch is decided again on what is stored then, so a stale guard comes back
  as the same STALE_BASE or HANDLE_EXISTS, and a commit whose acknowledgement was lost
  is found stored and answered with its receipt (the operation id is the idempotency
  key; the record also carries a Nats-Msg-Id of its operations for the duplicate window).
- A global position is an event's place in the records (each record says its first and
  last), not a stream sequence: heads, manifests and checkpoints share the stream.
  A record's stream links (stream_prev) and a head's record pointer are stream sequences,
  so read_stream follows a handle's chain back from its head by direct gets.
- Operation and event ids are checked for reuse against an index of the records this
  process read (built on first write by reading the cell's records once, then kept up
  to date from the records it appends or catches up on): runs of their keys, as SQL's
  kvl_record_ids holds them (journal.run_index), a few dozen bytes a record. The
  startup read is proportional to the journal; a server-side index is the next step.
- Nothing is acknowledged before the server's acknowledgement of the commit, which with
  `sync_interval: always` (`kvledger init` requires it, journal.nats_admin) means every
  replica that stored it has fsynced it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import msgspec

from kvledger.journal import faults
from kvledger.journal.audit import audit_record, decode_record
from kvledger.journal.batching import answer_stored, apply_rounds, batch_ids, resolve_repeats, validate
from kvledger.journal.contract import HeadFacts, ImportTables, Operation, Rejection
from kvledger.journal.keys import PREV_NONE, id_keys, id_runs, pack_prev, unpack_prev
from kvledger.journal.manifests import allocation_manifest, manifest_ref_position, unpack_manifest
from kvledger.journal.nats_client import COMMIT_WAIT, GET_BATCH, MESSAGE_TOO_LARGE, RETRY, Msg, NatsClient, Refused
from kvledger.journal.nats_heads import Head, HeadView, Rec, Tail, head_decode, head_encode, token
from kvledger.journal.nats_import import import_into, unfinished
from kvledger.journal.port import Journal, Snapshot
from kvledger.journal.readback import Damage, Record
from kvledger.journal.record_format import GENESIS
from kvledger.journal.record_rows import Base, build_record
from kvledger.journal.run_index import RunIndex
from kvledger.journal.statements import chain_step, positioned
from kvledger.journal.step_values import FoldItem
from kvledger.journal.url import parse_url, redact
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import Event
from kvledger.schemas.receipts import Receipt, receipt_decoder

STREAM_PREFIX = "KVL_"
MAX_TRIES = 200  # decisions of one append under contention before DATABASE_BUSY


def open_journal(raw_url: str) -> NatsJournal:
    """Open a cell's journal. A cell without its stream is NOT_MIGRATED (run `kvledger init`)."""
    return NatsJournal(raw_url)


class NatsJournal(Journal):
    def __init__(self, raw_url: str) -> None:
        url = parse_url(raw_url)
        self._raw = raw_url
        self.display_url = redact(url)
        self.cell = str(url.database)
        self.stream = STREAM_PREFIX + self.cell
        self.prefix = f"kvl.{self.cell}"
        self.records_subject = f"{self.prefix}.r"
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._closed = True
        self.client = NatsClient(url)
        self._closed = False
        info = self.client.api(f"STREAM.INFO.{self.stream}")
        if "error" in info:
            self.close()
            raise KvLedgerError(ErrorCode.NOT_MIGRATED, f"{self.display_url} has no kvledger stream for cell "
                                f"{self.cell}; run `kvledger init --db URL` to create it")
        config = info.get("config", {})
        if not (config.get("allow_atomic") and config.get("allow_direct")):
            self.close()
            raise KvLedgerError(ErrorCode.SCHEMA_MISMATCH, f"the stream {self.stream} at {self.display_url} does "
                                "not allow atomic publish and direct gets: not one `kvledger init` made")
        self._unfinished = unfinished(self.client, self.stream, self.prefix)
        # What this process knows, valid while the last record is `_tail` (a commit that
        # expects it proves it): heads read or written, and the index of stored ids.
        self._tail: Tail | None = None
        self._heads: dict[str, Head] = {}
        self._indexed = 0  # the stream sequence of the last record indexed
        self._index = RunIndex()  # the stored ids' keys -> their records' stream sequences
        self._known_manifests: set[str] = set()
        # stream sequence -> (sequence, last position) of the first record at or after it:
        # fixed once that record is stored (nothing is ever stored before it)
        self._probes: dict[int, tuple[int, int]] = {}

    def reopen_url(self) -> str:
        return self._raw

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if os.getpid() == self._pid:
                self.client.close()

    def _check(self, *, importing: bool = False) -> None:
        if self._closed:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "journal is closed")
        if os.getpid() != self._pid:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "journal opened in another process; open it after fork()")
        if self._unfinished and not importing:
            raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"{self.display_url}: an import into cell {self.cell} "
                                "stopped partway (unfinished); `kvledger import FILE` into it again replaces it")

    def append(self, operations: Sequence[Operation]) -> list[Receipt | Rejection]:
        if not operations:
            return []
        for op in operations:
            validate(op)
        self._check()
        with self._lock:
            if faults.INTENTS:
                faults.intend([op.operation_id for op in operations])
            unreachable_until = time.monotonic() + self.client.timeout
            fetched = None  # a tail read in this call: the journal as it was at a moment of it
            for attempt in range(MAX_TRIES):
                tail = self._tail or (fetched := self._fetch_tail())
                results, batch, written = self._decide(operations, tail)
                if batch is None:  # refused or answered: as of `tail`, if no head read was past it
                    if (tail == fetched and not written) or (fetched := self._fetch_tail()) == tail:
                        return results
                    continue  # decided again as of the tail just read
                faults.fault_unreachable("before_commit", self.display_url)
                try:
                    ack = self.client.publish_batch(batch, COMMIT_WAIT)  # mid_batch: before its commit message
                except Refused as refused:
                    self._forget()
                    if refused.code in RETRY:
                        if attempt > 2:  # contended: let the others through
                            time.sleep(random.uniform(0, 0.001 * min(attempt, 50)))
                        continue
                    raise self._refused(refused) from None
                except faults.FaultInjected as exc:  # mid_batch's raise: lost for good, not retried
                    self._forget()
                    raise faults.unreachable(exc, self.display_url) from None
                except KvLedgerError as exc:
                    self._forget()  # the outcome is unknown: decide again from what is stored
                    if exc.code is not ErrorCode.DATABASE_UNREACHABLE or time.monotonic() > unreachable_until:
                        raise
                    time.sleep(0.05)  # a failover: the stream's next leader answers in seconds
                    continue
                self._committed(ack, written)
                faults.fault_unreachable("after_commit", self.display_url)
                return results
        raise KvLedgerError(ErrorCode.DATABASE_BUSY, f"{MAX_TRIES} other commits to {self.display_url} went "
                            "first while this one was decided: the cell is too contended")

    def _decide(self, ops: Sequence[Operation], tail: Tail
                ) -> tuple[list[Receipt | Rejection], list[tuple[str, bytes, dict[str, str]]] | None, Any]:
        """The results of `ops` decided on the journal as of `tail`, and the batch that
        commits them with what _committed remembers of it (None: nothing to write, and
        whether a head it read belongs to a record past `tail`)."""
        self._catch_up(tail.seq)
        op_ids, event_ids, known = batch_ids(ops)
        stored: dict[str, tuple[str, bytes]] = {}
        taken: set[str] = set()
        for seq in self._index.candidates(known.runs):  # none, unless an id is reused (or its key is)
            receipts, stored_ids = self._stored_ids(seq)
            stored.update((o, receipts[o]) for o in op_ids if o in receipts)
            taken.update(e for e in event_ids if e in stored_ids)
        results: list[Receipt | Rejection | None] = [None] * len(ops)
        phantoms: dict[str, Any] = {}
        first_in_batch, pending = answer_stored(ops, stored, results, phantoms)
        touched = list(dict.fromkeys(h for i in pending for h in
                                     [w.handle_id for w in ops[i].writes] + [c.handle_id for c in ops[i].checks]))
        heads = self._read_heads(touched)
        faults.fault_unreachable("before_update", self.display_url)
        view = HeadView({h: hd.facts for h, hd in heads.items()})
        prevs = {h: hd.record for h, hd in heads.items()}
        apply_rounds(view, None, ops, pending, results, phantoms, 0)
        written = build_record(ops, pending, results, Base(tail.last, tail.chain, time.time_ns(), taken, prevs),
                               known)
        faults.fault_unreachable("after_update", self.display_url)
        if len(first_in_batch) + len(stored) < len(ops):
            resolve_repeats(ops, results, first_in_batch)
        record = written.record
        if record is None:  # every slot decided
            return results, None, any(hd.record > tail.seq for hd in heads.values())  # type: ignore[return-value]  # no None left
        msg_id = hashlib.sha256("\n".join(ops[i].operation_id for i in pending).encode()).hexdigest()
        batch = [(self.records_subject, record.body, {
            "Nats-Expected-Last-Subject-Sequence": str(tail.seq), "Nats-Msg-Id": f"kvl-{msg_id}",
            "Kvl-First": str(record.first_position), "Kvl-Last": str(record.last_position),
            "Kvl-Chain": record.chain.hex(), "Kvl-Prev": pack_prev(
                [prevs.get(h, PREV_NONE) for h in record.handles]).hex()})]
        changed = list(view.changed.items())
        for back, (h, facts) in enumerate(changed, 1):
            expect = heads[h].seq if h in heads else 0
            batch.append((f"{self.prefix}.h.{token(h)}", head_encode(h, back, facts),
                          {"Nats-Expected-Last-Subject-Sequence": str(expect)}))
        for sha, body in written.manifests.items():
            if self._has_manifest(sha):
                continue
            batch.append((f"{self.prefix}.m.{sha}", body, {"Nats-Expected-Last-Subject-Sequence": "0"}))
        return results, batch, (record, changed, list(written.manifests))  # type: ignore[return-value]

    def _committed(self, ack: dict[str, Any], written: Any) -> None:
        """Remember what a commit wrote: it is now the last record, its heads are the
        handles' heads, its ids are stored."""
        record, changed, manifests = written
        seq = int(ack["seq"]) - int(ack.get("count", 1)) + 1  # the record is the batch's first message
        self._tail = Tail(seq, record.last_position, record.chain)
        for back, (h, facts) in enumerate(changed, 1):
            self._heads[h] = Head(facts, seq + back, seq)
        if len(self._heads) > 1 << 16:  # a cache: handles come and go
            self._heads.clear()
        self._index.add(record.id_runs, seq)
        self._indexed = seq
        self._known_manifests.update(manifests)

    def _forget(self) -> None:
        self._tail = None
        self._heads.clear()

    def _refused(self, refused: Refused) -> KvLedgerError:
        if refused.code in (MESSAGE_TOO_LARGE, 10122):  # message too large, batch too large
            return KvLedgerError(ErrorCode.FIELD_TOO_LARGE, f"{self.display_url} refused a commit as too large "
                                 f"(JetStream {refused.code}): commit it in parts")
        return KvLedgerError(ErrorCode.DATABASE_ERROR, f"{self.display_url} refused a commit (JetStream error "
                             f"{refused.code}: {refused.description[:120]})")

    # -- what a decision reads ----------------------------------------------------

    def _fetch_tail(self) -> Tail:
        msg = self.client.get(self.stream, {"last_by_subj": self.records_subject})
        if msg is None:
            tail = Tail(0, 0, GENESIS)
        else:
            rec = self._rec(msg)
            tail = Tail(rec.seq, rec.last, rec.chain)
        if tail != self._tail:  # the heads held were read as of another last record
            self._heads.clear()
        self._tail = tail
        return tail

    def _read_heads(self, handles: list[str]) -> dict[str, Head]:
        """The heads of `handles` that exist: from what this process knows, else read."""
        found = {h: self._heads[h] for h in handles if h in self._heads}
        missing = [h for h in handles if h not in found]
        for i in range(0, len(missing), 1000):
            chunk = missing[i:i + 1000]
            got = self.client.get_each(self.stream, [{"last_by_subj": f"{self.prefix}.h.{token(h)}"} for h in chunk])
            for h, msg in zip(chunk, got):
                head = None if msg is None else self._head(msg)
                if head is not None and head[0] == h:
                    found[h] = self._heads[h] = head[1]
        return found

    def _head(self, msg: Msg) -> tuple[str, Head] | None:
        decoded = head_decode(msg.data)
        if decoded is None:
            raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"the head message at stream sequence {msg.seq} of "
                                f"{self.display_url} does not decode (run `kvledger verify`)")
        handle, back, facts = decoded
        return handle, Head(facts, msg.seq, msg.seq - back)

    def _catch_up(self, upto: int) -> None:
        """Index the ids of the records up to stream sequence `upto`."""
        if self._indexed >= upto:
            return
        for rec in self._records(self._indexed + 1, upto):
            ids = self._ids(self._decode(rec), rec.last)
            self._index.add(id_runs(id_keys(list(ids[0] | ids[1]))), rec.seq)
            self._indexed = rec.seq
        self._indexed = upto

    @staticmethod
    def _ids(record: Record, last: int) -> tuple[set[str], set[str]]:
        ids = record.ids()
        if ids is None:
            raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"an event of the record ending at position "
                                f"{last} does not decode (run `kvledger verify`)")
        return ids

    def _stored_ids(self, seq: int) -> tuple[dict[str, tuple[str, bytes]], set[str]]:
        """The receipts (operation id -> fingerprint and body) and the event ids of the
        record at stream sequence `seq`."""
        rec = self._record_at(seq)
        record = self._decode(rec)
        receipts = {}
        for body in record.receipts:
            key = _receipt_key(body)
            receipts[key.operation_id] = (key.fingerprint, body)
        return receipts, self._ids(record, rec.last)[0]

    def _stored_receipt(self, operation_id: str) -> tuple[str, bytes] | None:
        """(fingerprint, receipt body) of a stored operation."""
        for seq in self._index.candidates(id_runs(id_keys([operation_id]))):
            found = self._stored_ids(seq)[0].get(operation_id)
            if found is not None:
                return found
        return None

    def _has_manifest(self, sha: str) -> bool:
        if sha not in self._known_manifests and self.client.get(
                self.stream, {"last_by_subj": f"{self.prefix}.m.{sha}"}) is not None:
            self._known_manifests.add(sha)
        return sha in self._known_manifests

    # -- records -------------------------------------------------------------------

    def _rec(self, msg: Msg) -> Rec:
        h = msg.headers
        try:
            return Rec(msg.seq, int(h["Kvl-First"]), int(h["Kvl-Last"]), bytes.fromhex(h["Kvl-Chain"]),
                       bytes.fromhex(h["Kvl-Prev"]), msg.data)
        except (KeyError, ValueError):
            raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"the record at stream sequence {msg.seq} of "
                                f"{self.display_url} lacks its positions (run `kvledger verify`)") from None

    def _record_at(self, seq: int) -> Rec:
        msg = self.client.get(self.stream, {"seq": seq})
        if msg is None or msg.subject != self.records_subject:
            raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"no record at stream sequence {seq} of "
                                f"{self.display_url}, which a head or record names (run `kvledger verify`)")
        return self._rec(msg)

    def _records(self, start: int, upto: int | None = None) -> Iterator[Rec]:
        """The records from stream sequence `start` to the record at `upto` (None: the last now)."""
        return (self._rec(msg) for msg in self.record_msgs(start, upto))

    def record_msgs(self, start: int, upto: int | None = None) -> Iterator[Msg]:
        """The record messages from stream sequence `start` to the record at `upto` (None:
        the last now), a page of direct gets at a time. A replica that has not applied them
        all answers short of `upto`: the rest is read from the leader."""
        if upto is None:
            with self._lock:
                upto = self._fetch_tail().seq
        while start <= upto:
            with self._lock:
                page = self.client.get_many(self.stream, {"seq": start, "next_by_subj": self.records_subject,
                                                          "batch": GET_BATCH, "up_to_seq": upto})
                page = [m for m in page if m.seq <= upto]
                if not page:  # a lagging replica: the leader has it
                    msg = self.client.get(self.stream, {"seq": start, "next_by_subj": self.records_subject})
                    if msg is None or msg.seq > upto:
                        raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"no record up to stream sequence {upto} "
                                            f"of {self.display_url}, which the last record names")
                    page = [msg]
            yield from page
            start = page[-1].seq + 1

    def _decode(self, rec: Rec, fold: bool = False) -> Record:
        where = f"ending at position {rec.last}"
        record = decode_record(rec.body, where, fold)
        if rec.first + record.count - 1 != rec.last:
            raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"the record {where} holds {record.count} events "
                                f"from position {rec.first} (run `kvledger verify`)")
        return record

    def _record_seq_after(self, position: int, tail: Tail | None = None) -> int | None:
        """The stream sequence of the first record ending past global position `position`
        (a binary search over the stream by direct gets) up to `tail` (None: the last
        record now); None: there is none."""
        tail = tail or self._fetch_tail()
        if tail.last <= position:
            return None
        # the least s whose first record at or after s ends past `position`
        lo, hi, found = 1, tail.seq, tail.seq
        while lo < hi:
            mid = (lo + hi) // 2
            probe = self._probes.get(mid)
            if probe is None:
                msg = self.client.get(self.stream, {"seq": mid, "next_by_subj": self.records_subject})
                assert msg is not None  # the tail is a record at or after it
                if len(self._probes) > 1 << 16:  # a cache: the searches of recent reads
                    self._probes.clear()
                probe = self._probes[mid] = (msg.seq, self._rec(msg).last)
            if probe[1] > position:
                hi, found = mid, probe[0]
            else:
                lo = probe[0] + 1  # every s up to that record finds it or one before
        return found  # the first record at or after hi, which lo has reached

    # -- reading -----------------------------------------------------------------

    def _items(self, after: int, mode: str) -> Iterator[tuple[int, Any]]:
        """(global position, item) past `after`: the stored JSON ("json"), events
        ("events"), or what a projector folds ("fold", a run of steps at its last position)."""
        self._check()
        with self._lock:
            tail = self._fetch_tail()  # the read ends at the last record now
            start = self._record_seq_after(after, tail)
        if start is None:
            return
        for rec in self._records(start, tail.seq):
            record = self._decode(rec, mode == "fold")
            if mode == "fold":
                yield from positioned(rec.first, record.folded(), after)
                continue
            items: list[Any] = record.decoded() if mode == "events" else record.events
            first = rec.first
            if first <= after:
                items, first = items[after + 1 - first:], after + 1
            yield from zip(range(first, first + len(items)), items)

    def read_all(self, after: int = 0, limit: int | None = None) -> Iterator[Event]:
        items = (e for _, e in self._items(after, "events"))
        return items if limit is None else (e for e, _ in zip(items, range(limit)))

    def read_fold(self, after: int = 0) -> Iterator[FoldItem]:
        return (e for _, e in self._items(after, "fold"))

    def read_raw(self, after: int = 0, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
        items = self._items(after, "json")
        return items if limit is None else (x for x, _ in zip(items, range(limit)))

    def read_stream(self, handle_id: str, after: int = 0) -> list[Event]:
        self._check()
        with self._lock:
            msg = self.client.get(self.stream, {"last_by_subj": f"{self.prefix}.h.{token(handle_id)}"})
            found = None if msg is None else self._head(msg)
            if found is None or found[0] != handle_id:
                return []
            pointer = found[1].record
            chained: list[list[Event]] = []  # newest record first
            while pointer > 0:  # back along the handle's chain, until its records hold nothing past `after`
                rec = self._record_at(pointer)
                own, pointer = chain_step(self._decode(rec), unpack_prev(rec.prev), handle_id, pointer, after,
                                          f"ending at position {rec.last}")
                chained.append(own)
        return [e for found_events in reversed(chained) for e in found_events]

    def head(self, handle_id: str) -> HeadFacts | None:
        return self.heads_of([handle_id]).get(handle_id)

    def heads_of(self, handle_ids: Sequence[str]) -> dict[str, HeadFacts]:
        """The stored heads of `handle_ids` (read now, not from what this process knows)."""
        self._check()
        asked = list(dict.fromkeys(handle_ids))
        with self._lock:
            for h in asked:  # read now: what this process knew of them may be older
                self._heads.pop(h, None)
            return {h: head.facts for h, head in self._read_heads(asked).items()}

    def heads(self, *, prefix_identity_sha256: str | None = None) -> dict[str, HeadFacts]:
        self._check()
        with self._lock:
            subjects = self._subjects(f"{self.prefix}.h.*")
            found: dict[str, HeadFacts] = {}
            for i in range(0, len(subjects), 1000):
                for msg in self.client.get_each(self.stream, [{"last_by_subj": s} for s in subjects[i:i + 1000]]):
                    head = None if msg is None else self._head(msg)
                    if head is not None:
                        found[head[0]] = head[1].facts
        if prefix_identity_sha256 is not None:
            found = {h: f for h, f in found.items() if f.prefix_identity_sha256 == prefix_identity_sha256}
        return dict(sorted(found.items()))

    def _subjects(self, wildcard: str) -> list[str]:
        """The stream's subjects matching `wildcard` (stream info pages them)."""
        subjects: list[str] = []
        while True:
            info = self.client.api(f"STREAM.INFO.{self.stream}", {"subjects_filter": wildcard,
                                                                  "offset": len(subjects)})
            page = list((info.get("state") or {}).get("subjects") or {})
            subjects += page
            if not page or len(subjects) >= int(info.get("total", 0)):
                return subjects

    def existing(self, handle_ids: Sequence[str]) -> set[str]:
        return set(self.heads_of(handle_ids)) if handle_ids else set()

    def receipt(self, operation_id: str) -> Receipt | None:
        self._check()
        with self._lock:
            self._catch_up(self._fetch_tail().seq)
            found = self._stored_receipt(operation_id)
        return None if found is None else receipt_decoder.decode(found[1])

    def last_position(self) -> int:
        self._check()
        with self._lock:
            return self._fetch_tail().last

    def manifest(self, manifest_sha256: str) -> bytes | None:
        self._check()
        with self._lock:
            msg = self.client.get(self.stream, {"last_by_subj": f"{self.prefix}.m.{token(manifest_sha256)}"})
            if msg is None:
                return None
            position = manifest_ref_position(msg.data)
            if position is None:
                return unpack_manifest(msg.data)
            seq = self._record_seq_after(position - 1)
            rec = None if seq is None else self._record_at(seq)
        found = None if rec is None else audit_record(rec.body)
        if rec is None or isinstance(found, Damage) or found is None or not 0 <= position - rec.first < len(
                found.events):
            return msg.data  # unresolved: its digest does not match, which readers refuse
        return allocation_manifest(found.events[position - rec.first]) or msg.data

    # -- checkpoints ---------------------------------------------------------------

    def save_checkpoint(self, name: str, position: int, state: bytes) -> None:
        self._check()
        with self._lock:
            faults.fault_unreachable("checkpoint", self.display_url)
            try:
                self.client.publish(f"{self.prefix}.c.{token(name)}",
                                    _checkpoint_encode(_Checkpoint(name, position, state, time.time_ns())), {})
            except Refused as refused:
                raise self._refused(refused) from None

    def load_checkpoint(self, name: str) -> tuple[int, bytes] | None:
        self._check()
        with self._lock:
            msg = self.client.get(self.stream, {"last_by_subj": f"{self.prefix}.c.{token(name)}"})
        if msg is None:
            return None
        try:
            found = _checkpoint_decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"the checkpoint {name!r} of {self.display_url} "
                                "does not decode") from None
        return (found.position, found.state) if found.name == name else None

    # -- audit copies --------------------------------------------------------------

    def read_receipts(self) -> Iterator[Receipt]:
        self._check()
        for rec in self._records(1):
            for body in self._decode(rec).receipts:
                yield receipt_decoder.decode(body)

    def import_events(self, events: Iterable[tuple[Event, bytes]],
                      tables: Callable[[], ImportTables]) -> None:
        self._check(importing=True)
        with self._lock:
            self._forget()
            import_into(self, events, tables)
            self._unfinished = False

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Snapshot]:
        """Every read bounded by the last record now (journal.nats_audit)."""
        from kvledger.journal.nats_audit import NatsSnapshot

        self._check()
        with self._lock:
            while True:  # the last record, and the stream's end with no record after it
                tail = self._fetch_tail()
                end = int((self.client.api(f"STREAM.INFO.{self.stream}").get("state") or {}).get("last_seq", 0))
                later = self.client.get(self.stream, {"seq": tail.seq + 1, "next_by_subj": self.records_subject})
                if later is None or later.seq > end:
                    break
        yield NatsSnapshot(self, tail, end)


class _Checkpoint(msgspec.Struct, array_like=True, frozen=True):
    name: str
    position: int
    state: bytes
    updated_wall_ns: int


_checkpoint_encode = msgspec.msgpack.Encoder().encode
_checkpoint_decode = msgspec.msgpack.Decoder(_Checkpoint).decode


class _ReceiptKey(msgspec.Struct):
    operation_id: str
    fingerprint: str


_receipt_key = msgspec.json.Decoder(_ReceiptKey).decode


__all__ = ["NatsJournal", "open_journal"]
