"""The recorder's decisions, without sockets: which batches to journal, in which order,
when to ask for a replay, and what to journal as a gap or a publisher restart.

Each stream (endpoint, topic, data-parallel rank) has a cursor: its epoch (publisher
restarts seen), the next seq it expects and its stream position. A message is

- older than the cursor: from the replay socket, a duplicate (dropped); live, a
  duplicate when it is a batch just recorded (same seq, same bytes), else the publisher
  restarted (seq went back): `kv_events_restart`, a new epoch that expects seq 0;
- the next seq: journaled, then any held later batches that now follow;
- later: held, and a replay from the cursor is asked for. What the replay's end marker
  leaves missing below the first held batch is journaled as `kv_events_gap`. Held batches
  are bounded in bytes (`max_held_bytes`): past it, the oldest hole is journaled as a gap
  at once; at exit (`stop`), every hole below a held batch is.

A batch the journal could not read back (its stored event over MAX_EVENT_BYTES) is never
sent to it: its seq is journaled as a `kv_events_gap` with code FIELD_TOO_LARGE and its
size. A message that is no batch (malformed, a seq outside 0..2^63-2) is skipped and
counted: `live` and `replayed` return its coded error, for the caller to say.

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
from typing import Any

import msgspec

from kvledger.adapters.kv_events_wire import (
    MAX_SEQ,
    Encoded,
    batch_seq,
    decode_batch_encoded,
    split_live,
    split_replay,
)
from kvledger.engine.ids import instance_name
from kvledger.journal.contract import Guard, HeadFacts, Operation, StreamWrite
from kvledger.schemas import events as ev
from kvledger.schemas import kv_events as kv
from kvledger.schemas.codec import MAX_EVENT_BYTES
from kvledger.schemas.errors import ErrorCode, KvLedgerError, one_line
from kvledger.schemas.events import CURRENT_VERSION

LIFECYCLE = kv.KV_LIFECYCLE
SOURCE = "kvledger-kv-events"
RECENT = 1 << 16  # seqs remembered per stream to tell a late live duplicate from a restart
MAX_HELD_BYTES = 256 << 20  # default cap on held batches' bytes; beyond it the oldest hole is a gap
HELD_OVERHEAD = 768  # a held batch's objects beside its events' JSON (dict slot, tuple, ints)
# The most a batch's envelope and payload fields add to its events' JSON (ids of at most
# 256 characters, escaped; tests/test_kv_events_hostile.py measures the worst case).
ENVELOPE_BYTES = 8192
MAX_STREAMS = 1024  # streams (data-parallel ranks) one recorder opens; a batch of one more is skipped
MAX_TOPICS = 8  # other topics named in the summary
GROUP = 256  # a stream's consecutive batches written as one operation (one guard, one receipt)
RETRIES = 3  # replays asked for a hole the replay sent batches around before it is a gap
STOPPED = "the recorder stopped while the replay was pending"
NO_TOPIC = "<no topic frame>"  # SGLang's [seq, payload], seen while recording a topic

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


class TooLarge(msgspec.Struct, frozen=True, gc=False):
    """A batch whose stored event would be over MAX_EVENT_BYTES: journaled as a refusal."""

    size: int  # its events' JSON, in bytes


# A held batch: ts, events (or their refusal), rank, replayed, fingerprint, monotonic ns
# when received, the bytes it is counted for.
Held = tuple[float, Events | TooLarge, int | None, bool, bytes, int, int]


class Cursor(msgspec.Struct):
    sid: str
    key: str
    epoch: int = 0
    next_seq: int = 0
    position: int = 0
    held: dict[int, Held] = {}
    held_bytes: int = 0
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
    received: int = 0  # messages of the recorded topic (live or replayed, any outcome)
    skipped: int = 0  # messages not journaled, each with a coded error (see skipped_codes)
    too_large: int = 0  # batches journaled as a FIELD_TOO_LARGE refusal of their seq
    cap_gaps: int = 0  # gaps journaled because the held batches reached the byte cap
    cap_gap_seqs: int = 0
    held_batches: int = 0  # held now, waiting for a replay
    held_bytes: int = 0
    held_bytes_peak: int = 0
    backlog_peak: int = 0  # the most decided writes that waited for the committer (the journal's slowness)
    other_topics: int = 0  # messages on other topics than the recorded one
    unknown_engines: int = 0  # a collector's engines not named by --engine (recorded without replay)
    last_seq: int = -1  # the seq the last write decided leaves the stream after (-1: none)
    skipped_codes: dict[str, int] = {}
    topics_seen: dict[str, int] = {}  # the first MAX_TOPICS other topics, with their messages
    first_message_ns: int = 0  # monotonic: the first message received
    last_commit_ns: int = 0  # monotonic: the last commit that wrote something


def count_skip(s: Summary, exc: KvLedgerError) -> KvLedgerError:
    """A message skipped with `exc`, counted in `s` (and its code); `exc`, for the caller to say."""
    s.skipped += 1
    s.skipped_codes[exc.code.value] = s.skipped_codes.get(exc.code.value, 0) + 1
    return exc


class Recorder:
    """Feed messages (`live`, `replayed`, `replay_done`); take the Operations to append
    with `take()` and the replay requests with `replay_wanted`."""

    def __init__(self, endpoint: str, topic: str, heads: dict[str, HeadFacts], *, replayable: bool,
                 gap_reason: str = "no replay endpoint", live_duplicates: bool = True,
                 max_held_bytes: int = MAX_HELD_BYTES, frames: int | None = None) -> None:
        self.endpoint, self.topic = endpoint, topic
        self.source = instance_name(SOURCE)  # this recording's clock: a recording resumed later is another source
        self.topic_bytes = topic.encode()
        self.frame_count = frames  # a live message's frames (3: vLLM, 2: SGLang; None: either)
        self.replayable = replayable
        self.max_held_bytes = max_held_bytes
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
        self.ops_bytes = 0  # the events' bytes in `ops`
        self.summary = Summary(streams=len(self.cursors))
        # The seq to ask a replay from (None: none wanted); on start, from the cursor.
        self.replay_wanted: int | None = min((c.next_seq for c in self.cursors.values()), default=0) \
            if replayable else None
        self.replay_pending = False
        self._known: dict[str, int] = {}  # per stream, the last seq known missing when the replay was asked
        self._lowest: dict[str, int] = {}  # per stream, the lowest seq the pending replay sent
        self._retries: dict[str, tuple[int, int]] = {}  # per stream, a hole asked again, and how often
        self._by_rank: dict[int | None, Cursor] = {}  # a stream's name is formatted once, not per batch

    def take(self, group: int = GROUP) -> list[Operation]:
        """The operations to append for everything decided since the last take."""
        return self.take_group(group).ops

    def take_group(self, group: int = GROUP, most_bytes: int | None = None) -> Taken:
        """`take`, with what the operations bring: the summary once they are committed,
        and when the oldest batch among them was received. With `most_bytes`, only the
        first writes up to that many events' bytes (a drain of held batches is committed
        in parts); the summary then stays None until the last part."""
        pending, summary = self.ops, None
        if most_bytes is not None and self.ops_bytes > most_bytes:
            n = total = 0
            while total < most_bytes:
                total += pending[n].size
                n += 1
            pending, self.ops = pending[:n], pending[n:]
            self.ops_bytes -= total
        else:
            self.ops, self.ops_bytes, summary = [], 0, msgspec.structs.replace(self.summary)
        oldest = min([p.received_ns for p in pending], default=0)
        return Taken(_operations(pending, group, self.source), summary, oldest)

    def stop(self) -> None:
        """At exit: every held batch is journaled, each hole below one as a gap."""
        for c in self.cursors.values():
            while c.held:
                self._gap(c, min(c.held) - 1, STOPPED)
                self._drain(c)

    # -- frames, as a socket gives them -------------------------------------------

    def live(self, frames: list[bytes]) -> KvLedgerError | None:
        """One PUB message: decided, counted as another topic's, or skipped (its coded
        error is returned, and counted)."""
        try:
            topic = self.topic_bytes
            if topic and (len(frames) != 3 or frames[0] != topic) and len(frames) in (2, 3):
                self._other_topic(frames[0] if len(frames) == 3 else None)
                return None
            if self.frame_count is not None and len(frames) != self.frame_count:
                raise KvLedgerError(ErrorCode.MALFORMED_EVENT,
                                    f"{len(frames)} frames, not the dialect's {self.frame_count}")
            self.summary.received += 1
            _, seq, payload = split_live(frames)
            self.message(seq, payload, decode_batch_encoded(payload), replayed=False)
        except KvLedgerError as exc:
            return self._skip(exc)
        return None

    def routed(self, seq: int, payload: bytes, batch: tuple[float, Events, int | None]) -> KvLedgerError | None:
        """A live batch a collector already split and decoded (to route it by topic and
        rank): decided like `live`'s, or skipped (its coded error returned, and counted)."""
        self.summary.received += 1
        try:
            self.message(seq, payload, batch, replayed=False)
        except KvLedgerError as exc:
            return self._skip(exc)
        return None

    def replayed(self, frames: list[bytes]) -> KvLedgerError | None:
        """One reply of the replay socket (a batch, or the end marker)."""
        try:
            if self.topic_bytes and len(frames) == 4 and frames[1] != self.topic_bytes:
                self._other_topic(frames[1])  # vLLM's [b"", topic, seq, payload] of another topic
                return None
            item = split_replay(frames)
            if item is None:
                self.replay_done()
                return None
            self.summary.received += 1
            seq, payload = item
            self.message(seq, payload, decode_batch_encoded(payload), replayed=True)
        except KvLedgerError as exc:
            return self._skip(exc)
        return None

    def _skip(self, exc: KvLedgerError) -> KvLedgerError:
        return count_skip(self.summary, exc)

    def _other_topic(self, topic: bytes | None) -> None:
        s = self.summary
        s.other_topics += 1
        name = NO_TOPIC if topic is None else one_line(topic[:100].decode("utf-8", "backslashreplace"))
        if name in s.topics_seen or len(s.topics_seen) < MAX_TOPICS:
            s.topics_seen[name] = s.topics_seen.get(name, 0) + 1

    # -- messages ----------------------------------------------------------------

    def message(self, seq: int, payload: bytes, batch: tuple[float, Events, int | None],
                *, replayed: bool) -> None:
        batch_seq(seq)  # a seq from a file or a caller too; next_seq must fit the journal's int64 columns
        now = time.monotonic_ns()
        ts, events, rank = batch
        c = self._cursor(rank)
        if replayed and seq < self._lowest.get(c.sid, MAX_SEQ + 1):
            self._lowest[c.sid] = seq
        fp = _fingerprint(payload)
        if seq < c.next_seq:
            if replayed or (self.live_duplicates and c.recent.get(seq) == fp):
                self.summary.duplicates += 1
                return
            self._restart(c, seq)
        size = _stored_size(events)
        kept: Events | TooLarge = TooLarge(size) if size > MAX_EVENT_BYTES - ENVELOPE_BYTES else events
        if seq == c.next_seq:
            self._record(c, seq, ts, kept, rank, replayed, fp, now)
            self._drain(c)
            return
        self._hold(c, seq, (ts, kept, rank, replayed, fp, now, (0 if kept is not events else size) + HELD_OVERHEAD))
        if not self.replayable:
            self._gap(c, seq - 1, self.gap_reason)
            self._drain(c)
        elif not self.replay_pending and self.replay_wanted is None:
            self.replay_wanted = c.next_seq

    def replay_done(self, reason: str = "evicted from the publisher's replay buffer") -> None:
        """The replay's end marker (or its timeout). A hole that was already open when
        the request went out (its seqs were published before it) and is still open was
        not in the publisher's buffer: the buffer keeps a contiguous tail, so everything
        below the first batch held is gone, and is journaled as a gap. Unless the replay
        sent a seq below the hole: then the buffer had it, and it was lost on the way (a
        socket past its HWM drops), so it is asked for again, up to RETRIES times. A hole
        that opened after the request went out is asked for again."""
        self.replay_pending = False
        known, self._known = self._known, {}
        lowest, self._lowest = self._lowest, {}
        for c in self.cursors.values():
            if not c.held:
                continue
            if c.next_seq <= known.get(c.sid, -1):
                if lowest.get(c.sid, c.next_seq) < c.next_seq:
                    hole, tries = self._retries.get(c.sid, (c.next_seq, 0))
                    tries = tries + 1 if hole == c.next_seq else 1
                    self._retries[c.sid] = (c.next_seq, tries)
                    if tries <= RETRIES:
                        self._want(c.next_seq)
                        continue
                    reason = f"the replay socket sent the batches around it {RETRIES} times, never these"
                self._gap(c, min(c.held) - 1, reason)
                self._drain(c)
            else:
                self._want(c.next_seq)

    def replay_sent(self) -> None:
        self.replay_pending, self.replay_wanted = True, None
        self._known = {c.sid: min(c.held) - 1 for c in self.cursors.values() if c.held}
        self._lowest = {}

    def _want(self, seq: int) -> None:
        if self.replay_wanted is None or seq < self.replay_wanted:
            self.replay_wanted = seq

    # -- decisions ---------------------------------------------------------------

    def _cursor(self, rank: int | None) -> Cursor:
        c = self._by_rank.get(rank)
        if c is not None:
            return c
        sid = stream_id(self.endpoint, self.topic, rank)
        c = self.cursors.get(sid)
        if c is None:
            if len(self.cursors) >= MAX_STREAMS:
                raise KvLedgerError(ErrorCode.CAPACITY_EXCEEDED, f"data_parallel_rank {rank}: a recorder "
                                    f"records at most {MAX_STREAMS} streams (ranks)")
            c = self.cursors[sid] = Cursor(sid, stream_key(sid))
            self.summary.streams += 1
        self._by_rank[rank] = c
        return c

    def _hold(self, c: Cursor, seq: int, held: Held) -> None:
        old = c.held.get(seq)  # a second copy of a held seq (live and replayed) replaces the first
        c.held[seq] = held
        s = self.summary
        delta = held[6] - (0 if old is None else old[6])
        c.held_bytes += delta
        s.held_bytes += delta
        s.held_batches += old is None
        while s.held_bytes > self.max_held_bytes:
            self.give_up_oldest()
        if s.held_bytes > s.held_bytes_peak:
            s.held_bytes_peak = s.held_bytes

    def give_up_oldest(self) -> None:
        """The replay has not filled the holes in time (the held batches are at the cap):
        the oldest hole of the stream holding most is given up as a gap, and what follows
        it is journaled."""
        s = self.summary
        most = max((x for x in self.cursors.values() if x.held), key=lambda x: x.held_bytes)
        n = self._gap(most, min(most.held) - 1, f"the held batches reached the recorder's cap of "
                                               f"{self.max_held_bytes} bytes before the replay answered")
        s.cap_gaps += n > 0
        s.cap_gap_seqs += n
        self._drain(most)

    def _unhold(self, c: Cursor, seq: int) -> Held:
        held = c.held.pop(seq)
        c.held_bytes -= held[6]
        s = self.summary
        s.held_bytes -= held[6]
        s.held_batches -= 1
        return held

    def _drain(self, c: Cursor) -> None:
        held = c.held
        while c.next_seq in held:
            ts, events, rank, replayed, fp, received, _ = self._unhold(c, c.next_seq)
            self._record(c, c.next_seq, ts, events, rank, replayed, fp, received)

    def _record(self, c: Cursor, seq: int, ts: float, events: Events | TooLarge, rank: int | None,
                replayed: bool, fp: bytes, received: int) -> None:
        c.recent[seq] = fp
        c.order.append(seq)
        if len(c.order) > RECENT:
            c.recent.pop(c.order.popleft(), None)
        s = self.summary
        if isinstance(events, TooLarge):
            gap = kv.KvEventsGap(c.epoch, seq, seq, f"the batch's events are {events.size} bytes of JSON, over "
                                 f"the journal's event limit of {MAX_EVENT_BYTES}",
                                 code=ErrorCode.FIELD_TOO_LARGE.value, size_bytes=events.size)
            self._write(c, f"{c.epoch}:gap:{seq}", f"refused:{seq}:{fp.hex()}", gap, seq + 1, received)
            s.gaps += 1
            s.gap_seqs += 1
            s.too_large += 1
            return
        if isinstance(events, Encoded):
            # The events' JSON in place of their tuple: what the encoder writes is the same.
            body: Any = events.json
            count, size = events.count, len(body)
            self.ops_bytes += size
        else:
            body, count, size = events, len(events), 0
        payload = kv.KvEventsBatch(c.epoch, seq, ts, body, rank, replayed)
        self._write(c, f"{c.epoch}:{seq}", fp.hex(), payload, seq + 1, received, size)
        s.batches += 1
        s.events += count
        s.replayed += replayed

    def _gap(self, c: Cursor, last: int, reason: str) -> int:
        """Journal seqs next_seq..last as never received; how many they are."""
        if last < c.next_seq:
            return 0
        first = c.next_seq
        payload = kv.KvEventsGap(c.epoch, first, last, reason)
        self._write(c, f"{c.epoch}:gap:{first}", f"gap:{first}:{last}", payload, last + 1, time.monotonic_ns())
        self.summary.gaps += 1
        self.summary.gap_seqs += last - first + 1
        return last - first + 1

    def _restart(self, c: Cursor, seq: int) -> None:
        payload = kv.KvEventsRestart(c.epoch + 1, c.next_seq - 1, seq, "seq went backwards")
        self._write(c, f"{c.epoch + 1}:restart", f"restart:{c.next_seq}:{seq}", payload, 0, time.monotonic_ns())
        for held in list(c.held):
            self._unhold(c, held)
        c.recent.clear()
        c.order.clear()
        self.summary.restarts += 1

    def _write(self, c: Cursor, what: str, fingerprint: str, payload: _Payload, next_seq: int, received: int,
               size: int = 0) -> None:
        """Decides one event of `payload`'s kind, in `payload.epoch`; the stream's next seq
        after it is `next_seq`."""
        position, epoch = c.position + 1, payload.epoch
        self.ops.append(_Pending(c.sid, c.key, c.guard(), what, fingerprint, EVENT_OF[type(payload)], payload,
                                 HeadFacts(c.sid, epoch, next_seq, position, 0, LIFECYCLE, "", ""),
                                 time.monotonic_ns(), time.time_ns(), received, size))
        c.epoch, c.next_seq, c.position = epoch, next_seq, position
        self.summary.last_seq = next_seq - 1


