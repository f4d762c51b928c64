"""Prometheus metrics of `kvledger kv-events record --metrics-port P`: read at scrape time
from the Recorder (what it holds, skips and drops now) and from what the journal holds of
the run (the summary as of the last commit, the commit lag). No label but an error code
from a fixed set: never a seq, an id or a stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvledger.adapters.kv_events_recorder import Summary
from kvledger.adapters.kv_events_zmq import Committed, Deciding
from kvledger.schemas.errors import ErrorCode, KvLedgerError

P = "kvledger_kv_events_"
# What a recorder refuses a batch with; anything else is counted as "other".
CODES = (ErrorCode.MALFORMED_EVENT.value, ErrorCode.CAPACITY_EXCEEDED.value, ErrorCode.FIELD_TOO_LARGE.value)


class RecorderMetrics:
    """A collector on a registry of its own; `watch` hands it a running recorder."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rec: Deciding | None = None
        self.committed: Committed | None = None
        self._server: Any = None
        self.registry.register(self)

    def watch(self, rec: Deciding, committed: Committed) -> None:
        self.rec, self.committed = rec, committed

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0: any free port); the port bound."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:  # in use, no such address, not allowed
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"cannot serve metrics on {host}:{port}: "
                                                            f"{exc.strerror or exc}") from None
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def collect(self) -> Iterator[Metric]:
        live = self.rec.summary if self.rec is not None else Summary()
        done = self.committed.summary if self.committed is not None else Summary()

        def counter(name: str, doc: str, value: int) -> CounterMetricFamily:
            return CounterMetricFamily(P + name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(P + name, doc, value=value)

        yield counter("batches", "batches journaled (committed)", done.batches)
        yield counter("events", "KV events in the batches journaled", done.events)
        yield counter("replayed_batches", "batches journaled that came from the replay socket", done.replayed)
        yield counter("gaps", "kv_events_gap events journaled (never received, refused, given up)", done.gaps)
        yield counter("gap_seqs", "seqs the journaled gaps cover", done.gap_seqs)
        yield counter("cap_gaps", "gaps journaled because the held batches reached --max-held-bytes", done.cap_gaps)
        yield counter("cap_gap_seqs", "seqs those gaps cover", done.cap_gap_seqs)
        yield counter("restarts", "publisher restarts journaled (seq went back)", done.restarts)
        yield counter("duplicates", "batches received again and dropped", live.duplicates)
        yield counter("other_topic_messages", "messages on another topic than --topic, not journaled",
                      live.other_topics)
        refused = CounterMetricFamily(P + "refused_batches", "messages refused: skipped with a code, or journaled "
                                                            "as a coded refusal (FIELD_TOO_LARGE)", labels=["code"])
        codes = dict.fromkeys((*CODES, "other"), 0)
        for code, n in list(live.skipped_codes.items()):
            codes[code if code in codes else "other"] += n
        codes[ErrorCode.FIELD_TOO_LARGE.value] += done.too_large
        for code, n in codes.items():
            refused.add_metric([code], n)
        yield refused
        yield counter("commits", "commits that wrote something", self.committed.commits if self.committed else 0)
        yield gauge("held_batches", "batches held now, waiting for a replay", live.held_batches)
        yield gauge("held_bytes", "bytes of the batches held now", live.held_bytes)
        yield gauge("held_bytes_peak", "the most bytes held at once in this run", live.held_bytes_peak)
        yield gauge("backlog_peak", "the most decided batches that waited for the committer at once in this run "
                    "(a slow journal: bounded, past it the receiving waits and the publisher drops)", live.backlog_peak)
        yield gauge("last_committed_seq", "the seq of the last batch or gap committed (-1: none)", done.last_seq)
        yield gauge("streams", "streams (data-parallel ranks) recorded", live.streams)
        c = self.committed
        yield gauge("last_commit_lag_seconds", "the last commit: seconds from receiving its oldest batch to its end",
                    c.lag_s if c else 0.0)
        cumulative, running = [], 0
        counts = c.lag_counts if c else [0] * (len(Committed.LAG_BUCKETS) + 1)
        for bound, n in zip((*map(str, Committed.LAG_BUCKETS), "+Inf"), counts):
            running += n
            cumulative.append((bound, running))
        yield HistogramMetricFamily(P + "commit_lag_seconds", "per commit: seconds from receiving its oldest batch "
                                    "to the commit's end", buckets=cumulative, sum_value=c.lag_sum if c else 0.0)
