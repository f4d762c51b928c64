"""`kvledger kv-events serve` under load and hostile requests (issue 44): a client that
sends many replay requests and never reads is refused past its bound (CAPACITY_EXCEEDED,
in its turn) while another client is served in full; a client that goes away takes its
replies with it; replies are read from the journal a page at a time and are the same
whatever the page; and over arbitrary request frames every reply is well formed or a
coded ERROR, never an exception."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("zmq")

import zmq

from kvledger.adapters import kv_events_serve as s
from kvledger.adapters.kv_events_wire import decode_batch, encode_batch
from kvledger.adapters.kv_events_zmq import Stop
from kvledger.cli import main
from kvledger.journal import open_journal
from kvledger.schemas import events as ev
from kvledger.schemas.errors import ErrorCode

END = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


def _line(seq: int, n_events: int = 1) -> str:
    events = [{"type": "BlockStored", "block_hashes": [f"{seq:08x}{i:04x}"], "parent_block_hash": None,
               "token_ids": list(range(16)), "block_size": 16, "medium": "GPU"} for i in range(n_events)]
    return json.dumps({"seq": seq, "ts": 1000.0 + seq, "events": events, "data_parallel_rank": 0})


def _import(url: str, tmp: Path, name: str, seqs: list[int], n_events: int = 1) -> None:
    f = tmp / f"{name}.jsonl"
    f.write_text("".join(_line(q, n_events) + "\n" for q in seqs))
    assert main(["kv-events", "import", str(f), "--dialect", "vllm", "--stream", name, "--db", url]) == 0


def _expected(url: str, sid: str, start: int) -> list[list[bytes]]:
    """The reply a replay from `start` must be: the latest epoch's batches with seq >= start."""
    with open_journal(url) as j:
        events = j.read_stream(sid)
    restarts = [i for i, e in enumerate(events) if isinstance(e, ev.KvEventsRestartEvent)]
    epoch = events[restarts[-1] + 1:] if restarts else events
    topic = s.topic_of(sid)
    return [[b"", topic, e.payload.seq.to_bytes(8, "big"), encode_batch(e.payload.ts, e.payload.events, 0)]
            for e in epoch if isinstance(e, ev.KvEventsBatchEvent) and e.payload.seq >= start] + [END]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Serving:
    """`serve` on a thread of its own (its own journal connection), real sockets."""

    def __init__(self, url: str) -> None:
        self.bind = f"tcp://127.0.0.1:{_free_port()}"
        self.stop = Stop()
        self.served: s.Served | None = None
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()

    def _run(self, url: str) -> None:
        with open_journal(url) as j:
            self.served = s.serve(j, self.bind, stop=self.stop)

    def close(self) -> s.Served:
        self.stop()
        self.thread.join(30)
        assert self.served is not None
        return self.served


def _dealer(ctx: zmq.Context[Any], bind: str, **opts: int) -> zmq.Socket[bytes]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    for k, v in opts.items():
        d.setsockopt(getattr(zmq, k), v)
    d.connect(bind)
    return d


def _replies(d: zmq.Socket[bytes], count: int, timeout_s: float = 60) -> Iterator[list[list[bytes]]]:
    """`count` replies, each its messages up to its end marker, SNAPSHOT or ERROR."""
    deadline = time.monotonic() + timeout_s
    for _ in range(count):
        reply = []
        while True:
            assert d.poll(max(1, int((deadline - time.monotonic()) * 1000))), "the reply stopped"
            reply.append(d.recv_multipart())
            if reply[-1] == END or reply[-1][1] in (s.SNAPSHOT, s.ERROR):
                break
        yield reply


def test_a_client_that_never_reads_is_refused_past_its_bound_and_others_are_served(tmp_path):
    """300 replay requests from a DEALER that does not read (its receive buffers at their
    smallest): at most MAX_PENDING are in progress, the rest are answered CAPACITY_EXCEEDED
    in their turn; meanwhile another client gets its whole replay. Before, every reply
    was queued whole (SNDHWM=0) and none refused."""
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    _import(url, tmp_path, "big", list(range(200)), n_events=64)  # ~7 KB a batch, 1.4 MB a replay
    with open_journal(url) as j:
        (sid,) = j.heads()
    want = _expected(url, sid, 0)
    server = _Serving(url)
    ctx = zmq.Context()
    try:
        hostile = _dealer(ctx, server.bind, RCVHWM=1, RCVBUF=4096)
        for _ in range(300):
            hostile.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(1.0)  # the flood is in; the hostile client's queue is full
        other = _dealer(ctx, server.bind)
        other.send_multipart([b"", (150).to_bytes(8, "big")])
        (got,) = _replies(other, 1, timeout_s=20)
        assert got == [m for m in want if m is END or int.from_bytes(m[2], "big") >= 150]
        replies = list(_replies(hostile, 300))  # now it reads: every request has its reply, in order
        full = [r for r in replies if r == want]
        refused = [r for r in replies if r != want]
        assert len(refused) >= 250 and len(full) >= s.MAX_PENDING, (len(full), len(refused))
        assert all(len(r) == 1 and r[0][1] == s.ERROR and r[0][2].startswith(b"CAPACITY_EXCEEDED: ") for r in refused)
        assert replies[:s.MAX_PENDING] == [want] * s.MAX_PENDING  # the first ones were admitted
        # one more that floods and goes away: its replies go with it
        gone = _dealer(ctx, server.bind, RCVHWM=1, RCVBUF=4096)
        for _ in range(50):
            gone.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.5)
        gone.close(0)
        time.sleep(0.5)
        other.send_multipart([b"", (199).to_bytes(8, "big")])
        assert list(_replies(other, 1)) == [[want[199], END]]
    finally:
        ctx.destroy(0)
        served = server.close()
    assert served.refused >= len(refused) and served.peak_pending == s.MAX_PENDING and served.dropped > 0
    # what the server held for replies stayed under its cap: per client its requests' frames and one
    # page (one batch past PAGE_BYTES); at most two clients had work at once here
    assert served.peak_held_bytes <= 2 * (s.MAX_PENDING * 64 + s.PAGE_BYTES + 8192), served


