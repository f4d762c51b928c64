"""Telemetry records (spec 0x07): what the command service and the worker say about
state the journal already committed, one JSON object per line.

Runtime state causes telemetry; telemetry never becomes runtime state. A record is
written only after the journal commit it describes returned, and it can still be
delayed, duplicated, reordered, sampled or dropped on its way to a file, so nothing
reads it back as truth: `replay.reconcile` compares it with the journal.

A telemetry file holds, in order:
    header      once: who emits, from which journal position on, sampling, the
                declared allocator/residency conversion;
    mutation    one per committed journal event (semantic and operation planes),
                event_id = the journal event's id; also one per refused command
                (outcome "refused", a fresh event_id, no journal event);
    allocator   allocator-plane observation after a committed event (its cause);
    residency   residency-plane observation after a committed event;
    trailer     once at a clean close: the last journal position covered, counts.

Every record but header/trailer carries the 0x07 envelope. `local_sequence` is
gapless per source (source_instance, source_component), assigned at emission;
monotonic clocks are comparable only within one source, wall clocks only with a
skew caveat. Observations name the semantic event they follow (caused_by_event_id).
Times are integer nanoseconds; byte counts are integers.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvledger.schemas import events as ev

Id = Annotated[str, Meta(min_length=1, max_length=256)]
Count = Annotated[int, Meta(ge=0)]
Name = Annotated[str, Meta(min_length=1, max_length=64)]

TELEMETRY_SCHEMA_VERSION = 1

# Source components (the telemetry plane's producers).
SERVICE = "command_service"  # semantic + operation planes: one record per committed event
ALLOCATOR = "allocator"  # allocator plane: the worker's K/V store slots
RESIDENCY = "residency"  # residency plane: payload bytes resident per tier

# Committed outcomes name a journal event; "refused" names a command the service
# rejected before anything was written (no journal event exists for it).
SUCCESS = "success"
REFUSED = "refused"
Outcome = Literal["success", "failed", "aborted", "rejected", "refused", "observed"]

# After these journal events the worker reports its allocator and residency planes.
OBSERVED_EVENT_TYPES = ("append_publish", "fork", "truncate", "cancel_request", "finish", "release")

BLOCK_SIZE = 16  # rows per block in the declared allocator conversion

CONVERSION = (
    "allocator: slots = K/V rows of the store slot the handle holds (0 once freed), "
    "blocks = ceil(slots / block_size), used_slots = committed rows; so used_slots == "
    "committed_length and slots >= used_slots. residency: resident payload bytes on a tier "
    "= committed_length x B_token x (copies the handle declares on that tier). "
    "handle_generation of an observation = the handle's generation after its cause."
)


class Header(msgspec.Struct, frozen=True, kw_only=True, tag="header", tag_field="record"):
    schema_version: Annotated[int, Meta(ge=1)]
    source_instance: Id  # the journal source_instance whose events this file covers
    components: tuple[Name, ...]
    sample_rate: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0  # < 1: absence proves nothing
    after_position: Count = 0  # journal events after this global position are covered
    observed_event_types: tuple[Name, ...] = OBSERVED_EVENT_TYPES
    block_size: Annotated[int, Meta(gt=0)] = BLOCK_SIZE
    conversion: str = CONVERSION
    observed_wall_time: Count = 0


class Trailer(msgspec.Struct, frozen=True, kw_only=True, tag="trailer", tag_field="record"):
    source_instance: Id
    last_position: Count  # journal events up to here are covered
    records: Count  # audit records emitted (enqueued)
    dropped: Count  # of those, never written (queue full or sink error)
    observed_wall_time: Count = 0


# subclasses repeat frozen=True for mypy (see schemas.events._Payload)
class _Envelope(msgspec.Struct, frozen=True, kw_only=True, tag_field="record"):
    # Stable delivery and correlation identity.
    event_id: Id
    trace_id: Id
    source_instance: Id
    source_component: Name
    local_sequence: Count
    # Event time is source-local; observation time is for correlation (skew caveat).
    monotonic_ns: Count
    observed_wall_time: Count
    # Versioned semantic target.
    request_id: Id
    handle_id: Id
    handle_generation: Count
    operation_id: Id | None = None
    event_type: Name
    base_snapshot: Count | None = None
    result_snapshot: Count | None = None
    outcome: Outcome | None = None


class Mutation(_Envelope, tag="mutation", frozen=True):
    """A committed journal event (event_id = its id) or a refused command."""

    journal_watermark: Count | None = None  # last global position of the commit it follows
    committed_length: Count | None = None  # K_c after the event, when the event sets it
    code: Name | None = None  # refused: the stable error code


class AllocatorObservation(_Envelope, tag="allocator", frozen=True):
    caused_by_event_id: Id
    blocks: Count
    slots: Count
    used_slots: Count
    block_size: Annotated[int, Meta(gt=0)]


class ResidencyObservation(_Envelope, tag="residency", frozen=True):
    caused_by_event_id: Id
    resident_payload_bytes: dict[Name, Count]  # per tier


Record = Header | Trailer | Mutation | AllocatorObservation | ResidencyObservation
AuditRecord = Mutation | AllocatorObservation | ResidencyObservation

record_decoder = msgspec.json.Decoder(Record)


class ReconcileCode(StrEnum):
    """Stable codes of `kvledger reconcile` findings. Only ever added to."""

    UNPUBLISHED_SUCCESS = "UNPUBLISHED_SUCCESS"  # claimed committed; never (or later) published
    UNPUBLISHED_CAUSE = "UNPUBLISHED_CAUSE"  # an observation follows an event the journal lacks
    LOST_AUDIT = "LOST_AUDIT"  # a journal publication with no telemetry
    SEQUENCE_GAP = "SEQUENCE_GAP"  # local_sequence numbers missing within a source
    SEQUENCE_REGRESSION = "SEQUENCE_REGRESSION"  # one local_sequence, two different records
    DUPLICATE_DELIVERY = "DUPLICATE_DELIVERY"  # same id, same content: deduplicated, counted
    CORRUPT_DUPLICATE = "CORRUPT_DUPLICATE"  # same id, different content
    STALE_GENERATION = "STALE_GENERATION"  # names a generation the journal already fenced
    NEGATIVE_DURATION = "NEGATIVE_DURATION"  # an ordering the clocks make impossible
    UNBOUNDED_LABEL = "UNBOUNDED_LABEL"  # an identity as a metric label
    FINISH_COUNTED_AS_FREE = "FINISH_COUNTED_AS_FREE"
    ALLOCATOR_DRIFT = "ALLOCATOR_DRIFT"  # allocator figures vs the journal, declared conversion
    RESIDENCY_DRIFT = "RESIDENCY_DRIFT"  # resident bytes vs committed x B_token per copy
    TELEMETRY_CONTRADICTS_JOURNAL = "TELEMETRY_CONTRADICTS_JOURNAL"  # other fields disagree
    MALFORMED_RECORD = "MALFORMED_RECORD"
    SAMPLED_NO_ABSENCE = "SAMPLED_NO_ABSENCE"  # info: sampled/undeclared, absence not concluded
    METRIC_CONTRADICTS_JOURNAL = "METRIC_CONTRADICTS_JOURNAL"  # a scrape's value vs the journal's count


# The failure class (spec 0x07 failure lab, issue 6) each code belongs to.
FINDING_CLASS: dict[ReconcileCode, str] = {
    ReconcileCode.UNPUBLISHED_SUCCESS: "unpublished_success",
    ReconcileCode.UNPUBLISHED_CAUSE: "unpublished_success",
    ReconcileCode.LOST_AUDIT: "lost_audit",
    ReconcileCode.SEQUENCE_GAP: "lost_audit",
    ReconcileCode.SEQUENCE_REGRESSION: "lost_audit",
    ReconcileCode.DUPLICATE_DELIVERY: "duplicate_delivery",
    ReconcileCode.CORRUPT_DUPLICATE: "duplicate_corruption",
    ReconcileCode.STALE_GENERATION: "stale_generation",
    ReconcileCode.NEGATIVE_DURATION: "impossible_ordering",
    ReconcileCode.UNBOUNDED_LABEL: "unbounded_label",
    ReconcileCode.FINISH_COUNTED_AS_FREE: "finish_counted_as_free",
    ReconcileCode.ALLOCATOR_DRIFT: "plane_drift",
    ReconcileCode.RESIDENCY_DRIFT: "plane_drift",
    ReconcileCode.TELEMETRY_CONTRADICTS_JOURNAL: "contradiction",
    ReconcileCode.MALFORMED_RECORD: "malformed",
    ReconcileCode.SAMPLED_NO_ABSENCE: "sampled",
    ReconcileCode.METRIC_CONTRADICTS_JOURNAL: "metric_drift",
}

# Informational: reported and counted, but not a finding that fails reconciliation.
INFO_CODES = frozenset({ReconcileCode.DUPLICATE_DELIVERY, ReconcileCode.SAMPLED_NO_ABSENCE})

# Metric label names that carry per-request or per-event identity: never bounded.
IDENTITY_LABELS = frozenset({"request_id", "trace_id", "span_id", "operation_id", "event_id",
                             "handle_id", "stream_id", "txn_id", "caused_by_event_id"})

__all__ = [
    "event_outcome", "event_snapshots", "trace_id_of",
    "ALLOCATOR",
    "BLOCK_SIZE",
    "CONVERSION",
    "FINDING_CLASS",
    "IDENTITY_LABELS",
    "INFO_CODES",
    "OBSERVED_EVENT_TYPES",
    "REFUSED",
    "RESIDENCY",
    "SERVICE",
    "SUCCESS",
    "TELEMETRY_SCHEMA_VERSION",
    "AllocatorObservation",
    "AuditRecord",
    "Header",
    "Mutation",
    "ReconcileCode",
    "Record",
    "ResidencyObservation",
    "Trailer",
    "record_decoder",
]


# -- what a mutation record states about the event it reports (the producer writes it,
# reconcile checks it) ------------------------------------------------------------------

def trace_id_of(request_id: str) -> str:
    """One trace per request: a stable W3C-sized (16-byte) id derived from it."""
    return hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()


def event_snapshots(e: ev.Event) -> tuple[int | None, int | None, int | None]:
    """(base snapshot, result snapshot, committed length) a journal event states."""
    p = e.payload  # narrowed by its class: mypy cannot follow `e.event_type` into `p`
    if isinstance(p, ev.RequestAllocate):
        return None, 0, 0
    if isinstance(p, (ev.AppendStart, ev.Failure)):
        return p.base_snapshot_version, None, None
    if isinstance(p, ev.AppendPublish):
        return p.base_snapshot_version, p.result_snapshot_version, p.committed_length
    if isinstance(p, ev.OutputEmit):
        return p.snapshot_version, p.snapshot_version, None
    if isinstance(p, ev.Fork):
        return p.parent_snapshot_version, 0, p.prefix_length
    if isinstance(p, ev.Truncate):
        return p.base_snapshot_version, p.result_snapshot_version, p.new_length
    if isinstance(p, ev.CancelRequest):
        return p.base_snapshot_version, p.result_snapshot_version, None
    if isinstance(p, ev.Finish):
        return None, None, p.committed_length
    if isinstance(p, ev.Release):
        return p.base_snapshot_version, p.result_snapshot_version, 0
    return None, None, None


def event_outcome(e: ev.Event) -> str:
    """A committed event's outcome: a failure's own outcome, else success."""
    return e.payload.outcome if e.event_type == "failure" else SUCCESS
