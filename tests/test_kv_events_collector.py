"""`kv-events record --bind`: one collector bound on a port, engines in vLLM's wire form
connecting to it (issue 46 item 3). vLLM's own ZmqEventPublisher (tests/vllm_oracle.py,
a process of its own) restarts; two reference publishers (tests/kv_publisher.py, which
can drop a batch on purpose) connect too: one drops a range its replay then serves, one
is evicted past its replay buffer; a fourth, not named by --engine, is recorded without
replay. The exported journal holds every batch of every engine once, with the gap and
the restart journaled; on both backends."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("zmq")

from kvledger.adapters import kv_events_zmq as z
from kvledger.adapters.kv_events_collector import UNKNOWN, collect, replay_endpoint_of
from kvledger.adapters.kv_events_metrics import RecorderMetrics
from kvledger.adapters.kv_events_recorder import stream_id
from kvledger.cli import main
from kvledger.journal import open_journal
from kvledger.replay.sources import jsonl_events
from kvledger.schemas import events as ev

from kv_publisher import Publisher, Wiring, Workload, normalized
from kv_recording import VllmOracle, await_true, free_port

HERE = Path(__file__).resolve().parent
TIMEOUT = 60.0
pytestmark = pytest.mark.nats_case("the recorder on a NATS cell, its gap and restart: tests/test_nats_kv_events.py")


def sid(name: str, rank: int = 0) -> str:
    return stream_id("collector", name, rank)


def batches(url: str, name: str, rank: int = 0) -> list[Any]:
    with open_journal(url) as j:
        return [e for e in j.read_stream(sid(name, rank)) if isinstance(e, ev.KvEventsBatchEvent)] \
            if sid(name, rank) in j.heads() else []


def has(url: str, name: str, epoch: int, seq: int, rank: int = 0) -> Callable[[], bool]:
    return lambda: any((e.payload.epoch, e.payload.seq) == (epoch, seq) for e in batches(url, name, rank))


class HeldJournal:
    """The real journal, whose appends wait while `open` is clear: a journal far slower than the engines."""

    def __init__(self, journal: Any, open_: threading.Event) -> None:
        self.journal, self.open = journal, open_

    def append(self, ops: Any) -> Any:
        assert self.open.wait(TIMEOUT)
        return self.journal.append(ops)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.journal, name)


@contextlib.contextmanager
def collecting(url: str, binds: list[str], engines: dict[str, str], options: z.RecordOptions | None = None,
               gate: threading.Event | None = None, watch: Any = None) -> Iterator[dict[str, Any]]:
    stop = z.Stop()
    out: dict[str, Any] = {}

    def run() -> None:
        with open_journal(url) as j:
            try:
                journal = j if gate is None else HeldJournal(j, gate)
                out["summary"], out["engines"] = collect(journal, binds, engines, options, stop=stop, watch=watch)
            except BaseException as exc:  # noqa: BLE001 - handed to the test, which raises it
                out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop()
        t.join(60)
        if "error" in out:
            raise out["error"]


def joined(url: str, name: str, publish: Callable[[], Any], epoch: int = 0, rank: int = 0) -> None:
    """Publish one batch at a time until the collector journals one of this epoch: the
    engine's PUB has connected and the collector's subscription reached it (the batches
    before it were dropped by the PUB, and come back by replay)."""
    def one() -> bool:
        publish()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if any(e.payload.epoch == epoch for e in batches(url, name, rank)):
                return True
            time.sleep(0.05)
        return False
    await_true(f"{name} joining", one)


def settled(url: str, name: str, publish: Callable[[], int]) -> int:
    """Publish one batch at a time until the one just published is journaled; its seq."""
    last = -1

    def one() -> bool:
        nonlocal last
        last = publish()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if has(url, name, 0, last)():
                return True
            time.sleep(0.05)
        return False
    await_true(f"{name} settling", one)
    return last


@pytest.mark.sqlite_case("the collector is above the journal's port: its writes are the recorder's, on every backend")
def test_one_collector_records_three_engines_exactly_once(db_url, tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (.ci/run installs vllm==0.33.0 --no-deps for this test)")
    port, vllm_replay = free_port(), f"tcp://127.0.0.1:{free_port()}"
    at = f"tcp://127.0.0.1:{port}"  # where the engines connect; the collector binds every interface
    dropper = Publisher("vllm", topic="drop", wiring=Wiring(connect=at))
    evicted = Publisher("vllm", topic="evict", buffer_steps=20, wiring=Wiring(connect=at))
    stranger = Publisher("vllm", topic="stranger", wiring=Wiring(connect=at))
    published: dict[str, dict[tuple[int, int], list[Any]]] = {"drop": {}, "evict": {}, "stranger": {}}
    w = Workload(46)

    def pub(p: Publisher, *, drop: bool = False) -> int:
        events = w.batch()
        seq = p.publish(events, drop=drop)
        published[p.topic.decode()][(p.epoch, seq)] = events
        return seq

    engines = {"drop": dropper.replay_endpoint, "evict": evicted.replay_endpoint, "vllm": vllm_replay}
    oracle = None
    try:
        with collecting(db_url, [f"tcp://*:{port}"], engines) as out:
            # vLLM's publisher, epoch 0: joins, then 30 more; all journaled
            oracle = VllmOracle(at, vllm_replay, "vllm")
            ready = oracle.answer()
            if "skip" in ready:
                pytest.skip(ready["skip"])
            sent = 0

            def vllm_one() -> None:
                nonlocal sent
                oracle.ask(f"publish 1 {sent}")
                sent += 1
            joined(db_url, "vllm", vllm_one)
            oracle.ask("publish 30 7")
            first_run = sent + 30
            await_true("vLLM epoch 0", has(db_url, "vllm", 0, first_run - 1))

            # the dropper: 40 batches lost on the way, which its replay serves
            joined(db_url, "drop", lambda: pub(dropper))
            for i in range(80):
                last = pub(dropper, drop=20 <= i < 60)
            await_true("the dropper's last batch", has(db_url, "drop", 0, last))

            # evicted: 40 lost, and its buffer keeps only the last 20
            joined(db_url, "evict", lambda: pub(evicted))
            # a new engine asks a replay from seq 0 at once: answered after the drops began,
            # it would bring the first of them (seen in CI as a gap one seq short)
            await_true("the evicted engine's first replay", lambda: bool(evicted.replays))
            lost_from = evicted.seq
            for _ in range(40):
                pub(evicted, drop=True)
            live = pub(evicted)
            await_true("the evicted engine's batch after the hole", has(db_url, "evict", 0, live))
            for _ in range(5):
                last_evicted = pub(evicted)
            await_true("the evicted engine's last batch", has(db_url, "evict", 0, last_evicted))

            # not named by --engine: a lost batch is a gap at once
            joined(db_url, "stranger", lambda: pub(stranger))
            pub(stranger, drop=True)
            last_stranger = pub(stranger)
            await_true("the stranger's last batch", has(db_url, "stranger", 0, last_stranger))

            # vLLM's publisher restarts: a new process, seq from 0
            oracle.close()
            oracle = VllmOracle(at, vllm_replay, "vllm")
            assert oracle.answer()["ready"]
            sent = 0
            joined(db_url, "vllm", vllm_one, epoch=1)
            oracle.ask("publish 20 8")
            second_run = sent + 20
            await_true("vLLM epoch 1", has(db_url, "vllm", 1, second_run - 1))
    finally:
        if oracle is not None:
            oracle.close()
        for p in (dropper, evicted, stranger):
            p.close()

    audit = tmp_path / "audit.jsonl"
    assert main(["export", "--db", db_url, "--out", str(audit)]) == 0
    assert main(["verify", "--db", db_url, "--json"]) == 0
    exported = [e for e in jsonl_events(audit) if isinstance(e, ev.KV_EVENT_CLASSES)]
    by_stream: dict[str, list[Any]] = {}
    for e in exported:
        by_stream.setdefault(e.stream_id, []).append(e)
    assert set(by_stream) == {sid(n) for n in ("drop", "evict", "stranger", "vllm")}

    def kinds(name: str, cls: type) -> list[Any]:
        return [e.payload for e in by_stream[sid(name)] if isinstance(e, cls)]

    def seqs(name: str) -> list[tuple[int, int]]:
        return [(b.epoch, b.seq) for b in kinds(name, ev.KvEventsBatchEvent)]

    # vLLM's engine: every batch of both runs once, the restart journaled between them
    assert sorted(seqs("vllm")) == [(0, s) for s in range(first_run)] + [(1, s) for s in range(second_run)]
    assert len(set(seqs("vllm"))) == len(seqs("vllm"))
    (restart,) = kinds("vllm", ev.KvEventsRestartEvent)
    assert (restart.epoch, restart.previous_seq) == (1, first_run - 1)
    assert not kinds("vllm", ev.KvEventsGapEvent)

    # the dropper: everything, the lost range from its replay, no gap
    got = {(b.epoch, b.seq): b for b in kinds("drop", ev.KvEventsBatchEvent)}
    assert sorted(got) == sorted(published["drop"]) and len(got) == len(seqs("drop"))
    for key, b in got.items():
        assert msgspec.json.decode(msgspec.json.encode(b.events)) == normalized(published["drop"][key])
    assert all(got[(0, s)].replayed for s in range(dropper.seq - 60, dropper.seq - 20))
    assert not kinds("drop", ev.KvEventsGapEvent) and not kinds("drop", ev.KvEventsRestartEvent)

    # evicted: the 21 seqs its buffer no longer had are one gap; the rest once
    (gap,) = kinds("evict", ev.KvEventsGapEvent)
    assert (gap.first_seq, gap.last_seq) == (lost_from, lost_from + 20) and "evicted" in gap.reason
    missing = {(0, s) for s in range(lost_from, lost_from + 21)}
    got = {(b.epoch, b.seq): b for b in kinds("evict", ev.KvEventsBatchEvent)}
    assert sorted(got) == sorted(set(published["evict"]) - missing) and len(got) == len(seqs("evict"))
    for key, b in got.items():
        assert msgspec.json.decode(msgspec.json.encode(b.events)) == normalized(published["evict"][key])

    # the stranger: recorded without replay, its lost batch a gap saying why
    gaps = kinds("stranger", ev.KvEventsGapEvent)
    assert gaps[-1].reason == UNKNOWN and (gaps[-1].first_seq, gaps[-1].last_seq) == (last_stranger - 1,) * 2
    gap_seqs = {(0, s) for g in gaps for s in range(g.first_seq, g.last_seq + 1)}
    assert sorted(seqs("stranger")) == sorted(set(published["stranger"]) - gap_seqs)

    summary = out["summary"]
    assert summary.restarts == 1 and summary.unknown_engines == 1 and summary.streams == 4
    report = {e.engine: e for e in out["engines"]}
    assert report["stranger"].replay_endpoint is None and report["drop"].replay_endpoint == dropper.replay_endpoint
    assert report["drop"].replayed >= 40 and report["evict"].gaps == 1 and report["vllm"].restarts == 1


def test_replay_endpoints_follow_vllms_rank_offset():
    assert replay_endpoint_of("tcp://engine:5558", 0) == "tcp://engine:5558"
    assert replay_endpoint_of("tcp://engine:5558", 3) == "tcp://engine:5561"
    assert replay_endpoint_of("tcp://[::1]:5558", 1) == "tcp://[::1]:5559"
    assert replay_endpoint_of("ipc:///tmp/r", 2) == "ipc:///tmp/r_dp2"
    assert replay_endpoint_of("tcp://engine:5558", None) == "tcp://engine:5558"


def test_a_slow_journal_never_holds_an_engine_back(db_url):
    """While the journal takes nothing, an engine publishes 3,000 batches without waiting
    (its PUB drops past its queue, ours stops reading past --rcvhwm); once the journal
    moves, every batch is journaled once, the lost ones by replay, and the backlog that
    waited is bounded and reported."""
    port = free_port()
    engine = Publisher("vllm", topic="kv", sndhwm=50, buffer_steps=20_000,
                       wiring=Wiring(connect=f"tcp://127.0.0.1:{port}"))
    published: dict[tuple[int, int], list[Any]] = {}
    w = Workload(3)

    def pub() -> int:
        events = w.batch()
        seq = engine.publish(events)
        published[(engine.epoch, seq)] = events
        return seq

    gate = threading.Event()
    gate.set()
    try:
        with collecting(db_url, [f"tcp://127.0.0.1:{port}"], {"kv": engine.replay_endpoint},
                        z.RecordOptions(rcvhwm=20), gate) as out:
            joined(db_url, "kv", pub)
            gate.clear()  # the journal stops
            for _ in range(3_000):  # past both queues (50 + 20) many times over
                pub()  # returns at once: nothing waits for the journal
            gate.set()
            # a tail the PUB dropped shows only at the next batch, as with a live engine: publish on until one lands
            last = settled(db_url, "kv", pub)
    finally:
        engine.close()
    got = {(b.payload.epoch, b.payload.seq) for b in batches(db_url, "kv")}
    assert got == set(published) and len(batches(db_url, "kv")) == len(published) and max(got) == (0, last)
    s = out["summary"]
    assert s.gaps == 0 and 0 < s.backlog_peak <= z.FLUSH_OPS + z.RECEIVE_MOST
    assert s.replayed > 0  # batches were dropped on the way: the replay brought them
    assert main(["verify", "--db", db_url, "--json"]) == 0


def test_a_restarted_collector_asks_each_named_engine_from_its_cursor(db_url):
    port = free_port()
    at = f"tcp://127.0.0.1:{port}"
    engine = Publisher("vllm", topic="kv", wiring=Wiring(connect=at))
    w = Workload(4)
    try:
        with collecting(db_url, [at], {"kv": engine.replay_endpoint}):
            joined(db_url, "kv", lambda: engine.publish(w.batch()))
            for _ in range(10):
                first = engine.publish(w.batch())
            await_true("the first run's last batch", has(db_url, "kv", 0, first))
        asked = len(engine.replays)
        for _ in range(15):  # while no collector runs
            last = engine.publish(w.batch())
        metrics = RecorderMetrics()
        with collecting(db_url, [at], {"kv": engine.replay_endpoint}, watch=metrics.watch) as out:
            await_true("the batches published while it was down", has(db_url, "kv", 0, last))
    finally:
        engine.close()
    assert sorted(b.payload.seq for b in batches(db_url, "kv")) == list(range(last + 1))
    (report,) = out["engines"]
    assert report.engine == "kv" and report.batches == 15 and report.gaps == 0 and report.restarts == 0
    assert engine.replays[asked][0] == first + 1  # its first request: from the journal's cursor, at once
    scraped = {m.name: m.samples[0].value for m in metrics.collect()}  # /metrics reads the collector's sums
    assert scraped["kvledger_kv_events_batches"] == 15 and scraped["kvledger_kv_events_streams"] == 1
    assert scraped["kvledger_kv_events_gaps"] == 0 and scraped["kvledger_kv_events_last_committed_seq"] == -1


def free_port_run(n: int) -> int:
    """A port P with P + 1 ... P + n - 1 free too (vLLM puts rank r at the configured port
    + r). One run for every port a test needs: two runs asked for one after the other can
    overlap (a second P at the first P + 1), which once failed a bind."""
    import socket

    for _ in range(100):
        p = free_port()
        with contextlib.ExitStack() as held:
            try:
                for k in range(1, n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", p + k))
            except OSError:
                continue
        return p
    raise AssertionError(f"no {n} consecutive free ports")


def test_data_parallel_ranks_are_streams_of_their_own(db_url):
    """One engine with two data-parallel ranks, as vLLM runs them: rank r connects to the
    collector's port + r and binds its replay at the configured replay port + r. Both
    ranks publish the same seqs on the same topic; rank 1 loses a range its own replay
    socket serves."""
    sub = free_port_run(4)
    replay = sub + 2
    ranks = [Publisher("vllm", topic="kv", rank=r,
                       wiring=Wiring(f"tcp://127.0.0.1:{sub + r}", f"tcp://127.0.0.1:{replay + r}")) for r in (0, 1)]
    published: dict[int, dict[tuple[int, int], list[Any]]] = {0: {}, 1: {}}
    w = Workload(5)

    def pub(r: int, drop: bool = False) -> int:
        events = w.batch()
        seq = ranks[r].publish(events, drop=drop)
        published[r][(0, seq)] = events
        return seq

    binds = [f"tcp://127.0.0.1:{sub}", f"tcp://127.0.0.1:{sub + 1}"]
    try:
        with collecting(db_url, binds, {"kv": f"tcp://127.0.0.1:{replay}"}) as out:
            for r in (0, 1):
                joined(db_url, "kv", lambda r=r: pub(r), rank=r)
            for i in range(30):
                last0, last1 = pub(0), pub(1, drop=10 <= i < 20)
            await_true("rank 0's last batch", has(db_url, "kv", 0, last0, rank=0))
            await_true("rank 1's last batch", has(db_url, "kv", 0, last1, rank=1))
    finally:
        for p in ranks:
            p.close()
    for r in (0, 1):
        got = batches(db_url, "kv", r)
        assert sorted((b.payload.epoch, b.payload.seq) for b in got) == sorted(published[r])
        assert all(b.payload.data_parallel_rank == r for b in got)
    assert ranks[1].replays and not any(start > 0 for start, _ in ranks[0].replays)  # rank 1's own replay served it
    report = {e.rank: e for e in out["engines"]}
    assert report[1].replay_endpoint == f"tcp://127.0.0.1:{replay + 1}" and report[1].replayed >= 10
    assert out["summary"].gaps == 0 and out["summary"].streams == 2
