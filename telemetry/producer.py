"""Telemetry and metrics for the command service and the worker (spec 0x07).

    telemetry = Telemetry("telemetry.jsonl")          # or a binary file object, or None
    telemetry.attach(service, worker)                 # hooks; writes the header
    port = telemetry.serve(9100)                      # /metrics on 127.0.0.1
    ... worker.run() ...
    telemetry.close()                                 # drain, trailer, stop

Emission follows the transition, never precedes it: records come from the service's
`on_commit` hook (called after the journal commit returned) and from the worker's
`on_applied` hook (after a committed receipt's store effects were applied). Refused
commands come from `on_reject` as outcome "refused" records.

The hot path is an append: a hook assigns the source's gapless `local_sequence` and
adds one tuple to the exporter's batch. Every `batch` tuples the hook's thread renders
them with one structlog call (a processor chain ending in a msgspec JSON-lines
renderer) and queues the bytes; a background thread writes them to the sink. A full
buffer or a failing sink drops records and counts them (`dropped`, and
`kvledger_telemetry_dropped_records_total{reason}`); the service and the worker never
wait for, or fail because of, the sink.

Metrics are plain integers updated in the hooks and exposed by a prometheus_client
collector on a dedicated CollectorRegistry, with bounded labels only (event type,
append kind, outcome, error code, ledger, drop reason, source component). Every
series exists from the start, so the series count never grows with traffic.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, BinaryIO

from prometheus_client import CollectorRegistry

from kvledger.engine import commands as c
from kvledger.engine.port import CommandPort
from kvledger.engine.service import SystemClock
from kvledger.schemas import events as ev
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt
from kvledger.schemas.telemetry import (
    ALLOCATOR,
    BLOCK_SIZE,
    OBSERVED_EVENT_TYPES,
    REFUSED,
    RESIDENCY,
    SERVICE,
    TELEMETRY_SCHEMA_VERSION,
    Header,
    event_outcome,
    event_snapshots,
    trace_id_of,
)
from kvledger.telemetry.exporter import Exporter, ObservationRow
from kvledger.telemetry.metrics import COMPONENTS, Metrics

if TYPE_CHECKING:  # annotations only: telemetry never loads torch for the worker it observes
    from kvledger.worker.kvstore import KVStore
    from kvledger.worker.serving import Worker

_OBSERVED = frozenset(OBSERVED_EVENT_TYPES)

# The event a refused command would have written (for its outcome record).
_COMMAND_EVENT: dict[type[c.Command], str] = {
    c.Allocate: "request_allocate", c.BeginAppend: "append_start", c.Publish: "append_publish",
    c.Fail: "failure", c.EmitOutput: "output_emit", c.Fork: "fork", c.Truncate: "truncate",
    c.Reorder: "reorder", c.CancelRequest: "cancel_request", c.Finish: "finish", c.Release: "release",
}

# -- the telemetry source ----------------------------------------------------------------

class Telemetry:
    """The telemetry source of one command service (and optionally its worker).

    sink: a path or a binary file object for the JSON lines; None for metrics only.
    sample_rate < 1 keeps whole traces (requests) by a hash of the request id and
    says so in the header, so a reader never concludes absence from it."""

    def __init__(self, sink: str | os.PathLike[str] | BinaryIO | None = None, *,
                 registry: CollectorRegistry | None = None, queue_size: int = 65536,
                 sample_rate: float = 1.0, block_size: int = BLOCK_SIZE) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"sample_rate {sample_rate} not in (0, 1]")
        if queue_size < 1 or block_size < 1:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "queue_size and block_size must be >= 1")
        self.metrics = Metrics(registry)
        self.exporter = Exporter(sink, capacity=queue_size, metrics=self.metrics) if sink is not None else None
        self.sample_rate = sample_rate
        self.block_size = block_size
        self.source_instance = "kvledger"
        self.service: Any = None
        self.store: KVStore | None = None
        self.metrics_port: int | None = None
        self._clock: Any = SystemClock()
        self._nonce = os.urandom(8).hex()  # observation ids: nonce, component (1, 2), sequence
        self._lock = threading.Lock()
        self._seq = {SERVICE: 0, ALLOCATOR: 0, RESIDENCY: 0}
        self._stash: OrderedDict[str, list[tuple[ev.Event, str]]] = OrderedDict()  # op id -> events to observe
        self._server: Any = None
        self._closed = False
        self._row_bytes = 0

    # -- wiring --------------------------------------------------------------------
    def attach(self, service: CommandPort, worker: Worker | None = None) -> Telemetry:
        """Hook into a CommandService (and its Worker) and write the header. The file
        covers the journal events of this service's source_instance committed after
        the journal's current last position."""
        self.service = service
        self.source_instance = service.source_instance
        self._clock = service.clock  # the clock the journal's events are stamped with
        components: tuple[str, ...] = (SERVICE,)
        if worker is not None:
            self.store = store = worker.store
            # payload bytes per committed row of the store: what KVStore.payload_bytes counts
            layers, _, heads, _, dim = store.k.shape
            self._row_bytes = layers * heads * dim * (store.k.element_size()
                                                      + store.v.element_size())
            worker.on_applied = self._on_applied
            components = COMPONENTS
        if self.exporter is not None:
            header = Header(schema_version=TELEMETRY_SCHEMA_VERSION, source_instance=self.source_instance,
                            components=components, sample_rate=self.sample_rate,
                            after_position=service.journal.last_position(),
                            observed_event_types=OBSERVED_EVENT_TYPES if worker is not None else (),
                            block_size=self.block_size, observed_wall_time=self._clock.wall_ns())
            with self._lock:
                self.exporter.put(("h", header), 0)
        service.on_commit.append(self._on_commit)
        service.on_reject.append(self._on_reject)
        return self

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve `/metrics` from this registry; returns the bound port (0 picks one)."""
        from prometheus_client import start_http_server

        try:
            self._server, _ = start_http_server(port, addr=addr, registry=self.metrics.registry)
        except OSError as exc:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT,
                                f"cannot serve metrics on {addr}:{port}: {exc.strerror}") from None
        self.metrics_port = self._server.server_port
        return self.metrics_port

    def close(self, timeout: float = 30.0) -> None:
        """Detach, drain the queue, write the trailer, stop the exporter and the server."""
        if self._closed:
            return
        self._closed = True
        if self.service is not None:
            for hooks, fn in ((self.service.on_commit, self._on_commit),
                              (self.service.on_reject, self._on_reject)):
                if fn in hooks:
                    hooks.remove(fn)
        if self.exporter is not None:
            if self.service is not None:  # a trailer closes only a file that has a header
                with self._lock:
                    self.exporter.put(("t", self.source_instance, self.service.journal.last_position(),
                                       self.exporter._in, self._clock.wall_ns()), 0)
            self.exporter.stop(timeout)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dropped(self) -> int:
        return self.exporter.dropped if self.exporter is not None else 0

    @property
    def emitted(self) -> int:
        """Audit records emitted: queued, or dropped because the queue was full."""
        return self.exporter._in + self.exporter.dropped_queue if self.exporter is not None else 0

    def stats(self) -> dict[str, Any]:
        x = self.exporter
        if x is None:
            return {"records": 0, "written": 0, "dropped": 0}
        return {"records": self.emitted, "written": x.written, "dropped": x.dropped,
                "dropped_queue_full": x.dropped_queue, "dropped_sink_error": x.dropped_sink,
                "sink_error": x.error}

    def _sampled(self, request_id: str) -> bool:
        if self.sample_rate >= 1.0:
            return True
        h = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")
        return h < self.sample_rate * 2**64

    # -- hooks (the committing thread; each returns after an enqueue) ------------------
    def _on_commit(self, receipt: Receipt, events: list[ev.Event]) -> None:
        x = self.exporter
        if x is not None:
            audit = events if self.sample_rate >= 1.0 else [e for e in events if self._sampled(e.request_id)]
            if audit:
                if self.store is not None:
                    observe = [(e, self._tier(e)) for e in audit if e.event_type in _OBSERVED]
                    if observe:
                        self._stash[receipt.operation_id] = observe
                        if len(self._stash) > 4096:  # receipts no worker applied: forget them
                            self._stash.popitem(last=False)
                n = len(audit)
                mono, wall = self._clock.monotonic_ns(), self._clock.wall_ns()
                with self._lock:
                    seq = self._seq[SERVICE]
                    self._seq[SERVICE] = seq + n
                    x.put(("m", self.source_instance, seq, receipt.last_global_position, mono, wall,
                           audit), n)
                self.metrics.records[SERVICE] += n
        self._account(events, receipt.last_global_position)

    def _tier(self, e: ev.Event) -> str:
        h = self.metrics.fold.handles.get(e.stream_id)
        if h is not None:
            return h.tier
        tiers = getattr(e.payload, "copy_tiers", None)
        return tiers[0] if tiers else "gpu"

    def _on_applied(self, receipt: Receipt) -> None:
        pending = self._stash.pop(receipt.operation_id, None)
        x, store = self.exporter, self.store
        if not pending or x is None or store is None:
            return
        row_bytes = self._row_bytes
        results = {r.handle_id: r for r in receipt.handles}
        rows: list[ObservationRow] = []
        for e, tier in pending:
            handle = e.stream_id
            r = results.get(handle)
            used = store.committed.get(handle, 0) if handle in store.slot else None
            rows.append((e.event_id, e.operation_id, handle, e.request_id, r.generation if r else 0, tier,
                         r.snapshot_version if r else None, 0 if used is None else store.capacity,
                         used or 0, (used or 0) * row_bytes))
        n = len(rows)
        mono, wall = self._clock.monotonic_ns(), self._clock.wall_ns()
        with self._lock:
            seq_a, seq_r = self._seq[ALLOCATOR], self._seq[RESIDENCY]
            self._seq[ALLOCATOR], self._seq[RESIDENCY] = seq_a + n, seq_r + n
            x.put(("o", self.source_instance, self._nonce, seq_a, seq_r, self.block_size, mono, wall,
                   rows), 2 * n)
        self.metrics.records[ALLOCATOR] += n
        self.metrics.records[RESIDENCY] += n

    def _on_reject(self, cmd: object, exc: KvLedgerError) -> None:
        if not isinstance(cmd, c.Command):
            return  # a relative command that could not even be bound (no such handle)
        m = self.metrics
        code = exc.code.value if exc.code.value in m.rejections else "other"
        m.rejections[code] += 1
        if isinstance(cmd, (c.BeginAppend, c.Publish)):
            m.outcomes["conflict" if code == "CONFLICT" else "stale" if code == "STALE_BASE"
                       else "rejected"] += 1
        x = self.exporter
        if x is None:
            return
        handle = c.handles_of(cmd)[0]
        state = self.service.states.get(handle) if self.service is not None else None
        if isinstance(cmd, c.Allocate):
            request = cmd.manifest.request_identity.request_id
        else:
            request = state.request_id if state is not None else handle
        if not self._sampled(request):
            return
        generation = getattr(cmd, "base_generation", getattr(cmd, "generation", None))
        if generation is None:
            generation = state.generation if state is not None else 0
        base = getattr(cmd, "base_snapshot_version", None)
        if base is None and not isinstance(cmd, c.Allocate) and state is not None:
            base = state.snapshot_version
        fields: dict[str, str | int | None]
        fields = {"record": "mutation", "event_id": uuid.uuid4().hex, "trace_id": trace_id_of(request),
                  "source_instance": self.source_instance, "source_component": SERVICE,
                  "local_sequence": 0, "monotonic_ns": self._clock.monotonic_ns(),
                  "observed_wall_time": self._clock.wall_ns(), "request_id": request,
                  "handle_id": handle, "handle_generation": generation,
                  "operation_id": cmd.operation_id, "event_type": _COMMAND_EVENT[type(cmd)],
                  "base_snapshot": base, "result_snapshot": None, "outcome": REFUSED,
                  "journal_watermark": None, "committed_length": None, "code": exc.code.value}
        with self._lock:
            self._seq[SERVICE] += 1
            fields["local_sequence"] = self._seq[SERVICE]
            x.put(("r", fields), 1)
        m.records[SERVICE] += 1

    # -- metrics from committed events ---------------------------------------------
    def _account(self, events: list[ev.Event], position: int) -> None:
        """Counters, gauges and histograms from every committed event (sampling thins
        the audit stream, never the metrics): replay.service_fold, under the lock a
        scrape takes."""
        m = self.metrics
        with m.lock:
            m.fold.apply(events, position)


__all__ = ["Exporter", "Metrics", "Telemetry", "event_outcome", "event_snapshots", "trace_id_of"]

