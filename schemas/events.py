"""Journal events: one envelope (spec 0x07) and one payload type per event type.

The envelope is a msgspec tagged union on `event_type`, so a stored line decodes into
the right class in one pass. Payloads evolve by `schema_version`: an older stored
payload is upcast when read (schemas.upcast), a newer one is refused.
Times are integer nanoseconds; byte counts are integers.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

import msgspec
from msgspec import Meta

from kvledger.schemas.ids import MAX_ID
from kvledger.schemas.kv_events import KvEventsBatch, KvEventsGap, KvEventsRestart
from kvledger.schemas.manifest import Manifest

# Bounds keep a forged or corrupt line from becoming an unbounded allocation.
Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID)]
# A lowercase hex sha256. msgspec checks a `pattern` with Python's `re` on every decode
# (most of a publish event's decode), so the length is bounded in
# C here and the alphabet checked by `_hex` from the owning struct's __post_init__.
Digest = Annotated[str, Meta(min_length=64, max_length=64,
                             extra_json_schema={"pattern": "^[0-9a-f]{64}$"})]
_NOT_HEX = str.maketrans("", "", "0123456789abcdef")


def _hex(*digests: str) -> None:
    for d in digests:
        if d.translate(_NOT_HEX):
            raise ValueError(f"Expected a lowercase hex sha256, got {d[:64]!r}")
Text = Annotated[str, Meta(max_length=4096)]
INT64_MAX = (1 << 63) - 1  # the journal's integer columns (BIGINT) hold no more
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
TokenIds = Annotated[tuple[Annotated[int, Meta(ge=0, le=INT64_MAX)], ...], Meta(max_length=1 << 20)]

AppendKind = Literal["prefill", "chunk", "decode", "repair", "verify"]
FailureOutcome = Literal["failed", "aborted", "rejected"]
FinishReason = Literal["eos", "max_tokens", "stop", "client", "length"]


# Subclasses repeat frozen=True: msgspec inherits it, but mypy's dataclass_transform reads
# each class's own keywords and would take them for mutable.
class _Payload(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    pass


class RequestAllocate(_Payload, frozen=True):
    manifest: Manifest
    manifest_sha256: Digest
    cache_abi_sha256: Digest
    prefix_identity_sha256: Digest
    b_token: Annotated[int, Meta(gt=0)]
    reserved_capacity: Count  # C_i: token slots reserved per materialized copy
    copy_tiers: Annotated[tuple[Id, ...], Meta(min_length=1, max_length=64)]  # r_i = len
    allocator_bytes_per_copy: Count = 0  # declared allocator metadata policy

    def __post_init__(self) -> None:
        _hex(self.manifest_sha256, self.cache_abi_sha256, self.prefix_identity_sha256)


class ForwardCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """The model call an append ran in. Floating-point results depend on the call's
    shape (batch size, padded query rows, padded key extent) and on how many CPU threads
    split its reductions, so re-executing a journal bit-for-bit needs both: recovery
    rebuilds each call from these."""

    call_id: Id
    index: Count  # this append's row in the batch
    size: Annotated[int, Meta(gt=0)]
    new_pad: Annotated[int, Meta(gt=0)]  # padded query rows per sequence
    key_extent: Annotated[int, Meta(gt=0)]  # padded key columns
    # torch's intra-op CPU threads during the call (1 and 2 give different bits on the
    # same machine); 0: not recorded (append_start v2), re-executed with whatever is set
    threads: Count = 0


class AppendStart(_Payload, frozen=True):
    txn_id: Id
    kind: AppendKind
    base_snapshot_version: Count
    interval_start: Count  # T
    interval_count: Annotated[int, Meta(gt=0)]  # n: the interval is [T, T+n)
    token_ids: TokenIds
    cache_positions: TokenIds
    mask_key_extent: Count  # must be T + n
    cache_abi_sha256: Digest
    call: ForwardCall | None = None  # set by a worker that executes the append

    def __post_init__(self) -> None:
        if self.cache_abi_sha256.translate(_NOT_HEX):  # _hex inlined: one per decode step
            _hex(self.cache_abi_sha256)


class LayerRows(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    layer: Count
    start: Count
    count: Count
    k_complete: bool
    v_complete: bool
    rows_sha256: Digest | None = None  # digest of the K and V rows this layer adds


class AppendPublish(_Payload, frozen=True):
    """v2. The rows published are [committed_length - accepted_count, committed_length)
    of every layer below `layers_complete`, each with complete K and V: a valid publish
    names all of the handle's layers (anything less is refused before it is written), so
    v1's record per layer said nothing a count does not, at 120-190 bytes a layer."""

    txn_id: Id
    base_snapshot_version: Count
    result_snapshot_version: Count
    committed_length: Count  # K_c after publication
    accepted_count: Count  # rows committed; < interval_count only for verify
    layers_complete: Count  # layers 0 .. n-1 hold those rows complete
    logits_ready: bool  # False for repair: its logits are discarded, never an output
    workspace_bytes: Count = 0  # temporary workspace live at this event
    # schemas.canonical.layers_sha256 of the layers' row digests, when the writer took them
    rows_sha256: Digest | None = None

    def __post_init__(self) -> None:
        if self.rows_sha256 is not None and self.rows_sha256.translate(_NOT_HEX):
            _hex(self.rows_sha256)


