"""`kvledger crash-test`: kill a journaled worker at random moments and at named fault
points, recover, and prove that no acknowledged write was lost, nothing is half
visible, the journal verifies, re-executed K/V matches every digest, and every
request finishes with the outputs of an uninterrupted run.

Process layout (docs/CRASH.md). This process is a zygote: it imports torch and
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

import json
import os
import random
import select
import shutil
import signal
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvledger.engine.service import BatchSurface
from kvledger.journal import faults
from kvledger.journal.url import parse_url, redact, resolve_url
from kvledger.schemas.errors import ErrorCode, KvLedgerError

POINTS = faults.POINTS
ACTIONS = ("exit", "raise", "stall")
REQUESTS, MAX_NEW_TOKENS = 5, 8
WORKER = {"capacity": 64, "prefill_chunk": 16, "prefill_tokens": 32, "max_running": 4}
CHECKPOINT_EVERY = 2  # iterations between projection checkpoints in the run child
CHECKPOINT = "crash-test"
STALL_SECONDS = 60.0


# -- the workload ---------------------------------------------------------------------

def workload(seed: int, vocab: int = 512):
    """Plain greedy requests with ragged prompts (one long one, prefilled in chunks),
    arriving two per iteration; more requests than running slots, so one waits."""
    from kvledger.worker.serving import RequestSpec

    rng = random.Random(seed)
    return [RequestSpec(request_id=f"crash-{i}", max_new_tokens=MAX_NEW_TOKENS, arrival_step=i // 2,
                        prompt=tuple(rng.randrange(vocab) for _ in range(40 if i == 1 else rng.randint(3, 12))))
            for i in range(REQUESTS)]


# -- trial plans ----------------------------------------------------------------------

@dataclass
class Plan:
    trial: int
    mode: str  # sigkill | exit | raise | stall
    point: str | None = None
    nth: int | None = None
    delay_s: float = 0.0  # sigkill: after the run started; stall: after the stall began

    def fault_spec(self) -> str | None:
        if self.mode == "sigkill":
            return None
        action = {"exit": "exit", "raise": "raise", "stall": f"sleep={STALL_SECONDS:g}"}[self.mode]
        return f"{self.point}:{action}@{self.nth}"

    def label(self) -> str:
        if self.mode == "sigkill":
            return f"sigkill@{self.delay_s * 1000:.0f}ms"
        return f"{self.mode}@{self.point}#{self.nth}"


def plans(trials: int, seed: int, hits: dict[str, int], run_seconds: float) -> list[Plan]:
    """Every fourth trial a SIGKILL at a uniformly random moment of the run; the others
    go round robin over (fault point, action), at a random hit of that point."""
    rng = random.Random(seed * 1_000_003 + 17)
    combos = [(p, a) for a in ACTIONS for p in POINTS]
    out, f = [], 0
    for k in range(trials):
        if k % 4 == 0:
            out.append(Plan(k, "sigkill", delay_s=rng.uniform(0.0, 0.9 * run_seconds)))
            continue
        point, action = combos[f % len(combos)]
        f += 1
        out.append(Plan(k, action, point, rng.randint(1, max(1, hits.get(point, 1))),
                        delay_s=rng.uniform(0.0, 0.002)))
    return out


# -- backends: a fresh journal per trial ------------------------------------------------

class Backend:
    name = ""

    def prepare(self) -> None: ...
    def fresh(self, k: int) -> str: raise NotImplementedError  # noqa: E704 - an abstract one-liner
    def release(self, k: int) -> None: ...  # the trial passed: its journal may go
    def keep(self, k: int) -> str: return ""  # noqa: E704 - the trial failed: keep its journal
    def close(self) -> None: ...


class SqliteBackend(Backend):
    """Trial journals are copies of one migrated file, in a scratch directory next to
    the named database (or in a temp directory)."""

    name = "sqlite"

    def __init__(self, url: str, workdir: Path) -> None:
        self.dir = workdir / "journals"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.template = self.dir / "template.db"

    def prepare(self) -> None:
        from kvledger.migrations.storage import init_database

        init_database(f"sqlite:///{self.template}")  # engine disposed: nothing open at fork

    def path(self, k: int) -> Path:
        return self.dir / f"trial-{k:05d}.db"

    def fresh(self, k: int) -> str:
        shutil.copyfile(self.template, self.path(k))
        return f"sqlite:///{self.path(k)}"

    def release(self, k: int) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path(k)}{suffix}").unlink(missing_ok=True)

    def keep(self, k: int) -> str:
        return f"sqlite:///{self.path(k)}"

    def close(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.template}{suffix}").unlink(missing_ok=True)


class PostgresBackend(Backend):
    """Trial journals live in a scratch database created from a migrated template next
    to the named one (needs CREATEDB). A passing trial's journal is emptied (TRUNCATE)
    for the next trial; a failing one is kept and the next trial gets a new database."""

    name = "postgresql"
    TABLES = "kvl_events, kvl_heads, kvl_receipts, kvl_manifests, kvl_checkpoints"

    def __init__(self, url: str) -> None:
        from kvledger.journal.pgserver import ScratchDatabases
        from kvledger.migrations.storage import init_database

        self.prefix = f"kvl_crash_{os.getpid()}"
        self.scratch = ScratchDatabases(parse_url(url), self.prefix, init_database)
        self.current: str | None = None
        self.dirty = False
        self.made = 0

    def prepare(self) -> None:
        self.scratch.prepare()  # every connection is closed before a fork

    def fresh(self, k: int) -> str:
        if self.current is None:
            self.made += 1
            self.current = f"{self.prefix}_{self.made}"
            self.scratch.create(self.current)
        elif self.dirty:
            with self.scratch.connect(self.current) as conn:
                conn.execute(f"TRUNCATE {self.TABLES}")  # constant table names
        self.dirty = True
        return self.scratch.url(self.current)

    def keep(self, k: int) -> str:
        kept, self.current = self.current, None
        return self.scratch.url(kept) if kept else ""

    def close(self) -> None:
        self.scratch.drop(*([self.current] if self.current is not None else []), self.scratch.template)


# -- children -------------------------------------------------------------------------

_MODEL = None


def _model():
    global _MODEL
    if _MODEL is None:
        from kvledger.worker.loading import load_model

        _MODEL = load_model()
    return _MODEL


def warm() -> None:
    """Zygote warm-up: one torch thread, the model built and one call run, so a forked
    child starts in milliseconds. No database is opened here."""
    import torch

    from kvledger.worker.executor import Member, run_call, shape_of
    from kvledger.worker.kvstore import KVStore

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (a second warm-up in this process)
        pass
    model, _ = _model()
    store = KVStore(model.cfg, slots=1, capacity=8)
    store.open("warm", 8)
    m = [Member("warm", 0, (1, 2, 3))]
    run_call(model, store, m, shape_of(m))


class _Acking(BatchSurface):
    """The worker's command service, appending each acknowledged receipt to an fsync'd
    log after the commit returned (one fsync per worker commit)."""

    def __init__(self, service, ack_path: str) -> None:
        import msgspec

        from kvledger.schemas.receipts import Receipt

        self._service, self._receipt = service, Receipt
        self._fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._encode = msgspec.json.Encoder().encode

    def submit_many(self, cmds, *, defer=True):  # execute and execute_many (BatchSurface) too
        wait = self._service.submit_many(cmds, defer=defer)

        def acknowledged():
            results = wait()
            lines = [self._encode({"op": r.operation_id, "first": r.first_global_position,
                                   "last": r.last_global_position, "events": r.event_ids}) + b"\n"
                     for r in results if isinstance(r, self._receipt)]
            if lines:
                os.write(self._fd, b"".join(lines))
                os.fsync(self._fd)
            return results

        return acknowledged

    def __getattr__(self, name):
        return getattr(self._service, name)


def _acking_service(journal, ack_path: str, writer: str = "thread") -> _Acking:
    """A command service (in this process, or in a writer process) whose acknowledged
    receipts go to `ack_path`, and whose journal notes every transaction's operation ids
    before sending it (`<ack_path>.intents`, journal.faults.intend): the checker's unit of
    all-or-nothing."""
    from kvledger.engine.remote import command_service

    faults.record_intents(ack_path + ".intents")
    os.environ["KVLEDGER_INTENTS_LOG"] = ack_path + ".intents"  # for a writer process
    return _Acking(command_service(journal, writer=writer, source_instance="kvledger-crash-test"), ack_path)


def _run_child(url: str, specs, ack_path: str, fault_spec: str | None, fault_log: str, ready_fd: int,
               count_faults: bool = False, writer: str = "thread") -> dict:
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.replay import WindowSpec, replay_incremental
    from kvledger.worker.serving import Worker

    if count_faults:
        fault_spec = ",".join(f"{p}:count" for p in POINTS)
    if fault_spec:
        # Here for the checkpoint point (the projector sidecar writes here); a writer
        # process arms the same rules from its environment for the write path.
        faults.configure(fault_spec, log=fault_log or None)
        os.environ.update(KVLEDGER_FAULTS=fault_spec, KVLEDGER_FAULTS_LOG=fault_log)
    model, artifact = _model()
    window = WindowSpec(slo_ttft_ns=10**9, slo_tbt_ns=10**9)
    with open_or_create_journal(url) as journal:
        service = _acking_service(journal, ack_path, writer)
        worker = Worker(model, service=service, artifact=artifact, **WORKER)
        for s in specs:
            worker.submit(s)

        def sidecar(w) -> None:  # a projector beside the worker, checkpointing as it goes
            if w.step_no % CHECKPOINT_EVERY == 0:
                replay_incremental(journal, window, name=CHECKPOINT)

        if ready_fd >= 0:
            os.write(ready_fd, b"r")
        t0 = time.perf_counter()
        outputs = worker.run(on_step=sidecar)
        seconds = time.perf_counter() - t0
        service.close()  # a writer process exits: its fault log is complete
        hits = Counter(faults.hits)
        if writer == "process" and count_faults:  # both processes logged every hit
            hits = Counter(line.split()[0] for line in Path(fault_log).read_text().splitlines())
        return {"outputs": outputs, "seconds": seconds, "steps": worker.step_no, "errors": worker.errors,
                "events": journal.last_position(), "hits": dict(hits)}


def _read_lines(path: str) -> list:
    acks = []
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return acks
    for line in data.splitlines():
        try:
            acks.append(json.loads(line))
        except ValueError:  # a torn last line: its fsync never returned, not acknowledged
            pass
    return acks


def _check_child(url: str, specs, ack_path: str, baseline: dict[str, list[int]]) -> dict:
    from kvledger.engine.evolve import fold
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.recovery.recover import recover, verify_findings
    from kvledger.replay import WindowSpec, replay_incremental, replay_journal, to_json
    from kvledger.worker.serving import Worker

    model, artifact = _model()
    out: dict = {}
    with open_or_create_journal(url) as j:
        out["position_at_crash"] = j.last_position()
        # 1. acknowledged writes and atomicity, straight from the tables
        acks = _read_lines(ack_path)
        receipts = {r.operation_id: r for r in j.read_receipts()}
        by_op: dict[str | None, list[tuple[int, str]]] = {}
        for e in j.read_all():
            by_op.setdefault(e.operation_id, []).append((e.global_position, e.event_id))
        lost = []
        for a in acks:
            r = receipts.get(a["op"])
            got = by_op.get(a["op"], [])
            if (r is None or list(r.event_ids) != a["events"] or
                    (r.first_global_position, r.last_global_position) != (a["first"], a["last"]) or
                    got != list(zip(range(a["first"], a["last"] + 1), a["events"]))):
                lost.append(a["op"])
        partial = []
        for op, r in receipts.items():
            if by_op.get(op, []) != list(zip(range(r.first_global_position, r.last_global_position + 1),
                                             r.event_ids)):
                partial.append(op)
        partial += [op for op in by_op if op not in receipts]
        # one transaction is all or nothing: every noted append is wholly present or absent
        batches = [b for b in _read_lines(ack_path + ".intents") if isinstance(b, list)]
        partial_batches = [b for b in batches if 0 < sum(op in receipts for op in b) < len(b)]
        out["transactions"] = len(batches)
        out["partial_batches"] = partial_batches
        out.update(acks=len(acks), lost=lost, partial=partial, committed_ops=len(receipts),
                   unacknowledged_commits=len(set(receipts) - {a["op"] for a in acks}))
        out["verify_before"] = verify_findings(j)
        # 2. recovery, then the client resubmits what was never acknowledged as allocated
        rep = recover(j, model=model, artifact=artifact)
        out["recovery"] = {k: v for k, v in rep.to_dict().items() if k != "outputs"}
        missing = [s for s in specs if j.head(s.request_id) is None]
        out["resubmitted"] = [s.request_id for s in missing]
        if missing:
            worker = Worker(model, service=_acking_service(j, ack_path), artifact=artifact, **WORKER)
            for s in missing:
                worker.submit(msgspec.structs.replace(s, arrival_step=0))
            worker.run()
            out["resubmit_errors"] = worker.errors
        out["verify_after"] = verify_findings(j)
        heads = j.heads()
        out["unfinished"] = sorted(h for h, f in heads.items() if f.lifecycle != "RELEASED")
        # 3. outputs equal an uninterrupted run
        mismatches = []
        for s in specs:
            st = fold(j.read_stream(s.request_id))
            got = list(st.outputs) if st is not None else None
            want = baseline.get(s.request_id)
            if got != want:
                mismatches.append(_mismatch(model, s, got, want))
        out["output_mismatches"] = mismatches
        # 4. a second recovery changes nothing
        again = recover(j, model=model, artifact=artifact)
        out["second_recover_writes"] = again.events_written
        # 5. the projection checkpoint resumes to what a full replay gives
        window = WindowSpec(slo_ttft_ns=10**9, slo_tbt_ns=10**9)
        stored = j.load_checkpoint(CHECKPOINT)
        out["checkpoint_position"] = stored[0] if stored else None
        incremental, _ = replay_incremental(j, window, name=CHECKPOINT)
        out["checkpoint_ok"] = to_json(incremental) == to_json(replay_journal(j, window))
    return out


def _mismatch(model, spec, got, want) -> dict:
    """A differing output, with the top-2 logit margin of the uninterrupted run at the
    first difference (from a cache-free forward): a tie within ~1e-6 is a rounding
    flip of a recovered continuation, anything larger is a bug."""
    d = {"request": spec.request_id, "got": got, "want": want}
    if got is None or want is None:
        return d
    i = next((n for n, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    d["index"] = i
    if i < min(len(got), len(want)):
        import torch

        seq = list(spec.prompt) + list(want[:i])
        with torch.inference_mode():
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None], logits_rows="last")[0, -1]
        top = torch.topk(logits.float(), 2).values
        d["margin"] = float(top[0] - top[1])
    return d


# -- forking --------------------------------------------------------------------------

def _fork(fn: Callable, *args, result: str | None = None, log: str | None = None, **kwargs) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        os.setpgid(0, 0)  # a group of its own: a kill takes its writer process along
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        value = fn(*args, **kwargs)
        if result:
            Path(result).write_text(json.dumps(value))
    except BaseException as exc:  # noqa: BLE001 - the child reports and dies, whatever it was
        traceback.print_exc()
        code = 1
        if result:
            Path(result).write_text(json.dumps({"__error__": {
                "code": exc.code.value if isinstance(exc, KvLedgerError) else None, "message": str(exc)}}))
    finally:
        os._exit(code)


def _wait(pid: int, timeout: float) -> int | None:
    """Exit status (negative: killed by that signal), or None after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.001)


