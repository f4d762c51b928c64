"""The recorder's decisions, without sockets: which batches to journal, in which order,
when to ask for a replay, and what to journal as a gap or a publisher restart.

Each stream (endpoint, topic, data-parallel rank) has a cursor: its epoch (publisher
restarts seen), the next seq it expects and its stream position. A message is

- older than the cursor: from the replay socket, a duplicate (dropped); live, a
  duplicate when it is a batch just recorded (same seq, same bytes), else the publisher
  restarted (seq went back): `kv_events_restart`, a new epoch that expects seq 0;
- the next seq: journaled, then any held later batches that now follow;
- later: held, and a replay from the cursor is asked for. What the replay's end marker
  leaves missing below the first held batch is journaled as `kv_events_gap`.

Every write is an Operation whose guard is the cursor it was decided from (generation =
epoch, snapshot_version = next seq, stream position): the journal's conditional write
refuses it if anything else moved the stream, and its operation id names (stream,
epoch, seq), so a retried write returns the first receipt and writes nothing.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from collections import deque
from collections.abc import Iterable
from typing import Any  # _write's payload: the one of `cls`, a pairing its type cannot state

import msgspec

from kvledger.adapters.kv_events_wire import Encoded
from kvledger.journal.contract import Guard, HeadFacts, Operation, StreamWrite
from kvledger.schemas import events as ev
from kvledger.schemas import kv_events as kv
from kvledger.schemas.events import CURRENT_VERSION

LIFECYCLE = kv.KV_LIFECYCLE
SOURCE = "kvledger-kv-events"
RECENT = 1 << 16  # seqs remembered per stream to tell a late live duplicate from a restart
MAX_HELD = 1 << 17  # batches held while a replay is pending; beyond this the gap is journaled
GROUP = 256  # a stream's consecutive batches written as one operation (one guard, one receipt)

# A batch's events: as kv events, or already encoded as the journal stores them (the live
# recorder's form, kv_events_wire.decode_batch_encoded); either is journaled the same bytes.
Events = tuple[kv.KvEvent, ...] | Encoded


def stream_id(endpoint: str, topic: str, rank: int | None) -> str:
    sid = f"kv:{endpoint}|{topic}|dp{'-' if rank is None else rank}"
    if len(sid) > 200:  # Id allows 256: a very long endpoint is named by its digest
        sid = "kv:" + hashlib.sha256(sid.encode()).hexdigest()
    return sid


def stream_key(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()[:24]


class Cursor(msgspec.Struct):
    sid: str
    key: str
    epoch: int = 0
    next_seq: int = 0
    position: int = 0
    held: dict[int, tuple[float, Events, int | None, bool, bytes]] = {}
    recent: dict[int, bytes] = {}
    order: deque[int] = msgspec.field(default_factory=deque)

    def guard(self) -> Guard | None:
        return None if self.position == 0 else Guard(self.epoch, self.next_seq, self.position)


class Summary(msgspec.Struct):
    batches: int = 0
    events: int = 0
    replayed: int = 0
    duplicates: int = 0
    gaps: int = 0
    gap_seqs: int = 0
    restarts: int = 0
    streams: int = 0
    first_message_ns: int = 0  # monotonic: the first message received
    last_commit_ns: int = 0  # monotonic: the last commit that wrote something


class Recorder:
    """Feed messages (`live`, `replayed`, `replay_done`); take the Operations to append
    with `take()` and the replay requests with `replay_wanted`."""

    def __init__(self, endpoint: str, topic: str, heads: dict[str, HeadFacts], *, replayable: bool,
                 gap_reason: str = "no replay endpoint", live_duplicates: bool = True) -> None:
        self.endpoint, self.topic = endpoint, topic
        self.replayable = replayable
        self.gap_reason = gap_reason  # of a gap when there is no replay to ask
        # Can a live message repeat a recorded one (a socket can, after a replay overtook
        # it)? In a file it cannot: a step back there is always a restart.
        self.live_duplicates = live_duplicates
        self.cursors: dict[str, Cursor] = {}
        for sid, h in heads.items():
            if h.lifecycle == LIFECYCLE and sid.startswith(stream_id(endpoint, topic, None)[:-3]):
                self.cursors[sid] = Cursor(sid, stream_key(sid), h.generation, h.snapshot_version,
                                           h.stream_position)
        self.ops: list[_Pending] = []
        self.summary = Summary(streams=len(self.cursors))
        # The seq to ask a replay from (None: none wanted); on start, from the cursor.
        self.replay_wanted: int | None = min((c.next_seq for c in self.cursors.values()), default=0) \
            if replayable else None
        self.replay_pending = False
        self._known: dict[str, int] = {}  # per stream, the last seq known missing when the replay was asked
        self._by_rank: dict[int | None, Cursor] = {}  # a stream's name is formatted once, not per batch

    def take(self, group: int = GROUP) -> list[Operation]:
        """The operations to append for everything decided since the last take."""
        pending, self.ops = self.ops, []
        return _operations(pending, group)

    # -- messages ----------------------------------------------------------------

    def message(self, seq: int, payload: bytes, batch: tuple[float, Events, int | None],
                *, replayed: bool) -> None:
        ts, events, rank = batch
        c = self._cursor(rank)
        if seq < c.next_seq:
            if replayed or (self.live_duplicates and c.recent.get(seq) == _fingerprint(payload)):
                self.summary.duplicates += 1
                return
            self._restart(c, seq)
        if seq == c.next_seq:
            self._record(c, seq, ts, events, rank, replayed, payload)
            self._drain(c)
            return
        if len(c.held) >= MAX_HELD:
            self._gap(c, min(c.held) - 1, "the replay did not answer while this many batches were held")
            self._drain(c)
        c.held[seq] = (ts, events, rank, replayed, payload)
        if not self.replayable:
            self._gap(c, seq - 1, self.gap_reason)
            self._drain(c)
        elif not self.replay_pending and self.replay_wanted is None:
            self.replay_wanted = c.next_seq

    def replay_done(self, reason: str = "evicted from the publisher's replay buffer") -> None:
        """The replay's end marker (or its timeout). A hole that was already open when
        the request went out (its seqs were published before it) and is still open was
        not in the publisher's buffer: the buffer keeps a contiguous tail, so everything
        below the first batch held is gone, and is journaled as a gap. A hole that opened
        after the request went out is asked for again."""
        self.replay_pending = False
        known, self._known = self._known, {}
        for c in self.cursors.values():
            if not c.held:
                continue
            if c.next_seq <= known.get(c.sid, -1):
                self._gap(c, min(c.held) - 1, reason)
                self._drain(c)
            elif self.replay_wanted is None or c.next_seq < self.replay_wanted:
                self.replay_wanted = c.next_seq

    def replay_sent(self) -> None:
        self.replay_pending, self.replay_wanted = True, None
        self._known = {c.sid: min(c.held) - 1 for c in self.cursors.values() if c.held}

    # -- decisions ---------------------------------------------------------------

    def _cursor(self, rank: int | None) -> Cursor:
        c = self._by_rank.get(rank)
        if c is not None:
            return c
        sid = stream_id(self.endpoint, self.topic, rank)
        c = self.cursors.get(sid)
        if c is None:
            c = self.cursors[sid] = Cursor(sid, stream_key(sid))
            self.summary.streams += 1
        self._by_rank[rank] = c
        return c

    def _drain(self, c: Cursor) -> None:
        held = c.held
        while c.next_seq in held:
            ts, events, rank, replayed, payload = held.pop(c.next_seq)
            self._record(c, c.next_seq, ts, events, rank, replayed, payload)

    def _record(self, c: Cursor, seq: int, ts: float, events: Events, rank: int | None,
                replayed: bool, payload: bytes) -> None:
        fp = _fingerprint(payload)
        if isinstance(events, Encoded):
            # The events' JSON in place of their tuple: what the encoder writes is the same.
            body: Any = events.json
            count = events.count
        else:
            body, count = events, len(events)
        payload_ = kv.KvEventsBatch(c.epoch, seq, ts, body, rank, replayed)
        self._write(c, f"{c.epoch}:{seq}", fp.hex(), ev.KvEventsBatchEvent, payload_, seq + 1, c.epoch)
        c.recent[seq] = fp
        c.order.append(seq)
        if len(c.order) > RECENT:
            c.recent.pop(c.order.popleft(), None)
        s = self.summary
        s.batches += 1
        s.events += count
        s.replayed += replayed

    def _gap(self, c: Cursor, last: int, reason: str) -> None:
        if last < c.next_seq:
            return
        first = c.next_seq
        payload = kv.KvEventsGap(c.epoch, first, last, reason)
        self._write(c, f"{c.epoch}:gap:{first}", f"gap:{first}:{last}", ev.KvEventsGapEvent, payload, last + 1,
                    c.epoch)
        self.summary.gaps += 1
        self.summary.gap_seqs += last - first + 1

    def _restart(self, c: Cursor, seq: int) -> None:
        payload = kv.KvEventsRestart(c.epoch + 1, c.next_seq - 1, seq, "seq went backwards")
        self._write(c, f"{c.epoch + 1}:restart", f"restart:{c.next_seq}:{seq}", ev.KvEventsRestartEvent,
                    payload, 0, c.epoch + 1)
        c.held.clear()
        c.recent.clear()
        c.order.clear()
        self.summary.restarts += 1

    def _write(self, c: Cursor, what: str, fingerprint: str, cls: type[ev.KvStreamEvent], payload: Any,
               next_seq: int, epoch: int) -> None:
        position = c.position + 1
        self.ops.append(_Pending(c.sid, c.key, c.guard(), what, fingerprint, cls, payload,
                                 HeadFacts(c.sid, epoch, next_seq, position, 0, LIFECYCLE, "", ""),
                                 time.monotonic_ns(), time.time_ns()))
        c.epoch, c.next_seq, c.position = epoch, next_seq, position


class _Pending(msgspec.Struct, array_like=True, gc=False):
    """One decided write, not yet an event: `take` groups a stream's consecutive ones
    into one operation (one receipt, one guard) and only then knows the operation id."""

    sid: str
    key: str
    guard: Guard | None
    what: str
    fingerprint: str
    cls: type[ev.KvStreamEvent]
    payload: Any
    head: HeadFacts
    monotonic_ns: int
    wall_ns: int


def _operations(pending: list[_Pending], most: int) -> list[Operation]:
    """Consecutive writes of one stream, up to `most`, as one operation: its guard is the
    first write's, its head the last's, its id the first write's (stream, epoch, seq) and
    how many follow, so a retry of the same group is recognized and any other overlap is
    refused by the guard."""
    ops: list[Operation] = []
    i = 0
    while i < len(pending):
        first = pending[i]
        j = i + 1
        while j < len(pending) and j - i < most and pending[j].sid == first.sid:
            j += 1
        group = pending[i:j]
        op_id = f"kv:{first.key}:{first.what}" + (f"+{len(group) - 1}" if len(group) > 1 else "")
        events = tuple(p.cls(
            event_id=f"kv:{p.key}:{p.what}", stream_id=p.sid, stream_position=p.head.stream_position,
            schema_version=CURRENT_VERSION[p.cls.event_type], request_id=p.sid, handle_generation=p.head.generation,
            operation_id=op_id, source_instance=SOURCE, monotonic_ns=p.monotonic_ns, observed_wall_time=p.wall_ns,
            payload=p.payload) for p in group)
        fingerprint = first.fingerprint if len(group) == 1 else \
            f"{len(group)}:{zlib.crc32(''.join(p.fingerprint for p in group).encode()):08x}:{group[-1].fingerprint}"
        ops.append(Operation(op_id, fingerprint[:128], (StreamWrite(first.sid, first.guard, group[-1].head, events),)))
        i = j
    return ops


def _fingerprint(payload: bytes) -> bytes:
    # Tells a late duplicate from a new batch at the same seq, and names a batch in its
    # operation's fingerprint (a retry with other bytes is CONFLICT): length and CRC-32,
    # a tenth of a cryptographic digest's cost on the recorder's hot path.
    return len(payload).to_bytes(4, "big") + zlib.crc32(payload).to_bytes(4, "big")


def kv_heads(heads: Iterable[tuple[str, HeadFacts]]) -> dict[str, HeadFacts]:
    return {sid: h for sid, h in heads if h.lifecycle == LIFECYCLE}