class Failure(_Payload, frozen=True):
    txn_id: Id
    outcome: FailureOutcome
    code: Id
    base_snapshot_version: Count
    detail: Text = ""


class OutputEmit(_Payload, frozen=True):
    output_index: Count
    token_id: Annotated[int, Meta(ge=0, le=INT64_MAX)]
    snapshot_version: Count  # the snapshot whose logits produced this token


class Fork(_Payload, frozen=True):
    """Written on the child's stream: the parent is not mutated by a fork."""

    parent_handle_id: Id
    parent_generation: Count
    parent_snapshot_version: Count
    prefix_length: Count
    child_index: Count
    token_ids: TokenIds  # inherited logical tokens (prompt + outputs) of the child
    prompt_length: Count
    logits_ready: bool
    manifest_sha256: Digest
    cache_abi_sha256: Digest
    prefix_identity_sha256: Digest
    num_layers: Annotated[int, Meta(gt=0)]
    b_token: Annotated[int, Meta(gt=0)]
    reserved_capacity: Count
    copy_tiers: Annotated[tuple[Id, ...], Meta(min_length=1, max_length=64)]
    allocator_bytes_per_copy: Count = 0

    def __post_init__(self) -> None:
        _hex(self.manifest_sha256, self.cache_abi_sha256, self.prefix_identity_sha256)


class Truncate(_Payload, frozen=True):
    base_snapshot_version: Count
    result_snapshot_version: Count
    new_length: Count
    output_count: Count  # outputs kept: ids beyond the cut are rolled back with the rows


class Reorder(_Payload, frozen=True):
    group_id: Id
    rows: Annotated[tuple[Id, ...], Meta(max_length=4096)]  # handle per row, before
    permutation: Annotated[tuple[Count, ...], Meta(max_length=4096)]  # new[i] = old[perm[i]]
    row_index: Count  # this handle's row after the reorder


class CancelRequest(_Payload, frozen=True):
    base_snapshot_version: Count
    result_snapshot_version: Count
    aborted_txn_ids: tuple[Id, ...] = ()
    reason: Text = ""


class Finish(_Payload, frozen=True):
    reason: FinishReason
    output_count: Count
    committed_length: Count


class Release(_Payload, frozen=True):
    base_snapshot_version: Count
    result_generation: Count
    result_snapshot_version: Count
    released_length: Count


# Each event class names its tag as a Literal so mypy narrows `Event` on `event_type`;
# subclasses repeat frozen=True (see _Payload).
class Envelope(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="event_type", forbid_unknown_fields=True,
    gc=False,
):
    event_id: Id
    global_position: Count = 0  # assigned by the journal at commit
    stream_id: Id  # = handle_id
    stream_position: Count
    schema_version: Annotated[int, Meta(ge=1)]
    request_id: Id
    handle_generation: Count  # the generation the event was decided against
    operation_id: Id | None = None
    caused_by_event_id: Id | None = None
    source_instance: Id = "kvledger"
    local_sequence: Count = 0
    monotonic_ns: Count = 0
    observed_wall_time: Count = 0  # wall clock, ns since the epoch


class RequestAllocateEvent(Envelope, tag="request_allocate", frozen=True):
    event_type: ClassVar[Literal["request_allocate"]] = "request_allocate"
    payload: RequestAllocate


