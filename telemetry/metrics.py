"""Prometheus metrics of the command service and the worker: plain integers updated by
the telemetry hooks, exposed by one collector on a dedicated CollectorRegistry. Labels
come only from bounded sets (event type, append kind, outcome, error code, ledger, drop
reason, source component), and every series exists from the start, so the series
count never grows with traffic.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvledger.schemas import events as ev
from kvledger.schemas.errors import ErrorCode
from kvledger.schemas.telemetry import (
    ALLOCATOR,
    RESIDENCY,
    SERVICE,
)

EVENT_TYPES = tuple(ev.EVENT_CLASSES)
APPEND_KINDS = ("prefill", "chunk", "decode", "repair", "verify")
APPEND_OUTCOMES = ("success", "failed", "aborted", "rejected", "cancelled", "stale", "conflict")
LEDGERS = ("logical", "reserved", "physical")
DROP_REASONS = ("queue_full", "sink_error")
COMPONENTS = (SERVICE, ALLOCATOR, RESIDENCY)
REJECTION_CODES = (*(code.value for code in ErrorCode), "other")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)




# -- metrics -----------------------------------------------------------------------------

class _Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts):
            running += n
            cumulative.append((bound, running))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=self.sum)


class Metrics:
    """The Prometheus surface: integers the hooks update (one thread writes each), read
    by a collector at scrape time. Several instances can coexist (own registries)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.events = dict.fromkeys(EVENT_TYPES, 0)
        self.attempts = dict.fromkeys(APPEND_KINDS, 0)
        self.outcomes = dict.fromkeys(APPEND_OUTCOMES, 0)
        self.rejections = dict.fromkeys(REJECTION_CODES, 0)
        self.records = dict.fromkeys(COMPONENTS, 0)
        self.dropped_queue = 0  # written by producers (under the Telemetry lock)
        self.dropped_sink = 0  # written by the exporter thread
        self.running = self.waiting = 0
        self.kv = dict.fromkeys(LEDGERS, 0)
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.queue_depth: Callable[[], int] = lambda: 0  # the exporter's, once there is one
        self.registry.register(self)

    def scrape(self) -> bytes:
        """The text exposition `/metrics` serves."""
        return generate_latest(self.registry)

    # prometheus_client collector protocol
    def describe(self) -> list[Metric]:
        return list(self._families(empty=True))

    def collect(self) -> list[Metric]:
        return list(self._families())

    def _families(self, empty: bool = False) -> Iterator[Metric]:
        def counter(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
            f = CounterMetricFamily(name, doc, labels=[label])
            if not empty:
                for k, v in list(values.items()):
                    f.add_metric([k], v)
            return f

        def gauge(name: str, doc: str, value: float = 0, label: str | None = None,
                  values: dict[str, int] | None = None) -> GaugeMetricFamily:
            f = GaugeMetricFamily(name, doc, labels=[label] if label else None)
            if not empty:
                if values is None:
                    f.add_metric([], value)
                else:
                    for k, v in list(values.items()):
                        f.add_metric([k], v)
            return f

        yield counter("kvledger_append_attempts", "Appends started (committed append_start), by kind: "
                      "the denominator of append outcomes", "kind", self.attempts)
        yield counter("kvledger_append_outcomes", "Append outcomes: success (published), failed/"
                      "aborted/rejected (failure event), cancelled (aborted by a cancel), "
                      "stale/conflict (refused publish or start)", "outcome", self.outcomes)
        yield counter("kvledger_journal_events", "Journal events committed through this service",
                      "event_type", self.events)
        yield counter("kvledger_command_rejections", "Commands refused before anything was written, "
                      "by stable error code", "code", self.rejections)
        yield gauge("kvledger_requests_running", "Handles with work started and not yet finished, "
                    "cancelled or released", self.running)
        yield gauge("kvledger_requests_waiting", "Allocated handles whose first append has not "
                    "started", self.waiting)
        yield gauge("kvledger_kv_bytes", "KV-cache byte ledgers of the handles this service "
                    "committed (spec 0x02): logical = committed x B_token, reserved = copies x C x "
                    "B_token, physical = reserved + allocator", label="ledger", values=self.kv)
        if empty:
            yield HistogramMetricFamily("kvledger_time_to_first_token_seconds", "")
            yield HistogramMetricFamily("kvledger_inter_token_latency_seconds", "")
        else:
            yield self.ttft.family("kvledger_time_to_first_token_seconds", "Arrival (request_allocate) "
                                   "to first output_emit, on the service's monotonic clock")
            yield self.itl.family("kvledger_inter_token_latency_seconds", "Between consecutive "
                                  "output_emit events of one handle")
        yield counter("kvledger_telemetry_records", "Audit records emitted (queued for export)",
                      "source_component", self.records)
        yield counter("kvledger_telemetry_dropped_records", "Audit records never written: queue "
                      "full or sink error", "reason",
                      {"queue_full": self.dropped_queue, "sink_error": self.dropped_sink})
        yield gauge("kvledger_telemetry_queue_depth", "Audit records waiting for the exporter",
                    0 if empty else self.queue_depth())