_Payload = kv.KvEventsBatch | kv.KvEventsGap | kv.KvEventsRestart
# the event each decided payload becomes
EVENT_OF: dict[type[_Payload], type[ev.KvStreamEvent]] = {
    kv.KvEventsBatch: ev.KvEventsBatchEvent, kv.KvEventsGap: ev.KvEventsGapEvent,
    kv.KvEventsRestart: ev.KvEventsRestartEvent}


class _Pending(msgspec.Struct, array_like=True, gc=False):
    """One decided write, not yet an event: `take` groups a stream's consecutive ones
    into one operation (one receipt, one guard) and only then knows the operation id."""

    sid: str
    key: str
    guard: Guard | None
    what: str
    fingerprint: str
    cls: type[ev.KvStreamEvent]
    payload: Any  # the one of `cls`, a pairing its type cannot state
    head: HeadFacts
    monotonic_ns: int
    wall_ns: int
    received_ns: int  # monotonic: when its batch was received (for the commit lag)
    size: int  # its events' bytes in ops_bytes (0: none counted)


class Taken(msgspec.Struct, frozen=True, gc=False):
    """Operations to append, the summary as it stands once they are (None: more decided
    writes follow them), and when the oldest batch among them was received (monotonic
    ns; 0: none)."""

    ops: list[Operation]
    summary: Summary | None
    oldest_received_ns: int