def _kill(pid: int) -> int:
    """SIGKILL a child and its process group (its writer process, if any): a crash of
    the machine or container the worker runs in, not of one process of it."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# -- the test ---------------------------------------------------------------------------

@dataclass
class Totals:
    trials: int = 0
    crashed: int = 0
    completed_before_crash: int = 0
    modes: Counter = field(default_factory=Counter)
    fault_points_hit: Counter = field(default_factory=Counter)
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
    progress_quartiles: Counter = field(default_factory=Counter)


def run_crash_test(db: str | None, *, trials: int = 50, seed: int = 0, workdir: str | None = None,
                   on_trial: Callable[[int, dict], None] | None = None, trial_timeout: float = 120.0,
                   writer: str = "thread") -> dict:
    """Run `trials` crash trials against the backend of `db` (see the module docstring),
    with the worker's command service in its process or in a writer process (`writer`).
    Returns the report; `report["ok"]` is False on any violation."""
    from kvledger.engine.remote import WRITERS

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
    backend: Backend = (SqliteBackend(url, root) if parsed.get_backend_name() == "sqlite"
                        else PostgresBackend(url))
    t0 = time.perf_counter()
    warm()
    backend.prepare()
    specs = workload(seed)
    try:
        baseline = _baseline(backend, specs, root, writer)
        totals, violations, moments, timing = Totals(), [], [], Counter()
        for plan in plans(trials, seed, baseline["hits"], baseline["seconds"]):
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
                     "run_seconds": round(baseline["seconds"], 4),
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


def _baseline(backend: Backend, specs, root: Path, writer: str) -> dict:
    """One uninterrupted run, counting how often each fault point is reached."""
    url = backend.fresh(-1)
    path = root / "baseline.json"
    pid = _fork(_run_child, url, specs, str(root / "baseline.acks"), None, str(root / "baseline.faults"), -1,
                count_faults=True, writer=writer, result=str(path), log=str(root / "baseline.log"))
    status = _wait(pid, 300)
    if status is None:
        _kill(pid)
    out = json.loads(path.read_text()) if path.exists() else {}
    error = out.get("__error__")
    if error and error["code"]:  # e.g. the database is unreachable: the child's own code
        raise KvLedgerError(ErrorCode(error["code"]), f"baseline run: {error['message']}")
    if status != 0 or error or out.get("errors"):
        detail = error["message"] if error else (out.get("errors") or ["no result"])[0]
        raise RuntimeError(f"the uninterrupted baseline run failed ({detail}): see {root / 'baseline.log'}")
    backend.release(-1)
    return out


def _trial(backend: Backend, plan: Plan, specs, baseline: dict, root: Path, timeout: float,
           writer: str) -> dict:
    d = root / f"trial-{plan.trial:05d}"
    d.mkdir()
    t0 = time.monotonic()
    url = backend.fresh(plan.trial)
    t_fresh = time.monotonic() - t0
    acks, flog, log = str(d / "acks.jsonl"), str(d / "faults.log"), str(d / "child.log")
    r, w = os.pipe()
    pid = _fork(_run_child, url, specs, acks, plan.fault_spec(), flog, w, writer=writer, log=log)
    os.close(w)
    ready, _, _ = select.select([r], [], [], timeout)
    os.close(r)
    status: int | None = None
    t_ready = time.monotonic()
    if not ready:
        status = _kill(pid)
    elif plan.mode == "sigkill":
        status = _wait(pid, plan.delay_s)
        if status is None:
            status = _kill(pid)
    elif plan.mode == "stall":
        deadline = t_ready + timeout
        while status is None and time.monotonic() < deadline:
            if Path(flog).exists() and Path(flog).read_text():
                time.sleep(plan.delay_s)
                status = _kill(pid)
                break
            status = _wait(pid, 0.001)
        if status is None:
            status = _kill(pid)
    else:
        status = _wait(pid, timeout)
        if status is None:
            status = _kill(pid)
    fired = [line.split()[0] for line in Path(flog).read_text().splitlines()] if Path(flog).exists() else []
    crashed = status != 0
    result = {"trial": plan.trial, "moment": plan.label(), "mode": plan.mode, "status": status,
              "crashed": crashed, "fired": fired,
              "crash_ms": round((time.monotonic() - t_ready) * 1000, 1)}
    path = d / "check.json"
    t1 = time.monotonic()
    cpid = _fork(_check_child, url, specs, acks, baseline["outputs"], result=str(path), log=log)
    cstatus = _wait(cpid, timeout)
    if cstatus is None:
        cstatus = _kill(cpid)
    result["ms"] = {"fresh": round(t_fresh * 1000), "run": round((t1 - t0 - t_fresh) * 1000),
                    "check": round((time.monotonic() - t1) * 1000)}
    if cstatus == 0:
        result["check"] = json.loads(path.read_text())
    else:
        result["check_failed"] = f"check child exited {cstatus}: see {log}"
    result["kept"] = str(d)
    return result


def _tally(t: Totals, result: dict, baseline: dict) -> list[str]:
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
