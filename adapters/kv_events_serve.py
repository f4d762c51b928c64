"""`kvledger kv-events serve`: vLLM's replay protocol answered from the durable journal,
for any seq ever recorded, plus a snapshot request (docs/guides/kv-events.md).

A ROUTER socket. Requests and replies as a DEALER sends and sees them (the ROUTER sees
the identity first), frame for frame as vLLM 0.33's `ZmqEventPublisher` answers:

- replay: `[b"", start_seq]`, start_seq big-endian (vLLM's consumers send 8 bytes; any
  length is read as vLLM reads it, unsigned), or `[b"", start_seq, stream_id]`: every
  recorded batch of the stream's latest epoch with seq >= start, each
  `[b"", topic, seq (8 bytes), payload]` (payload vLLM's msgpack EventBatch), then the end
  marker `[b"", b"", -1 (8 bytes), b""]`. Without a stream id the journal must hold
  exactly one KV-event stream. Seqs journaled as a gap were never received and are not sent.
- snapshot: `[b"", b"SNAPSHOT", stream_id or b""]`: one reply `[b"", b"SNAPSHOT", json]`,
  the json `{"stream_id", "epoch", "seq", "next_seq", "global_position", "uncertain",
  "pools": {"MEDIUM/GROUP": [hash, ...]}}`: the resident block set after the stream's
  latest recorded event, valid at `seq`. A consumer loads it, then asks a replay from
  `next_seq`, and has the same block set a full replay would give.
- anything else, or a failure: `[b"", b"ERROR", b"CODE: message"]` (a stable code of
  schemas/errors.py), which ends that request's reply.

Bounded: a reply is made as it is sent (a cursor per request holds one page of the
journal's encoded batches), sent only while the client's queue has room (ROUTER_MANDATORY,
a finite SNDHWM: a client that does not read stops its own replies, nobody else's), and
each client has at most `max_pending` requests in progress and `max_clients` clients are
served at once; a request past either bound is answered `CAPACITY_EXCEEDED` in its turn.
"""

from __future__ import annotations

import json
import time
from collections import deque

import msgspec
import zmq

from kvledger.adapters.kv_events_wire import END_SEQ, encode_batch, seq_bytes
from kvledger.adapters.kv_events_zmq import Stop
from kvledger.journal.port import Journal
from kvledger.replay.kv_blocks import KvBlocks, kv_head, resident
from kvledger.schemas import events as ev
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.kv_events import KV_LIFECYCLE

SNAPSHOT = b"SNAPSHOT"
ERROR = b"ERROR"
END = [b"", b"", END_SEQ, b""]
PAGE = 256  # journal events read at a time by a replay
PAGE_BYTES = 1 << 20  # encoded replies one replay holds at most (one batch may pass it)
MAX_PENDING = 8  # requests of one client in progress or waiting
MAX_CLIENTS = 64  # clients with a request in progress
MAX_REQUEST = 1 << 16  # bytes of a request message (ZMQ drops a peer that sends more)
SNDHWM = 256  # reply messages queued per client in ZMQ before sending waits
SEND_TURN = 64  # messages sent to one client before the next client's turn


def topic_of(sid: str) -> bytes:
    """The topic named in a stream id `kv:{endpoint}|{topic}|dp{rank}` (b"" if none)."""
    parts = sid.split("|")
    return parts[1].encode() if len(parts) == 3 else b""


def _stream(journal: Journal, requested: bytes) -> str:
    streams = sorted(h for h, f in journal.heads().items() if f.lifecycle == KV_LIFECYCLE)
    if requested:
        sid = requested.decode("utf-8", "replace")
        if sid not in streams:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"no KV-event stream {sid[:200]!r} in this journal")
        return sid
    if len(streams) != 1:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"the journal holds {len(streams)} KV-event streams: "
                                                        "name one")
    return streams[0]


def _span(journal: Journal, sid: str, start: int) -> tuple[int, int]:
    """Global positions: the first batch of the stream's latest epoch with seq >= start
    (past `last` when none), and the stream's last event now."""
    events = journal.read_stream(sid)
    last = events[-1].global_position if events else 0
    first = last + 1
    for e in reversed(events):
        if isinstance(e, ev.KvEventsRestartEvent):
            break
        if isinstance(e, ev.KvEventsBatchEvent) and e.payload.seq >= start:
            first = e.global_position
    return first, last


