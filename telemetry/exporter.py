"""The telemetry exporter: records are rendered in batches on the producer's thread
(structlog, a msgspec JSON-lines renderer) and written to the sink by one thread. A full
queue or a failing sink drops records and counts them; producers never wait for the sink.
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import threading
from typing import Any, BinaryIO, Final, Literal

import msgspec
import structlog
from structlog.typing import EventDict, WrappedLogger

from kvledger.journal import tuning
from kvledger.schemas import events as ev
from kvledger.schemas.telemetry import (
    ALLOCATOR,
    RESIDENCY,
    SERVICE,
    Header,
    Trailer,
    event_outcome,
    event_snapshots,
    trace_id_of,
)
from kvledger.telemetry.metrics import Metrics

log = logging.getLogger("kvledger.telemetry")

# -- export: a bounded queue, one thread, structlog rendering -----------------------------

_encoder = msgspec.json.Encoder()

# What the hooks queue, one tuple per hook call, tagged by its first element (_render):
# "m" (source, local_sequence before, journal watermark, monotonic_ns, wall, events)
MutationItem = tuple[Literal["m"], str, int, int, int, int, list[ev.Event]]
# one observed row of a store: (cause event id, operation id, handle, request, generation,
# tier, snapshot version, slots, used slots, resident payload bytes)
ObservationRow = tuple[str, str | None, str, str, int, str, int | None, int, int, int]
# "o" (source, nonce, allocator and residency sequences before, block size, monotonic_ns,
# wall, rows)
ObservationItem = tuple[Literal["o"], str, str, int, int, int, int, int, list[ObservationRow]]
# "r" a refused command's mutation record, as its fields
RefusedItem = tuple[Literal["r"], dict[str, str | int | None]]
# "h" the header; "t" the trailer's (source, last position, records, wall)
HeaderItem = tuple[Literal["h"], Header]
TrailerItem = tuple[Literal["t"], str, int, int, int]
Item = MutationItem | ObservationItem | RefusedItem | HeaderItem | TrailerItem
# a rendered batch: (JSON lines, or why it could not be rendered; its audit records)
_Chunk = tuple[bytes | Exception, int]


class _Rendered:
    """structlog's wrapped logger for the exporter: hands the rendered lines back to
    the caller, which queues them for the writer thread."""

    def msg(self, lines: bytes) -> bytes:
        return lines


def _json_lines(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> bytes:
    """The renderer: the batch's records, one JSON object per line."""
    return _encoder.encode_lines(event_dict["records"])


class _Stop(enum.Enum):
    """The writer thread's stop mark (an enum member, so `is` narrows the queue's type)."""

    STOP = 0


_STOP: Final = _Stop.STOP


class _MutationLine(msgspec.Struct, gc=False):
    """Rendering shape of schemas.telemetry.Mutation (same keys, built positionally)."""

    record: str
    event_id: str
    trace_id: str
    source_instance: str
    source_component: str
    local_sequence: int
    monotonic_ns: int
    observed_wall_time: int
    request_id: str
    handle_id: str
    handle_generation: int
    operation_id: str | None
    event_type: str
    base_snapshot: int | None
    result_snapshot: int | None
    outcome: str
    journal_watermark: int | None
    committed_length: int | None


class _ObservationLine(msgspec.Struct, gc=False, omit_defaults=True):
    """Rendering shape of schemas.telemetry.AllocatorObservation / ResidencyObservation."""

    record: str
    event_id: str
    trace_id: str
    source_instance: str
    source_component: str
    local_sequence: int
    monotonic_ns: int
    observed_wall_time: int
    request_id: str
    handle_id: str
    handle_generation: int
    operation_id: str | None
    event_type: str
    result_snapshot: int | None
    outcome: str
    caused_by_event_id: str
    blocks: int = -1
    slots: int = -1
    used_slots: int = -1
    block_size: int = -1
    resident_payload_bytes: dict[str, int] | None = None


