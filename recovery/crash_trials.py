"""`kvledger crash-test`: kill a journaled worker at random moments and at named fault
points, recover, and prove that no acknowledged write was lost, nothing is half
visible, the journal verifies, re-executed K/V matches every digest, and every
request finishes with the outputs of an uninterrupted run.

Process layout (docs/guides/recover-after-crash.md). This process is a zygote: it imports torch and
kvledger, warms the model with one thread, and never opens a database connection
while it forks. Per trial it forks
  - a run child: opens a fresh journal, serves a small greedy workload with a worker
    (plus a projector sidecar that stores a checkpoint every few iterations), and
    appends every acknowledged receipt to an fsync'd acknowledgement log; it is
    killed with SIGKILL at a random moment, or exits (os._exit), raises or stalls at a
    chosen fault point (journal.faults);
  - a check child: reopens the journal, checks acknowledgements and atomicity,
    verifies, runs recovery (kvledger.recovery.recover), resubmits the requests whose
    allocation was never acknowledged (the client's retry), compares outputs with the
    baseline, recovers a second time (must write nothing) and checks the checkpoint.
A forked child starts in milliseconds; spawning a Python with torch costs seconds.

Use it from a fresh process (the CLI): forking a process whose torch already runs
several OpenMP threads can deadlock the children.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvledger.journal import faults
from kvledger.journal.backends import backend_of
from kvledger.journal.url import parse_url, redact, resolve_url
from kvledger.recovery.crash_backends import Backend, NatsBackend, PostgresBackend, SqliteBackend
from kvledger.recovery.crash_children import (
    MAX_NEW_TOKENS,
    Result,
    acknowledged,
    baseline_run,
    check_child,
    fork,
    kill_group,
    reaped,
    run_child,
    wait_child,
    warm,
    workload,
)
from kvledger.schemas.errors import ErrorCode, KvLedgerError

if TYPE_CHECKING:
    from kvledger.worker.serving import RequestSpec

POINTS = faults.POINTS
ACTIONS = ("exit", "raise", "stall")
STALL_SECONDS = 60.0


# -- trial plans ----------------------------------------------------------------------

@dataclass
class Plan:
    trial: int
    mode: str  # sigkill | exit | raise | stall
    point: str | None = None
    nth: int | None = None
    delay_s: float = 0.0  # sigkill: after the `after_acks`th acknowledgement; stall: after the stall began
    after_acks: int = 0  # sigkill: how many acknowledgements the run makes before the kill is timed

    def fault_spec(self) -> str | None:
        if self.mode == "sigkill":
            return None
        action = {"exit": "exit", "raise": "raise", "stall": f"sleep={STALL_SECONDS:g}"}[self.mode]
        return f"{self.point}:{action}@{self.nth}"

    def label(self) -> str:
        if self.mode == "sigkill":
            return f"sigkill@ack{self.after_acks}+{self.delay_s * 1000:.1f}ms"
        return f"{self.mode}@{self.point}#{self.nth}"


def plans(trials: int, seed: int, hits: dict[str, int], acks: int, run_seconds: float) -> list[Plan]:
    """Every fourth trial a SIGKILL at a uniformly random moment of the run; the others
    go round robin over (fault point, action), at a random hit of that point. Both aim
    inside the first three quarters of what the baseline run saw, and in units of its
    progress: a SIGKILL comes a random fraction of one acknowledgement's time after a
    random acknowledgement. A run's wall time moves with the machine's load, and a plan
    past the run's end is a trial that never crashes."""
    rng = random.Random(seed * 1_000_003 + 17)
    combos = [(p, a) for a in ACTIONS for p in POINTS]
    gap = run_seconds / max(1, acks)
    out, f = [], 0
    for k in range(trials):
        if k % 4 == 0:
            out.append(Plan(k, "sigkill", after_acks=rng.randint(0, max(0, round(0.75 * acks))),
                            delay_s=rng.uniform(0.0, gap)))
            continue
        point, action = combos[f % len(combos)]
        f += 1
        out.append(Plan(k, action, point, rng.randint(1, max(1, round(0.75 * hits.get(point, 1)))),
                        delay_s=rng.uniform(0.0, 0.002)))
    return out


