"""`kvledger kv-events record`: the sockets around adapters.kv_events_recorder.

A receiving thread (a SUB socket on the publisher, a DEALER on its replay ROUTER) decides
each batch with the Recorder at once; a committer thread appends them in groups (one
commit for everything decided while the previous commit ran): nothing is ever
acknowledged to the publisher, so a crash loses only what was not yet committed, and
the restarted recorder asks the replay socket for it from its journal's cursor.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvledger.adapters.kv_events_recorder import Recorder, Summary

__all__ = ["Stop", "Summary", "install_signals", "record"]
from kvledger.adapters.kv_events_wire import decode_batch_encoded, seq_bytes, split_live, split_replay
from kvledger.journal.contract import Journal, Operation, Rejection
from kvledger.schemas.errors import ErrorCode, KvLedgerError

FLUSH_OPS = 4096  # decided batches that wait for a busy committer before the receiving waits too
RECEIVE_MOST = 256  # messages taken per look, so the first commit starts soon after the first batch
MIN_GROUP = 1024  # while messages keep waiting, an idle committer gets at least this many batches
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
    replay_deadline = 0.0
    next_progress = time.monotonic() + PROGRESS_EVERY_S
    committer = _Committer(journal, rec.summary)

    def flush() -> None:
        ops = rec.take()
        if ops:
            committer.submit(ops)

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
            # Decided batches wait for the committer: look again soon, without spinning on
            # the GIL the committer's statements need.
            ready = dict(poller.poll(1 if rec.ops else 100))
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
            # Group commit: whatever was decided while the previous commit ran goes in the
            # next one; a committer that falls far behind holds the receiving back. While
            # a backlog is still waiting, a group is at least MIN_GROUP: each commit costs
            # an fsync and its statements, which small groups under load pay far too often.
            if rec.ops and (len(rec.ops) >= FLUSH_OPS or committer.idle() and (
                    len(rec.ops) >= MIN_GROUP or got < RECEIVE_MOST)):
                flush()
            if progress is not None and now > next_progress:
                progress(rec.summary)
                next_progress = now + PROGRESS_EVERY_S
            if idle_exit is not None and not got and now - last_message > idle_exit:
                break
        flush()
        committer.close()
    finally:
        committer.close(raise_error=False)
        sub.close(0)
        if dealer is not None:
            dealer.close(0)
        ctx.term()
    return rec.summary


class _Committer:
    """Appends decided operations on a thread of its own, so the next batches are
    received and decoded while a commit runs: the record's compression and the commit's
    fsync release the GIL. One group at a time; `submit` waits while one is queued, which
    is the backpressure on the receiving loop. A failure is raised by the next submit or
    by close."""

    def __init__(self, journal: Journal, summary: Summary) -> None:
        self.journal, self.summary = journal, summary
        self.queue: queue.Queue[list[Operation] | None] = queue.Queue(maxsize=1)
        self.lock = threading.Lock()
        self.pending = 0  # groups submitted and not yet appended
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kv-events-commit", daemon=True)
        self.thread.start()

    def idle(self) -> bool:
        return self.pending == 0

    def submit(self, ops: list[Operation]) -> None:
        self._raise()
        with self.lock:
            self.pending += 1
        self.queue.put(ops)

    def close(self, raise_error: bool = True) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        if raise_error:
            self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _run(self) -> None:
        while (ops := self.queue.get()) is not None:
            try:
                if self.error is None:
                    self._append(ops)
            except BaseException as exc:  # noqa: BLE001 - handed to the receiving thread, which raises it
                self.error = exc
            finally:
                with self.lock:
                    self.pending -= 1

    def _append(self, ops: list[Operation]) -> None:
        for r in self.journal.append(ops):
            if isinstance(r, Rejection):
                raise KvLedgerError(ErrorCode(r.code), f"{r.handle_id}: {r.message} (another recorder "
                                                       "writes this stream?)")
        self.summary.last_commit_ns = time.monotonic_ns()


def _receive(sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], object], most: int = RECEIVE_MOST) -> int:
    """Hand up to `most` waiting messages to `handle`; how many there were."""
    n = 0
    recv = sock.recv
    while n < most:
        try:
            frame = recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break
        # Frame.more, not recv_multipart: that asks getsockopt(RCVMORE) after each part,
        # which converts the option to an enum in Python (2.5 of its 6.5 us a message here).
        frames = [frame.bytes]
        while frame.more:
            frame = recv(zmq.NOBLOCK, copy=False)  # a message's parts arrive together
            frames.append(frame.bytes)
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
        rec.message(seq, payload, decode_batch_encoded(payload), replayed=False)
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
        rec.message(seq, payload, decode_batch_encoded(payload), replayed=True)
    except KvLedgerError as exc:
        print(f"kv-events: skipped a replayed message: {exc}", file=sys.stderr)
        return False
    return True


def install_signals(stop: Stop) -> None:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
