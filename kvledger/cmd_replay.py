"""`kvledger replay | verify | head | export | import`: the read side on the command line.

Thin: parse flags, open the source, call replay/, print. Errors are KvLedgerError
(one line, exit 2); verify exits 1 when it has findings.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvledger import args as a
from kvledger.args import DB_HELP
from kvledger.cli import add_slo_arguments
from kvledger.schemas.errors import ErrorCode, KvLedgerError

if TYPE_CHECKING:
    from rich.console import Console

    from kvledger.replay.anchor import Anchor

MS = 1_000_000


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("replay", help="fold the journal into snapshots, byte ledgers, byte-time "
                                      "and service metrics",
                       description="Fold the journal (a database, or an audit file from `kvledger export`) into "
                                   "each handle's snapshot, the byte ledgers (reserved, materialized, physical), "
                                   "byte-time and service metrics (TTFT, TPOT, goodput under the SLO), at the end "
                                   "or at any position (--at). Read-only unless --incremental stores a checkpoint.")
    _source(p)
    p.add_argument("--at", type=a.POSITION, metavar="N",
                   help="the state after global positions 1..N (default: the whole journal)")
    p.add_argument("--incremental", action="store_true",
                   help="resume from the projection checkpoint stored in the database, then "
                        "store the new one (same result as a full replay)")
    p.add_argument("--checkpoint", type=a.name, default="replay", metavar="NAME",
                   help="checkpoint name for --incremental (default: replay)")
    p.add_argument("--window-start-ms", type=a.millis, metavar="MS",
                   help="observation window start, monotonic ms (default: the first event)")
    p.add_argument("--window-ms", type=a.millis, metavar="MS",
                   help="observation window width (default: up to the last event)")
    add_slo_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: position, handles, ledger, peaks, byte_time, "
                        "requests, window")
    p.add_argument("--trajectory", action="store_true",
                   help="with --json: add the ledgers after every event (default: only the final ones)")
    p.add_argument("--plot", type=a.output_file, metavar="FILE.png",
                   help="draw the byte trajectory (needs matplotlib: pip install 'kvledger[plot]')")
    p.add_argument("--block-bytes", type=a.BLOCK_BYTES, metavar="N",
                   help="bytes of one KV-event block: kv_blocks then reports resident bytes and byte-seconds "
                        "(default: block counts only)")
    p.set_defaults(run=_cmd_replay)

    p = sub.add_parser("verify", help="check every journal invariant; exit 1 on findings",
                       description="Check every journal invariant, the stored records and their chain, and the "
                                   "database's storage; exit 1 on findings. The chain shows an edited record, "
                                   "not a missing one: a rollback to an older copy, a deleted tail or an emptied "
                                   "journal verifies clean unless --expect gives an anchor taken earlier "
                                   "(`kvledger head`).")
    _source(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--max-findings", type=_findings_cap, default=100, metavar="N",
                   help="findings listed (default 100); the rest are counted, and verify stops "
                        "reading after 10000")
    p.add_argument("--expect", type=_anchor, metavar="ANCHOR",
                   help="an anchor `kvledger head` printed earlier (POSITION:CHAIN_DIGEST, or signed "
                        "POSITION:CHAIN_DIGEST:SIGNATURE): the journal must still reach POSITION with that "
                        "chain digest there; a rollback, deleted tail, emptied journal or different history "
                        "is an ANCHOR_MISMATCH finding. A signed anchor needs --key")
    p.add_argument("--key", type=a.input_file, metavar="FILE",
                   help="with --expect: the key the anchor was signed with (raw bytes, or hex); an unsigned "
                        "or wrongly signed anchor is an ANCHOR_MISMATCH finding")
    p.add_argument("--reexecute", action="store_true",
                   help="also re-run every journaled append through the model (--runtime hf --model DIR) "
                        "and compare each publication's row digest")
    p.add_argument("--runtime", choices=("hf",), default="hf",
                   help="the executor of --reexecute: hf (transformers; the journal's own worker "
                        "re-executes in `kvledger recover`)")
    p.add_argument("--model", metavar="DIR", help="the model directory --reexecute runs (required with it)")
    p.set_defaults(run=_cmd_verify)

    p = sub.add_parser("head", help="print the journal's anchor POSITION:CHAIN_DIGEST, to keep for verify --expect",
                       description="Print the journal's anchor: its last global position and the record chain "
                                   "digest there, POSITION:CHAIN_DIGEST. Keep it where you control it (outside "
                                   "the database); `kvledger verify --expect ANCHOR` later finds a rollback, a "
                                   "deleted tail, an emptied journal or a different history. With --key the "
                                   "anchor is signed (HMAC-SHA256): POSITION:CHAIN_DIGEST:SIGNATURE. An empty "
                                   "journal's anchor is 0 and the genesis digest.")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: database, position, chain, signature, anchor")
    p.add_argument("--key", type=a.input_file, metavar="FILE",
                   help="sign the anchor with the key in FILE (raw bytes, or hex; at least 16 bytes; never printed)")
    p.set_defaults(run=_cmd_head)

    p = sub.add_parser("export", help="write the journal as an audit file: one stored event per line",
                       description="Write every stored event, in global position order, as one JSON object a "
                                   "line: an audit file that `replay`, `verify` and `reconcile` read with "
                                   "--journal and `kvledger import` loads into an empty journal. Read-only.")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--out", type=a.output_or_stdout, required=True, metavar="FILE.jsonl",
                   help="output file ('-': stdout)")
    p.set_defaults(run=_cmd_export)

    p = sub.add_parser("import", help="load an audit file into an empty journal (all or nothing)",
                       description="Load an audit file written by `kvledger export` into an empty journal. "
                                   "Each line is checked as verify would, given the lines before it; the first "
                                   "bad one is refused with its code and FILE:LINE, and nothing is written.")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("file", type=a.input_file, metavar="FILE.jsonl",
                   help="the audit file (`kvledger export --out`), one stored event per line")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_cmd_import)


def _source(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--db", help=DB_HELP)
    g.add_argument("--journal", type=a.input_file, metavar="FILE.jsonl", help="an audit file; no database needed")


# -- commands --------------------------------------------------------------------------

def _cmd_replay(args: argparse.Namespace) -> int:
    import msgspec

    from kvledger.migrations.storage import open_existing_journal
    from kvledger.replay import WindowSpec, replay_incremental, replay_journal, replay_jsonl, to_json

    if args.incremental and (args.journal or args.at is not None):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--incremental resumes a database "
                                                        "checkpoint: not with --journal or --at")
    if args.incremental and (args.plot or args.trajectory):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--incremental does not record a trajectory "
                                                        "(--plot, --trajectory): replay in full")
    window = WindowSpec(slo_ttft_ns=_ns(args.slo_ttft_ms), slo_tbt_ns=_ns(args.slo_tbt_ms),
                        start_ns=None if args.window_start_ms is None else _ns(args.window_start_ms),
                        width_ns=None if args.window_ms is None else _ns(args.window_ms))
    trajectory = bool(args.plot or args.trajectory)
    resumed = None
    if args.journal:
        source = args.journal
        with _progress("replay", None) as progress:
            report = replay_jsonl(args.journal, window, at=args.at, trajectory=trajectory,
                                  progress=progress, block_bytes=args.block_bytes)
    else:
        with open_existing_journal(args.db) as journal:
            source = journal.display_url
            with _progress("replay", args.at if args.at is not None else journal.last_position()) as progress:
                if args.incremental:
                    report, resumed = replay_incremental(journal, window, name=args.checkpoint,
                                                         progress=progress, block_bytes=args.block_bytes)
                else:
                    report = replay_journal(journal, window, at=args.at, trajectory=trajectory,
                                            progress=progress, block_bytes=args.block_bytes)
    if args.plot:
        from kvledger.replay.plot import plot_trajectory

        title = f"{Path(source).name} to position {report.position}"
        with a.writing(args.plot):
            plot_trajectory(report.trajectory or [], args.plot, title)
    if not args.trajectory and report.trajectory is not None:
        report = msgspec.structs.replace(report, trajectory=None)
    if args.json:
        sys.stdout.buffer.write(to_json(report) + b"\n")
        sys.stdout.flush()
    else:
        from kvledger.replay.render import print_report

        console = _console()
        print_report(report, console, source)
        if resumed is not None:
            console.print(f"resumed from checkpoint {args.checkpoint!r} at position {resumed}")
        if args.plot:
            console.print(f"wrote {args.plot}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    import msgspec

    from kvledger.migrations.storage import open_existing_journal
    from kvledger.replay import verify_journal, verify_jsonl
    from kvledger.replay.anchor import read_key

    if args.key and args.expect is None:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--key checks the signature of --expect ANCHOR: give both")
    if args.expect is not None and args.journal:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--expect checks a database's record chain: an audit "
                                                        "file (--journal) has none")
    if args.expect is not None and args.expect.signature is not None and not args.key:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--expect is a signed anchor: give --key FILE to check "
                                                        "its signature")
    key = read_key(args.key) if args.key else None
    if args.journal:
        source, result = args.journal, verify_jsonl(args.journal, keep=args.max_findings)
    else:
        with open_existing_journal(args.db) as journal:
            source = journal.display_url
            result = verify_journal(journal, keep=args.max_findings, expect=args.expect, key=key)
    proof = _reexecution(args) if args.reexecute else None
    ok = result.ok and (proof is None or not (proof["mismatches"] or proof["other_artifacts"]
                                              or proof["not_reexecuted"]))
    if args.json:
        out = {"source": source, "events": result.events, "ok": ok, "findings": result.findings,
               "omitted": result.omitted, "stopped": result.stopped, "storage": result.storage}
        if result.anchor is not None:
            out["anchor"] = result.anchor
        if proof is not None:
            out["reexecution"] = proof
        sys.stdout.buffer.write(msgspec.json.encode(out) + b"\n")
        sys.stdout.flush()
    else:
        from kvledger.replay.render import print_findings

        print_findings(result, _console(), source)
        if result.anchor is not None and result.ok:
            print(f"anchor {result.anchor}")
        if proof is not None:
            for m in proof["mismatches"]:
                print(f"REEXECUTION_MISMATCH: append {m['txn_id']} of {m['handle_id']} (position "
                      f"{m['global_position']}) recomputes to {m['recomputed'][:16]}, recorded "
                      f"{(m['recorded'] or 'none')[:16]}")
            for a in proof["other_artifacts"]:
                print(f"ARTIFACT_MISMATCH: the journal's rows come from model {a[:16]}, not --model's")
            for n in proof["not_reexecuted"]:
                print(f"{n['code']}: {n['handle_id']} not re-executed: {n['reason']}")
            print(f"re-executed {proof['verified_appends']} appends ({proof['verified_rows']} rows): "
                  f"{len(proof['mismatches'])} mismatches")
    return 0 if ok else 1


def _reexecution(args: argparse.Namespace) -> dict[str, Any]:
    from kvledger.cmd_hf import reexecute
    from kvledger.migrations.storage import open_existing_journal
    from kvledger.replay.sources import journal_events, jsonl_events

    if args.journal:
        return reexecute(args, list(jsonl_events(args.journal)))
    with open_existing_journal(args.db) as journal:
        return reexecute(args, list(journal_events(journal)))


def _cmd_head(args: argparse.Namespace) -> int:
    import msgspec

    from kvledger.migrations.storage import open_existing_journal
    from kvledger.replay.anchor import current, read_key, sign

    key = read_key(args.key) if args.key else None  # read first: a bad key file opens no database
    with open_existing_journal(args.db) as journal:
        source, anchor = journal.display_url, current(journal)
    if key is not None:
        anchor = sign(anchor, key)
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode({
            "database": source, "position": anchor.position, "chain": anchor.chain.hex(),
            "signature": None if anchor.signature is None else anchor.signature.hex(),
            "anchor": anchor.text()}) + b"\n")
        sys.stdout.flush()
    else:
        print(anchor.text())
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from kvledger.migrations.storage import open_existing_journal
    from kvledger.replay import export_jsonl

    with open_existing_journal(args.db) as journal:
        with _progress("export", journal.last_position()) as progress, a.writing(args.out):
            n = export_jsonl(journal, args.out, progress)
        if args.out != "-":
            print(f"exported {n} events from {journal.display_url} to {args.out}", file=sys.stderr)
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    import json

    from kvledger.migrations.storage import creating_journal
    from kvledger.replay import import_jsonl

    source = Path(args.file)
    if not source.exists() or source.is_dir():  # checked before any database is opened
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"cannot read {args.file}: no such file")
    with creating_journal(args.db) as journal:  # a refused import leaves no new file behind
        summary = import_jsonl(journal, args.file)
        target = journal.display_url
    if args.json:
        print(json.dumps({"database": target, "events": summary.events, "handles": summary.handles,
                          "receipts": summary.receipts, "manifests": summary.manifests}))
    else:
        print(f"imported {summary.events} events ({summary.handles} handles, {summary.receipts} "
              f"receipts) from {args.file} into {target}")
    return 0


# -- helpers ---------------------------------------------------------------------------

def _findings_cap(text: str) -> int:
    from kvledger.replay.verify import STOP_AFTER

    return a.integer(0, STOP_AFTER)(text)


def _anchor(text: str) -> Anchor:
    from kvledger.replay.anchor import parse

    return parse(text)


def _ns(ms: float) -> int:  # ms as args.millis parsed it: finite, 0 to MAX_MS
    return round(ms * MS)


def _console() -> Console:
    from rich.console import Console

    # Piped output has no terminal width; 80 columns would truncate ids and digests.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


@contextlib.contextmanager
def _progress(label: str, total: int | None) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar on stderr for long runs, only when stderr is a terminal."""
    if not sys.stderr.isatty() or (total is not None and total < 50_000):
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.update(task, completed=n)
