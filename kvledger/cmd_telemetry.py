"""`kvledger reconcile`, and the `--telemetry/--metrics-port/--metrics-host/--metrics-out`
flags of `kvledger demo`.

    kvledger demo --db sqlite:///kv.db --telemetry t.jsonl --metrics-port 9100 --metrics-out m.txt
    kvledger reconcile --telemetry t.jsonl --metrics m.txt --db sqlite:///kv.db [--json]

Exit status of reconcile: 0 clean (informational notes allowed), 1 findings, 2 bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from kvledger import args as a
from kvledger.args import DB_HELP
from kvledger.schemas.errors import ErrorCode, KvLedgerError

if TYPE_CHECKING:
    from kvledger.replay.reconcile import ReconcileResult
    from kvledger.telemetry.producer import Telemetry

log = logging.getLogger("kvledger.cli")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "reconcile",
        help="compare telemetry (audit records, allocator/residency observations, a metrics "
             "scrape) with the journal; exit 1 on findings",
        description="Each finding names its class, the telemetry record(s) (line, id) and the "
                    "journal event(s) (position, id) it points to. Absence is concluded only from "
                    "a complete (unsampled) telemetry file, within the scope its header declares.")
    p.add_argument("--telemetry", type=a.input_file, metavar="FILE.jsonl",
                   help="telemetry JSON lines (from `kvledger demo --telemetry`)")
    p.add_argument("--kv-index", type=a.input_file, metavar="FILE.json",
                   help="instead of --telemetry: a KV-aware router's index dump (block hash -> media, per "
                        "KV-event stream) against the journal's block pool (docs/guides/kv-events.md)")
    p.add_argument("--at", type=a.POSITION, metavar="N",
                   help="with --kv-index: the block pool after global positions 1..N (default: the dump's "
                        "position, else the end)")
    p.add_argument("--metrics", type=a.input_file, metavar="SCRAPE.txt",
                   help="a Prometheus text scrape (`kvledger demo --metrics-out`): every value the journal can "
                        "prove is checked against it (events, appends, outcomes, requests, KV bytes, latency "
                        "histograms), the rest for identity labels only; the summary lists which")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--db", help=DB_HELP)
    g.add_argument("--journal", type=a.input_file, metavar="FILE.jsonl",
                   help="an audit file (kvledger export); no database")
    p.add_argument("--json", action="store_true", help="print one JSON object: summary, findings")
    p.set_defaults(run=_cmd_reconcile)

    demo = sub.choices.get("demo")
    if demo is not None:
        demo.add_argument("--telemetry", type=a.output_file, metavar="FILE.jsonl",
                          help="write telemetry JSON lines here (after each commit; never blocks)")
        demo.add_argument("--metrics-port", type=a.PORT, metavar="PORT", help=a.METRICS_PORT_HELP)
        demo.add_argument("--metrics-host", type=a.host, metavar="HOST", help=a.METRICS_HOST_HELP)
        demo.add_argument("--metrics-out", type=a.output_file, metavar="SCRAPE.txt",
                          help="write the final /metrics scrape here (for `kvledger reconcile --metrics`)")


# -- demo wiring (called by kvledger.cmd_serve) ------------------------------------------

def demo_telemetry(args: argparse.Namespace) -> Telemetry | None:
    """A Telemetry for `kvledger demo` when any telemetry flag is set, else None."""
    path = getattr(args, "telemetry", None)
    port = getattr(args, "metrics_port", None)
    host = getattr(args, "metrics_host", None)
    if host is not None and port is None:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--metrics-host needs --metrics-port")
    if path is None and port is None and getattr(args, "metrics_out", None) is None:
        return None
    from kvledger.telemetry.producer import Telemetry

    # The path, the port and the host were checked when parsed (kvledger.args).
    telemetry = Telemetry(Path(path).expanduser() if path else None)
    if port is not None:
        host = host or "127.0.0.1"
        try:
            bound = telemetry.serve(port, host)
        except BaseException:
            telemetry.close()
            raise
        shown = f"[{host}]" if ":" in host else host
        log.info("serving metrics on http://%s:%d/metrics", shown, bound)
    return telemetry


class TelemetrySummary(TypedDict):
    file: str | None
    metrics_port: int | None
    metrics_host: str | None
    metrics_out: str | None
    records: int
    written: int
    dropped: int


def finish_demo_telemetry(telemetry: Telemetry | None, args: argparse.Namespace) -> TelemetrySummary | None:
    """Close the telemetry (drain, trailer), write --metrics-out; a summary for the output."""
    if telemetry is None:
        return None
    telemetry.close()
    out = getattr(args, "metrics_out", None)
    if out is not None:
        with a.writing(out):
            Path(out).expanduser().write_bytes(telemetry.metrics.scrape())
    stats = telemetry.stats()
    return {"file": getattr(args, "telemetry", None), "metrics_port": telemetry.metrics_port,
            "metrics_host": (getattr(args, "metrics_host", None) or "127.0.0.1") if telemetry.metrics_port else None,
            "metrics_out": out, "records": stats["records"], "written": stats["written"],
            "dropped": stats["dropped"]}


# -- reconcile -------------------------------------------------------------------------

def _cmd_reconcile(args: argparse.Namespace) -> int:
    import msgspec

    from kvledger.migrations.storage import open_existing_journal
    from kvledger.replay.reconcile import reconcile
    from kvledger.replay.sources import journal_events, jsonl_bodies, jsonl_events

    if (args.telemetry is None) == (args.kv_index is None):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "reconcile takes --telemetry or --kv-index (one of them)")
    if args.kv_index is not None:
        return _reconcile_kv_index(args)
    if args.at is not None:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--at is for --kv-index")
    if not Path(args.telemetry).is_file():
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"no telemetry file {args.telemetry}")
    scrape = None
    if args.metrics:
        try:
            scrape = Path(args.metrics).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"cannot read {args.metrics}: {exc}") from None
    if args.journal:
        source = args.journal
        result = reconcile(jsonl_events(args.journal), jsonl_bodies(args.telemetry), scrape)
    else:
        with open_existing_journal(args.db) as journal:
            source = journal.display_url
            result = reconcile(journal_events(journal), jsonl_bodies(args.telemetry), scrape)
    if args.json:
        doc = {"journal": source, "telemetry": args.telemetry, "metrics": args.metrics, "ok": result.ok,
               "summary": result.summary, "findings": result.findings}
        sys.stdout.buffer.write(msgspec.json.encode(doc) + b"\n")
        sys.stdout.flush()
    else:
        _print(result, source, args.telemetry)
    return 0 if result.ok else 1


def _reconcile_kv_index(args: argparse.Namespace) -> int:
    import msgspec

    from kvledger.migrations.storage import open_existing_journal
    from kvledger.replay.kv_reconcile import parse_index, reconcile_index
    from kvledger.replay.sources import journal_events, jsonl_events

    try:
        doc = msgspec.json.decode(Path(args.kv_index).read_bytes())
    except (OSError, msgspec.DecodeError) as exc:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"cannot read {args.kv_index}: {exc}") from None
    index, position = parse_index(doc)
    at = args.at if args.at is not None else position
    if args.journal:
        source = args.journal
        result = reconcile_index(jsonl_events(args.journal, at), index)
    else:
        with open_existing_journal(args.db) as journal:
            source = journal.display_url
            result = reconcile_index(journal_events(journal, 0, at), index)
    if at is not None and result.position < at:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"position {at} is past the end of the journal "
                                                        f"(last position {result.position})")
    if args.json:
        out = {"journal": source, "kv_index": args.kv_index, "ok": result.ok, "position": result.position,
               "streams": result.streams, "journal_blocks": result.journal_blocks,
               "index_blocks": result.index_blocks, "findings": result.findings}
        sys.stdout.buffer.write(msgspec.json.encode(out) + b"\n")
    else:
        print(f"{args.kv_index} vs {source} at position {result.position}: {result.streams} stream(s), "
              f"{result.journal_blocks} resident (stream, block, medium) in the journal, {result.index_blocks} "
              f"in the index, {len(result.findings)} finding(s)")
        for f in result.findings:
            print(f"{f.code} {f.stream_id} {f.message}{' (stream uncertain: after a gap)' if f.uncertain else ''}")
    sys.stdout.flush()
    return 0 if result.ok else 1


def _print(result: ReconcileResult, source: str, telemetry: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    s = result.summary
    scope = (f"{s.in_scope} in scope" if s.complete else
             "sampled: absence not concluded" if s.sample_rate is not None else "no header")
    console.print(f"{escape(telemetry)} vs {escape(source)}: {s.journal_events} journal events ({scope}), "
                  f"{s.mutations} mutation records ({s.paired} paired, {s.refused} refused), "
                  f"{s.observations} observations, {s.duplicates} duplicate(s) deduplicated"
                  + (f", {s.metric_series} metric series" if s.metric_series is not None else ""))
    if s.metric_series is not None:
        proven = (f"values of {s.metric_values_proven} series proven against the journal "
                  f"({escape(s.metrics_scope or '')})" if s.metric_position is not None
                  else escape(s.metrics_scope or "labels only"))
        only = f"; labels only: {escape(', '.join(s.metrics_labels_only))}" if s.metrics_labels_only else ""
        console.print(f"metrics: {proven}{only}")
    if not result.findings:
        console.print("clean: every plane agrees with the journal")
        return
    t = Table(title=f"{len(result.errors)} finding(s), {len(result.findings) - len(result.errors)} note(s)",
              title_justify="left")
    for col in ("class", "code", "telemetry", "journal", "message"):
        t.add_column(col, overflow="fold")
    for f in result.findings:
        tele = ", ".join(f"line {n}" for n in f.lines[:3]) or (
            ", ".join(f"scrape line {n}" for n in f.scrape_lines[:3]) if f.scrape_lines else "-")
        if f.record_ids:
            tele += f" ({f.record_ids[0][:12]})"
        jour = ", ".join(f"pos {p}" for p in f.positions[:3]) or "-"
        if f.event_ids:
            jour += f" ({f.event_ids[0][:12]})"
        code = f.code if f.severity == "error" else f"{f.code} (info)"
        t.add_row(f.finding_class, code, tele, jour, escape(f.message))
    console.print(t)
