"""Prometheus metrics of the command service and the worker: plain integers updated by
the telemetry hooks, exposed by one collector on a dedicated CollectorRegistry. Labels
come only from bounded sets (event type, append kind, outcome, error code, ledger, drop
reason, source component), and every series exists from the start, so the series
count never grows with traffic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvledger.replay.service_fold import Histogram, ServiceFold
from kvledger.schemas.errors import ErrorCode
from kvledger.schemas.telemetry import (
    ALLOCATOR,
    RESIDENCY,
    SERVICE,
)

DROP_REASONS = ("queue_full", "sink_error")
COMPONENTS = (SERVICE, ALLOCATOR, RESIDENCY)
REJECTION_CODES = (*(code.value for code in ErrorCode), "other")


def _histogram(h: Histogram, name: str, doc: str) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=[("+Inf" if b == float("inf") else str(b), n)
                                                     for b, n in h.cumulative()], sum_value=h.sum)


class Metrics:
    """The Prometheus surface: integers the hooks update (one thread writes each), read
    by a collector at scrape time. Several instances can coexist (own registries)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # What committed events imply (replay.service_fold, which reconcile proves a scrape
        # with); `lock` makes a scrape see it whole, between two commits.
        self.fold = ServiceFold()
        self.lock = threading.Lock()
        self.events, self.attempts, self.outcomes, self.kv = (self.fold.events, self.fold.attempts,
                                                              self.fold.outcomes, self.fold.kv)
        self.rejections = dict.fromkeys(REJECTION_CODES, 0)
        self.records = dict.fromkeys(COMPONENTS, 0)
        self.dropped_queue = 0  # written by producers (under the Telemetry lock)
        self.dropped_sink = 0  # written by the exporter thread
        self.queue_depth: Callable[[], int] = lambda: 0  # the exporter's, once there is one
        self.registry.register(self)

    def scrape(self) -> bytes:
        """The text exposition `/metrics` serves."""
        return generate_latest(self.registry)

    # prometheus_client collector protocol
    def describe(self) -> list[Metric]:
        return list(self._families(empty=True))

    def collect(self) -> list[Metric]:
        with self.lock:
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
        fold = self.fold
        yield gauge("kvledger_requests_running", "Handles with work started and not yet finished, "
                    "cancelled or released", fold.running)
        yield gauge("kvledger_requests_waiting", "Allocated handles whose first append has not "
                    "started", fold.waiting)
        yield gauge("kvledger_kv_bytes", "KV-cache byte ledgers of the handles this service "
                    "committed (spec 0x02): logical = committed x B_token, reserved = copies x C x "
                    "B_token, physical = reserved + allocator", label="ledger", values=self.kv)
        if empty:
            yield HistogramMetricFamily("kvledger_time_to_first_token_seconds", "")
            yield HistogramMetricFamily("kvledger_inter_token_latency_seconds", "")
        else:
            yield _histogram(fold.ttft, "kvledger_time_to_first_token_seconds", "Arrival (request_allocate) "
                             "to first output_emit, on the service's monotonic clock")
            yield _histogram(fold.itl, "kvledger_inter_token_latency_seconds", "Between consecutive "
                             "output_emit events of one handle")
        yield counter("kvledger_telemetry_records", "Audit records emitted (queued for export)",
                      "source_component", self.records)
        yield counter("kvledger_telemetry_dropped_records", "Audit records never written: queue "
                      "full or sink error", "reason",
                      {"queue_full": self.dropped_queue, "sink_error": self.dropped_sink})
        yield gauge("kvledger_telemetry_queue_depth", "Audit records waiting for the exporter",
                    0 if empty else self.queue_depth())
        yield gauge("kvledger_journal_position", "The last global position committed through this service: "
                    "the journal prefix the counters above count (kvledger reconcile --metrics proves them "
                    "against it)", fold.position)