def test_idle_exit_is_not_held_off_by_a_client_that_does_not_read(tmp_path):
    """`serve --idle-exit 1`: a client whose queue is full and who never reads keeps no
    reply moving, so the server exits and says what it refused and held."""
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'kv.db'}"
    _import(url, tmp_path, "big", list(range(200)), n_events=64)
    bind = f"tcp://127.0.0.1:{_free_port()}"
    server = subprocess.Popen([sys.executable, "-m", "kvledger", "kv-events", "serve", "--bind", bind, "--db", url,
                               "--idle-exit", "1", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ctx = zmq.Context()
    try:
        hostile = _dealer(ctx, bind, RCVHWM=1, RCVBUF=4096)
        for _ in range(20):
            hostile.send_multipart([b"", (0).to_bytes(8, "big")])
        out, err = server.communicate(timeout=60)  # the client is still connected, not reading
    finally:
        ctx.destroy(0)
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, err.decode()
    served = json.loads(out)
    assert served["refused"] == 20 - s.MAX_PENDING and served["peak_pending"] == s.MAX_PENDING
    assert served["answered"] < s.MAX_PENDING  # its replies were stuck when it stopped


@pytest.fixture
def paged(db_url, tmp_path) -> tuple[str, str]:
    """A stream with a restart and a gap, beside another stream."""
    _import(db_url, tmp_path, "a", [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 12], n_events=2)
    _import(db_url, tmp_path, "b", list(range(7)))
    with open_journal(db_url) as j:
        sid = next(h for h in j.heads() if h.startswith("kv:a|"))
    return db_url, sid


def test_a_replay_is_the_same_whatever_the_page(paged, monkeypatch):
    """Read from the journal PAGE events (or PAGE_BYTES) at a time, as the cursor sends:
    the same messages as the latest epoch's batches from `start`, for pages of 1 event,
    3 events, one byte and the defaults; on both backends."""
    url, sid = paged
    with open_journal(url) as j:
        for page, page_bytes in ((1, 1 << 20), (3, 1 << 20), (256, 1), (s.PAGE, s.PAGE_BYTES)):
            monkeypatch.setattr(s, "PAGE", page)
            monkeypatch.setattr(s, "PAGE_BYTES", page_bytes)
            for start in (0, 1, 3, 5, 12, 13, 99):
                assert list(s.handle(j, [b"", start.to_bytes(8, "big"), sid.encode()])) == _expected(url, sid, start)
        (reply,) = s.handle(j, [b"", (0).to_bytes(8, "big")])  # two streams: name one
        assert reply[1] == s.ERROR and reply[2].startswith(b"INVALID_ARGUMENT: the journal holds 2")


# -- fuzz: arbitrary request frames ------------------------------------------------------

@pytest.fixture(scope="module")
def journals(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """One journal with a single stream (vLLM's request form works), one with two."""
    out = {}
    for name, streams in (("one", ["a"]), ("two", ["a", "b"])):
        tmp = tmp_path_factory.mktemp(name)
        url = f"sqlite:///{tmp / 'kv.db'}"
        for stream in streams:
            _import(url, tmp, stream, [0, 1, 2, 4, 5, 0, 1, 2, 3] if stream == "a" else [7, 8])
        with open_journal(url) as j:
            sid = next(h for h in j.heads() if h.startswith("kv:a|"))
        out[name] = (url, sid)
    return out


def _frame(sid: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.just(b""), st.just(s.SNAPSHOT), st.just(sid.encode()), st.just(b"kv:nope|x|dp0"),
        st.integers(0, 2 ** 64 - 1).map(lambda n: n.to_bytes(8, "big")),
        st.integers(-(2 ** 63), -1).map(lambda n: n.to_bytes(8, "big", signed=True)),
        st.integers(0, 2 ** 200).map(lambda n: n.to_bytes((n.bit_length() + 7) // 8, "big")),
        st.binary(max_size=12), st.just(b"7" * 70_000),
        st.text(max_size=8).map(str.encode), st.just(b"\xff\xfe"))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), which=st.sampled_from(["one", "two"]))
def test_fuzz_replay_requests(journals, data, which):
    url, sid = journals[which]
    frames = data.draw(st.lists(_frame(sid), max_size=5))
    with open_journal(url) as j:
        reply = list(s.handle(j, frames))
    assert reply, frames
    *body, last = reply
    if last[1:2] == [s.ERROR]:
        assert len(last) == 3
        code = last[2].split(b":")[0].decode()
        assert code in ErrorCode.__members__ and code != "INTERNAL_ERROR", last
        assert not body  # an error here is the whole reply (no journal read failed)
        return
    if last[1:2] == [s.SNAPSHOT]:
        assert not body and len(last) == 3 and json.loads(last[2])["stream_id"] == sid
        assert frames[:2] == [b"", s.SNAPSHOT] and len(frames) == 3
        return
    assert last == END
    named = frames[2] if len(frames) == 3 else b""
    assert len(frames) in (2, 3) and (named in (b"", sid.encode())) and (named or which == "one")
    start = int.from_bytes(frames[1], "big")
    assert reply == _expected(url, sid, start)
    for m in body:  # each a payload our own decoder reads back
        ts, events, rank = decode_batch(m[3])
        assert rank == 0 and ts == 1000.0 + int.from_bytes(m[2], "big") and events