class Exporter:
    """A bounded buffer of records, rendered in batches and written by one daemon thread.

    `put` never waits for the sink: beyond `capacity` records not yet written it drops
    and counts (queue_full). Every `batch` items the producer renders them with one
    structlog call and queues the bytes; the thread writes them, and a write the sink
    refuses is counted as dropped (sink_error). Rendering is the producer's, not the
    thread's, because on a machine whose cores the model's OpenMP pool fills a
    rendering thread takes the core the pool's second thread needs: the whole worker
    then waits at the pool's barrier. A batch left
    partial for `linger` seconds, because traffic stopped, is rendered by the thread."""

    def __init__(self, sink: str | os.PathLike[str] | BinaryIO, *, capacity: int, metrics: Metrics,
                 linger: float = 0.05, batch: int = 64) -> None:
        if isinstance(sink, (str, os.PathLike)):
            self._file: BinaryIO = open(sink, "wb")
            self._owns = True
        else:
            self._file, self._owns = sink, False
        self.capacity = capacity
        self.metrics = metrics
        self.linger = linger  # seconds a partial batch may wait before the thread renders it
        self.batch = batch  # queued items rendered together by the producer
        self._lock = threading.Lock()  # the pending batch; taken inside the Telemetry lock
        self._pending: list[tuple[Item, int]] = []
        self._q: queue.SimpleQueue[_Chunk | _Stop] = queue.SimpleQueue()  # rendered (lines, records), in order
        self._stopping = False  # the stop mark is queued (under self._lock): the thread renders no more early
        self._in = 0  # audit records accepted (under self._lock)
        self._out = 0  # audit records written or dropped by the sink (writer thread only)
        self.written = 0
        self.error: str | None = None
        self._traces: dict[str, str] = {}
        self._log = structlog.wrap_logger(_Rendered(), processors=[_json_lines],
                                          wrapper_class=structlog.BoundLogger, context_class=dict,
                                          cache_logger_on_first_use=True)
        metrics.queue_depth = lambda: self._in - self._out
        self._thread = threading.Thread(target=self._run, name="kvledger-telemetry", daemon=True)
        self._thread.start()

    @property
    def dropped_queue(self) -> int:
        return self.metrics.dropped_queue

    @property
    def dropped_sink(self) -> int:
        return self.metrics.dropped_sink

    @property
    def dropped(self) -> int:
        return self.metrics.dropped_queue + self.metrics.dropped_sink

    def put(self, item: Item, records: int) -> bool:
        with self._lock:
            if self._stopping or (records and self._in - self._out + records > self.capacity):
                self.metrics.dropped_queue += records  # full, or stopped: nothing would write it
                return False
            self._in += records
            self._pending.append((item, records))
            # Full batch, or nothing more fits until the thread writes: render now.
            if len(self._pending) >= self.batch or self._in - self._out >= self.capacity:
                self._flush()
        return True

    def stop(self, timeout: float | None = None) -> None:
        """Write everything put so far (the thread renders what is pending last, so a
        trailer counts the drops of every write before it), then stop the thread."""
        with self._lock:  # a render the thread starts after this would queue its chunk after the mark
            self._stopping = True
            self._q.put(_STOP)
        self._thread.join(timeout)
        if self._owns:
            try:
                self._file.close()
            except OSError:
                pass

    def render(self, items: list[Item]) -> bytes:
        """Queued items -> JSON lines, without writing (for measuring)."""
        lines = self._render_lines([(item, 0) for item in items])[0]
        if isinstance(lines, Exception):
            raise lines
        return lines

    def trace_id(self, request_id: str) -> str:
        t = self._traces.get(request_id)
        if t is None:
            if len(self._traces) > 65536:
                self._traces.clear()
            t = self._traces[request_id] = trace_id_of(request_id)
        return t

    def _flush(self) -> None:
        """Render the pending batch and queue it for the thread (self._lock held)."""
        if self._pending:
            batch, self._pending = self._pending, []
            self._q.put(self._render_lines(batch))

    def _render_lines(self, batch: list[tuple[Item, int]]) -> _Chunk:
        """(JSON lines, audit records) of a batch; an exception in place of the lines if
        the batch could not be encoded: the writer then counts it as dropped, and the
        producer, whose hook this runs in, never sees it."""
        records: list[Any] = []
        audit = 0
        for item, n in batch:
            try:
                _render(records, item, self)
            except Exception as exc:  # noqa: BLE001 - a bad record must not stop the others
                log.error("telemetry record not rendered: %r", exc)
            audit += n
        try:
            return (self._log.msg(records=records) if records else b""), audit
        except Exception as exc:  # noqa: BLE001 - counted as dropped by _write
            return exc, audit

    def _run(self) -> None:
        tuning.pin_writer()  # it writes files: beside the journal's writers, off the model's CPU
        while True:
            try:
                chunk = self._q.get(timeout=self.linger)
            except queue.Empty:
                with self._lock:  # producers are idle: render what they left (at the stop mark, below)
                    if not self._stopping:
                        self._flush()
                continue
            if chunk is _STOP:
                with self._lock:
                    batch, self._pending = self._pending, []
                self._write(*self._render_lines(batch))
                return
            self._write(*chunk)

    def _write(self, lines: bytes | Exception, audit: int) -> None:
        try:
            if isinstance(lines, Exception):
                raise lines
            if lines:
                self._file.write(lines)
                self._file.flush()
            self.written += audit
        except Exception as exc:  # noqa: BLE001 - any sink failure is a counted drop
            self.metrics.dropped_sink += audit
            if self.error is None:
                self.error = repr(exc)
                log.warning("telemetry batch not written: records are dropped and counted: %s", self.error)
        finally:
            self._out += audit


