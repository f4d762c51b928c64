"""Service metrics (spec 0x05) and the saved-work ledger (spec 0x03), derived from the
endpoint clocks and counts the fold keeps per handle. Pure functions of final state:
they run once per report, never per event.

Conventions, published because comparisons need them (0x05):
    TTFT     = first output time - arrival time (request_allocate or fork)
    TBT_j    = output_j - output_(j-1), j = 1..G-1
    TPOT     = (last output - first output) / (G - 1); undefined (None) for G = 1, never 0
    E2E      = finish time (finish or cancel) - arrival time
    release lag = release time - finish time
Output times are output_emit events; a verify append's accepted drafts become outputs
at their publish (engine.evolve records them so). Times are monotonic_ns integers.

A fork child arrives at its fork. The outputs it inherits were the parent's: its
metrics cover only the outputs it emitted itself, and the saved-work formulas (which
start from a prefill of P prompt rows) do not apply to it; its executed rows do.

Requests and forks are counted apart. A request is a handle its request_allocate
created: the root of a fork tree. Its forks (beams, n > 1 samples, a beam taken twice)
are that request's, not requests of their own: the window's throughput and goodput
count requests only (one prompt with 4 beams completes one request), and the forks get
their own figures beside them (`fork_window`), each fork naming the request it is of.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import sub

import msgspec

from kvledger.engine.state import HandleState

NS_PER_S = 1_000_000_000


# gc=False: immutable values only, so never in a cycle; a report holds one a request,
# which the collector would otherwise scan after every replay.
class SavedWork(msgspec.Struct, frozen=True, gc=False):
    """Rows and causal query-key pairs per layer (and query head) for P prompt tokens
    and G outputs, without and with a cache (0x03), next to what the journal proves
    was executed: the rows and pairs of its published appends."""

    prompt_tokens: int
    output_tokens: int
    rows_no_cache: int | None
    rows_cache: int | None
    rows_saved: int | None
    rows_ratio: float | None
    pairs_no_cache: int | None
    pairs_cache: int | None
    pairs_saved: int | None
    pairs_ratio: float | None
    executed_rows: int
    executed_pairs: int
    executed_appends: int


# gc=False: immutable values only, so never in a cycle; a report holds one a request,
# which the collector would otherwise scan after every replay. omit_defaults: fork_of
# and forks appear only where there are forks.
class RequestMetrics(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    handle_id: str
    request_id: str
    outcome: str | None  # "finished", "cancelled", or None while still running
    arrival_ns: int
    outputs: int  # emitted by this request (a fork child's inherited ones excluded)
    inherited_outputs: int
    ttft_ns: int | None
    tbt_ns: tuple[int, ...]
    tpot_ns: float | None
    e2e_ns: int | None
    release_lag_ns: int | None
    slo_valid: bool  # finished, TTFT <= limit and every TBT <= limit (window's thresholds)
    saved_work: SavedWork
    fork_of: str | None = None  # a fork: the handle of the request (the fork tree's root) it belongs to
    forks: int = 0  # a request: the forks of its tree


# The goodput SLO when none is declared: one pair, used by `replay` and the demo's summary.
DEFAULT_SLO_TTFT_MS = 1000.0
DEFAULT_SLO_TBT_MS = 100.0  # every time-between-tokens, not their mean


class WindowSpec(msgspec.Struct, frozen=True):
    """A declared observation window and SLO thresholds. start/width None: from the
    first event to the last one."""

    slo_ttft_ns: int
    slo_tbt_ns: int
    start_ns: int | None = None
    width_ns: int | None = None


class WindowMetrics(msgspec.Struct, frozen=True):
    """Over requests that finished (not cancelled) inside [start, start + width]:
    rates per second; None where the denominator is 0."""

    start_ns: int | None
    width_ns: int | None
    slo_ttft_ns: int
    slo_tbt_ns: int
    completed: int
    slo_valid: int
    slo_valid_tokens: int
    throughput_rps: float | None
    goodput_rps: float | None
    goodput_fraction: float | None
    token_goodput_tps: float | None


def _tetrahedral(n: int) -> int:
    """sum(s=1..n) s*(s+1)/2."""
    return n * (n + 1) * (n + 2) // 6 if n > 0 else 0


def saved_work(p: int, g: int, executed_rows: int = 0, executed_pairs: int = 0,
               executed_appends: int = 0, *, from_prefill: bool = True) -> SavedWork:
    """0x03 for prompt P and G >= 1 outputs. With G = 0 no decision was made, and a
    request that did not start from a prefill (a fork child) is not the formulas'
    case: both get None; what was executed is still reported."""
    if g < 1 or not from_prefill:
        return SavedWork(p, g, None, None, None, None, None, None, None, None,
                         executed_rows, executed_pairs, executed_appends)
    rows_no = g * p + g * (g - 1) // 2  # call g processes P + g rows
    rows_cache = p + g - 1  # prefill, then G - 1 one-row decodes
    pairs_no = _tetrahedral(p + g - 1) - _tetrahedral(p - 1)  # a causal triangle per call
    pairs_cache = p * (p + 1) // 2 + (g - 1) * p + (g - 1) * g // 2  # + sum(j=1..G-1) (P + j)
    return SavedWork(
        prompt_tokens=p, output_tokens=g,
        rows_no_cache=rows_no, rows_cache=rows_cache, rows_saved=rows_no - rows_cache,
        rows_ratio=rows_no / rows_cache if rows_cache else None,
        pairs_no_cache=pairs_no, pairs_cache=pairs_cache, pairs_saved=pairs_no - pairs_cache,
        pairs_ratio=pairs_no / pairs_cache if pairs_cache else None,
        executed_rows=executed_rows, executed_pairs=executed_pairs,
        executed_appends=executed_appends,
    )


def request_metrics(s: HandleState, outcome: str | None, window: WindowSpec,
                    work: SavedWork, inherited: int = 0, *, fork_of: str | None = None,
                    forks: int = 0) -> RequestMetrics:
    inherited = min(inherited, len(s.output_ns))  # a truncate may have cut into them
    times = s.output_ns[inherited:]
    g = len(times)
    tbt = tuple(map(sub, times[1:], times))
    ttft = times[0] - s.arrival_ns if g else None
    finished = outcome == "finished"
    return RequestMetrics(
        handle_id=s.handle_id, request_id=s.request_id, outcome=outcome,
        arrival_ns=s.arrival_ns, outputs=g, inherited_outputs=inherited, ttft_ns=ttft, tbt_ns=tbt,
        tpot_ns=(times[-1] - times[0]) / (g - 1) if g > 1 else None,
        e2e_ns=s.finish_ns - s.arrival_ns if s.finish_ns is not None else None,
        release_lag_ns=(s.release_ns - s.finish_ns
                        if s.release_ns is not None and s.finish_ns is not None else None),
        # One output: no TBT interval exists, so that clause holds vacuously (0x05).
        slo_valid=(finished and ttft is not None and ttft <= window.slo_ttft_ns
                   and (not tbt or max(tbt) <= window.slo_tbt_ns)),
        saved_work=work, fork_of=fork_of, forks=forks,
    )


def fork_roots(handles: dict[str, HandleState]) -> dict[str, str]:
    """Each fork's request: the root of its fork tree (a handle with no parent), for
    every handle that has a parent. `handles` in journal order, so a parent comes first;
    one whose parent is unknown (a partial fold) counts that parent as its root."""
    roots: dict[str, str] = {}
    for hid, s in handles.items():
        parent = s.parent_handle_id
        if parent is not None:
            roots[hid] = roots.get(parent, parent)
    return roots


def window_metrics(requests: Iterable[tuple[RequestMetrics, int | None]], window: WindowSpec,
                   first_ns: int | None, last_ns: int | None) -> WindowMetrics:
    """`requests` pairs each request with its finish time."""
    start = window.start_ns if window.start_ns is not None else first_ns
    width = window.width_ns
    if width is None and start is not None and last_ns is not None:
        width = max(0, last_ns - start)
    completed = valid = tokens = 0
    if start is not None and width is not None:
        end = start + width
        for r, finish_ns in requests:
            if r.outcome == "finished" and finish_ns is not None and start <= finish_ns <= end:
                completed += 1
                if r.slo_valid:
                    valid += 1
                    tokens += r.outputs

    def rate(n: int) -> float | None:
        return n * NS_PER_S / width if width else None

    return WindowMetrics(
        start_ns=start, width_ns=width, slo_ttft_ns=window.slo_ttft_ns,
        slo_tbt_ns=window.slo_tbt_ns, completed=completed, slo_valid=valid,
        slo_valid_tokens=tokens, throughput_rps=rate(completed), goodput_rps=rate(valid),
        goodput_fraction=valid / completed if completed else None,
        token_goodput_tps=rate(tokens),
    )
