"""Bounded memory of `kv-events serve` and `kv-events import` (issue 44), for bench.bounded.

- serve_unread_replays_peak_mb: the server (a thread of the measured process, its own
  journal connection) with a recorded stream; a client process sends replay requests
  from seq 0 as fast as it can and never reads. The server holds at most a page per
  client and ZMQ at most SNDHWM replies; the rest are refused (CAPACITY_EXCEEDED).
- import_endless_line_peak_mb: `kv-events import` of /dev/zero, one line without end:
  refused at the line bound (64 MiB), which is the most it holds.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvledger.schemas.errors import ErrorCode, KvLedgerError

GOALS = {"serve_unread_replays_peak_mb": ("<=", 64), "import_endless_line_peak_mb": ("<=", 160)}

_CLIENT = """
import sys, time, zmq
ctx = zmq.Context()
d = ctx.socket(zmq.DEALER)
d.connect(sys.argv[1])
for _ in range(int(sys.argv[2])):
    d.send_multipart([b"", (0).to_bytes(8, "big")])
print("sent", flush=True)
time.sleep(3600)
"""


def _line(seq: int) -> str:
    events = [{"type": "BlockStored", "block_hashes": [f"{seq:016x}{i:048x}"], "parent_block_hash": None,
               "token_ids": list(range(i * 16, i * 16 + 16)), "block_size": 16, "medium": "GPU"} for i in range(6)]
    return json.dumps({"seq": seq, "ts": 1000.0 + seq, "events": events, "data_parallel_rank": 0})


def serve_unread_replays(tmp: Path, mode: str, ready: Callable[[], None]) -> None:
    from kvledger.adapters.kv_events_import import import_operations
    from kvledger.adapters.kv_events_serve import serve
    from kvledger.adapters.kv_events_zmq import Stop
    from kvledger.migrations.storage import creating_journal, open_existing_journal

    batches, requests = {"smoke": (500, 300), "quick": (2000, 1200)}.get(mode, (2000, 1200))
    f = tmp / "stream.jsonl"
    f.write_text("".join(_line(s) + "\n" for s in range(batches)))  # ~1.3 KB a batch, as msgpack
    url = f"sqlite:///{tmp / 'kv.db'}"
    with creating_journal(url) as j:
        ops, _ = import_operations(f, "vllm", {}, "bench")
        j.append(ops)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        bind = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    stop = Stop()

    def run() -> None:
        with open_existing_journal(url) as journal:
            serve(journal, bind, stop=stop)

    server = threading.Thread(target=run, daemon=True)
    server.start()
    time.sleep(0.5)
    ready()
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, bind, str(requests)], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "sent"
        time.sleep(5)  # every request received and the client's queues full
    finally:
        client.kill()
        client.wait()
        stop()
        server.join(60)


def import_endless_line(tmp: Path, mode: str, ready: Callable[[], None]) -> None:
    from kvledger.adapters.kv_events_import import import_operations

    ready()
    try:
        import_operations(Path("/dev/zero"), "vllm", {}, "bench")
    except KvLedgerError as exc:
        assert exc.code is ErrorCode.FIELD_TOO_LARGE, exc
    else:
        raise AssertionError("/dev/zero was imported")


SCENARIOS = {"serve_unread_replays_peak_mb": serve_unread_replays,
             "import_endless_line_peak_mb": import_endless_line}
