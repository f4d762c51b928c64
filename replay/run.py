"""Replay entry points shared by the CLI and the Python API: full, time travel
(`at`: the first N events) and incremental (resume from a checkpoint in the journal).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from kvledger.journal.contract import ChainAt, HeadFacts
from kvledger.journal.port import FoldItem, Journal
from kvledger.journal.tuning import collector_paused
from kvledger.replay.metrics import WindowSpec
from kvledger.replay.projector import Projector
from kvledger.replay.report import Report, build
from kvledger.replay.sources import fold_items, jsonl_events
from kvledger.schemas.codec import decode_event
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.kv_events import KV_LIFECYCLE

CHECKPOINT = "replay"  # default checkpoint name in kvl_checkpoints

Progress = Callable[[int], None]  # called with the number of events applied so far


def project(events: Iterable[FoldItem], *, projector: Projector | None = None,
            trajectory: bool = False, progress: Progress | None = None) -> Projector:
    """Fold events (in global order) into a projector, new or resumed."""
    p = projector if projector is not None else Projector(trajectory=trajectory)
    with collector_paused():
        if progress is None:
            return p.feed(events)
        batch: list[FoldItem] = []
        base = p.position  # a decode step may come whole: count positions, not items
        for e in events:
            batch.append(e)
            if len(batch) == 4096:
                p.feed(batch)
                batch.clear()
                progress(p.position - base)
        p.feed(batch)
        progress(p.position - base)
    return p




def _check_at(p: Projector, at: int | None) -> None:
    if at is not None and p.position < at:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT,
                            f"--at {at} is past the end of the journal (last position {p.position})")


def _limit(at: int | None) -> int | None:
    if at is not None and at < 0:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"--at must be >= 0, got {at}")
    return at


def replay_jsonl(path: str | Path, window: WindowSpec, *, at: int | None = None,
                 trajectory: bool = False, progress: Progress | None = None,
                 block_bytes: int | None = None) -> Report:
    """Replay an audit file with no database: the first `at` lines, or all of them."""
    p = project(jsonl_events(path, _limit(at)), trajectory=trajectory, progress=progress)
    _check_at(p, at)
    return build(p, window, block_bytes=block_bytes)


def replay_journal(journal: Journal, window: WindowSpec, *, at: int | None = None,
                   trajectory: bool = False, progress: Progress | None = None,
                   block_bytes: int | None = None) -> Report:
    """Replay a journal database: positions 1..at, or all of it (then its head rows must
    agree with the events read)."""
    ends = None if at is not None else _ends(journal)
    p = project(fold_items(journal, 0, _limit(at)), trajectory=trajectory, progress=progress)
    _check_at(p, at)
    if ends is not None:
        _check_ends(p, *ends)
    return build(p, window, block_bytes=block_bytes)


def _ends(journal: Journal) -> tuple[dict[str, HeadFacts], ChainAt]:
    """The head rows and where the journal ends, in one snapshot, read before the events:
    a writer committing meanwhile only moves the events read past them."""
    with journal.snapshot() as snap:
        return snap.heads(), snap.chain_at()


def _check_ends(p: Projector, heads: dict[str, HeadFacts], end: ChainAt) -> None:
    """CORRUPT_JOURNAL naming the first disagreement between the head rows (read before
    the events) and the events replay read: a head row naming a record past the end, or
    a stream's head past its last event, or a stream with no event at all. What deleted
    records leave behind; a whole rollback leaves none (`verify --expect` finds it)."""
    def refuse(what: str) -> KvLedgerError:
        return KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"the journal's head rows and records disagree: {what} "
                                                        "(records deleted? run `kvledger verify`)")

    if end.named is not None and end.named > end.last_position:
        raise refuse(f"a head row names the record ending at position {end.named}, past the journal's end "
                     f"at {end.last_position}")
    handles, kv = p.handles, p.kv.state.streams
    for sid, h in heads.items():
        s = handles.get(sid)
        if s is not None:
            if h.stream_position > s.stream_position:
                raise refuse(f"the head of {sid!r} is at stream position {h.stream_position}, its last event "
                             f"at {s.stream_position}")
        elif not (h.lifecycle == KV_LIFECYCLE and sid in kv):
            raise refuse(f"the head of {sid!r} is at stream position {h.stream_position}, and no event of "
                         "it was read")


def resume(journal: Journal, name: str = CHECKPOINT) -> Projector:
    """The projector stored under `name`, if it still describes this journal: same
    format, and the event at its position is the one it last applied. Otherwise a new
    projector (a rebuilt journal or a changed projection format replays from 1)."""
    stored = journal.load_checkpoint(name)
    if stored is None:
        return Projector()
    position, blob = stored
    p = Projector.load(blob)
    if p is None or p.position != position:
        return Projector()
    if position > 0:
        rows = list(journal.read_raw(position - 1, 1))
        if not rows or rows[0][0] != position or decode_event(rows[0][1]).event_id != p.last_event_id:
            return Projector()
    return p


def replay_incremental(journal: Journal, window: WindowSpec, *, name: str = CHECKPOINT,
                       progress: Progress | None = None, block_bytes: int | None = None) -> tuple[Report, int]:
    """Resume from the stored checkpoint, apply what was appended since, store the new
    checkpoint. Returns the report and the position it resumed from (0: from scratch)."""
    p = resume(journal, name)
    start = p.position
    ends = _ends(journal)
    project(fold_items(journal, start), projector=p, progress=progress)
    _check_ends(p, *ends)
    if p.position != start or start == 0:
        journal.save_checkpoint(name, p.position, p.dump())
    return build(p, window, block_bytes=block_bytes), start