# -- records -----------------------------------------------------------------------------

def _render(out: list[Any], item: Item, exporter: Exporter) -> None:
    """Exporter thread: one queued tuple -> records, in envelope order."""
    if item[0] == "m":
        _, source, seq, watermark, mono, wall, events = item
        trace = exporter.trace_id
        for e in events:
            seq += 1
            base, result, committed = event_snapshots(e)
            out.append(_MutationLine(
                "mutation", e.event_id, trace(e.request_id), source, SERVICE, seq, mono, wall,
                e.request_id, e.stream_id, e.handle_generation, e.operation_id, e.event_type, base,
                result, event_outcome(e), watermark, committed))
    elif item[0] == "o":
        _, source, nonce, seq_a, seq_r, block_size, mono, wall, rows = item
        for (cause, op, handle, request, generation, tier, snapshot, slots, used, payload) in rows:
            seq_a += 1
            seq_r += 1
            trace_id = exporter.trace_id(request)
            out.append(_ObservationLine(
                ALLOCATOR, f"{nonce}1{seq_a:015x}", trace_id, source, ALLOCATOR, seq_a, mono, wall, request,
                handle, generation, op, "allocator_observation", snapshot, "observed", cause,
                blocks=-(-slots // block_size), slots=slots, used_slots=used, block_size=block_size))
            out.append(_ObservationLine(
                RESIDENCY, f"{nonce}2{seq_r:015x}", trace_id, source, RESIDENCY, seq_r, mono, wall, request,
                handle, generation, op, "residency_observation", snapshot, "observed", cause,
                resident_payload_bytes={tier: payload}))
    elif item[0] == "r":
        out.append(item[1])
    elif item[0] == "h":
        out.append({"record": "header", **msgspec.structs.asdict(item[1])})
    elif item[0] == "t":
        _, source, last_position, records, wall = item
        out.append({"record": "trailer", **msgspec.structs.asdict(Trailer(
            source_instance=source, last_position=last_position, records=records,
            dropped=exporter.dropped, observed_wall_time=wall))})


