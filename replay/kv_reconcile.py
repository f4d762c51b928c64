"""`kvledger reconcile --kv-index FILE.json`: a KV-aware router's index dump against the
journal's block pool (replay.kv_blocks) at a position.

The dump: `{"streams": {STREAM_ID: {HASH: [MEDIUM, ...], ...}, ...}}`, optionally
`"position": N`. A HASH is the block hash as the journal writes it: lowercase hex for a
bytes hash, the decimal digits of an int hash. Media are the engine's names ("GPU",
"CPU", ...; "-" for none).

Findings, per (stream, hash, medium):
- KV_INDEX_MISSING: resident in the journal, absent from the index;
- KV_INDEX_EXTRA: in the index, not resident in the journal, and never was before a
  reset of the stream (an index bug or a store the journal never saw);
- KV_INDEX_STALE: in the index, not resident now, but resident before the stream's
  last publisher restart or gap: the index kept state the engine no longer has.
A finding on a stream that is uncertain at that position (after a gap, before a clear)
says so: the journal itself cannot tell there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from kvledger.replay.kv_blocks import KvBlocks
from kvledger.schemas import events as ev
from kvledger.schemas.errors import ErrorCode, KvLedgerError

MISSING = "KV_INDEX_MISSING"
EXTRA = "KV_INDEX_EXTRA"
STALE = "KV_INDEX_STALE"


class KvIndexFinding(msgspec.Struct, frozen=True, omit_defaults=True):
    code: str
    stream_id: str
    block_hash: int | str
    medium: str
    message: str
    uncertain: bool = False


class KvIndexResult(msgspec.Struct, frozen=True):
    """What reconcile --kv-index prints: the position compared at, the counts of
    (stream, block, medium) on each side, and the findings (none: they agree)."""

    position: int
    streams: int
    journal_blocks: int
    index_blocks: int
    findings: list[KvIndexFinding]

    @property
    def ok(self) -> bool:
        return not self.findings


Entry = tuple[str, str]  # (hash key as in the dump, medium)


def _key(h: int | str) -> str:
    return str(h)


def parse_index(doc: Any) -> tuple[dict[str, set[Entry]], int | None]:
    """The dump's entries per stream, and its position if it names one; INVALID_ARGUMENT
    for anything else."""
    def bad(msg: str) -> KvLedgerError:
        return KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"kv index: {msg}")

    if not isinstance(doc, dict) or not isinstance(doc.get("streams"), dict):
        raise bad('expected {"streams": {STREAM_ID: {HASH: [MEDIUM, ...]}}}')
    position = doc.get("position")
    if position is not None and (not isinstance(position, int) or isinstance(position, bool) or position < 0):
        raise bad("position must be an integer >= 0")
    out: dict[str, set[Entry]] = {}
    for sid, blocks in doc["streams"].items():
        if not isinstance(blocks, dict):
            raise bad(f"stream {sid[:80]!r}: expected {{HASH: [MEDIUM, ...]}}")
        entries = out.setdefault(sid, set())
        for h, media in blocks.items():
            if not isinstance(media, list) or not all(isinstance(m, str) for m in media):
                raise bad(f"stream {sid[:80]!r}, block {h[:80]!r}: media must be a list of strings")
            entries.update((h, m) for m in media)
    return out, position


def reconcile_index(events: Iterable[ev.Event], index: dict[str, set[Entry]]) -> KvIndexResult:
    """Fold the KV-event streams of `events` (already cut at the position) and compare."""
    fold = KvBlocks()
    before_reset: dict[str, dict[Entry, str]] = {}  # what was resident before each restart / gap
    position = 0
    for e in events:
        position = e.global_position
        if not isinstance(e, ev.KV_EVENT_CLASSES):
            continue
        if isinstance(e, (ev.KvEventsRestartEvent, ev.KvEventsGapEvent)):
            why = "restart" if isinstance(e, ev.KvEventsRestartEvent) else "gap"
            seen = before_reset.setdefault(e.stream_id, {})
            for entry in _entries(fold, e.stream_id):
                seen[entry] = why
        fold.apply(e)  # type: ignore[arg-type]  # narrowed by the tuple
    findings: list[KvIndexFinding] = []
    journal_blocks = index_blocks = 0
    for sid in sorted(set(fold.state.streams) | set(index)):
        have = _entries(fold, sid)
        told = index.get(sid, set())
        journal_blocks += len(have)
        index_blocks += len(told)
        s = fold.state.streams.get(sid)
        uncertain = bool(s and s.uncertain)
        for h, m in sorted(have - told):
            findings.append(KvIndexFinding(MISSING, sid, h, m, f"block {h} is resident in {m} but not in the index",
                                           uncertain))
        for h, m in sorted(told - have):
            reset = before_reset.get(sid, {}).get((h, m))
            if reset is not None:
                findings.append(KvIndexFinding(STALE, sid, h, m, f"block {h} in {m} was resident before the stream's "
                                                                 f"{reset}, not since", uncertain))
            else:
                findings.append(KvIndexFinding(EXTRA, sid, h, m, f"block {h} in {m} is not resident in the journal",
                                               uncertain))
    return KvIndexResult(position, len(fold.state.streams), journal_blocks, index_blocks, findings)


def _entries(fold: KvBlocks, sid: str) -> set[Entry]:
    s = fold.state.streams.get(sid)
    if s is None:
        return set()
    return {(_key(h), key.split("/", 1)[0]) for key, pool in s.pools.items() for h in pool.blocks}
