"""A reference KV-event publisher, written from the documented protocol (vLLM's
vllm/distributed/kv_events.py ZmqEventPublisher; SGLang's variant), not from our
recorder: a PUB socket, a ROUTER replay socket and a ring buffer of the last
`buffer_steps` payloads, one thread owning both sockets.

- vllm: live `[topic, seq, payload]`; events as maps tagged by "type" with default-valued
  fields omitted; replay replies `[topic, seq, payload]`.
- sglang: live `[seq, payload]`; events as positional arrays `["BlockStored", ...]`
  (trailing fields missing); replay replies `[seq, payload]`.
Both: the payload is msgspec msgpack `EventBatch` positional `[ts, events, rank]`, the
seq 8 bytes big-endian, the replay end marker `[b"", -1, b""]` (after the ROUTER's
identity and empty delimiter).

Also a random workload of stores and removes, and the independent model of what a
stream's events leave resident (a plain set per pool).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# -- vLLM's structs (tagged maps, omit_defaults) ----------------------------------------

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


# -- SGLang's / older vLLM's (positional arrays) ------------------------------------------

class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None  # trailing: missing when at its default


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


_encoder = msgspec.msgpack.Encoder()


class Workload:
    """Random stores (chains under a resident parent or a root) and removes, over two
    media, with int and bytes hashes; now and then an AllBlocksCleared."""

    def __init__(self, seed: int, *, clears: bool = True) -> None:
        self.rng = random.Random(seed)
        self.resident: dict[str, list[int | bytes]] = {"GPU": [], "CPU": []}
        self.counter = 0
        self.clears = clears

    def _hash(self) -> int | bytes:
        self.counter += 1
        if self.counter % 2:
            return self.rng.getrandbits(63)
        return self.rng.getrandbits(128).to_bytes(16, "big")

    def batch(self, n: int = 10) -> list[tuple[str, dict[str, Any]]]:
        """n events as (type, fields) in vLLM's names."""
        out: list[tuple[str, dict[str, Any]]] = []
        rng = self.rng
        for _ in range(n):
            medium = "GPU" if rng.random() < 0.8 else "CPU"
            pool = self.resident[medium]
            r = rng.random()
            if self.clears and r < 0.003:
                for p in self.resident.values():
                    p.clear()
                out.append(("AllBlocksCleared", {}))
            elif r < 0.6 or len(pool) < 4:
                parent = rng.choice(pool) if pool and rng.random() < 0.7 else None
                hashes = [self._hash() for _ in range(rng.randint(1, 3))]
                pool.extend(hashes)
                out.append(("BlockStored", {"block_hashes": hashes, "parent_block_hash": parent,
                                            "token_ids": [rng.randrange(32000) for _ in range(4 * len(hashes))],
                                            "block_size": 4, "lora_id": None, "medium": medium}))
            else:
                k = rng.randint(1, min(3, len(pool)))
                gone = [pool.pop(rng.randrange(len(pool))) for _ in range(k)]
                out.append(("BlockRemoved", {"block_hashes": gone, "medium": medium}))
        return out


def encode(dialect: str, ts: float, events: list[tuple[str, dict[str, Any]]], rank: int) -> bytes:
    if dialect == "vllm":
        structs: list[Any] = []
        for kind, f in events:
            if kind == "BlockStored":
                structs.append(BlockStored(lora_name=None, **f))
            elif kind == "BlockRemoved":
                structs.append(BlockRemoved(**f))
            else:
                structs.append(AllBlocksCleared())
    else:
        structs = []
        for kind, f in events:
            if kind == "BlockStored":
                structs.append(ArrayBlockStored(**f))
            elif kind == "BlockRemoved":
                structs.append(ArrayBlockRemoved(**f))
            else:
                structs.append(ArrayAllBlocksCleared())
    return _encoder.encode(EventBatch(ts=ts, events=structs, data_parallel_rank=rank))