def snapshot(journal: Journal, requested: bytes = b"") -> dict[str, object]:
    sid = _stream(journal, requested)
    events = journal.read_stream(sid)
    fold = KvBlocks()
    head: tuple[int, int, int] | None = None
    for e in events:  # one read: the block set and the seq it is valid at agree
        fold.apply(e)  # type: ignore[arg-type]  # a KV stream holds only KV-stream events
        head = kv_head(head, e)  # type: ignore[arg-type]
    s = fold.state.streams[sid]
    epoch, next_seq, _ = head or (0, 0, 0)
    return {"stream_id": sid, "epoch": epoch, "seq": next_seq - 1, "next_seq": next_seq,
            "global_position": events[-1].global_position if events else 0, "uncertain": s.uncertain,
            "pools": resident(fold.state, sid)}


def error(code: ErrorCode, message: str) -> list[bytes]:
    return [b"", ERROR, str(KvLedgerError(code, message)).encode()]


class Reply:
    """The reply (messages without the identity) to one request (frames without the
    identity), made as it is consumed: a replay holds one page of encoded batches at a
    time. Iterating never raises: a failure is the reply's last message, a coded ERROR."""

    def __init__(self, journal: Journal, frames: list[bytes]) -> None:
        self.journal, self.request = journal, frames
        self.page: deque[list[bytes]] = deque()
        self.page_bytes = 0
        self.sid: str | None = None
        self.start = self.after = self.last = 0
        self.done = self.failed = False

    def __iter__(self) -> Reply:
        return self

    def __next__(self) -> list[bytes]:
        if self.done:
            raise StopIteration
        try:
            return self._next()
        except KvLedgerError as exc:
            return self._fail(exc.code, exc.message)
        except OverflowError:  # a journal imported before import bounded its integers
            return self._fail(ErrorCode.MALFORMED_EVENT, "a recorded batch holds an integer past msgpack's 64 bits")
        except UnicodeEncodeError:
            return self._fail(ErrorCode.MALFORMED_EVENT, "a recorded batch holds a lone surrogate")
        except msgspec.MsgspecError as exc:
            return self._fail(ErrorCode.CORRUPT_JOURNAL, f"a recorded event does not decode: {exc}")

    def held_bytes(self) -> int:
        return sum(map(len, self.request)) + self.page_bytes

    def _fail(self, code: ErrorCode, message: str) -> list[bytes]:
        self.done = self.failed = True
        self.page.clear()
        return error(code, message)

    def _next(self) -> list[bytes]:
        if self.sid is None:
            frames = self.request
            if len(frames) == 3 and frames[0] == b"" and frames[1] == SNAPSHOT:
                self.done = True
                return [b"", SNAPSHOT, json.dumps(snapshot(self.journal, frames[2]), separators=(",", ":")).encode()]
            if len(frames) == 2 or (len(frames) == 3 and frames[0] == b""):
                # vLLM's request is [b"", start_seq]: like vLLM, any first frame, and a seq of any
                # length read as an unsigned big-endian integer
                self.start = int.from_bytes(frames[1], "big")
                self.sid = _stream(self.journal, frames[2] if len(frames) == 3 else b"")
                first, self.last = _span(self.journal, self.sid, self.start)
                self.after = first - 1
            else:
                raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "a request is [b'', start_seq], [b'', start_seq, "
                                    f"stream_id] or [b'', b'SNAPSHOT', stream_id], not {len(frames)} frames")
        while not self.page and self.after < self.last:
            self._read_page()
        if self.page:
            message = self.page.popleft()
            self.page_bytes -= len(message[3])
            return message
        self.done = True
        return END

    def _read_page(self) -> None:
        """The stream's batches after `after` (to `last`): at most PAGE events read,
        PAGE_BYTES encoded."""
        assert self.sid is not None
        topic = topic_of(self.sid)
        read_to = self.last  # a journal that ends early ends the replay
        for e in self.journal.read_all(self.after, PAGE):
            if e.global_position > self.last:
                break
            read_to = e.global_position
            if isinstance(e, ev.KvEventsBatchEvent) and e.stream_id == self.sid and e.payload.seq >= self.start:
                p = e.payload
                payload = encode_batch(p.ts, p.events, p.data_parallel_rank)
                self.page.append([b"", topic, seq_bytes(p.seq), payload])
                self.page_bytes += len(payload)
                if self.page_bytes >= PAGE_BYTES:
                    break
        self.after = read_to


def handle(journal: Journal, frames: list[bytes]) -> Reply:
    """The reply to one request's frames (identity excluded): an iterator of messages."""
    return Reply(journal, frames)


