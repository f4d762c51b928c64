"""`kvledger kv-events record`: the sockets around adapters.kv_events_recorder.

A receiving thread (a SUB socket on the publisher, a DEALER on its replay ROUTER) decides
each batch with the Recorder at once; a committer thread appends them in groups (one
commit for everything decided while the previous commit ran): nothing is ever
acknowledged to the publisher, so a crash loses only what was not yet committed, and
the restarted recorder asks the replay socket for it from its journal's cursor.

Memory is bounded: each socket queues at most `rcvhwm` messages (past it ZMQ pushes
back on the TCP connection, and a publisher drops: a seq hole, replayed or journaled as a
gap), decided batches wait for the committer up to FLUSH_OPS or FLUSH_BYTES, and held
batches up to the Recorder's byte cap. The SUB takes every topic: the Recorder filters
and counts the others, so a wrong --topic shows.
"""

from __future__ import annotations

import bisect
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Sized
from typing import Any, Protocol

import msgspec
import zmq

from kvledger.adapters.kv_events_recorder import MAX_HELD_BYTES, Recorder, Summary, Taken

__all__ = ["Committed", "Deciding", "Loop", "RecordOptions", "Say", "Stop", "Summary", "drive", "install_signals",
           "receive_messages", "record"]
from kvledger.adapters.kv_events_wire import seq_bytes
from kvledger.journal.contract import Rejection
from kvledger.journal.port import Journal, retried
from kvledger.schemas.errors import ErrorCode, KvLedgerError

log = logging.getLogger("kvledger.kv_events")

FLUSH_OPS = 4096  # decided batches that wait for a busy committer before the receiving waits too
FLUSH_BYTES = 8 << 20  # the same in their events' bytes; and the most one commit takes
RCVHWM = 1000  # messages each socket queues before ZMQ pushes back (the default of --rcvhwm)
SAY_MOST = 100  # skipped messages logged one by one; the summary counts the rest
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


class RecordOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What `record` listens to and how much it holds: the replay socket (None: no
    replay), the topic, the seconds without a message of it before it returns (None:
    until stopped), the publisher's dialect, the Recorder's byte cap on held batches and
    each socket's queue."""

    replay_endpoint: str | None = None
    topic: str = ""
    idle_exit: float | None = None
    dialect: str = "auto"
    max_held_bytes: int = MAX_HELD_BYTES
    rcvhwm: int = RCVHWM


class Deciding(Protocol):
    """What the receiving loop, the committer and the metrics need of the decisions: a
    Recorder (one publisher), or a collector's engines together."""

    @property
    def summary(self) -> Summary: ...
    @property
    def ops(self) -> Sized: ...
    @property
    def ops_bytes(self) -> int: ...

    def take_group(self, group: int = ..., most_bytes: int | None = None) -> Taken: ...

    def stop(self) -> None: ...


def record(journal: Journal, endpoint: str, options: RecordOptions | None = None, *, stop: Stop | None = None,
           progress: Callable[[Summary], None] | None = None,
           watch: Callable[[Deciding, Committed], None] | None = None) -> Summary:
    """Record until `stop` (or `options.idle_exit` seconds without a message of the topic);
    what is held then is journaled (Recorder.stop). `progress` gets the summary every
    PROGRESS_EVERY_S; `watch` is handed the Recorder and the committed state once, before
    the first message (metrics read them)."""
    stop, options = stop or Stop(), options or RecordOptions()
    rec = Recorder(endpoint, options.topic, journal.heads(), replayable=options.replay_endpoint is not None,
                   max_held_bytes=options.max_held_bytes, frames={"vllm": 3, "sglang": 2}.get(options.dialect))
    drive(journal, _Loop(rec, _Sockets(endpoint, options.replay_endpoint, options.rcvhwm)), options.idle_exit,
          stop=stop, progress=progress, watch=watch)
    return rec.summary


def drive(journal: Journal, loop: Loop, idle_exit: float | None, *, stop: Stop,
          progress: Callable[[Summary], None] | None, watch: Callable[[Deciding, Committed], None] | None) -> None:
    """Run `loop` until `stop` or `idle_exit`, journal what it holds then, commit it all,
    close its sockets: the one run of `record` and of a collector."""
    try:
        rec = loop.rec
        committed = Committed(msgspec.structs.replace(rec.summary))
        loop.committer = _Committer(journal, rec.summary, committed, stop)
        if watch is not None:
            watch(rec, committed)
        try:
            loop.run(stop, idle_exit, progress)
            rec.stop()
            while rec.ops:
                loop.flush()
            loop.committer.close()
        finally:
            loop.committer.close(raise_error=False)
    finally:
        loop.close()


