"""Helpers of the KV-event recorder's tests: a journal, the reference publisher with an
in-process recorder on it, the CLI recorder as a process, and checks of what the
journal holds."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from kvledger.adapters import kv_events_zmq as z
from kvledger.journal import open_journal
from kvledger.migrations.storage import init_database
from kvledger.schemas import events as ev

from kv_publisher import Publisher, Workload, normalized


def new_db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    init_database(url)
    return url


@contextlib.contextmanager
def recording(url: str, dialect: str, *, record: dict[str, Any] | None = None,
              **kw: Any) -> Iterator[tuple[Publisher, dict[str, Any]]]:
    """A reference publisher and an in-process recorder on it (stopped, then the
    publisher closed, on exit); the dict gets the recorder's summary (or its error).
    `record`: more fields of kv_events_zmq.RecordOptions."""
    pub = Publisher(dialect, **kw)
    stop = z.Stop()
    out: dict[str, Any] = {}

    def run() -> None:
        with open_journal(url) as j:
            try:
                options = z.RecordOptions(**{"replay_endpoint": pub.replay_endpoint, "topic": pub.topic.decode(),
                                             **(record or {})})
                out["summary"] = z.record(j, pub.endpoint, options, stop=stop)
            except BaseException as exc:  # noqa: BLE001 - handed to the test, which asserts on it
                out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.3)  # the SUB connects (a slow joiner's first batches come by replay anyway)
    try:
        yield pub, out
    finally:
        stop()
        t.join(30)
        pub.close()


def stream_events(url: str) -> list[Any]:
    with open_journal(url) as j:
        return [e for e in j.read_all() if isinstance(e, ev.KV_EVENT_CLASSES)]


def wait_for(url: str, batches: int, timeout: float = 60, *, last: tuple[int, int] | None = None) -> list[Any]:
    """The journal's KV events once it holds `batches` batches (or the batch (epoch, seq) `last`)."""
    deadline = time.monotonic() + timeout
    while True:
        got = stream_events(url)
        done = (any(isinstance(e, ev.KvEventsBatchEvent) and (e.payload.epoch, e.payload.seq) == last for e in got)
                if last is not None
                else sum(isinstance(e, ev.KvEventsBatchEvent) for e in got) >= batches)
        if done or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def check_exactly_once(got: list[Any], published: dict[tuple[int, int], list[Any]],
                        missing: set[tuple[int, int]] = frozenset()) -> None:  # type: ignore[assignment]
    seen = [(e.payload.epoch, e.payload.seq) for e in got if isinstance(e, ev.KvEventsBatchEvent)]
    assert len(seen) == len(set(seen)), "a seq was journaled twice"
    assert set(seen) == set(published) - set(missing)
    for e in got:
        if isinstance(e, ev.KvEventsBatchEvent):
            journaled = msgspec.json.decode(msgspec.json.encode(e.payload.events))
            assert journaled == normalized(published[(e.payload.epoch, e.payload.seq)])


def publish_batches(pub: Publisher, w: Workload, n: int, published: dict[tuple[int, int], list[Any]], *,
             drop: set[int] = frozenset(), pace: int = 200) -> None:  # type: ignore[assignment]
    for i in range(n):
        events = w.batch()
        seq = pub.publish(events, drop=i in drop)
        published[(pub.epoch, seq)] = events
        if i % pace == pace - 1:
            time.sleep(0.01)


def record_cli(url: str, pub: Publisher | None, *extra: str, endpoint: str | None = None,
               topic: str | None = None) -> subprocess.Popen[bytes]:
    """`kvledger kv-events record` as a process, on `pub` (its endpoints and topic) or on
    `endpoint` with no replay socket; `topic` in place of the publisher's."""
    where = ["--endpoint", endpoint] if pub is None else \
        ["--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint]
    topic = topic if topic is not None else "" if pub is None else pub.topic.decode()
    return subprocess.Popen(
        [sys.executable, "-m", "kvledger", "kv-events", "record", *where, "--topic", topic, "--db", url, "--json",
         *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "KVLEDGER_LOG": "warning"})


def verify_clean(url: str) -> None:
    from kvledger.cli import main

    assert main(["verify", "--db", url, "--json"]) == 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])




def await_true(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll `check` (the journal, or a process's answer) until it holds: the event a test waits for."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class VllmOracle:
    """tests/vllm_oracle.py as a process: vLLM's own ZmqEventPublisher on `pub` (bound
    for tcp://*:P, connected when it names a host) with its replay ROUTER on `replay`."""

    def __init__(self, pub: str, replay: str, topic: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "vllm_oracle.py"), pub,
                                      replay, topic], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def answer(self, timeout: float = 300) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the vLLM oracle exited ({self.proc.wait()})")
            if line.startswith("ORACLE "):
                doc: dict[str, Any] = json.loads(line[7:])
                return doc
        raise AssertionError("the vLLM oracle did not answer")

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