# -- the trials -------------------------------------------------------------------------

@dataclass
class Totals:
    trials: int = 0
    crashed: int = 0
    completed_before_crash: int = 0
    modes: Counter[str] = field(default_factory=Counter)
    fault_points_hit: Counter[str] = field(default_factory=Counter)
    acknowledged_writes_checked: int = 0
    transactions_checked: int = 0
    unacknowledged_commits: int = 0
    lost: int = 0
    partial: int = 0
    digest_mismatches: int = 0
    output_mismatches: int = 0
    verify_findings: int = 0
    unfinished: int = 0
    second_recover_writes: int = 0
    checkpoint_mismatches: int = 0
    recovery_errors: int = 0
    child_failures: int = 0
    fault_not_reached: int = 0
    aborted_appends: int = 0
    rows_reexecuted: int = 0
    resubmitted: int = 0
    progress_quartiles: Counter[str] = field(default_factory=Counter)


def run_crash_test(db: str | None, *, trials: int = 50, seed: int = 0, workdir: str | None = None,
                   on_trial: Callable[[int, Result], None] | None = None, trial_timeout: float = 120.0,
                   writer: str = "thread") -> Result:
    """Run `trials` crash trials against the backend of `db` (see the module docstring),
    with the worker's command service in its process or in a writer process (`writer`).
    Returns the report; `report["ok"]` is False on any violation."""
    from kvledger.engine import WRITERS

    if writer not in WRITERS:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"writer must be one of {', '.join(WRITERS)}")
    if trials < 1:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--trials must be >= 1")
    url = resolve_url(db)
    parsed = parse_url(url)
    base = Path(workdir) if workdir else None
    if base is None and parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        base = Path(parsed.database).expanduser().resolve().parent
    root = Path(tempfile.mkdtemp(prefix=f"kvledger-crash-{os.getpid()}-", dir=base))
    name = parsed.get_backend_name()
    t0 = time.perf_counter()
    try:
        backend: Backend = (SqliteBackend(url, root) if name == "sqlite" else NatsBackend(url) if name == "nats"
                            else PostgresBackend(url))
        backend.prepare()  # first: an unreachable server is said before the model loads
        warm(backend_of(parsed).modules)
    except BaseException:
        _drop_if_empty(root)
        raise
    specs = workload(seed)
    try:
        baseline = baseline_run(backend, specs, root, writer)
        totals, violations, moments, timing = Totals(), [], [], Counter[str]()
        for plan in plans(trials, seed, baseline["hits"], baseline["acks"], baseline["seconds"]):
            result = _trial(backend, plan, specs, baseline, root, trial_timeout, writer)
            problems = _tally(totals, result, baseline)
            moments.append(result["moment"])
            timing.update(result.get("ms", {}))
            if problems:
                violations.append({"trial": plan.trial, "moment": plan.label(), "problems": problems,
                                   "kept": result.get("kept"), "journal": redact(backend.keep(plan.trial))})
            else:
                backend.release(plan.trial)
                shutil.rmtree(root / f"trial-{plan.trial:05d}", ignore_errors=True)
            if on_trial:
                on_trial(plan.trial, result)
    except BaseException:
        _drop_if_empty(root)  # a failed baseline keeps its log there
        raise
    finally:
        backend.close()
    report = {
        "backend": backend.name,
        "writer": writer,
        "journal": redact(url),
        "seed": seed,
        "trials": totals.trials,
        "seconds": round(time.perf_counter() - t0, 2),
        "workload": {"requests": len(specs), "max_new_tokens": MAX_NEW_TOKENS,
                     "events": baseline["events"], "iterations": baseline["steps"],
                     "run_seconds": round(baseline["seconds"], 4), "acknowledgements": baseline["acks"],
                     "fault_point_hits_per_run": baseline["hits"]},
        "crash_moments": {"by_mode": dict(totals.modes), "crashed": totals.crashed,
                          "completed_before_crash": totals.completed_before_crash,
                          "progress_quartiles": {q: totals.progress_quartiles.get(q, 0)
                                                 for q in ("0-25%", "25-50%", "50-75%", "75-100%")}},
        "fault_points_hit": {p: totals.fault_points_hit.get(p, 0) for p in POINTS},
        "fault_points_missed": [p for p in POINTS if not totals.fault_points_hit.get(p)],
        "fault_not_reached": totals.fault_not_reached,
        "acknowledged_writes_checked": totals.acknowledged_writes_checked,
        "transactions_checked": totals.transactions_checked,
        "unacknowledged_commits": totals.unacknowledged_commits,
        "lost": totals.lost,
        "partial": totals.partial,
        "digest_mismatches": totals.digest_mismatches,
        "output_mismatches": totals.output_mismatches,
        "verify_findings": totals.verify_findings,
        "unfinished": totals.unfinished,
        "second_recover_writes": totals.second_recover_writes,
        "checkpoint_mismatches": totals.checkpoint_mismatches,
        "recovery_errors": totals.recovery_errors,
        "child_failures": totals.child_failures,
        "aborted_appends": totals.aborted_appends,
        "rows_reexecuted": totals.rows_reexecuted,
        "resubmitted_requests": totals.resubmitted,
        "violations": violations[:20],
        "violating_trials": len(violations),
        "moments": moments,
        "mean_trial_ms": {k: round(v / max(1, totals.trials)) for k, v in timing.items()},
        "workdir": str(root) if violations else None,
    }
    report["ok"] = not violations
    if not violations:
        shutil.rmtree(root, ignore_errors=True)
    return report



