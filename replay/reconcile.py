"""reconcile: what telemetry claims against what the journal proves (spec 0x07).

A pure function over (journal events in global order, telemetry lines, an optional
Prometheus scrape). The journal is the truth; every plane of the telemetry is checked
against it, and every finding names the telemetry record(s) (file line, record id)
and the journal event(s) (global position, event id) it points to.

Classes and codes (schemas.telemetry.ReconcileCode, FINDING_CLASS):
  unpublished_success     UNPUBLISHED_SUCCESS: a committed outcome the journal never
                          published, or published after the commit the record says it
                          follows (journal_watermark), or before the event was even
                          stamped on the same clock; UNPUBLISHED_CAUSE: an observation
                          following an event the journal does not have
  lost_audit              LOST_AUDIT: a journal event (in the file's declared scope) with
                          no record, per expected component; SEQUENCE_GAP and
                          SEQUENCE_REGRESSION in one source's local_sequence
  duplicate_delivery      DUPLICATE_DELIVERY (info): same id, same content, deduplicated
  duplicate_corruption    CORRUPT_DUPLICATE: same id, different content
  stale_generation        STALE_GENERATION: a generation the journal had already fenced
  impossible_ordering     NEGATIVE_DURATION: a source's monotonic clock ran backwards, or
                          a record's wall clock precedes the wall clock of its cause in
                          another source (wall clocks cannot order two sources)
  unbounded_label         UNBOUNDED_LABEL: an identity (request, trace, operation, event
                          id...) as a metric label
  finish_counted_as_free  FINISH_COUNTED_AS_FREE: an observation after finish/cancel that
                          shows the handle's memory free while the journal still retains it
  plane_drift             ALLOCATOR_DRIFT / RESIDENCY_DRIFT under the declared conversion
                          (schemas.telemetry.CONVERSION)
  contradiction           TELEMETRY_CONTRADICTS_JOURNAL: other fields of a paired record
  malformed               MALFORMED_RECORD
  sampled                 SAMPLED_NO_ABSENCE (info): the file is sampled, or declares no
                          header, so missing records prove nothing; never a finding

Absence (LOST_AUDIT, SEQUENCE_GAP) is concluded only from a file whose header declares
sample_rate 1, and only for journal events in its scope: the header's source_instance,
after its after_position, up to the trailer's last_position when there is one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, TypedDict, Unpack

import msgspec

from kvledger.engine.evolve import evolve
from kvledger.engine.state import HandleState
from kvledger.replay.metric_proof import Sample, family, parse_scrape, prove, scrape_position
from kvledger.replay.service_fold import ServiceFold
from kvledger.schemas import events as ev
from kvledger.schemas.telemetry import (
    ALLOCATOR,
    FINDING_CLASS,
    IDENTITY_LABELS,
    INFO_CODES,
    REFUSED,
    RESIDENCY,
    SERVICE,
    AllocatorObservation,
    Header,
    Mutation,
    ReconcileCode,
    Record,
    ResidencyObservation,
    Trailer,
    event_outcome,
    event_snapshots,
    record_decoder,
)

C = ReconcileCode
_FREEING = ("finish", "cancel_request")  # terminal, but the handle still owns its memory
_MAX_POINTERS = 20  # lines/ids listed per finding; `count` says how many there were


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


class Summary(msgspec.Struct, frozen=True):
    journal_events: int
    in_scope: int  # journal events the telemetry declares it covers
    telemetry_lines: int
    mutations: int
    refused: int  # outcome records of refused commands (no journal event, by design)
    observations: int
    duplicates: int  # byte-equivalent re-deliveries, deduplicated
    paired: int  # mutation records matched to their journal event
    complete: bool  # a header declares the unsampled stream: absence can be concluded
    sample_rate: float | None
    metric_series: int | None
    # --metrics: series whose values were proven against the journal, the position they
    # were proven at, and what was checked for its labels only (why, when it is everything)
    metric_values_proven: int | None = None
    metric_position: int | None = None
    metrics_labels_only: tuple[str, ...] = ()
    metrics_scope: str | None = None


class ReconcileResult(msgspec.Struct, frozen=True):
    summary: Summary
    findings: list[Finding]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors


class _J(NamedTuple):
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


class _Scope(NamedTuple):
    """The journal events a scrape's service counted: its source's, in (after, upto]."""

    source_instance: str
    after: int
    upto: int
    fold: ServiceFold


def _fold(events: Iterable[ev.Event], scope: _Scope | None = None) -> tuple[dict[str, _J], list[str], int]:
    index: dict[str, _J] = {}
    order: list[str] = []
    states: dict[str, HandleState] = {}
    broken: set[str] = set()
    last = 0
    for e in events:
        if scope is not None and e.source_instance == scope.source_instance \
                and scope.after < e.global_position <= scope.upto:
            scope.fold.apply((e,))
        s: HandleState | None = None
        if e.stream_id not in broken:
            try:
                s = evolve(states.get(e.stream_id), e)
                states[e.stream_id] = s
            except Exception:  # noqa: BLE001 - a corrupt stream is verify's finding, not ours
                broken.add(e.stream_id)
        base, result, committed = event_snapshots(e)
        index[e.event_id] = _J(
            e.global_position, e.event_type, e.stream_id, e.request_id, e.operation_id,
            e.handle_generation, e.source_instance, e.monotonic_ns, e.observed_wall_time, base, result,
            committed, event_outcome(e),
            None if s is None else s.generation, None if s is None else s.committed_length,
            None if s is None else s.lifecycle, None if s is None else s.b_token,
            () if s is None else s.copy_tiers)
        order.append(e.event_id)
        last = max(last, e.global_position)
    return index, order, last


class _Rec(NamedTuple):
    line: int
    rec: Mutation | AllocatorObservation | ResidencyObservation


class _FindingExtras(TypedDict, total=False):
    source: str | None
    sequences: tuple[int, ...]
    metric: str | None
    scrape_lines: tuple[int, ...]
    count: int | None
    labels: str | None
    claimed: float | None
    proven: float | None


class _Findings:
    def __init__(self) -> None:
        self.items: list[Finding] = []

    def add(self, code: ReconcileCode, message: str, *, recs: Iterable[_Rec] = (),
            journal: Iterable[_J | None] = (), ids: Iterable[str] = (), lines: tuple[int, ...] | None = None,
            **kw: Unpack[_FindingExtras]) -> None:
        recs = list(recs)
        js = [j for j in journal if j is not None]
        if lines is None:  # the telemetry lines of the records
            lines = tuple(r.line for r in recs)[:_MAX_POINTERS]
        self.items.append(Finding(
            code=code.value, finding_class=FINDING_CLASS[code],
            severity="info" if code in INFO_CODES else "error", message=message,
            lines=lines, record_ids=tuple(r.rec.event_id for r in recs)[:_MAX_POINTERS],
            positions=tuple(j.position for j in js)[:_MAX_POINTERS],
            event_ids=tuple(ids)[:_MAX_POINTERS], **kw))


def _src(rec: Mutation | AllocatorObservation | ResidencyObservation) -> str:
    return f"{rec.source_instance}/{rec.source_component}"


def reconcile(journal_events: Iterable[ev.Event], telemetry: Iterable[tuple[int, bytes]],
              scrape: str | None = None) -> ReconcileResult:
    """journal_events: decoded events in global order; telemetry: (line, body) pairs;
    scrape: a Prometheus text exposition, or None."""
    # The telemetry is read first: its header and trailer say which journal events a
    # scrape's values count, and the journal is folded once.
    decoded: list[tuple[int, Record | str]] = []  # a record, or why the line is none
    for line, body in telemetry:
        try:
            decoded.append((line, record_decoder.decode(body)))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            decoded.append((line, str(exc)))
    samples = parse_scrape(scrape) if scrape is not None else None
    scope, why = _metrics_scope(decoded, samples)
    index, order, last_position = _fold(journal_events, scope)
    out = _Findings()

    # -- deduplicate ---------------------------------------------------------------------
    header: tuple[int, Header] | None = None
    trailer: Trailer | None = None
    first: dict[str, _Rec] = {}
    records: list[_Rec] = []
    lines = duplicates = 0
    for line, rec in decoded:
        lines += 1
        if isinstance(rec, str):
            out.add(C.MALFORMED_RECORD, f"not a telemetry record: {rec}", lines=(line,))
            continue
        if isinstance(rec, Header):
            if header is None:
                header = (line, rec)
            elif rec != header[1]:
                out.add(C.MALFORMED_RECORD, f"a second, different header (first at line {header[0]})",
                        lines=(line,))
            continue
        if isinstance(rec, Trailer):
            trailer = rec if trailer is None else trailer
            continue
        r = _Rec(line, rec)
        seen = first.get(rec.event_id)
        if seen is None:
            first[rec.event_id] = r
            records.append(r)
        elif seen.rec == rec:
            duplicates += 1
            out.add(C.DUPLICATE_DELIVERY, f"record {rec.event_id} delivered again with the same "
                                          f"content (line {seen.line}): deduplicated, counted once",
                    recs=(seen, r), journal=(index.get(rec.event_id),), ids=_ids(index, rec.event_id))
        else:
            diff = _diff(seen.rec, rec)
            out.add(C.CORRUPT_DUPLICATE, f"record {rec.event_id} delivered again with different "
                                         f"content ({', '.join(diff)}) than line {seen.line}",
                    recs=(seen, r), journal=(index.get(rec.event_id),), ids=_ids(index, rec.event_id))

    hdr = header[1] if header is not None else None
    complete = hdr is not None and hdr.sample_rate >= 1.0

    # -- each source's local sequence and monotonic clock ------------------------------
    by_source: dict[str, list[_Rec]] = {}
    for r in records:
        by_source.setdefault(_src(r.rec), []).append(r)
    for source, recs in by_source.items():
        recs.sort(key=lambda r: (r.rec.local_sequence, r.line))
        expected = 1
        prev: _Rec | None = None
        for r in recs:
            seq = r.rec.local_sequence
            if prev is not None and seq == prev.rec.local_sequence:
                out.add(C.SEQUENCE_REGRESSION, f"{source}: local_sequence {seq} names two different "
                                               f"records: the source's counter went back",
                        recs=(prev, r), source=source, sequences=(seq,))
            else:
                if complete and seq > expected:
                    missing = f"{expected}" if seq == expected + 1 else f"{expected}..{seq - 1}"
                    out.add(C.SEQUENCE_GAP, f"{source}: local_sequence {missing} missing "
                                            f"({seq - expected} record(s) lost between these)",
                            recs=(prev, r) if prev is not None else (r,), source=source,
                            sequences=(expected, seq - 1), count=seq - expected)
                if prev is not None and r.rec.monotonic_ns < prev.rec.monotonic_ns:
                    out.add(C.NEGATIVE_DURATION, f"{source}: monotonic clock runs backwards by "
                                                 f"{prev.rec.monotonic_ns - r.rec.monotonic_ns} ns "
                                                 f"from sequence {prev.rec.local_sequence} to {seq}",
                            recs=(prev, r), source=source)
            expected = max(expected, seq + 1)
            prev = r

    # -- records against the journal -----------------------------------------------------
    paired: set[str] = set()
    observed: set[tuple[str, str]] = set()  # (component, cause event id)
    mutations = refused = observations = 0
    block_size = hdr.block_size if hdr is not None else None
    for r in records:
        rec = r.rec
        if isinstance(rec, Mutation):
            mutations += 1
            j = index.get(rec.event_id)
            if j is None:
                if rec.outcome == REFUSED:
                    refused += 1
                    continue
                behind = (f"; the journal ends at position {last_position}, before the commit the "
                          f"record follows ({rec.journal_watermark}): is it a complete copy?"
                          if rec.journal_watermark is not None and rec.journal_watermark > last_position
                          else "")
                out.add(C.UNPUBLISHED_SUCCESS, f"{rec.event_type} of {rec.handle_id} claimed "
                                               f"{rec.outcome}, but the journal never published "
                                               f"event {rec.event_id}{behind}", recs=(r,),
                        source=_src(rec))
                continue
            paired.add(rec.event_id)
            _check_mutation(out, r, rec, j)
        else:
            observations += 1
            j = index.get(rec.caused_by_event_id)
            if j is None:
                out.add(C.UNPUBLISHED_CAUSE, f"{rec.event_type} of {rec.handle_id} follows event "
                                             f"{rec.caused_by_event_id}, which the journal never "
                                             f"published", recs=(r,), source=_src(rec))
                continue
            observed.add((rec.source_component, rec.caused_by_event_id))
            _check_observation(out, r, rec, j, block_size)

    # -- what the journal published and the telemetry never said -------------------------
    in_scope = 0
    unseen = 0
    if header is not None and hdr is not None:  # hdr: header[1]
        end = trailer.last_position if trailer is not None else last_position
        observers = [k for k in (ALLOCATOR, RESIDENCY) if k in hdr.components]
        for eid in order:
            j = index[eid]
            if j.source_instance != hdr.source_instance or not hdr.after_position < j.position <= end:
                continue
            in_scope += 1
            expect = [SERVICE] if SERVICE in hdr.components else []
            if j.event_type in hdr.observed_event_types:
                expect += observers
            for component in expect:
                have = eid in paired if component == SERVICE else (component, eid) in observed
                if have:
                    continue
                if not complete:
                    unseen += 1
                    continue
                what = "record" if component == SERVICE else "observation"
                out.add(C.LOST_AUDIT, f"{j.event_type} of {j.stream_id} at position {j.position} "
                                      f"was published, but {hdr.source_instance}/{component} has no "
                                      f"{what} of it", journal=(j,), ids=(eid,),
                        source=f"{hdr.source_instance}/{component}")
        if not complete and unseen:
            out.add(C.SAMPLED_NO_ABSENCE, f"{unseen} expected record(s) of {in_scope} in-scope "
                                          f"journal events are missing from a stream sampled at "
                                          f"{hdr.sample_rate}: absence is not concluded",
                    lines=(header[0],), count=unseen)
    else:
        known = {r.rec.source_instance for r in records}
        unseen = sum(1 for eid in order if index[eid].source_instance in known and eid not in paired)
        if unseen:
            out.add(C.SAMPLED_NO_ABSENCE, f"no header declares this telemetry complete: {unseen} "
                                          f"journal event(s) without a record prove nothing",
                    count=unseen)

    proof = None
    if samples is not None:
        _check_labels(out, samples, index, records)
        proof = prove(samples, scope.fold if scope is not None else None)
        for d in proof.drifts:
            out.add(C.METRIC_CONTRADICTS_JOURNAL,
                    f"metric {d.metric}{d.labels} is {d.claimed:g} in the scrape; the journal proves {d.proven:g} "
                    f"({why})", metric=d.metric, scrape_lines=d.lines[:_MAX_POINTERS], labels=d.labels,
                    claimed=d.claimed, proven=d.proven)

    summary = Summary(
        journal_events=len(order), in_scope=in_scope, telemetry_lines=lines, mutations=mutations,
        refused=refused, observations=observations, duplicates=duplicates, paired=len(paired),
        complete=complete, sample_rate=hdr.sample_rate if hdr is not None else None,
        metric_series=len(samples) if samples is not None else None,
        metric_values_proven=proof.checked if proof is not None else None,
        metric_position=scope.upto if scope is not None else None,
        metrics_labels_only=proof.labels_only if proof is not None else (),
        metrics_scope=why or None)
    return ReconcileResult(summary, out.items)


def _metrics_scope(decoded: list[tuple[int, Record | str]],
                   samples: list[Sample] | None) -> tuple[_Scope | None, str]:
    """Which journal events a scrape counts: after the header's position, up to the
    scrape's own kvledger_journal_position (else the trailer's), of the header's source.
    None (and why) when the files do not say."""
    if samples is None:
        return None, ""
    header = next((r for _, r in decoded if isinstance(r, Header)), None)
    trailer = next((r for _, r in decoded if isinstance(r, Trailer)), None)
    if header is None:
        return None, "no telemetry header says which journal events the scrape counts: labels only"
    upto = scrape_position(samples)
    where = "its kvledger_journal_position"
    if upto is None and trailer is not None:
        upto, where = trailer.last_position, "the trailer's last_position (the scrape names no position)"
    if upto is None:
        return None, ("the scrape names no kvledger_journal_position and the telemetry has no trailer: "
                      "labels only")
    return (_Scope(header.source_instance, header.after_position, upto, ServiceFold()),
            f"events of {header.source_instance} after position {header.after_position} up to {upto}, "
            f"{where}")


def _ids(index: dict[str, _J], eid: str) -> tuple[str, ...]:
    return (eid,) if eid in index else ()


def _diff(a: msgspec.Struct, b: msgspec.Struct) -> list[str]:
    if type(a) is not type(b):
        return [f"record kind {a.__struct_config__.tag} vs {b.__struct_config__.tag}"]
    return [f for f in a.__struct_fields__ if getattr(a, f) != getattr(b, f)]


def _check_mutation(out: _Findings, r: _Rec, rec: Mutation, j: _J) -> None:  # rec: r.rec
    eid = rec.event_id
    if rec.handle_generation < j.generation:
        out.add(C.STALE_GENERATION, f"{rec.event_type} of {rec.handle_id} names generation "
                                    f"{rec.handle_generation}; the journal decided it at generation "
                                    f"{j.generation}", recs=(r,), journal=(j,), ids=(eid,), source=_src(rec))
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
                source=_src(rec))
    if rec.journal_watermark is None or j.position > rec.journal_watermark:
        out.add(C.UNPUBLISHED_SUCCESS, f"{rec.event_type} of {rec.handle_id} claimed {rec.outcome} "
                                       f"after the commit through position {rec.journal_watermark}, "
                                       f"but the journal published it later, at {j.position}",
                recs=(r,), journal=(j,), ids=(eid,), source=_src(rec))
    elif rec.source_instance == j.source_instance and rec.monotonic_ns < j.monotonic_ns:
        out.add(C.UNPUBLISHED_SUCCESS, f"{rec.event_type} of {rec.handle_id} was claimed "
                                       f"{j.monotonic_ns - rec.monotonic_ns} ns before the event was "
                                       f"even stamped (same source clock)", recs=(r,), journal=(j,),
                ids=(eid,), source=_src(rec))
    elif rec.source_instance != j.source_instance and rec.observed_wall_time < j.wall:
        out.add(C.NEGATIVE_DURATION, f"record of {eid} from {rec.source_instance} is "
                                     f"{j.wall - rec.observed_wall_time} ns (wall clock) older than the "
                                     f"event it describes from {j.source_instance}: wall clocks of two "
                                     f"sources cannot order them", recs=(r,), journal=(j,), ids=(eid,),
                source=_src(rec))


def _check_observation(out: _Findings, r: _Rec, rec: AllocatorObservation | ResidencyObservation, j: _J,
                       block_size: int | None) -> None:  # rec: r.rec
    cause = rec.caused_by_event_id
    src = _src(rec)
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
    committed = j.committed_after
    retained = j.event_type in _FREEING and j.lifecycle_after != "RELEASED" and committed > 0
    if isinstance(rec, AllocatorObservation):
        if retained and (rec.slots == 0 or rec.blocks == 0 or rec.used_slots == 0):
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
    elif isinstance(rec, ResidencyObservation):
        total = sum(rec.resident_payload_bytes.values())
        if retained and total == 0:
            out.add(C.FINISH_COUNTED_AS_FREE, f"residency shows 0 payload bytes for {rec.handle_id} "
                                              f"after {j.event_type}, but the handle still owns "
                                              f"{committed} committed rows until release", recs=(r,),
                    journal=(j,), ids=(cause,), source=src)
            return
        wrong = []
        for tier, got in sorted(rec.resident_payload_bytes.items()):
            want = committed * j.b_token * j.tiers.count(tier)
            if got != want:
                wrong.append(f"{tier}: {got} B != {committed} x {j.b_token} B x "
                             f"{j.tiers.count(tier)} cop{'y' if j.tiers.count(tier) == 1 else 'ies'} = {want} B")
        if wrong:
            out.add(C.RESIDENCY_DRIFT, f"residency after {j.event_type} of {rec.handle_id}: "
                                       f"{'; '.join(wrong)}", recs=(r,), journal=(j,), ids=(cause,),
                    source=src)


def _check_labels(out: _Findings, samples: list[Sample], index: dict[str, _J], records: list[_Rec]) -> None:
    """Label values that carry identity grow with traffic: one finding per (family,
    label), pointing at the scrape lines."""
    known: set[str] = set(index)
    for j in index.values():
        known.add(j.request_id)
        known.add(j.stream_id)
        if j.operation_id:
            known.add(j.operation_id)
    for r in records:
        known.update((r.rec.event_id, r.rec.trace_id, r.rec.request_id, r.rec.handle_id))
    hits: dict[tuple[str, str], tuple[list[int], set[str]]] = {}
    for s in samples:
        for label, value in s.labels:
            if label in IDENTITY_LABELS or value in known:
                lines, values = hits.setdefault((family(s.name), label), ([], set()))
                lines.append(s.line)
                values.add(value)
    for (fam, label), (lines, values) in hits.items():
        why = "names an identity" if label in IDENTITY_LABELS else "takes request/event id values"
        out.add(C.UNBOUNDED_LABEL, f"metric {fam} label {label!r} {why}: {len(values)} value(s) in "
                                   f"this scrape, one series each, growing with traffic; keep "
                                   f"identity in traces, audit records or logs",
                metric=fam, scrape_lines=tuple(lines[:_MAX_POINTERS]), count=len(values))


__all__ = ["Finding", "ReconcileResult", "Summary", "reconcile"]