class _Sockets:
    """A SUB on the publisher, taking every topic (the Recorder counts the others, and
    SGLang's [seq, payload] has none), and a DEALER on its replay ROUTER if there is one."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, rcvhwm: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.dealer: zmq.Socket[bytes] | None = None
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)
        if replay_endpoint is not None:
            self.dealer = self.ctx.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.setsockopt(zmq.RCVHWM, rcvhwm)
            self.dealer.connect(replay_endpoint)
            self.poller.register(self.dealer, zmq.POLLIN)

    def close(self) -> None:
        self.sub.close(0)
        if self.dealer is not None:
            self.dealer.close(0)
        self.ctx.term()


class Loop:
    """The receiving thread: asks for replays when the decisions want them, hands what
    arrives to them, and the decided batches to the committer in groups. The sockets are
    a subclass's (`ask_replay`, `receive`, `close`)."""

    committer: _Committer  # set by `drive`

    def __init__(self, rec: Deciding) -> None:
        self.rec = rec

    def ask_replay(self, now: float) -> None:
        raise NotImplementedError

    def receive(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def run(self, stop: Stop, idle_exit: float | None, progress: Callable[[Summary], None] | None) -> None:
        rec = self.rec
        last_message = time.monotonic()
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        while not stop.stopped:
            self.ask_replay(time.monotonic())
            received = rec.summary.received
            got = self.receive()
            now = time.monotonic()
            if got and not rec.summary.first_message_ns:
                rec.summary.first_message_ns = time.monotonic_ns()
            if rec.summary.received != received:
                last_message = now  # idle: no message of the topic (another topic's keep nothing alive)
            self.commit(got)
            if progress is not None and now > next_progress:
                progress(rec.summary)
                next_progress = now + PROGRESS_EVERY_S
            if idle_exit is not None and now - last_message > idle_exit:
                break

    def commit(self, got: int) -> None:
        """Group commit: whatever was decided while the previous commit ran goes in the
        next one; a committer that falls far behind holds the receiving back. While a
        backlog is still waiting, a group is at least MIN_GROUP: each commit costs an
        fsync and its statements, which small groups under load pay far too often."""
        rec = self.rec
        if (waiting := len(rec.ops)) > rec.summary.backlog_peak:
            rec.summary.backlog_peak = waiting
        if rec.ops and (len(rec.ops) >= FLUSH_OPS or self.committer.idle() and (
                len(rec.ops) >= MIN_GROUP or got < RECEIVE_MOST)):
            self.flush()
        while rec.ops_bytes >= FLUSH_BYTES:  # a burst or a drain of held batches: in parts, before more is taken
            self.flush()

    def flush(self) -> None:
        taken = self.rec.take_group(most_bytes=FLUSH_BYTES)
        if taken.ops:
            self.committer.submit(taken)


class _Loop(Loop):
    """One publisher's: a SUB on it and a DEALER on its replay ROUTER."""

    def __init__(self, rec: Recorder, sockets: _Sockets) -> None:
        super().__init__(rec)
        self.one, self.sockets = rec, sockets
        self.say_live, self.say_replayed = Say("live"), Say("replayed")
        self.replay_deadline = 0.0

    def close(self) -> None:
        self.sockets.close()

    def ask_replay(self, now: float) -> None:
        rec, dealer = self.one, self.sockets.dealer
        if dealer is None:
            return
        if rec.replay_wanted is not None and not rec.replay_pending:
            dealer.send_multipart([b"", seq_bytes(rec.replay_wanted)])
            rec.replay_sent()
            self.replay_deadline = now + REPLAY_TIMEOUT_S
        elif rec.replay_pending and now > self.replay_deadline:
            rec.replay_done("the replay socket sent no end marker in time")

    def receive(self) -> int:
        """The messages that arrived, handed to the Recorder; how many."""
        rec, sub, dealer = self.one, self.sockets.sub, self.sockets.dealer
        now = time.monotonic()
        # Decided batches wait for the committer: look again soon, without spinning on
        # the GIL the committer's statements need.
        ready = dict(self.sockets.poller.poll(1 if rec.ops else 100))
        got = 0
        if sub in ready:
            got += receive_messages(sub, rec.live, self.say_live)
        if dealer is not None and dealer in ready:
            got += receive_messages(dealer, rec.replayed, self.say_replayed)
            self.replay_deadline = now + REPLAY_TIMEOUT_S  # a long replay that is still sending is no timeout
        return got


class Committed:
    """What the journal holds of this run: the summary as of the last commit, the number
    of commits and the lag of each (seconds from receiving its oldest batch to the
    commit's end). Written by the committer thread, read by metrics."""

    LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

    def __init__(self, summary: Summary) -> None:
        self.summary = summary
        self.commits = 0
        self.lag_s = 0.0  # the last commit's
        self.lag_counts = [0] * (len(self.LAG_BUCKETS) + 1)  # the last is +Inf
        self.lag_sum = 0.0

    def add(self, taken: Taken, now_ns: int) -> None:
        if taken.summary is not None:
            self.summary = taken.summary
        self.commits += 1
        if taken.oldest_received_ns:
            lag = max(0, now_ns - taken.oldest_received_ns) / 1e9
            self.lag_s = lag
            self.lag_counts[bisect.bisect_left(self.LAG_BUCKETS, lag)] += 1
            self.lag_sum += lag


class _Committer:
    """Appends decided operations on a thread of its own, so the next batches are
    received and decoded while a commit runs: the record's compression and the commit's
    fsync release the GIL. One group at a time; `submit` waits while one is queued, which
    is the backpressure on the receiving loop. A failure is raised by the next submit or
    by close."""

    def __init__(self, journal: Journal, summary: Summary, committed: Committed, stop: Stop) -> None:
        self.journal, self.summary, self.committed, self.stop = journal, summary, committed, stop
        self.queue: queue.Queue[Taken | None] = queue.Queue(maxsize=1)
        self.lock = threading.Lock()
        self.pending = 0  # groups submitted and not yet appended
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kv-events-commit", daemon=True)
        self.thread.start()

    def idle(self) -> bool:
        return self.pending == 0

    def submit(self, taken: Taken) -> None:
        self._raise()
        with self.lock:
            self.pending += 1
        self.queue.put(taken)

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
        while (taken := self.queue.get()) is not None:
            try:
                if self.error is None:
                    self._append(taken)
            except BaseException as exc:  # noqa: BLE001 - handed to the receiving thread, which raises it
                self.error = exc
            finally:
                with self.lock:
                    self.pending -= 1

    def _append(self, taken: Taken) -> None:
        for r in self._appended(taken):
            if isinstance(r, Rejection):
                raise KvLedgerError(ErrorCode(r.code), f"{r.handle_id}: {r.message} (another recorder "
                                                       "writes this stream?)")
        now = time.monotonic_ns()
        self.summary.last_commit_ns = now
        self.committed.add(taken, now)

    def _appended(self, taken: Taken) -> list[Any]:
        """The group appended, through a database that restarts or drops the session:
        asked again (its operation ids make a retry land once) for up to RETRY_S, while
        the receiving loop waits (the publisher's ring then replays what it missed); not
        once the recorder is told to stop."""
        return retried(lambda: self.journal.append(taken.ops), what="a group", stopped=lambda: self.stop.stopped)


def receive_messages(sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], KvLedgerError | None],
             say: Callable[[KvLedgerError], None], most: int = RECEIVE_MOST) -> int:
    """Hand up to `most` waiting messages (and about FLUSH_BYTES) to `handle`, and what it
    skipped to `say`; how many there were."""
    n = size = 0
    recv = sock.recv
    while n < most and size < FLUSH_BYTES:
        try:
            frame = recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break
        # Frame.more, not recv_multipart: that asks getsockopt(RCVMORE) after each part,
        # which converts the option to an enum in Python, a large part of a message's cost.
        frames = [frame.bytes]
        while frame.more:
            frame = recv(zmq.NOBLOCK, copy=False)  # a message's parts arrive together
            frames.append(frame.bytes)
        size += len(frames[-1])
        n += 1
        if (error := handle(frames)) is not None:
            say(error)
    return n


class Say:
    """Logs a skipped message as a warning: the first SAY_MOST of them (the summary counts all)."""

    def __init__(self, kind: str) -> None:
        self.kind, self.said = kind, 0

    def __call__(self, error: KvLedgerError) -> None:
        self.said += 1
        if self.said <= SAY_MOST:
            more = "; further skips are counted in the summary only" if self.said == SAY_MOST else ""
            log.warning("skipped a %s message: %s%s", self.kind, error, more)


def install_signals(stop: Stop) -> None:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
