"""`kvledger kv-events record`: the sockets around adapters.kv_events_recorder.

One thread: a SUB socket on the publisher, a DEALER on its replay ROUTER, the journal.
Received batches are decided by the Recorder at once and appended in groups (one
commit for everything that arrived while the previous commit ran): nothing is ever
acknowledged to the publisher, so a crash loses only what was not yet committed, and
the restarted recorder asks the replay socket for it from its journal's cursor.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvledger.adapters.kv_events_recorder import Recorder, Summary

__all__ = ["Stop", "Summary", "install_signals", "record"]
from kvledger.adapters.kv_events_wire import decode_batch, seq_bytes, split_live, split_replay
from kvledger.journal.contract import Journal, Rejection
from kvledger.schemas.errors import ErrorCode, KvLedgerError

FLUSH_OPS = 2048  # operations per commit at most
FLUSH_AFTER_S = 0.02  # a received batch waits at most this long for its commit
REPLAY_TIMEOUT_S = 5.0  # a replay silent this long without its end marker is treated as ended
PROGRESS_EVERY_S = 5.0


class Stop:
    """Set by SIGINT/SIGTERM: the loop commits what it has and returns."""

    def __init__(self) -> None:
        self.stopped = False

    def __call__(self, *_: Any) -> None:
        self.stopped = True


def record(journal: Journal, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
           idle_exit: float | None = None, progress: Callable[[Summary], None] | None = None,
           stop: Stop | None = None, dialect: str = "auto") -> Summary:
    stop = stop or Stop()
    heads = journal.heads()
    rec = Recorder(endpoint, topic, heads, replayable=replay_endpoint is not None)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side: the publisher's HWM bounds it
    sub.setsockopt(zmq.LINGER, 0)
    # SGLang's [seq, payload] has no topic frame: with no topic, take everything.
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(endpoint)
    dealer = None
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    if replay_endpoint is not None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(replay_endpoint)
        poller.register(dealer, zmq.POLLIN)
    topic_bytes = topic.encode()
    frame_count = {"vllm": 3, "sglang": 2}.get(dialect)  # None: either form
    last_message = time.monotonic()
    first_unflushed: float | None = None
    replay_deadline = 0.0
    next_progress = time.monotonic() + PROGRESS_EVERY_S

    def flush() -> None:
        nonlocal first_unflushed
        ops = rec.take()
        first_unflushed = None
        if not ops:
            return
        for r in journal.append(ops):
            if isinstance(r, Rejection):
                raise KvLedgerError(ErrorCode(r.code), f"{r.handle_id}: {r.message} (another recorder "
                                                       "writes this stream?)")
        rec.summary.last_commit_ns = time.monotonic_ns()

    try:
        while not stop.stopped:
            now = time.monotonic()
            if dealer is not None:
                if rec.replay_wanted is not None and not rec.replay_pending:
                    dealer.send_multipart([b"", seq_bytes(rec.replay_wanted)])
                    rec.replay_sent()
                    replay_deadline = now + REPLAY_TIMEOUT_S
                elif rec.replay_pending and now > replay_deadline:
                    rec.replay_done("the replay socket sent no end marker in time")
            wait = 0 if first_unflushed is not None else 100
            ready = dict(poller.poll(wait))
            got = 0
            if sub in ready:
                got += _receive(sub, lambda frames: _live(rec, frames, topic_bytes, frame_count))
            if dealer is not None and dealer in ready:
                got += _receive(dealer, lambda frames: _replayed(rec, frames))
                replay_deadline = now + REPLAY_TIMEOUT_S  # a long replay that is still sending is no timeout
            now = time.monotonic()
            if got:
                if not rec.summary.first_message_ns:
                    rec.summary.first_message_ns = time.monotonic_ns()
                last_message = now
                if first_unflushed is None:
                    first_unflushed = now
            if rec.ops and (not got or len(rec.ops) >= FLUSH_OPS or now - (first_unflushed or now) > FLUSH_AFTER_S):
                flush()
            if progress is not None and now > next_progress:
                progress(rec.summary)
                next_progress = now + PROGRESS_EVERY_S
            if idle_exit is not None and not got and now - last_message > idle_exit:
                break
        flush()
    finally:
        sub.close(0)
        if dealer is not None:
            dealer.close(0)
        ctx.term()
    return rec.summary


def _receive(sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], object], most: int = 4096) -> int:
    """Hand up to `most` waiting messages to `handle`; how many there were."""
    n = 0
    while n < most:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        n += 1
        handle(frames)
    return n


def _live(rec: Recorder, frames: list[bytes], topic: bytes, frame_count: int | None = None) -> bool:
    try:
        if frame_count is not None and len(frames) != frame_count:
            raise KvLedgerError(ErrorCode.MALFORMED_EVENT, f"{len(frames)} frames, not the dialect's {frame_count}")
        got_topic, seq, payload = split_live(frames)
        if len(frames) == 3 and got_topic != topic and topic:
            return False
        rec.message(seq, payload, decode_batch(payload), replayed=False)
    except KvLedgerError as exc:
        print(f"kv-events: skipped a live message: {exc}", file=sys.stderr)
        return False
    return True


def _replayed(rec: Recorder, frames: list[bytes]) -> bool:
    try:
        item = split_replay(frames)
        if item is None:
            rec.replay_done()
            return False
        seq, payload = item
        rec.message(seq, payload, decode_batch(payload), replayed=True)
    except KvLedgerError as exc:
        print(f"kv-events: skipped a replayed message: {exc}", file=sys.stderr)
        return False
    return True


def install_signals(stop: Stop) -> None:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
