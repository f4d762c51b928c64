"""`kvledger recover` and `kvledger crash-test`.

recover: reopen a journal after its writer died, verify it, abort in-doubt appends,
rebuild live K/V by re-execution (every row digest checked) and run every unfinished
request to completion. Exit 0 when done and clean, 1 on findings (verify findings,
digest mismatches, handles left unfinished), 2 on errors (ABI_MISMATCH, ...).

crash-test: trials of kill-and-recover (kvledger.recovery.crash_trials). Exit 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvledger import args as a
from kvledger.args import DB_HELP
from kvledger.engine import WRITERS
from kvledger.schemas.errors import ErrorCode, KvLedgerError

if TYPE_CHECKING:
    from rich.progress import Progress

    from kvledger.recovery.recover import RecoveryReport



def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("recover", help="after a crash: verify, abort in-doubt appends, rebuild live K/V "
                                       "by re-execution and finish every unfinished request",
                       description="After a crash: verify the journal, abort the appends left in doubt, rebuild "
                                   "every live handle's K/V by re-executing its journaled appends (each row digest "
                                   "checked bit for bit) and run every unfinished request to its end. A second run "
                                   "writes nothing. Re-execution needs kvledger[worker] and the serving model.")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--model", type=a.model_dir, help="the serving model: Hugging Face checkpoint directory "
                                   "(default: the small random model)")
    p.add_argument("--device", type=a.device, default="cpu", help="cpu, cuda or cuda:N (the serving run's device)")
    p.add_argument("--no-continue", action="store_true",
                   help="only verify and abort in-doubt appends; do not re-execute or continue "
                        "(default: re-execute and continue)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_cmd_recover)

    p = sub.add_parser("crash-test", help="kill a journaled worker at random moments and fault points, "
                                          "recover, and check nothing acknowledged was lost; exit 1 on "
                                          "any violation",
                       description="Each trial runs a journaled worker, kills it (SIGKILL, exit, raise or stall) at a "
                                   "random moment or a named fault point, runs recover, and checks that no "
                                   "acknowledged write was lost, no operation is half visible, verify is clean, "
                                   "row digests match and outputs equal an uninterrupted run. Exit 1 on any "
                                   "violation. Needs kvledger[worker].")
    p.add_argument("--db", help=DB_HELP + "; trials use scratch journals beside it (SQLite files in a "
                                          "scratch directory, PostgreSQL databases: needs CREATEDB, "
                                          "NATS cells on its cluster)")
    p.add_argument("--trials", type=a.TRIALS, default=50, help="number of trials (default 50)")
    p.add_argument("--seed", type=a.SEED, default=0,
                   help="seed of the workload and the crash plan (32 bits; default 0)")
    p.add_argument("--writer", choices=WRITERS, default="thread",
                   help="the worker's command service in its process (default) or in a writer process "
                        "(killed with it: the process group)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_cmd_crash_test)


def _cmd_recover(args: argparse.Namespace) -> int:
    from kvledger.migrations.storage import open_existing_journal
    from kvledger.recovery.recover import recover

    # recover repairs a journal a crashed writer left: there is nothing to recover in a
    # database that does not exist, and creating one would hide a mistyped path.
    with open_existing_journal(args.db) as journal:
        report = recover(journal, model_dir=args.model, device=args.device,
                         continue_requests=not args.no_continue)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        _print_recovery(report)
    return 0 if report.ok else 1


def _print_recovery(r: RecoveryReport) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="kvledger recover", show_header=False)
    t.add_column("step", style="bold")
    t.add_column("result", justify="right")
    rows = [
        ("journal", f"{r.journal} (position {r.position_before} -> {r.position_after})"),
        ("verify before", "clean" if not r.verify_findings else f"{len(r.verify_findings)} findings"),
        ("live handles", str(len(r.live_handles))),
        ("in-doubt appends aborted", str(len(r.aborted))),
        ("handles rebuilt / rows re-executed", f"{len(r.rebuilt)} / {r.rows_reexecuted}"),
        ("digest mismatches", str(len(r.digest_mismatches))),
        ("requests continued / tokens generated", f"{len(r.continued)} / {r.tokens_generated}"),
        ("released / left unfinished", f"{len(r.released)} / {len(r.unfinished)}"),
        ("events written", str(r.events_written)),
        ("verify after", "clean" if not r.verify_after else f"{len(r.verify_after)} findings"),
        ("seconds", f"{r.seconds:.2f}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    for f in r.verify_findings[:10]:
        print(f"finding: {f.get('code')} at {f.get('global_position')}: {f.get('message')}", file=sys.stderr)
    for m in r.digest_mismatches[:10]:
        print(f"DIGEST_MISMATCH: {m['handle_id']} txn {m['txn_id']} at {m['global_position']}: recorded "
              f"{m['recorded']}, recomputed {m['recomputed']}", file=sys.stderr)
    for h, why in list(r.not_rebuildable.items())[:10]:
        print(f"not continued: {h}: {why}", file=sys.stderr)
    for e in r.errors[:10]:
        print(f"error: {e}", file=sys.stderr)
    if r.ok and not r.live_handles:
        print("nothing to recover: no live handle")


def _cmd_crash_test(args: argparse.Namespace) -> int:
    from kvledger.recovery.crash_trials import run_crash_test

    if args.trials < 1:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--trials must be >= 1")
    bar, on_trial = _progress(args.trials)
    if bar:
        bar.start()
    try:
        report = run_crash_test(args.db, trials=args.trials, seed=args.seed, on_trial=on_trial,
                                writer=args.writer)
    finally:
        if bar:
            bar.stop()
    if args.json:
        print(json.dumps(report))
    else:
        _print_crash(report)
    return 0 if report["ok"] else 1


def _progress(total: int) -> tuple[Progress | None, Callable[[int, a.JsonDoc], None] | None]:
    if not sys.stderr.isatty():
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("crash trials"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                   TimeElapsedColumn(), transient=True)
    task = bar.add_task("", total=total)
    bad = [0]

    def on_trial(_k: int, result: a.JsonDoc) -> None:
        c = result.get("check") or {}
        if "check" not in result or c.get("lost") or c.get("partial") or c.get("output_mismatches"):
            bad[0] += 1
        bar.update(task, advance=1, description=f"{result['moment']}  violations: {bad[0]}")

    return bar, on_trial


def _print_crash(r: a.JsonDoc) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kvledger crash-test ({r['backend']}, seed {r['seed']})", show_header=False)
    t.add_column("check", style="bold")
    t.add_column("result", justify="right")
    m = r["crash_moments"]
    rows = [
        ("trials", f"{r['trials']} in {r['seconds']:.1f} s"),
        ("crash moments", ", ".join(f"{k} {v}" for k, v in m["by_mode"].items())
         + f"; ran to completion first: {m['completed_before_crash']}"),
        ("journal progress at the crash", ", ".join(f"{k}: {v}" for k, v in m["progress_quartiles"].items())),
        ("fault points hit (trials)", ", ".join(f"{k} {v}" for k, v in r["fault_points_hit"].items())),
        ("acknowledged writes checked", f"{r['acknowledged_writes_checked']:,}"),
        ("lost acknowledged writes", str(r["lost"])),
        ("partial operations / transactions checked", f"{r['partial']} / {r['transactions_checked']:,}"),
        ("digest mismatches (rows re-executed)", f"{r['digest_mismatches']} ({r['rows_reexecuted']:,})"),
        ("output mismatches vs uninterrupted run", str(r["output_mismatches"])),
        ("verify findings", str(r["verify_findings"])),
        ("unfinished after recovery", str(r["unfinished"])),
        ("writes by a second recover", str(r["second_recover_writes"])),
        ("checkpoint mismatches", str(r["checkpoint_mismatches"])),
        ("in-doubt appends aborted", str(r["aborted_appends"])),
        ("commits never acknowledged (allowed)", str(r["unacknowledged_commits"])),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    if r["fault_points_missed"]:
        print(f"fault points never hit: {', '.join(r['fault_points_missed'])}", file=sys.stderr)
    for v in r["violations"]:
        print(f"VIOLATION trial {v['trial']} ({v['moment']}): {'; '.join(v['problems'])} [{v['kept']}]",
              file=sys.stderr)
    print("ok: no violation" if r["ok"] else f"{r['violating_trials']} trial(s) with violations")
