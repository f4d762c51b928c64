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
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from kvledger.engine.evolve import evolve
from kvledger.engine.state import HandleState
from kvledger.replay.metric_proof import Proof, Sample, family, parse_scrape, prove, scrape_position
from kvledger.replay.reconcile_record import (
    MAX_POINTERS,
    C,
    Finding,
    Findings,
    Journaled,
    Rec,
    check_mutation,
    check_observation,
    source_of,
)
from kvledger.replay.service_fold import ServiceFold
from kvledger.schemas import events as ev
from kvledger.schemas.telemetry import (
    ALLOCATOR,
    IDENTITY_LABELS,
    REFUSED,
    RESIDENCY,
    SERVICE,
    Header,
    Mutation,
    Record,
    Trailer,
    event_outcome,
    event_snapshots,
    record_decoder,
)


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


class _Scope(NamedTuple):
    """The journal events a scrape's service counted: its source's, in (after, upto]."""

    source_instance: str
    after: int
    upto: int
    fold: ServiceFold


def _fold(events: Iterable[ev.Event], scope: _Scope | None = None) -> tuple[dict[str, Journaled], list[str], int]:
    index: dict[str, Journaled] = {}
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
        index[e.event_id] = Journaled(
            e.global_position, e.event_type, e.stream_id, e.request_id, e.operation_id,
            e.handle_generation, e.source_instance, e.monotonic_ns, e.observed_wall_time, base, result,
            committed, event_outcome(e),
            None if s is None else s.generation, None if s is None else s.committed_length,
            None if s is None else s.lifecycle, None if s is None else s.b_token,
            () if s is None else s.copy_tiers)
        order.append(e.event_id)
        last = max(last, e.global_position)
    return index, order, last


@dataclass
class _Telemetry:
    """The telemetry lines, deduplicated: the header (and its line), the trailer, each record once."""

    header: tuple[int, Header] | None = None
    trailer: Trailer | None = None
    records: list[Rec] = field(default_factory=list)
    lines: int = 0
    duplicates: int = 0

    @property
    def hdr(self) -> Header | None:
        return self.header[1] if self.header is not None else None

    @property
    def complete(self) -> bool:
        """A header declares the stream unsampled: absence can be concluded."""
        return self.header is not None and self.header[1].sample_rate >= 1.0


@dataclass
class _Pairs:
    """Records matched to the journal events they name."""

    paired: set[str] = field(default_factory=set)  # mutation records' event ids
    observed: set[tuple[str, str]] = field(default_factory=set)  # (component, cause event id)
    mutations: int = 0
    refused: int = 0
    observations: int = 0


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
    out = Findings()
    tel = _deduplicate(out, decoded, index)
    _check_sequences(out, tel)
    pairs = _pair(out, tel, index, last_position)
    in_scope = _check_absence(out, tel, pairs, index, order, last_position)
    proof = None
    if samples is not None:
        proof = _check_metrics(out, samples, scope, why, index, tel.records)
    hdr = tel.hdr
    summary = Summary(
        journal_events=len(order), in_scope=in_scope, telemetry_lines=tel.lines, mutations=pairs.mutations,
        refused=pairs.refused, observations=pairs.observations, duplicates=tel.duplicates,
        paired=len(pairs.paired), complete=tel.complete, sample_rate=hdr.sample_rate if hdr is not None else None,
        metric_series=len(samples) if samples is not None else None,
        metric_values_proven=proof.checked if proof is not None else None,
        metric_position=scope.upto if scope is not None else None,
        metrics_labels_only=proof.labels_only if proof is not None else (),
        metrics_scope=why or None)
    return ReconcileResult(summary, out.items)


