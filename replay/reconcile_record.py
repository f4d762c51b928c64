"""One telemetry record against the journal event it names, for reconcile.

What reconcile keeps of a journal event (Journaled) and of a telemetry record (Rec), the
findings it collects (Finding, Findings), and the checks of a paired record: a mutation
against the event it claims, an allocator or residency observation against the handle's
state after the event it follows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, TypedDict, Unpack

import msgspec

from kvledger.schemas.telemetry import (
    FINDING_CLASS,
    INFO_CODES,
    AllocatorObservation,
    Mutation,
    ReconcileCode,
    ResidencyObservation,
)

C = ReconcileCode
_FREEING = ("finish", "cancel_request")  # terminal, but the handle still owns its memory
MAX_POINTERS = 20  # lines/ids listed per finding; `count` says how many there were


class Finding(msgspec.Struct, frozen=True, omit_defaults=True):
    code: str
    finding_class: str
    severity: str  # "error" or "info"
    message: str
    lines: tuple[int, ...] = ()  # telemetry file lines
    record_ids: tuple[str, ...] = ()  # telemetry event_id of those records
    positions: tuple[int, ...] = ()  # journal global positions
    event_ids: tuple[str, ...] = ()  # journal event ids
    source: str | None = None  # "source_instance/source_component"
    sequences: tuple[int, ...] = ()  # local_sequence numbers concerned (a gap: first, last)
    metric: str | None = None
    scrape_lines: tuple[int, ...] = ()
    count: int | None = None
    labels: str | None = None  # a metric's label set, as Prometheus writes it
    claimed: float | None = None  # a metric's value in the scrape
    proven: float | None = None  # and what the journal proves


class Journaled(NamedTuple):
    """What reconcile keeps of one journal event (not the payload)."""

    position: int
    event_type: str
    stream_id: str
    request_id: str
    operation_id: str | None
    generation: int
    source_instance: str
    monotonic_ns: int
    wall: int
    base: int | None
    result: int | None
    committed: int | None
    outcome: str
    # the handle after this event (None when the stream cannot be folded)
    gen_after: int | None
    committed_after: int | None
    lifecycle_after: str | None
    b_token: int | None
    tiers: tuple[str, ...]


class Rec(NamedTuple):
    line: int
    rec: Mutation | AllocatorObservation | ResidencyObservation


class FindingExtras(TypedDict, total=False):
    source: str | None
    sequences: tuple[int, ...]
    metric: str | None
    scrape_lines: tuple[int, ...]
    count: int | None
    labels: str | None
    claimed: float | None
    proven: float | None


class Findings:
    def __init__(self) -> None:
        self.items: list[Finding] = []

    def add(self, code: ReconcileCode, message: str, *, recs: Iterable[Rec] = (),
            journal: Iterable[Journaled | None] = (), ids: Iterable[str] = (), lines: tuple[int, ...] | None = None,
            **kw: Unpack[FindingExtras]) -> None:
        recs = list(recs)
        js = [j for j in journal if j is not None]
        if lines is None:  # the telemetry lines of the records
            lines = tuple(r.line for r in recs)[:MAX_POINTERS]
        self.items.append(Finding(
            code=code.value, finding_class=FINDING_CLASS[code],
            severity="info" if code in INFO_CODES else "error", message=message,
            lines=lines, record_ids=tuple(r.rec.event_id for r in recs)[:MAX_POINTERS],
            positions=tuple(j.position for j in js)[:MAX_POINTERS],
            event_ids=tuple(ids)[:MAX_POINTERS], **kw))


def source_of(rec: Mutation | AllocatorObservation | ResidencyObservation) -> str:
    return f"{rec.source_instance}/{rec.source_component}"


def check_mutation(out: Findings, r: Rec, rec: Mutation, j: Journaled) -> None:  # rec: r.rec
    eid = rec.event_id
    if rec.handle_generation < j.generation:
        out.add(C.STALE_GENERATION, f"{rec.event_type} of {rec.handle_id} names generation "
                                    f"{rec.handle_generation}; the journal decided it at generation "
                                    f"{j.generation}", recs=(r,), journal=(j,), ids=(eid,), source=source_of(rec))
        return
    expected = {"event_type": j.event_type, "handle_id": j.stream_id, "request_id": j.request_id,
                "operation_id": j.operation_id, "handle_generation": j.generation,
                "base_snapshot": j.base, "result_snapshot": j.result, "outcome": j.outcome}
    if rec.committed_length is not None:
        expected["committed_length"] = j.committed
    wrong = [f"{k} {getattr(rec, k)!r} != {v!r}" for k, v in expected.items() if getattr(rec, k) != v]
    if wrong:
        out.add(C.TELEMETRY_CONTRADICTS_JOURNAL, f"record of {eid} disagrees with the journal: "
                                                 f"{'; '.join(wrong)}", recs=(r,), journal=(j,), ids=(eid,),
                source=source_of(rec))
    if rec.journal_watermark is None or j.position > rec.journal_watermark:
        out.add(C.UNPUBLISHED_SUCCESS, f"{rec.event_type} of {rec.handle_id} claimed {rec.outcome} "
                                       f"after the commit through position {rec.journal_watermark}, "
                                       f"but the journal published it later, at {j.position}",
                recs=(r,), journal=(j,), ids=(eid,), source=source_of(rec))
    elif rec.source_instance == j.source_instance and rec.monotonic_ns < j.monotonic_ns:
        out.add(C.UNPUBLISHED_SUCCESS, f"{rec.event_type} of {rec.handle_id} was claimed "
                                       f"{j.monotonic_ns - rec.monotonic_ns} ns before the event was "
                                       f"even stamped (same source clock)", recs=(r,), journal=(j,),
                ids=(eid,), source=source_of(rec))
    elif rec.source_instance != j.source_instance and rec.observed_wall_time < j.wall:
        out.add(C.NEGATIVE_DURATION, f"record of {eid} from {rec.source_instance} is "
                                     f"{j.wall - rec.observed_wall_time} ns (wall clock) older than the "
                                     f"event it describes from {j.source_instance}: wall clocks of two "
                                     f"sources cannot order them", recs=(r,), journal=(j,), ids=(eid,),
                source=source_of(rec))


def check_observation(out: Findings, r: Rec, rec: AllocatorObservation | ResidencyObservation, j: Journaled,
                      block_size: int | None) -> None:  # rec: r.rec
    cause = rec.caused_by_event_id
    src = source_of(rec)
    if rec.handle_id != j.stream_id:
        out.add(C.TELEMETRY_CONTRADICTS_JOURNAL, f"{rec.event_type} of {rec.handle_id} names cause "
                                                 f"{cause}, an event of {j.stream_id}", recs=(r,),
                journal=(j,), ids=(cause,), source=src)
        return
    if rec.observed_wall_time < j.wall:
        out.add(C.NEGATIVE_DURATION, f"{rec.event_type} of {rec.handle_id} is "
                                     f"{j.wall - rec.observed_wall_time} ns (wall clock) older than the "
                                     f"{j.event_type} it follows: a negative duration between two "
                                     f"sources; order them by causality, not wall time",
                recs=(r,), journal=(j,), ids=(cause,), source=src)
    if j.gen_after is None or j.committed_after is None or j.b_token is None:
        return  # the journal stream does not fold (all three None): verify reports why
    if rec.handle_generation != j.gen_after:
        code = C.STALE_GENERATION if rec.handle_generation < j.gen_after else C.TELEMETRY_CONTRADICTS_JOURNAL
        out.add(code, f"{rec.event_type} of {rec.handle_id} names generation {rec.handle_generation}; "
                      f"after {j.event_type} the journal has it at generation {j.gen_after}",
                recs=(r,), journal=(j,), ids=(cause,), source=src)
        return
    if isinstance(rec, AllocatorObservation):
        _check_allocator(out, r, rec, j, j.committed_after, block_size)
    elif isinstance(rec, ResidencyObservation):
        _check_residency(out, r, rec, j, j.committed_after, j.b_token)


def _retained(j: Journaled, committed: int) -> bool:
    """After finish or cancel, before release, the handle still owns its committed rows."""
    return j.event_type in _FREEING and j.lifecycle_after != "RELEASED" and committed > 0


def _check_allocator(out: Findings, r: Rec, rec: AllocatorObservation, j: Journaled, committed: int,
                     block_size: int | None) -> None:  # rec: r.rec
    cause, src = rec.caused_by_event_id, source_of(rec)
    if _retained(j, committed) and (rec.slots == 0 or rec.blocks == 0 or rec.used_slots == 0):
        out.add(C.FINISH_COUNTED_AS_FREE, f"allocator shows {rec.handle_id} free ({rec.blocks} "
                                          f"blocks, {rec.slots} slots, {rec.used_slots} used) after "
                                          f"{j.event_type}, but the handle still owns {committed} "
                                          f"committed rows until release", recs=(r,), journal=(j,),
                ids=(cause,), source=src)
        return
    wrong = []
    if rec.used_slots != committed:
        wrong.append(f"used_slots {rec.used_slots} != committed_length {committed}")
    if rec.slots < rec.used_slots:
        wrong.append(f"slots {rec.slots} < used_slots {rec.used_slots}")
    if rec.blocks != -(-rec.slots // rec.block_size):
        wrong.append(f"blocks {rec.blocks} != ceil({rec.slots} / {rec.block_size})")
    if block_size is not None and rec.block_size != block_size:
        wrong.append(f"block_size {rec.block_size} != declared {block_size}")
    if wrong:
        out.add(C.ALLOCATOR_DRIFT, f"allocator after {j.event_type} of {rec.handle_id}: "
                                   f"{'; '.join(wrong)}", recs=(r,), journal=(j,), ids=(cause,),
                source=src)


def _check_residency(out: Findings, r: Rec, rec: ResidencyObservation, j: Journaled, committed: int,
                     b_token: int) -> None:  # rec: r.rec
    cause, src = rec.caused_by_event_id, source_of(rec)
    total = sum(rec.resident_payload_bytes.values())
    if _retained(j, committed) and total == 0:
        out.add(C.FINISH_COUNTED_AS_FREE, f"residency shows 0 payload bytes for {rec.handle_id} "
                                          f"after {j.event_type}, but the handle still owns "
                                          f"{committed} committed rows until release", recs=(r,),
                journal=(j,), ids=(cause,), source=src)
        return
    wrong = []
    for tier, got in sorted(rec.resident_payload_bytes.items()):
        want = committed * b_token * j.tiers.count(tier)
        if got != want:
            wrong.append(f"{tier}: {got} B != {committed} x {b_token} B x "
                         f"{j.tiers.count(tier)} cop{'y' if j.tiers.count(tier) == 1 else 'ies'} = {want} B")
    if wrong:
        out.add(C.RESIDENCY_DRIFT, f"residency after {j.event_type} of {rec.handle_id}: "
                                   f"{'; '.join(wrong)}", recs=(r,), journal=(j,), ids=(cause,),
                source=src)