def normalized(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """What the journal must hold for these events: vLLM's names, bytes as hex, fields at
    None left out."""
    out = []
    for kind, f in events:
        d: dict[str, Any] = {"type": kind}
        for k, v in f.items():
            if v is None:
                continue
            if k == "block_hashes":
                v = [h.hex() if isinstance(h, bytes) else h for h in v]
            elif isinstance(v, bytes):
                v = v.hex()
            d[k] = v
        out.append(d)
    return out


def model_resident(batches: list[list[tuple[str, dict[str, Any]]]]) -> dict[str, set[Any]]:
    """The independent model: resident hashes per medium after these batches in order."""
    res: dict[str, set[Any]] = {}
    for batch in batches:
        for kind, f in batch:
            if kind == "AllBlocksCleared":
                res = {}
            elif kind == "BlockStored":
                res.setdefault(f["medium"], set()).update(h.hex() if isinstance(h, bytes) else h
                                                          for h in f["block_hashes"])
            else:
                s = res.setdefault(f["medium"], set())
                s.difference_update(h.hex() if isinstance(h, bytes) else h for h in f["block_hashes"])
    return {m: s for m, s in res.items() if s}


class Wiring(msgspec.Struct, frozen=True):
    """Where a Publisher's sockets go, when not on random ports it binds: `connect` its PUB
    to a collector (vLLM's endpoint naming a host), `replay_bind` its ROUTER on a given port."""

    connect: str | None = None
    replay_bind: str | None = None


class Publisher:
    """PUB + ROUTER replay with a ring buffer. `publish(events, drop=True)` assigns the
    next seq and buffers it without sending it live (a batch lost before the subscriber)."""

    def __init__(self, dialect: str = "vllm", *, topic: str = "kv", rank: int = 0, buffer_steps: int = 10_000,
                 sndhwm: int = 100_000, answer_replays: bool = True,
                 replay_loses: dict[int, int] | None = None, wiring: Wiring | None = None) -> None:
        self.dialect = dialect
        self.answer_replays = answer_replays  # False: a replay socket that takes requests and never answers
        # seq -> how many replays leave it out (lost on the way, as a ROUTER past its HWM drops)
        self.replay_loses = dict(replay_loses or {})
        self.topic = topic.encode() if dialect == "vllm" else b""
        self.rank = rank
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, sndhwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        connect, replay_bind = (wiring or Wiring()).connect, (wiring or Wiring()).replay_bind
        if connect is not None:  # vLLM's form with a host in its endpoint: the PUB connects to a collector
            self.pub.connect(connect)
            self.endpoint = connect
        else:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)
        if replay_bind is not None:  # a given port (vLLM's: rank r's at the configured port + r)
            self.router.bind(replay_bind)
            self.replay_endpoint = replay_bind
        else:
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.published: list[tuple[int, int, bytes]] = []  # (epoch, seq, payload)
        self.epoch = 0
        self.replays: list[tuple[int, int | None]] = []  # (start asked, first seq sent)
        self.requests = 0  # replay requests received (answered or not)
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def publish(self, events: list[tuple[str, dict[str, Any]]], *, drop: bool = False) -> int:
        payload = encode(self.dialect, time.time(), events, self.rank)
        done = threading.Event()
        self._queue.put(("pub", (payload, drop, done)))
        done.wait()
        return self.seq - 1

    def send(self, frames: list[bytes]) -> None:
        """Send these frames live as they are (a hostile message): no seq taken, nothing buffered."""
        done = threading.Event()
        self._queue.put(("raw", (frames, done)))
        done.wait()

    def restart(self) -> None:
        """A new publisher process: seq from 0, an empty buffer."""
        done = threading.Event()
        self._queue.put(("restart", done))
        done.wait()

    def close(self) -> None:
        self._running = False
        self._thread.join()
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()

    def _run(self) -> None:
        while self._running:
            if self.router.poll(0):
                self._serve_replay()
            try:
                kind, arg = self._queue.get(timeout=0.002)
            except queue.Empty:
                continue
            if kind == "raw":
                self.pub.send_multipart(arg[0])
                arg[1].set()
                continue
            if kind == "restart":
                self.seq = 0
                self.epoch += 1
                self.buffer.clear()
                arg.set()
                continue
            payload, drop, done = arg
            seq = self.seq
            self.seq += 1
            sb = seq.to_bytes(8, "big")
            self.buffer.append((seq, payload))
            self.published.append((self.epoch, seq, payload))
            if not drop:
                frames = [self.topic, sb, payload] if self.dialect == "vllm" else [sb, payload]
                self.pub.send_multipart(frames)
            done.set()

    def _serve_replay(self) -> None:
        frames = self.router.recv_multipart()
        self.requests += len(frames) == 3
        if len(frames) != 3 or not self.answer_replays:
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        first = None
        for seq, payload in self.buffer:
            if self.replay_loses.get(seq, 0) > 0 and seq >= start:
                self.replay_loses[seq] -= 1
                continue
            if seq >= start:
                first = seq if first is None else first
                if self.dialect == "vllm":
                    self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
                else:
                    self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self.router.send_multipart([client, b"", END_SEQ, b""])
        self.replays.append((start, first))
