"""The values of a Prometheus scrape against what the journal proves (reconcile --metrics).

A scrape of kvledger's service metrics (telemetry.metrics) counts the events one command
service committed after its telemetry header's `after_position`, up to the position its
`kvledger_journal_position` gauge names. Folding the journal's events of that source in
that range with the same definition (replay.service_fold) gives every value the journal
can prove: events by type, append attempts by kind, the append outcomes that committed
events decide (success, failed, aborted, cancelled), running and waiting requests, the
KV byte ledgers, the TTFT and inter-token histograms (their buckets, counts and sums come
from the events' monotonic clocks) and the position itself. Anything else (refusals,
which write nothing; the telemetry pipeline's own counters; another program's metrics) is
checked for its labels only, and the result says which.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import NamedTuple

from kvledger.replay.service_fold import JOURNAL_OUTCOMES, Histogram, ServiceFold
from kvledger.schemas.errors import ErrorCode, KvLedgerError

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_info")
POSITION = "kvledger_journal_position"


class Sample(NamedTuple):
    line: int  # in the scrape, from 1
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float | None  # None: not a number


class Drift(NamedTuple):
    """One series (or several that differ only in labels the journal says nothing of)
    whose value the journal contradicts."""

    metric: str
    labels: str  # as Prometheus writes them: {event_type="fork"}, or ""
    claimed: float
    proven: float
    lines: tuple[int, ...]


class Proof(NamedTuple):
    checked: int  # series whose value was proven
    labels_only: tuple[str, ...]  # families (or family{label="value"}) checked for labels only
    drifts: list[Drift]


def family(name: str) -> str:
    for s in _SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


def parse_scrape(text: str) -> list[Sample]:
    """Every sample line of a Prometheus text exposition, or INVALID_ARGUMENT."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        for _ in text_string_to_metric_families(text):
            pass
    except Exception as exc:  # noqa: BLE001 - the parser raises ValueError and friends
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"not a Prometheus text exposition: {exc}") from None
    samples = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value: float | None = float(m.group(3))
        except ValueError:
            value = None
        samples.append(Sample(n, m.group(1), tuple(_LABEL.findall(m.group(2) or "")), value))
    return samples


def scrape_position(samples: list[Sample]) -> int | None:
    """The journal position the scrape says its counters count up to, if it says."""
    for s in samples:
        if s.name == POSITION and s.value is not None and math.isfinite(s.value) and s.value >= 0:
            return int(s.value)
    return None


# sample name -> (the label that selects a value, the proven value for that label's value;
# None when the journal cannot prove it)
Rule = tuple[str | None, Callable[[str | None], float | None]]


def _rules(fold: ServiceFold) -> dict[str, Rule]:
    def keyed(values: dict[str, int]) -> Callable[[str | None], float | None]:
        return lambda v: None if v is None else values.get(v, 0)

    def buckets(h: Histogram) -> Callable[[str | None], float | None]:
        table = dict(h.cumulative())

        def proven(le: str | None) -> float | None:
            try:
                return table.get(float(le)) if le is not None else None
            except ValueError:
                return None

        return proven

    rules: dict[str, Rule] = {
        "kvledger_journal_events_total": ("event_type", keyed(fold.events)),
        "kvledger_append_attempts_total": ("kind", keyed(fold.attempts)),
        "kvledger_append_outcomes_total": ("outcome", lambda v: fold.outcomes[v] if v in JOURNAL_OUTCOMES else None),
        "kvledger_requests_running": (None, _const(fold.running)),
        "kvledger_requests_waiting": (None, _const(fold.waiting)),
        "kvledger_kv_bytes": ("ledger", keyed(fold.kv)),
        POSITION: (None, _const(fold.position)),
    }
    for name, h in (("kvledger_time_to_first_token_seconds", fold.ttft),
                    ("kvledger_inter_token_latency_seconds", fold.itl)):
        rules[f"{name}_bucket"] = ("le", buckets(h))
        rules[f"{name}_count"] = (None, _const(sum(h.counts)))
        rules[f"{name}_sum"] = (None, _const(h.sum))
    return rules


def _const(value: float) -> Callable[[str | None], float | None]:
    return lambda _: value


def prove(samples: list[Sample], fold: ServiceFold | None) -> Proof:
    """Each sample's value against `fold` (the journal's events in the scrape's scope);
    fold None: no scope is known, every family is checked for its labels only. Series
    that differ only in labels outside the rule's are summed first (a counter split by an
    extra label adds up to the same count)."""
    if fold is None:
        return Proof(0, tuple(sorted({family(s.name) for s in samples})), [])
    rules = _rules(fold)
    claimed: dict[tuple[str, str | None], tuple[float, list[int]]] = {}
    unproven: dict[str, set[str]] = {}  # family -> the series (label sets) not proven
    proven_families: set[str] = set()
    for s in samples:
        rule = rules.get(s.name)
        key = None if rule is None or rule[0] is None else dict(s.labels).get(rule[0])
        if rule is None or s.value is None or rule[1](key) is None:
            if not s.name.endswith("_created"):  # a counter's creation time: no count to prove
                unproven.setdefault(family(s.name), set()).add(_labels(s.labels))
            continue
        proven_families.add(family(s.name))
        total, lines = claimed.get((s.name, key), (0.0, []))
        claimed[(s.name, key)] = (total + s.value, [*lines, s.line])
    drifts = []
    for (name, key), (value, lines) in claimed.items():
        label, proven_of = rules[name]
        proven = proven_of(key)
        assert proven is not None  # only proven series were summed
        same = (math.isclose(value, proven, rel_tol=1e-9, abs_tol=1e-9) if name.endswith("_sum")
                else value == proven)
        if not same:
            shown = "" if label is None else _labels(((label, key or ""),))
            drifts.append(Drift(name, shown, value, float(proven), tuple(lines)))
    only = sorted(fam if fam not in proven_families else f"{fam}{series}"
                  for fam, all_series in unproven.items() for series in sorted(all_series))
    return Proof(len(claimed), tuple(dict.fromkeys(only)), drifts)


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""


__all__ = ["POSITION", "Drift", "Proof", "Sample", "family", "parse_scrape", "prove", "scrape_position"]
