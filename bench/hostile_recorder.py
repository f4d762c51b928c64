"""Peak memory of `kvledger kv-events record` under hostile publishers (bench.bounded):
the recorder runs in the measured process, the publisher in a process of its own.

- held: the publisher leaves one seq out of every 5,000 and its replay socket never
  answers (it sends a junk frame every second, so the replay stays pending): the
  recorder holds what follows each hole until --max-held-bytes, then journals the hole
  as a gap. Growth <= the cap + the receive queue + the commit pipeline.
- flood: a publisher with SNDHWM=0 sends as fast as ZMQ takes (100-event batches, ~25 KB)
  while the recorder journals into durable SQLite, slower: the recorder's receive HWM
  pushes back, the excess waits in the publisher's own memory.

Each runs for a fixed time, then the recorder is stopped (what it holds is journaled).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.kv_events import free_ports

CAP_MB = {"smoke": 32, "quick": 256, "full": 256}  # --max-held-bytes, in MiB
SECONDS = {"smoke": 4.0, "quick": 15.0, "full": 30.0}
# The cap, the receive queues (rcvhwm 1,000 messages each) and the commit pipeline (up to
# three groups of 16 MiB, each in its JSON, its record and SQLite's page cache).
GOALS = {"kv_events_record_held_peak_mb": ("<=", 256 + 192), "kv_events_record_flood_peak_mb": ("<=", 200)}


def _payloads(n: int, events: int, seed: int) -> list[bytes]:
    import msgspec

    rng = random.Random(seed)
    enc = msgspec.msgpack.Encoder()
    out = []
    for _ in range(n):
        evs: list[dict[str, Any]] = []
        for i in range(events):
            if i % 10 < 6:
                hashes = [rng.getrandbits(256).to_bytes(32, "big") for _ in range(rng.randint(1, 3))]
                evs.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                            "token_ids": [rng.randrange(32000) for _ in range(16 * len(hashes))], "block_size": 16,
                            "medium": "GPU"})
            else:
                evs.append({"type": "BlockRemoved", "block_hashes": [rng.getrandbits(256).to_bytes(32, "big")],
                            "medium": "GPU"})
        out.append(enc.encode([time.time(), evs, 0]))
    return out


def publish_main(pub_port: int, router_port: int, kind: str) -> None:
    """The publisher process: bind, say `ready`; on a line on stdin publish until stdin
    closes. held: every 5,000th seq left out, the replay socket never answers but sends
    a junk frame to each asker every second. flood: SNDHWM=0, every seq sent."""
    import zmq

    payloads = _payloads(200, 10 if kind == "held" else 100, 7)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0 if kind == "flood" else 100_000)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{router_port}")
    print("ready", flush=True)
    sys.stdin.readline()
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    askers: set[bytes] = set()
    next_junk = time.monotonic() + 1.0
    seq = 0
    while not done.is_set():
        while router.poll(0):
            askers.add(router.recv_multipart()[0])
        if time.monotonic() > next_junk:
            for client in askers:
                router.send_multipart([client, b"", b"junk"])
            next_junk = time.monotonic() + 1.0
        for _ in range(100):
            if kind == "flood" or seq % 5000 != 4999:
                pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payloads[seq % len(payloads)]], copy=False)
            seq += 1
        # held: about what one recorder takes (the hostile part is the replay); flood: ~60
        # MB/s, twice what the recorder journals, without growing this process past what a
        # shared machine has
        time.sleep(0.0005 if kind == "held" else 0.04)
    pub.close(0)
    router.close(0)
    ctx.term()


def _run(kind: str, tmp: Path, mode: str, ready: Callable[[], None]) -> None:
    import contextlib
    import io

    from kvledger.adapters import kv_events_zmq as z
    from kvledger.migrations.storage import open_or_create_journal

    pub_port, router_port = free_ports()
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from bench.hostile_recorder import publish_main; publish_main({pub_port}, "
                               f"{router_port}, {kind!r})"],
        cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stdin is not None and proc.stdout is not None
    stdin = proc.stdin
    try:
        if proc.stdout.readline() != b"ready\n":
            raise RuntimeError("the publisher did not start")
        stop = z.Stop()

        def go() -> None:
            time.sleep(1.0)  # the recorder's SUB joins
            stdin.write(b"go\n")
            stdin.flush()
            time.sleep(SECONDS[mode])
            stop()

        with open_or_create_journal(f"sqlite:///{tmp / 'kv.db'}") as journal:
            ready()
            threading.Thread(target=go, daemon=True).start()
            with contextlib.redirect_stderr(io.StringIO()):  # the junk frames' skip lines
                options = z.RecordOptions(replay_endpoint=f"tcp://127.0.0.1:{router_port}", topic="kv",
                                          max_held_bytes=CAP_MB[mode] << 20)
                summary = z.record(journal, f"tcp://127.0.0.1:{pub_port}", options, stop=stop)
        if summary.batches == 0:
            raise RuntimeError(f"nothing recorded: {summary}")
        print(f"{kind}: {summary.batches} batches, {summary.gaps} gaps ({summary.cap_gaps} by the cap), "
              f"held peak {summary.held_bytes_peak >> 20} MiB", file=sys.stderr)
    finally:
        stdin.close()
        proc.wait(60)


SCENARIOS = {
    "kv_events_record_held_peak_mb": lambda tmp, mode, ready: _run("held", tmp, mode, ready),
    "kv_events_record_flood_peak_mb": lambda tmp, mode, ready: _run("flood", tmp, mode, ready),
}
