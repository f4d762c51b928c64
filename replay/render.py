"""Human-readable output of replay and verify: rich tables. Presentation only; every
number comes from the Report or the findings unchanged (times shown in ms)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvledger.replay.ledger import PEAK_NAMES
from kvledger.replay.metrics import RequestMetrics
from kvledger.replay.report import Report
from kvledger.replay.verify import VerifyResult

MAX_ROWS = 40  # per table; --json has everything


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:,.3f}".rstrip("0").rstrip(".")


def _rate(x: float | None, unit: str) -> str:
    return "-" if x is None else f"{x:,.3f}".rstrip("0").rstrip(".") + f" {unit}"


def _more(console: Console, total: int) -> None:
    if total > MAX_ROWS:
        console.print(f"  ... {total - MAX_ROWS} more (see --json)")


def print_report(report: Report, console: Console, source: str) -> None:
    owning = sum(h.owns_cache for h in report.handles)
    console.print(f"[bold]{escape(source)}[/] at position {report.position}: {len(report.handles)} handles, "
                  f"{owning} owning cache state")

    t = Table(title="Handles", title_justify="left")
    for col in ("handle", "request", "gen", "snap", "phase", "committed", "logical", "copies",
                "snapshot_sha256"):
        t.add_column(col, justify="right" if col in ("gen", "snap", "committed", "logical") else "left")
    for h in report.handles[:MAX_ROWS]:
        t.add_row(escape(h.handle_id), escape(h.request_id), str(h.generation),
                  str(h.snapshot_version), h.view.phase,
                  str(h.committed_length), str(h.logical_length), ",".join(h.copy_tiers),
                  h.snapshot_sha256[:16])
    console.print(t)
    _more(console, len(report.handles))

    led = report.ledger
    t = Table(title="Byte ledgers (0x02)", title_justify="left")
    t.add_column("ledger")
    t.add_column("bytes now", justify="right")
    t.add_column("peak", justify="right")
    t.add_column("peak at position", justify="right")
    for name in ("logical", "materialized", "replication_overhead", "reserved", "reservation_slack",
                 "allocator", "physical", "workspace", "instantaneous", "rectangular", "phantom"):
        peak = report.peaks.get(name) if name in PEAK_NAMES else None
        t.add_row(name, f"{getattr(led, name):,}", f"{peak.value:,}" if peak else "",
                  str(peak.position) if peak else "")
    for tier, value in led.resident.items():
        t.add_row(escape(f"resident[{tier}]"), f"{value:,}", "", "")
    console.print(t)
    bt = report.byte_time
    console.print(f"byte-time: logical {bt.logical_byte_ns / 1e6:,.3f} byte-ms, physical "
                  f"{bt.physical_byte_ns / 1e6:,.3f} byte-ms "
                  f"(from {_ms(bt.start_ns)} to {_ms(bt.end_ns)} ms)")

    _print_metrics(console, "Requests (0x05), times in ms", report.requests, forks=True)
    w = report.window
    console.print(
        f"window [{_ms(w.start_ns)}, +{_ms(w.width_ns)}] ms, SLO TTFT <= {_ms(w.slo_ttft_ns)} ms, "
        f"TBT <= {_ms(w.slo_tbt_ns)} ms: completed {w.completed}, SLO-valid {w.slo_valid}; "
        f"throughput {_rate(w.throughput_rps, 'req/s')}, goodput {_rate(w.goodput_rps, 'req/s')}, "
        f"fraction {_fraction(w.goodput_fraction)}, token goodput {_rate(w.token_goodput_tps, 'tok/s')}")
    if report.forks and report.fork_window:
        _print_metrics(console, "Forks (beams, n > 1 samples) of those requests, times in ms from each fork",
                       report.forks, forks=False)
        f = report.fork_window
        console.print(
            f"forks: {len(report.forks)} of {sum(1 for r in report.requests if r.forks)} requests, counted "
            f"apart: completed {f.completed}, SLO-valid {f.slo_valid}; "
            f"throughput {_rate(f.throughput_rps, 'forks/s')}, goodput {_rate(f.goodput_rps, 'forks/s')}, "
            f"fraction {_fraction(f.goodput_fraction)}, token goodput {_rate(f.token_goodput_tps, 'tok/s')}")

    t = Table(title="Saved work per layer (0x03): rows and causal pairs", title_justify="left")
    for col in ("handle", "P", "G", "rows no-cache", "rows cache", "rows executed", "x",
                "pairs no-cache", "pairs cache", "pairs executed", "x "):
        t.add_column(col, justify="left" if col == "handle" else "right")
    for r in (report.requests + (report.forks or []))[:MAX_ROWS]:
        s = r.saved_work

        def n(v: int | None) -> str:
            return "-" if v is None else f"{v:,}"

        t.add_row(escape(r.handle_id), str(s.prompt_tokens), str(s.output_tokens), n(s.rows_no_cache),
                  n(s.rows_cache), n(s.executed_rows),
                  "-" if s.rows_ratio is None else f"{s.rows_ratio:.2f}", n(s.pairs_no_cache),
                  n(s.pairs_cache), n(s.executed_pairs),
                  "-" if s.pairs_ratio is None else f"{s.pairs_ratio:.2f}")
    console.print(t)
    _more(console, len(report.requests) + len(report.forks or []))
    print_kv_blocks(report, console)


def _fraction(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _print_metrics(console: Console, title: str, rows: list[RequestMetrics], *, forks: bool) -> None:
    """A table of requests (with their fork count) or of forks (with their request)."""
    t = Table(title=title, title_justify="left")
    extra = "forks" if forks else "request"
    for col in ("handle", extra, "outcome", "G", "TTFT", "TPOT", "max TBT", "E2E", "release lag", "SLO"):
        t.add_column(col, justify="left" if col in ("handle", "request", "outcome") else "right")
    for r in rows[:MAX_ROWS]:
        t.add_row(escape(r.handle_id), str(r.forks) if forks else escape(r.fork_of or "-"), r.outcome or "running",
                  str(r.outputs), _ms(r.ttft_ns), _ms(r.tpot_ns), _ms(max(r.tbt_ns)) if r.tbt_ns else "-",
                  _ms(r.e2e_ns), _ms(r.release_lag_ns), "yes" if r.slo_valid else "no")
    console.print(t)
    _more(console, len(rows))


def print_kv_blocks(report: Report, console: Console) -> None:
    """The KV-event streams' block pools (engine-owned prefix-cache residency)."""
    if not report.kv_blocks:
        return
    t = Table(title="KV-event block pools (engine-owned)", title_justify="left")
    for col in ("stream", "epoch", "seq", "gaps", "restarts", "state", "pool", "resident", "bytes", "stored",
                "removed", "block-s", "findings"):
        t.add_column(col, justify="left" if col in ("stream", "state", "pool") else "right")
    for st in report.kv_blocks[:MAX_ROWS]:
        for key, p in st.pools.items() or {"-": None}.items():
            t.add_row(escape(st.stream_id), str(st.epoch), str(st.seq), str(st.gaps), str(st.restarts),
                      "uncertain" if st.uncertain else "certain", escape(key),
                      *(("-",) * 5 if p is None else (
                          f"{p.resident_blocks:,}", "-" if p.resident_bytes is None else f"{p.resident_bytes:,}",
                          f"{p.stored:,}", f"{p.removed:,}", f"{p.block_seconds:,.3f}")),
                      str(len(st.findings) + st.omitted_findings))
    console.print(t)
    _more(console, len(report.kv_blocks))


def print_findings(result: VerifyResult, console: Console, source: str) -> None:
    if result.storage:
        console.print(f"storage check: {escape(result.storage)}")
    if result.ok:
        console.print(f"{escape(source)}: {result.events} events, every invariant holds")
        return
    total = len(result.findings) + result.omitted
    t = Table(title=f"{escape(source)}: {total} finding(s) in {result.events} events",
              title_justify="left")
    for col in ("code", "position", "line", "event", "stream", "message"):
        t.add_column(col, overflow="fold")
    for f in result.findings:
        t.add_row(f.code, "-" if f.global_position is None else str(f.global_position),
                  "-" if f.line is None else str(f.line), escape((f.event_id or "-")[:12]),
                  escape(f.stream_id or "-"), escape(f.message))
    console.print(t)
    if result.omitted:
        console.print(f"... and {result.omitted} more finding(s) not shown (--max-findings N shows more)")
    if result.stopped:
        console.print(f"verify {escape(result.stopped)}")