def _operations(pending: list[_Pending], most: int, source: str) -> list[Operation]:
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
            operation_id=op_id, source_instance=source, monotonic_ns=p.monotonic_ns, observed_wall_time=p.wall_ns,
            payload=p.payload) for p in group)
        fingerprint = first.fingerprint if len(group) == 1 else \
            f"{len(group)}:{zlib.crc32(''.join(p.fingerprint for p in group).encode()):08x}:{group[-1].fingerprint}"
        ops.append(Operation(op_id, fingerprint[:128], (StreamWrite(first.sid, first.guard, group[-1].head, events),)))
        i = j
    return ops


def _stored_size(events: Events) -> int:
    """The bytes of the events' JSON as the journal stores them (the tuple form, of import
    and tests, is encoded to count them)."""
    return len(events.json) if isinstance(events, Encoded) else len(_json(events))


_json = msgspec.json.Encoder().encode


def _fingerprint(payload: bytes) -> bytes:
    # Tells a late duplicate from a new batch at the same seq, and names a batch in its
    # operation's fingerprint (a retry with other bytes is CONFLICT): length and CRC-32,
    # a tenth of a cryptographic digest's cost on the recorder's hot path.
    return len(payload).to_bytes(4, "big") + zlib.crc32(payload).to_bytes(4, "big")


def kv_heads(heads: Iterable[tuple[str, HeadFacts]]) -> dict[str, HeadFacts]:
    return {sid: h for sid, h in heads if h.lifecycle == LIFECYCLE}