def _deduplicate(out: Findings, decoded: list[tuple[int, Record | str]], index: dict[str, Journaled]) -> _Telemetry:
    """The first header and trailer, and each record once: a second delivery of the same
    content is counted (info), one of different content is a finding."""
    tel = _Telemetry()
    first: dict[str, Rec] = {}
    for line, rec in decoded:
        tel.lines += 1
        if isinstance(rec, str):
            out.add(C.MALFORMED_RECORD, f"not a telemetry record: {rec}", lines=(line,))
            continue
        if isinstance(rec, Header):
            if tel.header is None:
                tel.header = (line, rec)
            elif rec != tel.header[1]:
                out.add(C.MALFORMED_RECORD, f"a second, different header (first at line {tel.header[0]})",
                        lines=(line,))
            continue
        if isinstance(rec, Trailer):
            tel.trailer = rec if tel.trailer is None else tel.trailer
            continue
        r = Rec(line, rec)
        seen = first.get(rec.event_id)
        if seen is None:
            first[rec.event_id] = r
            tel.records.append(r)
        elif seen.rec == rec:
            tel.duplicates += 1
            out.add(C.DUPLICATE_DELIVERY, f"record {rec.event_id} delivered again with the same "
                                          f"content (line {seen.line}): deduplicated, counted once",
                    recs=(seen, r), journal=(index.get(rec.event_id),), ids=_ids(index, rec.event_id))
        else:
            diff = _diff(seen.rec, rec)
            out.add(C.CORRUPT_DUPLICATE, f"record {rec.event_id} delivered again with different "
                                         f"content ({', '.join(diff)}) than line {seen.line}",
                    recs=(seen, r), journal=(index.get(rec.event_id),), ids=_ids(index, rec.event_id))
    return tel


def _check_sequences(out: Findings, tel: _Telemetry) -> None:
    """Each source's local sequence and monotonic clock."""
    by_source: dict[str, list[Rec]] = {}
    for r in tel.records:
        by_source.setdefault(source_of(r.rec), []).append(r)
    for source, recs in by_source.items():
        recs.sort(key=lambda r: (r.rec.local_sequence, r.line))
        expected = 1
        prev: Rec | None = None
        for r in recs:
            seq = r.rec.local_sequence
            if prev is not None and seq == prev.rec.local_sequence:
                out.add(C.SEQUENCE_REGRESSION, f"{source}: local_sequence {seq} names two different "
                                               f"records: the source's counter went back",
                        recs=(prev, r), source=source, sequences=(seq,))
            else:
                _check_step(out, source, prev, r, expected, tel.complete)
            expected = max(expected, seq + 1)
            prev = r


def _check_step(out: Findings, source: str, prev: Rec | None, r: Rec, expected: int, complete: bool) -> None:
    """One record after the previous one of its source: no sequence skipped, the clock not back."""
    seq = r.rec.local_sequence
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


def _pair(out: Findings, tel: _Telemetry, index: dict[str, Journaled], last_position: int) -> _Pairs:
    """Records against the journal: each names an event the journal published, and agrees with it."""
    pairs = _Pairs()
    block_size = tel.hdr.block_size if tel.hdr is not None else None
    for r in tel.records:
        rec = r.rec
        if isinstance(rec, Mutation):
            pairs.mutations += 1
            j = index.get(rec.event_id)
            if j is None:
                if rec.outcome == REFUSED:
                    pairs.refused += 1
                    continue
                behind = (f"; the journal ends at position {last_position}, before the commit the "
                          f"record follows ({rec.journal_watermark}): is it a complete copy?"
                          if rec.journal_watermark is not None and rec.journal_watermark > last_position
                          else "")
                out.add(C.UNPUBLISHED_SUCCESS, f"{rec.event_type} of {rec.handle_id} claimed "
                                               f"{rec.outcome}, but the journal never published "
                                               f"event {rec.event_id}{behind}", recs=(r,),
                        source=source_of(rec))
                continue
            pairs.paired.add(rec.event_id)
            check_mutation(out, r, rec, j)
        else:
            pairs.observations += 1
            j = index.get(rec.caused_by_event_id)
            if j is None:
                out.add(C.UNPUBLISHED_CAUSE, f"{rec.event_type} of {rec.handle_id} follows event "
                                             f"{rec.caused_by_event_id}, which the journal never "
                                             f"published", recs=(r,), source=source_of(rec))
                continue
            pairs.observed.add((rec.source_component, rec.caused_by_event_id))
            check_observation(out, r, rec, j, block_size)
    return pairs


