"""The block-pool projection of KV-event streams (schemas.kv_events): which prefix
blocks an engine says are resident, per stream, medium and KV-cache group.

Kept apart from the handle ledgers on purpose (spec 0x08): these are the engine's facts
about its own prefix cache, not request lifecycle, so nothing here touches a handle.

A fold in global order, like the projector it lives in: per stream the epoch and last
seq, whether the state is certain (a gap makes it uncertain until a clear or a restart),
the resident block set per pool, stored and removed counts, block-seconds over the
engine's own batch timestamps, and findings (a store whose parent is unknown, a remove
of an unknown block, a double store), each marked uncertain when it came after a gap.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvledger.journal.contract import HeadFacts
from kvledger.schemas import events as ev
from kvledger.schemas import kv_events as kv

KEEP_FINDINGS = 100  # findings kept per stream; the rest are counted

PARENT_UNKNOWN = "KV_PARENT_UNKNOWN"
REMOVE_UNKNOWN = "KV_REMOVE_UNKNOWN"
DOUBLE_STORE = "KV_DOUBLE_STORE"
MOVE_UNKNOWN = "KV_MOVE_UNKNOWN"

Hash = int | str


def pool_key(medium: str | None, group: int | None) -> str:
    """One pool's name: medium (as the engine named it; `-` when it named none) and the
    KV-cache group index (`-` likewise)."""
    return f"{'-' if medium is None else medium}/{'-' if group is None else group}"


class KvFinding(msgspec.Struct, frozen=True, omit_defaults=True):
    code: str
    message: str
    global_position: int
    seq: int
    uncertain: bool = False  # after a gap: the engine may have said it in a lost batch


class Pool(msgspec.Struct, kw_only=True):
    blocks: set[Hash] = msgspec.field(default_factory=set)
    stored: int = 0
    removed: int = 0
    block_seconds: float = 0.0  # resident blocks integrated over the engine's ts


class KvStream(msgspec.Struct, kw_only=True):
    epoch: int = 0
    seq: int = -1  # last seq recorded in this epoch (-1: none yet)
    batches: int = 0
    events: int = 0
    gaps: int = 0
    restarts: int = 0
    uncertain: bool = False
    ts: float | None = None  # the last batch's engine timestamp
    block_size: int | None = None
    pools: dict[str, Pool] = msgspec.field(default_factory=dict)
    findings: list[KvFinding] = msgspec.field(default_factory=list)
    omitted: int = 0


class KvBlockState(msgspec.Struct, kw_only=True):
    streams: dict[str, KvStream] = msgspec.field(default_factory=dict)


class KvBlocks:
    """The fold. `apply` one KV-stream event at a time, in global order."""

    __slots__ = ("state",)

    def __init__(self, state: KvBlockState | None = None) -> None:
        self.state = state if state is not None else KvBlockState()

    def apply(self, e: ev.KvStreamEvent) -> None:
        s = self.state.streams.get(e.stream_id)
        if s is None:
            s = self.state.streams[e.stream_id] = KvStream()
        if isinstance(e, ev.KvEventsBatchEvent):
            self._batch(s, e)
        elif isinstance(e, ev.KvEventsGapEvent):
            s.gaps += 1
            s.uncertain = True
            s.seq = e.payload.last_seq
        else:
            s.restarts += 1
            s.epoch, s.seq = e.payload.epoch, -1
            s.uncertain = False
            self._clear(s, None)

    def feed(self, events: Iterable[ev.Event]) -> KvBlocks:
        for e in events:
            if isinstance(e, ev.KV_EVENT_CLASSES):
                self.apply(e)  # type: ignore[arg-type]  # narrowed by the tuple
        return self

    def _batch(self, s: KvStream, e: ev.KvEventsBatchEvent) -> None:
        p = e.payload
        self._advance(s, p)
        pos = e.global_position
        for k in p.events:
            if isinstance(k, kv.BlockStored):
                pool = self._pool(s, pool_key(k.medium, k.group_idx))
                if k.block_size:
                    s.block_size = k.block_size
                parent = k.parent_block_hash
                if parent is not None and parent not in pool.blocks:
                    self._find(s, PARENT_UNKNOWN, f"store under parent {parent!r}, which is not resident in "
                                                  f"{pool_key(k.medium, k.group_idx)}", pos, p.seq)
                blocks = pool.blocks
                for h in k.block_hashes:
                    if h in blocks:
                        self._find(s, DOUBLE_STORE, f"block {h!r} stored again while resident", pos, p.seq)
                    blocks.add(h)
                pool.stored += len(k.block_hashes)
            elif isinstance(k, kv.BlockRemoved):
                pool = self._pool(s, pool_key(k.medium, k.group_idx))
                blocks = pool.blocks
                for h in k.block_hashes:
                    if h in blocks:
                        blocks.discard(h)
                    else:
                        self._find(s, REMOVE_UNKNOWN, f"remove of block {h!r}, which is not resident", pos, p.seq)
                pool.removed += len(k.block_hashes)
            elif isinstance(k, kv.AllBlocksCleared):
                self._clear(s, k.medium)
                s.uncertain = False  # whatever a gap lost, nothing is resident now
            elif isinstance(k, kv.BlockUpdated):
                if k.new_medium is None or k.new_medium == k.medium:
                    continue  # a priority change: residency is the same
                old = self._pool(s, pool_key(k.medium, k.group_idx))
                if k.block_hash in old.blocks:
                    old.blocks.discard(k.block_hash)
                else:
                    self._find(s, MOVE_UNKNOWN, f"move of block {k.block_hash!r}, which is not resident in "
                                                f"{pool_key(k.medium, k.group_idx)}", pos, p.seq)
                self._pool(s, pool_key(k.new_medium, k.group_idx)).blocks.add(k.block_hash)
            else:  # PoolCreated: a new, empty pool
                self._clear(s, None)
                s.uncertain = False

    @staticmethod
    def _advance(s: KvStream, p: kv.KvEventsBatch) -> None:
        """The stream's clock, seq and counts move to this batch; each resident block is
        charged the time since the previous one."""
        if s.ts is not None and p.ts > s.ts:
            dt = p.ts - s.ts
            for pool in s.pools.values():
                pool.block_seconds += len(pool.blocks) * dt
        if s.ts is None or p.ts > s.ts:
            s.ts = p.ts
        s.epoch, s.seq = p.epoch, p.seq
        s.batches += 1
        s.events += len(p.events)

    @staticmethod
    def _pool(s: KvStream, key: str) -> Pool:
        pool = s.pools.get(key)
        if pool is None:
            pool = s.pools[key] = Pool()
        return pool

    @staticmethod
    def _clear(s: KvStream, medium: str | None) -> None:
        for key, pool in s.pools.items():
            if medium is None or key.split("/", 1)[0] == medium:
                pool.removed += len(pool.blocks)
                pool.blocks = set()

    @staticmethod
    def _find(s: KvStream, code: str, message: str, pos: int, seq: int) -> None:
        if len(s.findings) < KEEP_FINDINGS:
            s.findings.append(KvFinding(code, message, pos, seq, s.uncertain))
        else:
            s.omitted += 1

    def copy(self) -> KvBlockState:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(self.state), type=KvBlockState)


# -- the stream's head row -------------------------------------------------------------

def kv_head(prev: tuple[int, int, int] | None, e: ev.KvStreamEvent) -> tuple[int, int, int]:
    """(epoch, next seq, stream position) after `e`: what the recorder's head row holds
    (generation, snapshot_version, stream_position)."""
    epoch, next_seq, _ = prev or (0, 0, 0)
    p = e.payload
    if isinstance(p, kv.KvEventsRestart):
        return p.epoch, 0, e.stream_position
    last = p.last_seq if isinstance(p, kv.KvEventsGap) else p.seq
    return p.epoch, max(next_seq, last + 1), e.stream_position


def kv_head_facts(sid: str, head: tuple[int, int, int]) -> HeadFacts:
    return HeadFacts(sid, head[0], head[1], head[2], 0, kv.KV_LIFECYCLE, "", "")


# -- the report ----------------------------------------------------------------------

class PoolReport(msgspec.Struct, frozen=True, omit_defaults=True):
    resident_blocks: int
    stored: int
    removed: int
    block_seconds: float
    resident_bytes: int | None = None  # with --block-bytes
    byte_seconds: float | None = None


class StreamReport(msgspec.Struct, frozen=True):
    stream_id: str
    epoch: int
    seq: int
    batches: int
    events: int
    gaps: int
    restarts: int
    uncertain: bool
    pools: dict[str, PoolReport]
    findings: list[KvFinding]
    omitted_findings: int


def report(state: KvBlockState, block_bytes: int | None = None) -> list[StreamReport]:
    out = []
    for sid, s in state.streams.items():
        pools = {}
        for key in sorted(s.pools):
            p = s.pools[key]
            n = len(p.blocks)
            pools[key] = PoolReport(n, p.stored, p.removed, round(p.block_seconds, 6),
                                    None if block_bytes is None else n * block_bytes,
                                    None if block_bytes is None else round(p.block_seconds * block_bytes, 3))
        out.append(StreamReport(sid, s.epoch, s.seq, s.batches, s.events, s.gaps, s.restarts, s.uncertain,
                                pools, list(s.findings), s.omitted))
    return out


def resident(state: KvBlockState, stream_id: str) -> dict[str, list[Hash]]:
    """The resident block set of one stream, per pool, each sorted (ints before hex)."""
    s = state.streams.get(stream_id)
    if s is None:
        return {}
    return {key: sorted(p.blocks, key=lambda h: (isinstance(h, str), h))
            for key, p in sorted(s.pools.items()) if p.blocks}
