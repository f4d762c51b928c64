"""A decode step as values: what a record of format 6 or 7 stores of one, and what a
reader gives back for it (docs/reference/storage-format.md).

A worker's decode step writes three events (append_publish, output_emit, append_start)
and a receipt; nearly every field of the four follows from a handful of values, which
`StepValues` holds (`events()` rebuilds the three events). A reader gives consecutive
steps of one record as a `StepRun`, whose `StepColumns` a projector folds at once.
journal.steps turns operations into stored rows, journal.step_rows is the stored layout,
journal.step_reader reads it back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import msgspec
from msgspec import Meta

from kvledger.schemas import events as ev
from kvledger.schemas.decode_fingerprint import DECODE_CHAIN
from kvledger.schemas.events import INT64_MAX, Count, Id
from kvledger.schemas.ids import counter_of, lower_hex

if TYPE_CHECKING:
    import numpy as np  # imported where a run is read: the API's import loads no numpy

# The schema versions a row rebuilds its events at. A later version of any of the three
# is not a row: the writer stores such events as JSON (a new row layout would be a format).
VERSIONS = (2, 1, 3)
_V_PUBLISH, _V_EMIT, _V_START = VERSIONS
_U64 = 1 << 64
_MASK, _HALF = _U64 - 1, 1 << 63
_PUBLISH, _EMIT, _START = DECODE_CHAIN
# What the rows store is read back within the events' own bounds: a forged row fails here,
# as a forged JSON event fails decode_event, never as a value no event could hold.
Positive = Annotated[int, Meta(gt=0, le=INT64_MAX)]
Sha256 = Annotated[bytes, Meta(min_length=32, max_length=32)]
# A Context's stream: stream_id, request_id, handle_generation, source_instance, cache ABI (32 bytes)
StreamEntry = tuple[Id, Id, Count, Id, Sha256]


class Call(msgspec.Struct, array_like=True, frozen=True, gc=False):
    prefix: int  # of call_id, in Context.prefixes
    counter: int  # call_id's counter less the previous row's (the batch's rows share one call)
    index: Count
    size: Positive
    new_pad: Positive
    key_extent: Positive
    threads: Count



_parsed: dict[str, int] = {}  # id -> its counter (parsed_counter)


def parsed_counter(value: object) -> int | None:
    """counter_of, remembered: a txn id is parsed twice (its append's start, then its
    publication a step later), and a batch's steps share one call id."""
    if type(value) is not str:
        return None
    n = _parsed.get(value)
    if n is None:
        n = counter_of(value)
        if n is None:
            return None
        if len(_parsed) > 1 << 16:  # a cache, not a registry
            _parsed.clear()
        _parsed[value] = n
    return n


def row_parts(rows_sha256: str | None, call: ev.ForwardCall | None
              ) -> tuple[bytes | None, tuple[str, int, Call] | None] | None:
    """A publication's digest and its next append's call as StepValues holds them, or None
    when either is not in the form a row stores (lowercase hex; engine.ids' call ids)."""
    digest = None if rows_sha256 is None else lower_hex(rows_sha256, 32)
    if (digest is None) != (rows_sha256 is None):
        return None
    if call is None:
        return digest, None
    n = parsed_counter(call.call_id)
    if n is None:
        return None
    # The Call's prefix and counter are a record's: values_row puts them in.
    return digest, (call.call_id[:16], n, Call(0, 0, call.index, call.size, call.new_pad, call.key_extent,
                                               call.threads))


class _StepFacts(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What a decode step's two forms share: its envelope, ids and counts (StepValues,
    DecodeStep)."""

    global_position: int  # the publication's, the emit and the start follow; 0: not committed yet
    stream_id: str
    request_id: str
    handle_generation: int
    source_instance: str
    cache_abi_sha256: str
    stream_position: int  # the publication's
    local_sequence: int
    monotonic_ns: int
    observed_wall_time: int
    prefix: str  # of the operation's and the events' ids
    op: int  # the operation id's counter
    gaps: tuple[int, int, int]
    publish_txn: str
    start_txn: str
    snapshot: int  # base snapshot version
    committed: int
    accepted: int
    layers: int
    workspace: int

    @property
    def event_id(self) -> str:
        """The last event's id (the append_start's): where a fold of the step ends."""
        n = (self.op + self.gaps[0] + self.gaps[1] + self.gaps[2]) & _MASK
        return f"{self.prefix}{n:016x}"

    def counters(self) -> tuple[int, int, int, int]:
        """The counters of the operation's id and of its three events' ids, under `prefix`."""
        n, gaps = self.op, self.gaps
        e1 = (n + gaps[0]) & _MASK
        e2 = (e1 + gaps[1]) & _MASK
        return n, e1, e2, (e2 + gaps[2]) & _MASK

    def event_ids(self) -> list[str]:
        prefix, (_, e1, e2, e3) = self.prefix, self.counters()
        return [f"{prefix}{e1:016x}", f"{prefix}{e2:016x}", f"{prefix}{e3:016x}"]

    @property
    def first_event_id(self) -> str:
        """The publication's id: the event at `global_position`."""
        return f"{self.prefix}{(self.op + self.gaps[0]) & _MASK:016x}"