class AppendStartEvent(Envelope, tag="append_start", frozen=True):
    event_type: ClassVar[Literal["append_start"]] = "append_start"
    payload: AppendStart


class AppendPublishEvent(Envelope, tag="append_publish", frozen=True):
    event_type: ClassVar[Literal["append_publish"]] = "append_publish"
    payload: AppendPublish


class FailureEvent(Envelope, tag="failure", frozen=True):
    event_type: ClassVar[Literal["failure"]] = "failure"
    payload: Failure


class OutputEmitEvent(Envelope, tag="output_emit", frozen=True):
    event_type: ClassVar[Literal["output_emit"]] = "output_emit"
    payload: OutputEmit


class ForkEvent(Envelope, tag="fork", frozen=True):
    event_type: ClassVar[Literal["fork"]] = "fork"
    payload: Fork


class TruncateEvent(Envelope, tag="truncate", frozen=True):
    event_type: ClassVar[Literal["truncate"]] = "truncate"
    payload: Truncate


class ReorderEvent(Envelope, tag="reorder", frozen=True):
    event_type: ClassVar[Literal["reorder"]] = "reorder"
    payload: Reorder


class CancelRequestEvent(Envelope, tag="cancel_request", frozen=True):
    event_type: ClassVar[Literal["cancel_request"]] = "cancel_request"
    payload: CancelRequest


class FinishEvent(Envelope, tag="finish", frozen=True):
    event_type: ClassVar[Literal["finish"]] = "finish"
    payload: Finish


class ReleaseEvent(Envelope, tag="release", frozen=True):
    event_type: ClassVar[Literal["release"]] = "release"
    payload: Release


# KV-event streams of a serving engine (schemas.kv_events): their own streams, named by
# endpoint, topic and rank; request_id repeats the stream id and handle_generation is the
# stream's epoch, because the envelope requires both and the engine has no such facts.
class KvEventsBatchEvent(Envelope, tag="kv_events_batch", frozen=True):
    event_type: ClassVar[Literal["kv_events_batch"]] = "kv_events_batch"
    payload: KvEventsBatch


class KvEventsGapEvent(Envelope, tag="kv_events_gap", frozen=True):
    event_type: ClassVar[Literal["kv_events_gap"]] = "kv_events_gap"
    payload: KvEventsGap


class KvEventsRestartEvent(Envelope, tag="kv_events_restart", frozen=True):
    event_type: ClassVar[Literal["kv_events_restart"]] = "kv_events_restart"
    payload: KvEventsRestart


Event = Union[  # noqa: UP007 - Union[...] keeps one member a line, and __args__ enumerates them
    RequestAllocateEvent,
    AppendStartEvent,
    AppendPublishEvent,
    FailureEvent,
    OutputEmitEvent,
    ForkEvent,
    TruncateEvent,
    ReorderEvent,
    CancelRequestEvent,
    FinishEvent,
    ReleaseEvent,
    KvEventsBatchEvent,
    KvEventsGapEvent,
    KvEventsRestartEvent,
]
# The events of KV-event streams: readers of handle streams pass these by.
KV_EVENT_CLASSES: tuple[type, ...] = (KvEventsBatchEvent, KvEventsGapEvent, KvEventsRestartEvent)
KvStreamEvent = KvEventsBatchEvent | KvEventsGapEvent | KvEventsRestartEvent

EVENT_CLASSES: dict[str, type] = {cls.event_type: cls for cls in Event.__args__}  # type: ignore[attr-defined]  # mypy types a Union alias as a special form
PAYLOAD_CLASSES: dict[str, type] = {
    name: next(f.type for f in msgspec.structs.fields(cls) if f.name == "payload")
    for name, cls in EVENT_CLASSES.items()
}

# The schema version this code writes for each payload. Bump it together with an
# upcaster from the previous version in schemas.upcast.
CURRENT_VERSION: dict[str, int] = {name: 1 for name in EVENT_CLASSES}
CURRENT_VERSION["append_start"] = 3  # v1: interval as a [start, end) pair; v2: no call.threads
CURRENT_VERSION["append_publish"] = 2  # v1: a LayerRows record (and digest) per layer
CURRENT_VERSION["kv_events_gap"] = 2  # v1: no code, no size_bytes (a gap was never a refusal)