def _drop_if_empty(root: Path) -> None:
    """Remove the work directory of a run that failed before writing to it (an
    unreachable server): nothing there to look at."""
    with contextlib.suppress(OSError):
        root.rmdir()


def _trial(backend: Backend, plan: Plan, specs: list[RequestSpec], baseline: Result, root: Path, timeout: float,
           writer: str) -> Result:
    d = root / f"trial-{plan.trial:05d}"
    d.mkdir()
    t0 = time.monotonic()
    url = backend.fresh(plan.trial)
    t_fresh = time.monotonic() - t0
    acks, flog, log = str(d / "acks.jsonl"), str(d / "faults.log"), str(d / "child.log")
    r, w = os.pipe()
    pid = fork(run_child, url, specs, acks, plan.fault_spec(), flog, w, writer=writer, log=log)
    with reaped(pid):  # an interrupted run leaves no child writing
        os.close(w)
        ready, _, _ = select.select([r], [], [], timeout)
        os.close(r)
        status: int | None = None
        t_ready = time.monotonic()
        if not ready:
            status = kill_group(pid)
        elif plan.mode == "sigkill":
            status, reached = _wait_until(pid, lambda: acknowledged(acks) >= plan.after_acks, t_ready + timeout, 0.0005)
            if reached:
                status = wait_child(pid, plan.delay_s)
            if status is None:
                status = kill_group(pid)
        elif plan.mode == "stall":
            status, reached = _wait_until(pid, lambda: Path(flog).exists() and bool(Path(flog).read_text()),
                                          t_ready + timeout, 0.001)
            if reached:
                time.sleep(plan.delay_s)  # stalled at its fault point, the writer lock held
            if status is None:
                status = kill_group(pid)
        else:
            status = wait_child(pid, timeout)
            if status is None:
                status = kill_group(pid)
    fired = [line.split()[0] for line in Path(flog).read_text().splitlines()] if Path(flog).exists() else []
    crashed = status != 0
    result = {"trial": plan.trial, "moment": plan.label(), "mode": plan.mode, "status": status,
              "crashed": crashed, "fired": fired,
              "crash_ms": round((time.monotonic() - t_ready) * 1000, 1)}
    path = d / "check.json"
    t1 = time.monotonic()
    cpid = fork(check_child, url, specs, acks, baseline["outputs"], result=str(path), log=log)
    with reaped(cpid):
        cstatus = wait_child(cpid, timeout)
        if cstatus is None:
            cstatus = kill_group(cpid)
    result["ms"] = {"fresh": round(t_fresh * 1000), "run": round((t1 - t0 - t_fresh) * 1000),
                    "check": round((time.monotonic() - t1) * 1000)}
    if cstatus == 0:
        result["check"] = json.loads(path.read_text())
    else:
        result["check_failed"] = f"check child exited {cstatus}: see {log}"
    result["kept"] = str(d)
    return result