class Served(msgspec.Struct):
    """What `serve` did: replies sent in full (replays, snapshots), ERROR replies, requests
    refused (CAPACITY_EXCEEDED, in their turn), requests dropped because their client went
    away, the most clients and one client's requests held at once, and the most bytes held
    for replies at once (requests waiting and the replays' pages)."""

    answered: int = 0
    errors: int = 0
    refused: int = 0
    dropped: int = 0
    peak_clients: int = 0
    peak_pending: int = 0
    peak_held_bytes: int = 0


_REFUSED = f"more than {MAX_PENDING} requests of this client, or {MAX_CLIENTS} clients, in progress"


class _Client:
    """One client's requests in order: a request's reply, or how many requests in a row
    were refused there; the first in progress."""

    def __init__(self) -> None:
        self.queue: deque[Reply | int] = deque()
        self.unsent: list[bytes] | None = None  # the message the socket had no room for
        self.blocked = False  # its queue was full at the last send
        self.pending = 0  # requests queued or in progress (refused ones not counted)

    def next_message(self, served: Served) -> list[bytes] | None:
        if self.unsent is not None:
            return self.unsent
        while self.queue:
            item = self.queue[0]
            if isinstance(item, int):
                if item > 1:
                    self.queue[0] = item - 1
                else:
                    self.queue.popleft()
                return error(ErrorCode.CAPACITY_EXCEEDED, _REFUSED)
            message = next(item, None)
            if message is not None:
                return message
            self.queue.popleft()
            self.pending -= 1
            served.answered += not item.failed
            served.errors += item.failed
        return None

    def refuse(self) -> None:
        if self.queue and isinstance(self.queue[-1], int):
            self.queue[-1] += 1
        else:
            self.queue.append(1)

    def held_bytes(self) -> int:
        return sum(r.held_bytes() for r in self.queue if isinstance(r, Reply))


class _Server:
    def __init__(self, journal: Journal, router: zmq.Socket[bytes]) -> None:
        self.journal, self.router = journal, router
        self.clients: dict[bytes, _Client] = {}
        self.served = Served()

    def admit(self, identity: bytes, frames: list[bytes]) -> None:
        s = self.served
        c = self.clients.get(identity)
        if c is None and len(self.clients) >= MAX_CLIENTS:
            s.refused += 1
            self._send(identity, error(ErrorCode.CAPACITY_EXCEEDED, _REFUSED))  # dropped if it has no room
            return
        c = self.clients.setdefault(identity, _Client())
        if c.pending >= MAX_PENDING:
            s.refused += 1
            c.refuse()
            return
        c.queue.append(handle(self.journal, frames))
        c.pending += 1
        s.peak_clients = max(s.peak_clients, len(self.clients))
        s.peak_pending = max(s.peak_pending, c.pending)

    def _send(self, identity: bytes, message: list[bytes]) -> bool | None:
        """Sent (True), no room in the client's queue (False), the client is gone (None)."""
        try:
            self.router.send_multipart([identity, *message], zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return None
        return True

    def turn(self) -> bool:
        """Up to SEND_TURN messages to each client with work, while its queue has room;
        whether any was sent."""
        any_sent = False
        for identity in list(self.clients):
            c = self.clients[identity]
            for _ in range(SEND_TURN):
                message = c.next_message(self.served)
                if message is None:
                    del self.clients[identity]
                    break
                sent = self._send(identity, message)
                c.unsent, c.blocked = (None, False) if sent else (message, True)
                if sent is None:
                    self.served.dropped += c.pending
                    del self.clients[identity]  # gone: its replies go with it
                    break
                if not sent:
                    break
                any_sent = True
        held = sum(c.held_bytes() for c in self.clients.values())
        self.served.peak_held_bytes = max(self.served.peak_held_bytes, held)
        return any_sent


def serve(journal: Journal, bind: str, *, stop: Stop, idle_exit: float | None = None) -> Served:
    """Answer requests until stopped (or idle)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full client queue is zmq.Again, not a silent drop
    router.setsockopt(zmq.SNDHWM, SNDHWM)
    router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
    router.bind(bind)
    server = _Server(journal, router)
    last = time.monotonic()
    try:
        while not stop.stopped:
            waiting = any(not c.blocked for c in server.clients.values())  # else wait a while for room
            if router.poll(0 if waiting else 10 if server.clients else 100):
                for _ in range(256):  # a burst of requests is admitted before the next turn
                    try:
                        identity, *frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    server.admit(identity, frames)
                last = time.monotonic()
            if server.clients and server.turn():
                last = time.monotonic()
            elif idle_exit is not None and time.monotonic() - last > idle_exit:
                break  # no request and nothing sent: clients that do not read do not keep it up
    finally:
        router.close(0)
        ctx.term()
    return server.served
