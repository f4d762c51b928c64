"""kvledger kv-events record against the reference publisher (tests/kv_publisher.py):
2,000 batches of random stores and removes in each case, the journal holding every
published seq exactly once with the published events (issue 21)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("zmq")

from kvledger.adapters import kv_events_zmq as z
from kvledger.journal import open_journal
from kvledger.migrations.storage import init_database
from kvledger.schemas import events as ev

from kv_publisher import Publisher, Workload, model_resident, normalized

N = 2000


def _db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    init_database(url)
    return url


@contextlib.contextmanager
def _recording(url: str, dialect: str, **kw: Any) -> Iterator[tuple[Publisher, dict[str, Any]]]:
    """A reference publisher and an in-process recorder on it (stopped, then the
    publisher closed, on exit); the dict gets the recorder's summary."""
    pub = Publisher(dialect, **kw)
    stop = z.Stop()
    out: dict[str, Any] = {}

    def run() -> None:
        with open_journal(url) as j:
            out["summary"] = z.record(j, pub.endpoint, replay_endpoint=pub.replay_endpoint,
                                      topic=pub.topic.decode(), stop=stop)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.3)  # the SUB connects (a slow joiner's first batches come by replay anyway)
    try:
        yield pub, out
    finally:
        stop()
        t.join(30)
        pub.close()


def _kv_events(url: str) -> list[Any]:
    with open_journal(url) as j:
        return [e for e in j.read_all() if isinstance(e, ev.KV_EVENT_CLASSES)]


def _wait_for(url: str, batches: int, timeout: float = 60, *, last: int | None = None) -> list[Any]:
    """The journal's KV events once it holds `batches` batches (or the batch of seq `last`)."""
    deadline = time.monotonic() + timeout
    while True:
        got = _kv_events(url)
        done = (any(isinstance(e, ev.KvEventsBatchEvent) and e.payload.seq == last for e in got) if last is not None
                else sum(isinstance(e, ev.KvEventsBatchEvent) for e in got) >= batches)
        if done or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _check_exactly_once(got: list[Any], published: dict[tuple[int, int], list[Any]],
                        missing: set[tuple[int, int]] = frozenset()) -> None:  # type: ignore[assignment]
    seen = [(e.payload.epoch, e.payload.seq) for e in got if isinstance(e, ev.KvEventsBatchEvent)]
    assert len(seen) == len(set(seen)), "a seq was journaled twice"
    assert set(seen) == set(published) - set(missing)
    for e in got:
        if isinstance(e, ev.KvEventsBatchEvent):
            journaled = msgspec.json.decode(msgspec.json.encode(e.payload.events))
            assert journaled == normalized(published[(e.payload.epoch, e.payload.seq)])


def _publish(pub: Publisher, w: Workload, n: int, published: dict[tuple[int, int], list[Any]], *,
             drop: set[int] = frozenset(), pace: int = 200) -> None:  # type: ignore[assignment]
    for i in range(n):
        events = w.batch()
        seq = pub.publish(events, drop=i in drop)
        published[(pub.epoch, seq)] = events
        if i % pace == pace - 1:
            time.sleep(0.01)


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_dropped_batches_are_replayed_and_journaled_once(tmp_path, dialect):
    url = _db(tmp_path)
    published: dict[tuple[int, int], list[Any]] = {}
    drop = set(range(100, N, 37)) | set(range(500, 540))
    with _recording(url, dialect) as (pub, out):
        _publish(pub, Workload(1), N, published, drop=drop)
        got = _wait_for(url, N)
    _check_exactly_once(got, published)
    assert not [e for e in got if not isinstance(e, ev.KvEventsBatchEvent)], "no gap, no restart"
    s = out["summary"]
    assert s.replayed >= len(drop) and s.gaps == 0 and s.restarts == 0
    replayed = {e.payload.seq for e in got if e.payload.replayed}
    assert drop <= replayed