def _wait_until(pid: int, condition: Callable[[], bool], deadline: float, poll: float) -> tuple[int | None, bool]:
    """Poll `condition` until it holds, the child exits or the deadline passes: (the
    child's exit status, None while it runs; whether the condition held)."""
    while time.monotonic() < deadline:
        if condition():
            return None, True
        status = wait_child(pid, poll)
        if status is not None:
            return status, False
    return None, False


def _tally(t: Totals, result: Result, baseline: Result) -> list[str]:
    t.trials += 1
    t.modes[result["mode"]] += 1
    if result["crashed"]:
        t.crashed += 1
    else:
        t.completed_before_crash += 1
    for p in set(result["fired"]):
        t.fault_points_hit[p] += 1
    problems: list[str] = []
    if result["mode"] in ("exit", "raise", "stall") and not result["fired"]:
        t.fault_not_reached += 1  # the run ended before that hit: a trial without a crash
    c = result.get("check")
    if c is None:
        t.child_failures += 1
        return problems + [result.get("check_failed", "no check result")]
    pos = c["position_at_crash"] / max(1, baseline["events"])
    t.progress_quartiles[("0-25%", "25-50%", "50-75%", "75-100%")[min(3, int(pos * 4))]] += 1
    rec = c["recovery"]
    t.acknowledged_writes_checked += c["acks"]
    t.unacknowledged_commits += c["unacknowledged_commits"]
    t.lost += len(c["lost"])
    t.partial += len(c["partial"]) + len(c["partial_batches"])
    t.transactions_checked += c["transactions"]
    t.digest_mismatches += len(rec["digest_mismatches"])
    t.output_mismatches += len(c["output_mismatches"])
    t.verify_findings += len(c["verify_before"]) + len(c["verify_after"]) + len(rec["verify_after"])
    t.unfinished += len(c["unfinished"])
    t.second_recover_writes += c["second_recover_writes"]
    t.checkpoint_mismatches += not c["checkpoint_ok"]
    t.recovery_errors += len(rec["errors"]) + len(c.get("resubmit_errors", [])) + len(rec["not_rebuildable"])
    t.aborted_appends += len(rec["aborted"])
    t.rows_reexecuted += rec["rows_reexecuted"]
    t.resubmitted += len(c["resubmitted"])
    for name, n in (("lost acknowledged writes", len(c["lost"])), ("partial operations", len(c["partial"])),
                    ("partial transactions", len(c["partial_batches"])),
                    ("digest mismatches", len(rec["digest_mismatches"])),
                    ("output mismatches", len(c["output_mismatches"])),
                    ("verify findings", len(c["verify_before"]) + len(c["verify_after"])),
                    ("unfinished handles", len(c["unfinished"])),
                    ("writes by a second recover", c["second_recover_writes"]),
                    ("recovery errors", len(rec["errors"]) + len(rec["not_rebuildable"])
                     + len(c.get("resubmit_errors", [])))):
        if n:
            problems.append(f"{n} {name}")
    if not c["checkpoint_ok"]:
        problems.append("incremental replay from the checkpoint differs from a full replay")
    if c["output_mismatches"]:
        problems.append(f"first output mismatch: {c['output_mismatches'][0]}")
    return problems


__all__ = ["POINTS", "Plan", "plans", "run_crash_test", "warm", "workload"]
