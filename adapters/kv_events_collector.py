"""`kvledger kv-events record --bind`: one recorder that many engines connect to.

vLLM's publisher connects its PUB when its endpoint names a host (`tcp://collector:5557`),
and always binds its replay ROUTER. The collector binds a SUB on each `--bind` endpoint and
tells the engines apart by the message's topic (vLLM's `topic` setting) and the batch's
`data_parallel_rank`: each (topic, rank) is an engine stream of its own,
`kv:collector|TOPIC|dpRANK`, decided by a Recorder of its own (the same per-stream
exactly-once, gap and restart logic as `record --endpoint`) with its own DEALER on the
engine's replay ROUTER. `--engine NAME=REPLAY_ENDPOINT` names that ROUTER for topic NAME;
rank r asks at the endpoint's port + r (ipc/inproc: `_dpR` appended), where vLLM binds
rank r's. An engine not named is recorded without replay: a warning, a count
(`unknown_engines`), and each lost batch journaled as a gap.

Nothing is sent to the engines but replay requests: a slow journal fills the collector's
backlog (decided batches, then each SUB pipe's `--rcvhwm`), past which ZMQ's PUB drops,
which the collector sees as a seq hole (replayed or journaled as a gap); never the engine's wait.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvledger.adapters import kv_events_zmq as z
from kvledger.adapters.kv_events_recorder import Recorder, Summary, Taken, count_skip, stream_id
from kvledger.adapters.kv_events_wire import decode_batch_encoded, seq_bytes, split_live
from kvledger.journal.contract import HeadFacts
from kvledger.journal.port import Journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError, one_line

log = logging.getLogger("kvledger.kv_events")

COLLECTOR = "collector"  # the endpoint part of a collected engine's stream id
MAX_ENGINES = 64  # engine streams (topic, rank) one collector records; a message of one more is skipped
MAX_NAME = 100  # bytes of a topic frame (an engine's name)
UNKNOWN = "no replay endpoint: the engine is not named by --engine"
# the summary fields summed over the engines
SUMMED = ("batches", "events", "replayed", "duplicates", "gaps", "gap_seqs", "restarts", "streams", "received",
          "skipped", "too_large", "cap_gaps", "cap_gap_seqs", "held_batches", "held_bytes")


def replay_endpoint_of(base: str, rank: int | None) -> str:
    """Rank `rank`'s replay endpoint when rank 0's is `base`: vLLM's offset_endpoint_port."""
    if not rank:
        return base
    if base.startswith("tcp://"):
        host, _, port = base.rpartition(":")
        return base if int(port) == 0 else f"{host}:{int(port) + rank}"
    return f"{base}_dp{rank}"


class EngineSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One engine stream's part of a collector's summary."""

    engine: str
    rank: int | None
    stream_id: str
    replay_endpoint: str | None
    batches: int
    events: int
    replayed: int
    duplicates: int
    gaps: int
    gap_seqs: int
    restarts: int
    skipped: int
    cap_gaps: int
    held_bytes_peak: int


class _Engine:
    """An engine stream: its Recorder, and a DEALER on its replay ROUTER (None: unknown)."""

    def __init__(self, name: str, rank: int | None, rec: Recorder, replay: str | None,
                 dealer: zmq.Socket[bytes] | None) -> None:
        self.name, self.rank, self.rec, self.replay, self.dealer = name, rank, rec, replay, dealer
        self.deadline = 0.0
        self.say = z.Say(f"replayed ({name!r} rank {rank})")

    def report(self) -> EngineSummary:
        s = self.rec.summary
        return EngineSummary(engine=self.name, rank=self.rank, stream_id=stream_id(COLLECTOR, self.name, self.rank),
                             replay_endpoint=self.replay, batches=s.batches, events=s.events, replayed=s.replayed,
                             duplicates=s.duplicates, gaps=s.gaps, gap_seqs=s.gap_seqs, restarts=s.restarts,
                             skipped=s.skipped, cap_gaps=s.cap_gaps, held_bytes_peak=s.held_bytes_peak)


class Collector:
    """Every engine's decisions together, as the receiving loop and the committer take
    them from one Recorder (kv_events_zmq.Deciding)."""

    def __init__(self, heads: dict[str, HeadFacts], engines: dict[str, str], options: z.RecordOptions,
                 open_dealer: Callable[[str], zmq.Socket[bytes]]) -> None:
        self.heads, self.replays, self.options, self.open_dealer = heads, engines, options, open_dealer
        self.engines: dict[tuple[str, int | None], _Engine] = {}
        self.summary = Summary()  # the engines' sums, refreshed as they change; and what no engine took
        self.own = Summary()  # messages no engine took (not a batch, one engine too many)

    def resume(self) -> None:
        """Open the named engines recorded before: each asks its replay from its cursor at once."""
        for sid in self.heads:
            name, sep, rank = sid.removeprefix(f"kv:{COLLECTOR}|").rpartition("|dp")
            if sep and sid.startswith(f"kv:{COLLECTOR}|") and name in self.replays:
                self.engine(name, None if rank == "-" else int(rank))
        self._refresh()

    @property
    def ops(self) -> list[Any]:
        return [op for e in self.engines.values() for op in e.rec.ops]

    @property
    def ops_bytes(self) -> int:
        return sum(e.rec.ops_bytes for e in self.engines.values())

    def engine(self, name: str, rank: int | None) -> _Engine:
        """The engine stream (name, rank), opened on its first message."""
        e = self.engines.get((name, rank))
        if e is not None:
            return e
        if len(self.engines) >= MAX_ENGINES:
            raise KvLedgerError(ErrorCode.CAPACITY_EXCEEDED, f"engine {name!r} rank {rank}: a collector records "
                                                             f"at most {MAX_ENGINES} engine streams")
        sid = stream_id(COLLECTOR, name, rank)
        base = self.replays.get(name)
        replay = None if base is None else replay_endpoint_of(base, rank)
        rec = Recorder(COLLECTOR, name, {sid: self.heads[sid]} if sid in self.heads else {},
                       replayable=replay is not None, gap_reason=UNKNOWN, max_held_bytes=self.options.max_held_bytes,
                       frames=3)
        if replay is None:
            self.own.unknown_engines += 1
            log.warning("engine %r (rank %s) is not named by --engine: recorded without replay, each lost batch "
                        "journaled as a gap", one_line(name), rank)
        e = self.engines[(name, rank)] = _Engine(name, rank, rec, replay,
                                                 None if replay is None else self.open_dealer(replay))
        return e

    def live(self, frames: list[bytes]) -> KvLedgerError | None:
        """One message on a bound SUB: routed to its engine by topic and rank, or skipped
        (its coded error returned, and counted)."""
        try:
            if len(frames) != 3:
                raise KvLedgerError(ErrorCode.MALFORMED_EVENT, f"{len(frames)} frames: a collector takes vLLM's "
                                                               "[topic, seq, payload], the topic naming the engine")
            topic, seq, payload = split_live(frames)
            if len(topic) > MAX_NAME:
                raise KvLedgerError(ErrorCode.MALFORMED_EVENT, f"a topic of {len(topic)} bytes, over {MAX_NAME}")
            try:
                name = topic.decode()
            except UnicodeDecodeError:
                raise KvLedgerError(ErrorCode.MALFORMED_EVENT, "a topic that is not UTF-8") from None
            batch = decode_batch_encoded(payload)
            engine = self.engine(name, batch[2])
        except KvLedgerError as exc:
            self.own.received += 1
            return count_skip(self.own, exc)
        error = engine.rec.routed(seq, payload, batch)
        if engine.rec.summary.held_bytes:
            self.within_cap()
        return error

    def replayed(self, engine: _Engine, frames: list[bytes]) -> KvLedgerError | None:
        error = engine.rec.replayed(frames)
        if engine.rec.summary.held_bytes:
            self.within_cap()
        return error

    def within_cap(self) -> None:
        """--max-held-bytes bounds the batches held by all engines together: past it, the
        engine holding most gives up its oldest hole (each Recorder keeps its own within
        it the same way)."""
        cap = self.options.max_held_bytes
        while (held := [e.rec for e in self.engines.values() if e.rec.summary.held_bytes]) and \
                sum(r.summary.held_bytes for r in held) > cap:
            max(held, key=lambda r: r.summary.held_bytes).give_up_oldest()

    def take_group(self, group: int = 256, most_bytes: int | None = None) -> Taken:
        """Every engine's decided writes (up to `most_bytes` of events' bytes), with the
        summary once none is left."""
        ops: list[Any] = []
        oldest = 0
        left = most_bytes
        for e in self.engines.values():
            if not e.rec.ops or (left is not None and left <= 0):
                continue
            before = e.rec.ops_bytes
            taken = e.rec.take_group(group, left)
            if left is not None:
                left -= before - e.rec.ops_bytes
            ops += taken.ops
            if taken.oldest_received_ns and (not oldest or taken.oldest_received_ns < oldest):
                oldest = taken.oldest_received_ns
        self._refresh()
        done = not any(e.rec.ops for e in self.engines.values())
        return Taken(ops, msgspec.structs.replace(self.summary) if done else None, oldest)

    def stop(self) -> None:
        for e in self.engines.values():
            e.rec.stop()
        self._refresh()

    def _refresh(self) -> None:
        """The engines' sums into `summary` (first_message_ns and last_commit_ns are the loop's)."""
        s, own = self.summary, self.own
        recs = [e.rec.summary for e in self.engines.values()]
        for k in SUMMED:
            setattr(s, k, getattr(own, k) + sum(getattr(r, k) for r in recs))
        s.held_bytes_peak = max(s.held_bytes_peak, s.held_bytes, *(r.held_bytes_peak for r in recs))
        s.unknown_engines = own.unknown_engines
        codes = dict(own.skipped_codes)
        for r in recs:
            for code, n in r.skipped_codes.items():
                codes[code] = codes.get(code, 0) + n
        s.skipped_codes = codes

    def report(self) -> list[EngineSummary]:
        return [e.report() for e in self.engines.values()]


class _Loop(z.Loop):
    """A SUB bound on each --bind endpoint, and a DEALER per known engine."""

    def __init__(self, collector: Collector, binds: list[str], rcvhwm: int) -> None:
        super().__init__(collector)
        self.col, self.rcvhwm = collector, rcvhwm
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, rcvhwm)  # per connected engine: each pipe has its own
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.poller.register(self.sub, zmq.POLLIN)
        self.say_live = z.Say("live")
        self.dealers: dict[zmq.Socket[bytes], _Engine] = {}
        try:
            for b in binds:
                self.sub.bind(b)
        except zmq.ZMQError as exc:
            self.close()
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"cannot bind {b}: {exc}") from None

    def dealer(self, endpoint: str) -> zmq.Socket[bytes]:
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, self.rcvhwm)
        d.connect(endpoint)
        self.poller.register(d, zmq.POLLIN)
        return d

    def close(self) -> None:
        for s in [self.sub, *self.col_dealers()]:
            s.close(0)
        self.ctx.term()

    def col_dealers(self) -> list[zmq.Socket[bytes]]:
        return [e.dealer for e in self.col.engines.values() if e.dealer is not None]

    def ask_replay(self, now: float) -> None:
        for e in self.col.engines.values():
            rec = e.rec
            if e.dealer is None:
                continue
            if rec.replay_wanted is not None and not rec.replay_pending:
                e.dealer.send_multipart([b"", seq_bytes(rec.replay_wanted)])
                rec.replay_sent()
                e.deadline = now + z.REPLAY_TIMEOUT_S
            elif rec.replay_pending and now > e.deadline:
                rec.replay_done("the replay socket sent no end marker in time")

    def receive(self) -> int:
        now = time.monotonic()
        # decided batches wait for the committer: look again soon (kv_events_zmq._Loop.receive)
        ready = dict(self.poller.poll(1 if any(e.rec.ops for e in self.col.engines.values()) else 100))
        got = 0
        if self.sub in ready:
            got += z.receive_messages(self.sub, self.col.live, self.say_live)
        for e in list(self.col.engines.values()):
            if e.dealer is not None and e.dealer in ready:
                got += z.receive_messages(e.dealer, functools.partial(self.col.replayed, e), e.say)
                e.deadline = now + z.REPLAY_TIMEOUT_S
        self.col._refresh()
        return got


def collect(journal: Journal, binds: list[str], engines: dict[str, str], options: z.RecordOptions | None = None, *,
            stop: z.Stop | None = None, progress: Callable[[Summary], None] | None = None,
            watch: Callable[[z.Deciding, z.Committed], None] | None = None) -> tuple[Summary, list[EngineSummary]]:
    """Collect until `stop` (or `options.idle_exit` seconds without a message); the
    summary (summed over the engines) and each engine's."""
    options = options or z.RecordOptions()
    heads = {sid: h for sid, h in journal.heads().items() if sid.startswith(f"kv:{COLLECTOR}|")}
    holder: dict[str, _Loop] = {}
    collector = Collector(heads, engines, options, lambda ep: holder["loop"].dealer(ep))
    loop = holder["loop"] = _Loop(collector, binds, options.rcvhwm)
    collector.resume()
    z.drive(journal, loop, options.idle_exit, stop=stop or z.Stop(), progress=progress, watch=watch)
    return collector.summary, collector.report()