def _check_absence(out: Findings, tel: _Telemetry, pairs: _Pairs, index: dict[str, Journaled], order: list[str],
                   last_position: int) -> int:
    """What the journal published and the telemetry never said; the journal events in the
    telemetry's declared scope."""
    if tel.header is None:
        known = {r.rec.source_instance for r in tel.records}
        unseen = sum(1 for eid in order if index[eid].source_instance in known and eid not in pairs.paired)
        if unseen:
            out.add(C.SAMPLED_NO_ABSENCE, f"no header declares this telemetry complete: {unseen} "
                                          f"journal event(s) without a record prove nothing",
                    count=unseen)
        return 0
    line, hdr = tel.header
    end = tel.trailer.last_position if tel.trailer is not None else last_position
    in_scope = unseen = 0
    for eid in order:
        j = index[eid]
        if j.source_instance != hdr.source_instance or not hdr.after_position < j.position <= end:
            continue
        in_scope += 1
        for component in _missing(hdr, j, eid, pairs):
            if not tel.complete:
                unseen += 1
                continue
            what = "record" if component == SERVICE else "observation"
            out.add(C.LOST_AUDIT, f"{j.event_type} of {j.stream_id} at position {j.position} "
                                  f"was published, but {hdr.source_instance}/{component} has no "
                                  f"{what} of it", journal=(j,), ids=(eid,),
                    source=f"{hdr.source_instance}/{component}")
    if not tel.complete and unseen:
        out.add(C.SAMPLED_NO_ABSENCE, f"{unseen} expected record(s) of {in_scope} in-scope "
                                      f"journal events are missing from a stream sampled at "
                                      f"{hdr.sample_rate}: absence is not concluded",
                lines=(line,), count=unseen)
    return in_scope


def _missing(hdr: Header, j: Journaled, eid: str, pairs: _Pairs) -> list[str]:
    """The components the header says report journal event `eid` and that did not."""
    expect = [SERVICE] if SERVICE in hdr.components else []
    if j.event_type in hdr.observed_event_types:
        expect += [k for k in (ALLOCATOR, RESIDENCY) if k in hdr.components]
    return [c for c in expect if not (eid in pairs.paired if c == SERVICE else (c, eid) in pairs.observed)]


def _check_metrics(out: Findings, samples: list[Sample], scope: _Scope | None, why: str,
                   index: dict[str, Journaled], records: list[Rec]) -> Proof:
    """A scrape: no identity as a label, and each value the journal proves."""
    _check_labels(out, samples, index, records)
    proof = prove(samples, scope.fold if scope is not None else None)
    for d in proof.drifts:
        out.add(C.METRIC_CONTRADICTS_JOURNAL,
                f"metric {d.metric}{d.labels} is {d.claimed:g} in the scrape; the journal proves {d.proven:g} "
                f"({why})", metric=d.metric, scrape_lines=d.lines[:MAX_POINTERS], labels=d.labels,
                claimed=d.claimed, proven=d.proven)
    return proof


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


def _ids(index: dict[str, Journaled], eid: str) -> tuple[str, ...]:
    return (eid,) if eid in index else ()


def _diff(a: msgspec.Struct, b: msgspec.Struct) -> list[str]:
    if type(a) is not type(b):
        return [f"record kind {a.__struct_config__.tag} vs {b.__struct_config__.tag}"]
    return [f for f in a.__struct_fields__ if getattr(a, f) != getattr(b, f)]


def _check_labels(out: Findings, samples: list[Sample], index: dict[str, Journaled], records: list[Rec]) -> None:
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
                metric=fam, scrape_lines=tuple(lines[:MAX_POINTERS]), count=len(values))


__all__ = ["Finding", "ReconcileResult", "Summary", "reconcile"]