def test_publisher_restart_is_journaled_and_clears_the_pool(tmp_path):
    from kvledger.replay import replay_journal
    from kvledger.replay.metrics import WindowSpec

    url = _db(tmp_path)
    published: dict[tuple[int, int], list[Any]] = {}
    with _recording(url, "vllm") as (pub, _):
        _publish(pub, Workload(2, clears=False), N // 2, published)
        _wait_for(url, N // 2)
        pub.restart()
        _publish(pub, Workload(3, clears=False), N // 2, published)
        got = _wait_for(url, N)
    _check_exactly_once(got, published)
    restarts = [e for e in got if isinstance(e, ev.KvEventsRestartEvent)]
    assert len(restarts) == 1
    r = restarts[0].payload
    assert (r.epoch, r.previous_seq, r.first_seq) == (1, N // 2 - 1, 0)
    # At the restart the stream's pool is empty; at the end it holds only epoch 1's blocks.
    with open_journal(url) as j:
        window = WindowSpec(slo_ttft_ns=1, slo_tbt_ns=1)
        at_restart = replay_journal(j, window, at=restarts[0].global_position)
        end = replay_journal(j, window)
    assert at_restart.kv_blocks is not None
    assert all(p.resident_blocks == 0 for p in at_restart.kv_blocks[0].pools.values())
    model = model_resident([published[(1, s)] for s in range(N // 2)])
    assert end.kv_blocks is not None
    assert {k.split("/")[0]: p.resident_blocks for k, p in end.kv_blocks[0].pools.items() if p.resident_blocks} \
        == {m: len(s) for m, s in model.items()}


def test_evicted_batches_are_one_gap_with_the_exact_range(tmp_path):
    url = _db(tmp_path)
    published: dict[tuple[int, int], list[Any]] = {}
    lost = set(range(700, 1100))  # 400 not sent live; the ring keeps only the last 200
    with _recording(url, "vllm", buffer_steps=200) as (pub, _):
        _publish(pub, Workload(4), N, published, drop=lost, pace=N)  # no pause: the ring moves on at once
        got = _wait_for(url, 0, timeout=30, last=N - 1)
        replays = list(pub.replays)
    gaps = [e.payload for e in got if isinstance(e, ev.KvEventsGapEvent)]
    assert len(gaps) == 1
    g = gaps[0]
    # The replay asked from 700 got what the ring still had: from its first seq on.
    served = [first for start, first in replays if start == 700]
    assert served and served[0] is not None
    assert (g.epoch, g.first_seq, g.last_seq) == (0, 700, served[0] - 1)
    _check_exactly_once(got, published, missing={(0, s) for s in range(700, served[0])})


def _record_cli(url: str, pub: Publisher, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvledger", "kv-events", "record", "--endpoint", pub.endpoint,
         "--replay-endpoint", pub.replay_endpoint, "--topic", pub.topic.decode(), "--db", url, "--json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "KVLEDGER_LOG": "warning"})


def test_sigkill_mid_run_then_restart_catches_up_by_replay(tmp_path):
    url = _db(tmp_path)
    pub = Publisher("vllm")
    published: dict[tuple[int, int], list[Any]] = {}
    w = Workload(5)
    try:
        rec = _record_cli(url, pub)
        time.sleep(1.5)  # the CLI starts and connects
        _publish(pub, w, 800, published, pace=50)
        mid = _wait_for(url, 300)
        rec.send_signal(signal.SIGKILL)
        rec.wait(10)
        before = {(e.payload.epoch, e.payload.seq) for e in mid if isinstance(e, ev.KvEventsBatchEvent)}
        assert 0 < len(before)
        _publish(pub, w, 700, published)  # published while no recorder runs: only the ring has them
        rec = _record_cli(url, pub, "--idle-exit", "2")
        time.sleep(1.5)
        _publish(pub, w, N - 1500, published, pace=50)
        out, err = rec.communicate(timeout=120)
    finally:
        pub.close()
    assert rec.returncode == 0, err.decode()
    got = _kv_events(url)
    _check_exactly_once(got, published)
    summary = msgspec.json.decode(out.splitlines()[-1])
    assert summary["replayed"] >= 700 and summary["gaps"] == 0 and summary["restarts"] == 0
