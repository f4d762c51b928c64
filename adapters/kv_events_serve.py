"""`kvledger kv-events serve`: vLLM's replay protocol answered from the durable journal,
for any seq ever recorded, plus a snapshot request (docs/KV_EVENTS.md).

A ROUTER socket. Requests, as a DEALER sends them (the ROUTER sees the identity first):

- replay: `[b"", start_seq]` (8 bytes big-endian, vLLM's form) or
  `[b"", start_seq, stream_id]`: every recorded batch of the stream's latest epoch with
  seq >= start, each `[b"", topic, seq, payload]` (payload the msgpack EventBatch
  `[ts, events, data_parallel_rank]`), then the end marker `[b"", -1, b""]`. Without a
  stream id the journal must hold exactly one KV-event stream. Seqs journaled as a gap
  were never received and are not sent.
- snapshot: `[b"", b"SNAPSHOT", stream_id or b""]`: one reply `[b"", b"SNAPSHOT", json]`,
  the json `{"stream_id", "epoch", "seq", "next_seq", "global_position", "uncertain",
  "pools": {"MEDIUM/GROUP": [hash, ...]}}`: the resident block set after the stream's
  latest recorded event, valid at `seq`. A consumer loads it, then asks a replay from
  `next_seq`, and has the same block set a full replay would give.
  An error is `[b"", b"ERROR", message]`.
"""

from __future__ import annotations

import json
import time

import zmq

from kvledger.adapters.kv_events_wire import END_SEQ, encode_batch, seq_bytes, seq_of
from kvledger.adapters.kv_events_zmq import Stop
from kvledger.journal.contract import Journal
from kvledger.replay.kv_blocks import KvBlocks, kv_head, resident
from kvledger.schemas import events as ev
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.kv_events import KV_LIFECYCLE

SNAPSHOT = b"SNAPSHOT"
ERROR = b"ERROR"


def topic_of(sid: str) -> bytes:
    """The topic named in a stream id `kv:{endpoint}|{topic}|dp{rank}` (b"" if none)."""
    parts = sid.split("|")
    return parts[1].encode() if len(parts) == 3 else b""


def _stream(journal: Journal, requested: bytes) -> str:
    streams = sorted(h for h, f in journal.heads().items() if f.lifecycle == KV_LIFECYCLE)
    if requested:
        sid = requested.decode("utf-8", "replace")
        if sid not in streams:
            raise LookupError(f"no KV-event stream {sid[:200]!r} in this journal")
        return sid
    if len(streams) != 1:
        raise LookupError(f"the journal holds {len(streams)} KV-event streams: name one")
    return streams[0]


def _latest_epoch(events: list[ev.Event]) -> list[ev.Event]:
    start = 0
    for i, e in enumerate(events):
        if isinstance(e, ev.KvEventsRestartEvent):
            start = i + 1
    return events[start:]


def replay_frames(journal: Journal, start: int, requested: bytes = b"") -> list[list[bytes]]:
    """The reply to a replay request, end marker included (without the identity)."""
    sid = _stream(journal, requested)
    topic = topic_of(sid)
    out = []
    for e in _latest_epoch(journal.read_stream(sid)):
        if isinstance(e, ev.KvEventsBatchEvent) and e.payload.seq >= start:
            p = e.payload
            out.append([b"", topic, seq_bytes(p.seq), encode_batch(p.ts, p.events, p.data_parallel_rank)])
    out.append([b"", END_SEQ, b""])
    return out


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


def handle(journal: Journal, frames: list[bytes]) -> list[list[bytes]]:
    """The reply frames (identity excluded) to one request's frames (identity excluded)."""
    try:
        if len(frames) < 2 or frames[0] != b"":
            raise LookupError("a request is [b'', start_seq] or [b'', b'SNAPSHOT', stream_id]")
        if frames[1] == SNAPSHOT:
            doc = snapshot(journal, frames[2] if len(frames) > 2 else b"")
            return [[b"", SNAPSHOT, json.dumps(doc, separators=(",", ":")).encode()]]
        start = seq_of(frames[1])
        if start < 0:
            raise LookupError("start_seq must be >= 0")
        return replay_frames(journal, start, frames[2] if len(frames) > 2 else b"")
    except (LookupError, KvLedgerError) as exc:
        return [[b"", ERROR, str(exc).encode()]]


def serve(journal: Journal, bind: str, *, stop: Stop, idle_exit: float | None = None) -> int:
    """Answer requests until stopped (or idle); returns how many were answered."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)  # a long replay is queued whole, never dropped
    router.bind(bind)
    answered = 0
    last = time.monotonic()
    try:
        while not stop.stopped:
            if not router.poll(100):
                if idle_exit is not None and time.monotonic() - last > idle_exit:
                    break
                continue
            identity, *frames = router.recv_multipart()
            for reply in handle(journal, frames):
                router.send_multipart([identity, *reply])
            answered += 1
            last = time.monotonic()
    finally:
        router.close(0)
        ctx.term()
    return answered
