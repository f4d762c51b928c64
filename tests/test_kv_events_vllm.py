"""`kvledger kv-events serve` answers as vLLM 0.33 does (issue 44): vLLM's own
ZmqEventPublisher (tests/vllm_oracle.py, a process of its own) publishes generated
batches; `kvledger kv-events record` journals them; `kvledger kv-events serve` answers
from the journal. The same replay requests, sent by a DEALER as vLLM's consumers send
them, get the same replies from both, frame for frame and byte for byte (topic, seqs,
payloads, end marker), and vLLM's own typed decoder reads every payload we send as it
reads its own. Skipped where vllm does not import (.ci/run installs it)."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("zmq")
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (.ci/run installs vllm==0.33.0 --no-deps for this test)",
                allow_module_level=True)

import zmq

from kvledger.migrations.storage import init_database

from kv_recording import VllmOracle

HERE = Path(__file__).resolve().parent
END = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
N = 60


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reply(dealer: zmq.Socket[bytes], request: list[bytes], timeout_ms: int = 10_000) -> list[list[bytes]]:
    """Every message of one request's reply, the end marker included."""
    dealer.send_multipart(request)
    out = []
    while True:
        assert dealer.poll(timeout_ms), f"{dealer.LAST_ENDPOINT!r}: no end marker after {len(out)} messages for " \
                                        f"{request!r}"
        out.append(dealer.recv_multipart())
        if out[-1] == END or out[-1][1:2] == [b"ERROR"]:
            return out


def _first_difference(mine: list[list[bytes]], theirs: list[list[bytes]]) -> str:
    for m, t in zip(mine, theirs):
        if m != t:
            if len(m) == len(t) == 4 and m[:3] == t[:3]:  # the payloads differ: say where
                at = next((i for i, (x, y) in enumerate(zip(m[3], t[3])) if x != y), min(len(m[3]), len(t[3])))
                ours, vllms = msgspec.msgpack.decode(m[3]), msgspec.msgpack.decode(t[3])
                events = next(((x, y) for x, y in zip(ours[1], vllms[1]) if x != y), None)
                near = slice(max(at - 20, 0), at + 20)
                return f"payload of seq {int.from_bytes(m[2], 'big')} from byte {at}: ours {m[3][near]!r} " \
                       f"vLLM's {t[3][near]!r}; first differing event {events!r:.1200}"
            return f"ours {m!r:.300} vLLM's {t!r:.300}"
    return "one is a prefix of the other"


REQUESTS = [
    [b"", (0).to_bytes(8, "big")],
    [b"", (1).to_bytes(8, "big")],
    [b"", (17).to_bytes(8, "big")],
    [b"", (N - 1).to_bytes(8, "big")],
    [b"", (N).to_bytes(8, "big")],  # past the end: the end marker only
    [b"", (10 ** 6).to_bytes(8, "big")],
    [b"", b""],  # a seq of no bytes: 0 to vLLM
    [b"", b"\x05"],  # one byte
    [b"", (33).to_bytes(9, "big")],  # nine bytes
    [b"", b"\xff" * 8],  # -1 signed: vLLM reads it unsigned
    [b"", b"SNAPSHOT"],  # two frames: a replay request to vLLM, from a seq past every batch
    [b"not empty", (40).to_bytes(8, "big")],  # vLLM ignores the delimiter's content
]


def test_serve_replies_frame_for_frame_as_vllm_and_vllm_decodes_them(tmp_path):
    pub = f"ipc://{tmp_path}/pub.sock"  # vLLM binds an ipc endpoint, and connects a tcp one that names a host
    vllm_replay = f"tcp://127.0.0.1:{_free_port()}"
    ours = f"tcp://127.0.0.1:{_free_port()}"
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    init_database(url)
    oracle = VllmOracle(pub, vllm_replay, "kv")
    ctx = zmq.Context()
    server = None
    try:
        ready = oracle.answer()
        if "skip" in ready:
            pytest.skip(ready["skip"])
        recorder = subprocess.Popen([sys.executable, "-m", "kvledger", "kv-events", "record", "--endpoint", pub,
                                     "--replay-endpoint", vllm_replay, "--topic", "kv", "--db", url,
                                     "--idle-exit", "3", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(1.0)  # the SUB connects; batches it misses come back by replay anyway
        assert oracle.ask(f"publish {N} 44") == {"published": N}
        out, err = recorder.communicate(timeout=120)
        assert recorder.returncode == 0 and json.loads(out)["batches"] == N, err.decode()[-2000:]
        server = subprocess.Popen([sys.executable, "-m", "kvledger", "kv-events", "serve", "--bind", ours,
                                   "--db", url, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        dealers = []
        for endpoint in (vllm_replay, ours):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(endpoint)
            dealers.append(d)
        payloads: list[list[bytes]] = [[], []]
        for request in REQUESTS:
            theirs, mine = (_reply(d, request) for d in dealers)
            assert mine == theirs, f"{request!r}: {len(mine)} messages, vLLM {len(theirs)}; " \
                + _first_difference(mine, theirs)
            payloads[0] += [m[3] for m in theirs[:-1]]
            payloads[1] += [m[3] for m in mine[:-1]]
        first = _reply(dealers[1], REQUESTS[0])
        assert len(first) == N + 1 and [int.from_bytes(m[2], "big") for m in first[:-1]] == list(range(N))
        decoded = [oracle.ask("decode " + ",".join(p.hex() for p in ps))["decoded"] for ps in payloads]
        assert not [d for d in decoded[1] if "error" in d], decoded[1][:3]
        assert decoded[1] == decoded[0]
        kinds = {e["type"] for b in decoded[1] for e in b[1]}  # a batch is [ts, events, rank]
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    finally:
        ctx.destroy(0)
        oracle.close()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            out, err = server.communicate(timeout=30)
    assert server.returncode == 0, err.decode()
    assert json.loads(out)["answered"] == len(REQUESTS) + 1
