"""7. KV-event recorder: `kvledger kv-events record` fed by a publisher process that
speaks vLLM's protocol (PUB `[topic, seq, payload]`, ROUTER replay with a ring buffer of
every batch, msgpack EventBatch, 10 events a batch: 6 stores of 1-3 blocks, 4 removes).

The publisher runs in its own process and sends pre-encoded batches as fast as ZMQ
takes them; the recorder (this process) journals them into durable SQLite (WAL,
synchronous=FULL), committing whatever arrived while the previous commit ran. The rate
is events journaled over the time from the first batch received to the last commit.
Baseline in the same run: the same stream received and decoded with no journal (the
events still encoded to their journal JSON, which the recorder does on receipt).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import Context

GOALS = {"kv_events_record_events_per_s": (">=", 100_000)}
NOTES = {
    "kv_events_record_events_per_s": "one recorder, one vLLM-form publisher process, 10-event batches (~2.2 KB "
                                      "msgpack, ~4 KB of journal JSON), durable SQLite, group commits of ~1,024 "
                                      "batches on a committer thread. Per batch, uncontended, on the 2-core "
                                      "machine: receiving ~4 us, msgpack decode ~9 us, hex and kv events ~6 us, "
                                      "their JSON ~2.3 us (encoded at once, journaled as is) and the Recorder "
                                      "~5 us on the receiving thread; the append 45-60 us on the committer "
                                      "(zstd ~9-15 us and SQLite ~20 us without the GIL, the record's envelopes, "
                                      "CRCs and join with it). The committer is the slower of the two; both "
                                      "share two vCPUs with the ZMQ I/O threads and the publisher, and this VM's "
                                      "speed moves up to 2x between runs (a pure-Python loop: 0.29-0.55 s)",
}
EVENTS_PER_BATCH = 10


def _payloads(n: int, seed: int) -> list[bytes]:
    import random

    import msgspec

    rng = random.Random(seed)
    enc = msgspec.msgpack.Encoder()
    out, live, counter = [], [], 0
    for _ in range(n):
        events: list[dict[str, Any]] = []
        for i in range(EVENTS_PER_BATCH):
            if i < 6 or len(live) < 8:
                hashes = []
                for _ in range(rng.randint(1, 3)):
                    counter += 1
                    hashes.append(rng.getrandbits(256).to_bytes(32, "big"))
                events.append({"type": "BlockStored", "block_hashes": hashes,
                               "parent_block_hash": live[-1] if live else None,
                               "token_ids": [rng.randrange(32000) for _ in range(16 * len(hashes))], "block_size": 16,
                               "lora_id": None, "medium": "GPU", "lora_name": None})
                live.extend(hashes)
            else:
                events.append({"type": "BlockRemoved", "block_hashes": [live.pop(rng.randrange(len(live)))],
                               "medium": "GPU"})
        out.append(enc.encode([time.time(), events, 0]))
    return out


def publish_main(pub_port: int, router_port: int, n: int, seed: int) -> None:
    """The publisher process: encode n batches, bind, say `ready`; on a line on stdin
    send them all, then serve replays from a ring of all of them until stdin closes."""
    import threading

    import zmq

    payloads = _payloads(n, seed)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.bind(f"tcp://127.0.0.1:{router_port}")
    print("ready", flush=True)
    sys.stdin.readline()  # the subscriber has joined
    done = threading.Event()
    published = [0]  # the replay buffer holds what was published, as vLLM's does

    def serve_replays() -> None:
        # A thread of its own, as in vLLM: a request is answered while publishing goes on
        # (answered after it, the recorder's start-up request would replay every batch).
        while not done.is_set():
            if router.poll(50):
                client, _, start = router.recv_multipart()
                for seq in range(int.from_bytes(start, "big"), published[0]):
                    router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payloads[seq]])
                router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])
        router.close(0)

    replays = threading.Thread(target=serve_replays, daemon=True)
    replays.start()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    for seq, p in enumerate(payloads):
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), p], copy=False)
        published[0] = seq + 1
    done.wait()
    replays.join()
    pub.close(0)
    ctx.term()


def free_ports() -> tuple[int, int]:
    """Two free TCP ports on 127.0.0.1: a publisher's PUB and replay ROUTER."""
    import socket

    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        return int(a.getsockname()[1]), int(b.getsockname()[1])


def _run_once(ctx: Context, n: int, journal_on: bool) -> tuple[float, int]:
    from kvledger.adapters import kv_events_zmq as z

    pub_port, router_port = free_ports()
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from bench.kv_events import publish_main; publish_main({pub_port}, {router_port}, "
                               f"{n}, 7)"],
        cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline() != b"ready\n":
            raise RuntimeError("the publisher did not start")
        stdin = proc.stdin

        def start() -> None:
            time.sleep(1.0)  # the recorder's SUB joins (a late joiner would be served by replay)
            stdin.write(b"go\n")
            stdin.flush()

        threading.Thread(target=start, daemon=True).start()
        path = ctx.sqlite_path(ctx.name("kv_events"))
        if journal_on:
            from kvledger.migrations.storage import open_or_create_journal

            journal: Any = open_or_create_journal(f"sqlite:///{path}")
        else:
            journal = _NoJournal()
        with journal:
            summary = z.record(journal, f"tcp://127.0.0.1:{pub_port}", z.RecordOptions(
                replay_endpoint=f"tcp://127.0.0.1:{router_port}", topic="kv", idle_exit=2.0))
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
    if summary.batches != n:
        raise RuntimeError(f"recorded {summary.batches} of {n} batches")
    seconds = (summary.last_commit_ns - summary.first_message_ns) / 1e9
    return summary.events / seconds, summary.events


class _NoJournal:
    """The baseline: the recorder's decisions with nothing written."""

    def heads(self) -> dict[str, Any]:
        return {}

    def append(self, ops: list[Any]) -> list[Any]:
        return []

    def __enter__(self) -> _NoJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def run(ctx: Context) -> dict[str, Any]:
    n = ctx.size(smoke=2_000, quick=20_000, full=100_000)
    best_on, best_off, events = 0.0, 0.0, 0
    for _ in range(ctx.size(smoke=1, quick=2, full=3)):
        rate, events = _run_once(ctx, n, journal_on=True)
        best_on = max(best_on, rate)
        ctx.log(f"kv-events record: {rate:,.0f} events/s journaled ({events} events)")
        rate, _ = _run_once(ctx, n, journal_on=False)
        best_off = max(best_off, rate)
        ctx.log(f"kv-events receive + decode only: {rate:,.0f} events/s")
    return {"kv_events_record_events_per_s": round(best_on), "kv_events_decode_only_events_per_s": round(best_off),
            "kv_events_record_vs_decode_only": round(best_on / best_off, 3), "kv_events_recorded": events}
