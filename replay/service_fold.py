"""The command service's metrics as its committed events imply them: events by type,
append attempts and outcomes, running/waiting requests, the KV byte ledgers, TTFT and
inter-token latency. One definition for both sides: telemetry.metrics exposes a live
ServiceFold to Prometheus, and reconcile folds the journal's events in a scrape's scope
with another to prove the scrape's values (replay.reconcile).

Pure: events in, integers and histograms out; no prometheus_client, no clock.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from typing import Any

from kvledger.schemas import events as ev

EVENT_TYPES = tuple(ev.EVENT_CLASSES)
APPEND_KINDS = ("prefill", "chunk", "decode", "repair", "verify")
APPEND_OUTCOMES = ("success", "failed", "aborted", "rejected", "cancelled", "stale", "conflict")
# Outcomes counted from committed events alone. "rejected" also counts refused commands,
# "stale" and "conflict" only them: a refusal writes nothing to the journal.
JOURNAL_OUTCOMES = ("success", "failed", "aborted", "cancelled")
LEDGERS = ("logical", "reserved", "physical")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it), the last bound +Inf: Prometheus's buckets."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append((bound, running))
        return out


class _Handle:
    """What the metrics need about one live handle (dropped at release)."""

    __slots__ = ("b_token", "capacity_bytes", "allocator", "copies", "tier", "committed", "owning", "state",
                 "arrival", "last_output")
    last_output: int | None  # monotonic_ns of the handle's newest output_emit

    def __init__(self, b_token: int, capacity: int, allocator: int, tiers: tuple[str, ...],
                 arrival: int | None) -> None:
        self.b_token, self.capacity_bytes, self.allocator = b_token, capacity * b_token, allocator
        self.copies, self.tier = len(tiers), tiers[0]
        self.committed, self.owning, self.state = 0, False, 0  # 0 waiting, 1 running, 2 terminal
        self.arrival, self.last_output = arrival, None


class ServiceFold:
    """Counters, gauges and histograms from committed events, in commit order. A handle
    allocated before the first event folded is counted in `events`, never tracked. The
    byte ledgers follow replay.ledger: a handle owns bytes from its first publication
    (or its fork) to its release."""

    def __init__(self) -> None:
        self.events = dict.fromkeys(EVENT_TYPES, 0)
        self.attempts = dict.fromkeys(APPEND_KINDS, 0)
        self.outcomes = dict.fromkeys(APPEND_OUTCOMES, 0)
        self.running = self.waiting = 0
        self.kv = dict.fromkeys(LEDGERS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.position = 0  # the last global position folded
        self.handles: dict[str, _Handle] = {}
        self._logical = self._reserved = self._allocator = 0

    def apply(self, events: Iterable[ev.Event], position: int | None = None) -> None:
        """Fold committed events; `position`: the commit's last global position, when the
        events do not carry theirs yet (a service's hook sees them as it wrote them)."""
        moved = False
        last: ev.Event | None = None
        for e in events:
            last = e
            self.events[e.event_type] += 1
            p = e.payload  # its class is the event type's (the envelope's tag): dispatch on it
            on = _ON.get(p.__class__)
            if on is not None and on(self, e, p):
                moved = True
        if position is None and last is not None:
            position = last.global_position
        if position is not None:
            self.position = max(self.position, position)
        if moved:
            kv = self.kv
            kv["logical"], kv["reserved"] = self._logical, self._reserved
            kv["physical"] = self._reserved + self._allocator

    # -- per payload class: True when the byte ledgers moved ----------------------
    # A handle allocated before this fold started is counted in `events`, not tracked.

    def _emit(self, e: ev.Event, p: ev.OutputEmit) -> bool:
        h = self.handles.get(e.stream_id)
        if h is None:
            return False
        now = e.monotonic_ns
        if h.last_output is None:
            if h.arrival is not None:
                self.ttft.observe(max(0, now - h.arrival) / 1e9)
        else:
            self.itl.observe(max(0, now - h.last_output) / 1e9)
        h.last_output = now
        return False

    def _start(self, e: ev.Event, p: ev.AppendStart) -> bool:
        self.attempts[p.kind] += 1
        h = self.handles.get(e.stream_id)
        if h is not None and h.state == 0:
            h.state = 1
            self.waiting -= 1
            self.running += 1
        return False

    def _publish(self, e: ev.Event, p: ev.AppendPublish) -> bool:
        self.outcomes["success"] += 1
        h = self.handles.get(e.stream_id)
        if h is None:
            return False
        self._own(h, p.committed_length)
        return True

    def _allocate(self, e: ev.Event, p: ev.RequestAllocate) -> bool:
        self.handles[e.stream_id] = _Handle(p.b_token, p.reserved_capacity, p.allocator_bytes_per_copy,
                                            p.copy_tiers, e.monotonic_ns)
        self.waiting += 1
        return False

    def _fork(self, e: ev.Event, p: ev.Fork) -> bool:
        h = self.handles[e.stream_id] = _Handle(p.b_token, p.reserved_capacity, p.allocator_bytes_per_copy,
                                                p.copy_tiers, None)
        h.state, h.last_output = 1, e.monotonic_ns
        self.running += 1
        self._own(h, p.prefix_length)
        return True

    def _failure(self, e: ev.Event, p: ev.Failure) -> bool:
        self.outcomes[p.outcome] += 1
        return False

    def _truncate(self, e: ev.Event, p: ev.Truncate) -> bool:
        h = self.handles.get(e.stream_id)
        if h is None or not h.owning:
            return False
        self._own(h, p.new_length)
        return True

    def _end(self, e: ev.Event, p: ev.CancelRequest | ev.Finish) -> bool:
        h = self.handles.get(e.stream_id)
        if h is None:
            return False
        if isinstance(p, ev.CancelRequest) and p.aborted_txn_ids:
            self.outcomes["cancelled"] += len(p.aborted_txn_ids)
        self._terminal(h)
        return False

    def _release(self, e: ev.Event, p: ev.Release) -> bool:
        h = self.handles.pop(e.stream_id, None)
        if h is None:
            return False
        self._terminal(h)
        if not h.owning:
            return False
        self._logical -= h.committed * h.b_token
        self._reserved -= h.copies * h.capacity_bytes
        self._allocator -= h.copies * h.allocator
        return True

    def _own(self, h: _Handle, committed: int) -> None:
        if not h.owning:
            h.owning = True
            self._reserved += h.copies * h.capacity_bytes
            self._allocator += h.copies * h.allocator
        self._logical += (committed - h.committed) * h.b_token
        h.committed = committed

    def _terminal(self, h: _Handle) -> None:
        if h.state == 0:
            self.waiting -= 1
        elif h.state == 1:
            self.running -= 1
        h.state = 2


# Keyed by the payload's class: each fold takes an event whose payload is of that class
# (Any: the dispatch pairs them); the other classes (reorders, KV events) only count.
_ON: dict[type, Callable[[ServiceFold, Any, Any], bool]] = {
    ev.OutputEmit: ServiceFold._emit,
    ev.AppendStart: ServiceFold._start,
    ev.AppendPublish: ServiceFold._publish,
    ev.RequestAllocate: ServiceFold._allocate,
    ev.Fork: ServiceFold._fork,
    ev.Failure: ServiceFold._failure,
    ev.Truncate: ServiceFold._truncate,
    ev.CancelRequest: ServiceFold._end,
    ev.Finish: ServiceFold._end,
    ev.Release: ServiceFold._release,
}

__all__ = ["APPEND_KINDS", "APPEND_OUTCOMES", "EVENT_TYPES", "ITL_BUCKETS", "JOURNAL_OUTCOMES", "LEDGERS",
           "TTFT_BUCKETS", "Histogram", "ServiceFold"]