class StepValues(_StepFacts, array_like=True, frozen=True, gc=False):
    """A row read back: what a fold needs of a decode step without its three events
    (replay.projector folds these at once), and `events()` for the rest."""

    digest: bytes | None
    output: int
    token: int
    call: tuple[str, int, Call] | None  # call id prefix, counter, the row's call

    def events(self) -> tuple[ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent]:
        call = None
        if self.call is not None:
            cp, cn, k = self.call
            call = ev.ForwardCall(f"{cp}{cn:016x}", k.index, k.size, k.new_pad, k.key_extent, k.threads)
        digest = self.digest
        return _events(self, self.output, self.token, None if digest is None else digest.hex(), call)


class DecodeStep(_StepFacts, array_like=True, frozen=True, gc=False):
    """A decided plain decode step as the engine gives it (Operation.step): its digest and
    forward call as its events hold them; the journal derives what a record stores of it
    (journal.steps.StepWriter), or stores `events()` when a row cannot hold it."""

    rows_sha256: str | None
    output: int
    token: int
    call: ev.ForwardCall | None

    def events(self) -> tuple[ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent]:
        return _events(self, self.output, self.token, self.rows_sha256, self.call)


def _events(x: _StepFacts, output: int, token: int, rows_sha256: str | None, call: ev.ForwardCall | None
            ) -> tuple[ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent]:
    """The three events of a step, its digest and call as the events hold them."""
    i1, i2, i3 = x.event_ids()
    g, pos, seq, v, c = x.global_position, x.stream_position, x.local_sequence, x.snapshot, x.committed
    stream_id, request_id, generation, source, mono, wall = (
        x.stream_id, x.request_id, x.handle_generation, x.source_instance, x.monotonic_ns, x.observed_wall_time)
    operation_id = f"{x.prefix}{x.op:016x}"
    publish = _PUBLISH(
        event_id=i1, global_position=g, stream_id=stream_id, stream_position=pos,
        schema_version=_V_PUBLISH, request_id=request_id, handle_generation=generation, operation_id=operation_id,
        source_instance=source, local_sequence=seq, monotonic_ns=mono, observed_wall_time=wall,
        payload=ev.AppendPublish(x.publish_txn, v, v + 1, c, x.accepted, x.layers, True, x.workspace, rows_sha256))
    v += 1
    emit = _EMIT(
        event_id=i2, global_position=g and g + 1, stream_id=stream_id, stream_position=pos + 1,
        schema_version=_V_EMIT, request_id=request_id, handle_generation=generation, operation_id=operation_id,
        source_instance=source, local_sequence=seq + 1, monotonic_ns=mono, observed_wall_time=wall,
        payload=ev.OutputEmit(output, token, v))
    start = _START(
        event_id=i3, global_position=g and g + 2, stream_id=stream_id, stream_position=pos + 2,
        schema_version=_V_START, request_id=request_id, handle_generation=generation, operation_id=operation_id,
        source_instance=source, local_sequence=seq + 2, monotonic_ns=mono, observed_wall_time=wall,
        payload=ev.AppendStart(x.start_txn, "decode", v, c, 1, (token,), (c,), c + 1, x.cache_abi_sha256, call))
    return publish, emit, start


class StepColumns(msgspec.Struct, frozen=True):
    """A run's values that a fold reads, one array each (journal.steps.StepValues names
    them): `stream` indexes `streams`, the txn prefixes index `prefixes`, the txn
    counters are uint64, the rest int64 (a clock past int64 is no run's)."""

    stream: np.ndarray
    position: np.ndarray
    mono: np.ndarray
    snapshot: np.ndarray
    committed: np.ndarray
    workspace: np.ndarray
    token: np.ndarray
    ptxn_prefix: np.ndarray
    ptxn: np.ndarray
    stxn_prefix: np.ndarray
    stxn: np.ndarray
    streams: list[StreamEntry]
    prefixes: list[str]


class StepRun:
    """Consecutive decode steps of one record read back together (Journal.read_fold): the
    fold takes their `columns` at once; `values()` gives each step's StepValues. Its
    steps are at global positions `global_position`, +3, ... (three events each)."""

    __slots__ = ("global_position", "count", "columns", "event_id", "_values")

    def __init__(self, global_position: int, count: int, columns: StepColumns | None, event_id: str,
                 values: list[StepValues] | Callable[[], list[StepValues]]) -> None:
        self.global_position, self.count, self.columns, self.event_id = global_position, count, columns, event_id
        self._values = values

    @property
    def last_position(self) -> int:
        return self.global_position + 3 * self.count - 1

    @property
    def first_event_id(self) -> str:
        return self.values()[0].first_event_id

    def values(self) -> list[StepValues]:
        if callable(self._values):
            self._values = self._values()
        return self._values

    def events(self) -> list[ev.Event]:
        return [e for x in self.values() for e in x.events()]



# What a fold reads (Journal.read_fold): events, and decode steps whole.
FoldItem = ev.Event | StepValues | StepRun
