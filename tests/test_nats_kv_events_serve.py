"""`kvledger kv-events serve` from a NATS cell (issue 46 items 2 and 4): a router's DEALER
asks vLLM's replay protocol of a serving process over real sockets, for starts before,
inside and past a stream with a restart and a gap, and a snapshot; every reply is, frame
for frame, what the same imports into SQLite answer (tests/test_kv_events_serve.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("zmq")

import zmq
from nats_cluster import nats_url  # noqa: F401  # a fixture
from test_kv_events_serve import _dealer, _expected, _free_port, _import, _replies

from kvledger.adapters import kv_events_serve as s
from kvledger.journal import open_journal

STARTS = (0, 3, 5, 7, 99)


def _stream(url: str, name: str) -> str:
    with open_journal(url) as j:
        return next(h for h in j.heads() if h.startswith(f"kv:{name}|"))


def test_serve_answers_replays_and_a_snapshot_from_a_cell(nats_url, tmp_path):  # noqa: F811
    sqlite = f"sqlite:///{tmp_path / 'kv.db'}"
    for url in (nats_url, sqlite):  # a restart (seq 0 again), a gap (3, 4 of the new epoch never sent)
        _import(url, tmp_path, "a", [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7], n_events=2)
        _import(url, tmp_path, "b", list(range(4)))
    sid = _stream(nats_url, "a")
    assert _stream(sqlite, "a") == sid
    with open_journal(sqlite) as j:
        snapshot = list(s.handle(j, [b"", s.SNAPSHOT, sid.encode()]))
    bind = f"tcp://127.0.0.1:{_free_port()}"
    server = subprocess.Popen([sys.executable, "-m", "kvledger", "kv-events", "serve", "--bind", bind,
                               "--db", nats_url, "--idle-exit", "2", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ctx = zmq.Context()
    try:
        d = _dealer(ctx, bind)
        for start in STARTS:
            d.send_multipart([b"", start.to_bytes(8, "big"), sid.encode()])
        d.send_multipart([b"", s.SNAPSHOT, sid.encode()])
        d.send_multipart([b"", (0).to_bytes(8, "big")])  # two streams on the cell: it must be named
        replies = list(_replies(d, len(STARTS) + 2))
        out, err = server.communicate(timeout=60)
    finally:
        ctx.destroy(0)
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, err.decode()[-2000:]
    assert replies[:len(STARTS)] == [_expected(sqlite, sid, start) for start in STARTS]
    assert [len(r) for r in replies[:len(STARTS)]] == [7, 4, 4, 2, 1]  # the new epoch: seqs 0-2 and 5-7, and the end
    assert replies[len(STARTS)] == snapshot
    shown = json.loads(snapshot[0][2])
    assert (shown["stream_id"], shown["epoch"], shown["seq"], shown["next_seq"]) == (sid, 1, 7, 8)
    (error,) = replies[-1]
    assert error[1] == s.ERROR and error[2].startswith(b"INVALID_ARGUMENT: the journal holds 2")
    served = json.loads(out)
    assert (served["answered"], served["errors"]) == (len(STARTS) + 1, 1)
