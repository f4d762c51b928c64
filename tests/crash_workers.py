"""Process bodies for the racing-history and crash tests. Children are forked by a
multiprocessing forkserver that preloads journal and kvledger (no torch), so a child
starts in milliseconds and never inherits a database connection."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import time
from pathlib import Path

import msgspec

from kvledger.engine import commands as c
from kvledger.engine.service import CommandService
from kvledger.journal import faults
from kvledger.journal.backends import BACKENDS
from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt

from factories import make_manifest
from mutants import unguard

PROMPT = (5, 6, 7, 8)
CAPACITY = 24


# What a racer imports before its first operation (the forkserver skips a name it cannot
# import, silently: keep these the installed names).
PRELOAD = ["kvledger.migrations.storage", "kvledger.engine.service", "kvledger.replay.linearizability",
           "kvledger.journal.faults", *dict.fromkeys(m for b in BACKENDS for m in b.modules), "psycopg",
           "sqlalchemy.dialects.postgresql.psycopg", "sqlalchemy.dialects.sqlite.pysqlite", "nats"]


def context():
    """The forkserver context. Its server imports PRELOAD once (installed packages: the
    server does not see the tests directory on its path), so a child starts in
    milliseconds; the preload is set before the server starts, once per process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _Log:
    """One JSON line per record, one write() each: a killed process leaves whole lines
    (the page cache survives the process) and at most one torn last line."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, **record) -> None:
        os.write(self.fd, json.dumps(record).encode() + b"\n")


class RecordingJournal:
    """The journal as the service sees it, logging each attempt's guarded steps (the
    Operation it sends) before the append: what the history checker needs to know
    about a write whose result never arrived."""

    def __init__(self, journal, log: _Log) -> None:
        self._j, self._log = journal, log

    def append(self, operations):
        self._attempt(operations)
        return self._j.append(operations)

    def append_deferred(self, operations):  # the service's first attempt
        self._attempt(operations)
        return self._j.append_deferred(operations)

    def _attempt(self, operations) -> None:
        for op in operations:
            steps = [[w.handle_id, _g(w.expected), [w.head.generation, w.head.snapshot_version,
                                                   w.head.stream_position]] for w in op.writes]
            steps += [[ch.handle_id, _g(ch.expected), None] for ch in op.checks]
            self._log(type="attempt", op=op.operation_id, steps=steps)

    def __getattr__(self, name):
        return getattr(self._j, name)


def _g(guard):
    return None if guard is None else [guard.generation, guard.snapshot_version, guard.stream_position]


def allocate_handles(url: str, names: list[str]) -> dict[str, list[int]]:
    """Allocate the shared handles; returns their heads (the histories' initial state)."""
    with open_or_create_journal(url) as j:
        service = CommandService(j, source_instance="race-setup")
        for h in names:
            service.execute(c.Allocate(handle_id=h, manifest=make_manifest(request_id=h, prompt=PROMPT),
                                       reserved_capacity=CAPACITY, operation_id=f"alloc-{h}"))
        heads = j.heads()
        return {h: [heads[h].generation, heads[h].snapshot_version, heads[h].stream_position] for h in names}


def _choose(rng: random.Random, s, key: str, p_fork: float = 0.15):
    """One command a client would send for handle state `s` (its possibly stale view)."""
    h = s.handle_id
    base = dict(base_generation=s.generation)
    snap = dict(base_generation=s.generation, base_snapshot_version=s.snapshot_version)
    if s.lifecycle in ("FINISHED", "CANCELLED"):
        if rng.random() < 0.25 and s.lifecycle == "FINISHED":
            return "fork", c.Fork(parent_handle_id=h, child_handle_ids=(f"{h}~{key}",),
                                  prefix_length=s.committed_length, operation_id=key, **snap)
        return "release", c.Release(handle_id=h, operation_id=key, **snap)
    if s.lifecycle != "ACTIVE":
        return None
    x = rng.random()
    if x < 0.06:
        return "cancel", c.CancelRequest(handle_id=h, reason="race", operation_id=key, **base)
    if x < 0.06 + p_fork and s.committed_length > 0:
        return "fork", c.Fork(parent_handle_id=h, child_handle_ids=(f"{h}~{key}",),
                              prefix_length=s.committed_length, operation_id=key, **snap)
    if x < 0.12 + p_fork and len(s.outputs) >= 2:
        return "finish", c.Finish(handle_id=h, operation_id=key, **base)
    if s.open_txns:
        return "publish", c.Publish(handle_id=h, txn_id=s.open_txns[0].txn_id, operation_id=key, **snap)
    if s.logits_ready:
        return "emit", c.EmitOutput(handle_id=h, base_generation=s.generation, base_snapshot_version=s.snapshot_version,
                                    output_index=len(s.outputs), token_id=rng.randrange(64), operation_id=key)
    if s.committed_length == 0 or s.has_frontier:
        n0 = s.committed_length
        tokens = s.prompt if n0 == 0 else (s.outputs[-1],)
        kind = "prefill" if n0 == 0 else "decode"
        return "begin", c.BeginAppend(
            handle_id=h, txn_id=f"t-{key}", kind=kind, interval_start=n0, interval_count=len(tokens),
            token_ids=tokens, cache_positions=tuple(range(n0, n0 + len(tokens))),
            mask_key_extent=n0 + len(tokens), cache_abi_sha256=s.cache_abi_sha256, operation_id=key, **snap)
    return None


class Race(msgspec.Struct, frozen=True, kw_only=True):
    """A racing history's workload: the shared handles, the operations each racer issues,
    whether the journal's guard is off (tests/mutants.py), and how often a racer forks
    and refreshes its cached view."""

    handles: tuple[str, ...]
    n_ops: int
    mutant: bool = False
    p_fork: float = 0.15
    p_refresh: float = 0.3


def racer(url: str, process: int, race: Race, seed: int, history: str, go: str, fault: str | None = None) -> None:
    """Issue race.n_ops random operations on the shared handles, recording each as invoke
    then ok / fail / info with monotonic timestamps (comparable across processes)."""
    log = _Log(history)
    try:
        _race(url, process, race, seed, log, go, fault)
    except BaseException:
        import traceback

        log(type="crash", op=f"p{process}", error=traceback.format_exc())
        raise


def _race(url: str, process: int, race: Race, seed: int, log: _Log, go: str, fault: str | None) -> None:
    if fault:
        faults.configure(fault)
    rng = random.Random(seed)
    handles, p_fork, p_refresh = race.handles, race.p_fork, race.p_refresh
    with open_or_create_journal(url) as j:
        if race.mutant:
            unguard(j)
        # retry_s=0: a lost acknowledgement stays the history's info operation, not asked again
        service = CommandService(RecordingJournal(j, log), source_instance=f"racer-{process}", retry_s=0)
        log(type="ready", op=f"p{process}")
        _await(go)
        for n in range(race.n_ops):
            key = f"p{process}-{n}-{seed}"
            h = rng.choice(handles)  # fork children stay out: contention is on the shared handles
            if rng.random() < 0.2:
                log(type="invoke", op=key, process=process, f="read", t=time.monotonic_ns())
                try:
                    head = j.head(h)
                except KvLedgerError as exc:  # no value: a failed read claims nothing
                    log(type="fail", op=key, t=time.monotonic_ns(), error=exc.code.value)
                    continue
                value = None if head is None else [head.generation, head.snapshot_version, head.stream_position]
                log(type="ok", op=key, t=time.monotonic_ns(), value={h: value})
                continue
            try:
                s = service.state(h, refresh=rng.random() < p_refresh)  # often a stale cached view
            except KvLedgerError:
                continue
            choice = _choose(rng, s, key, p_fork) if s is not None else None
            if choice is None:
                continue
            f, cmd = choice
            log(type="invoke", op=key, process=process, f=f, t=time.monotonic_ns())
            try:
                r = service.execute(cmd)
            except KvLedgerError as exc:
                # a driver error (or an injected one) leaves the outcome unknown
                status = "info" if exc.code is ErrorCode.DATABASE_UNREACHABLE else "fail"
                log(type=status, op=key, t=time.monotonic_ns(), error=exc.code.value)
                if status == "info":  # the connection may be gone: reopen, as a client would
                    j.close()
                    j = open_or_create_journal(url)
                    service = CommandService(RecordingJournal(j, log), source_instance=f"racer-{process}", retry_s=0)
                continue
            assert isinstance(r, Receipt)
            log(type="ok", op=key, t=time.monotonic_ns(),
                receipt={"event_ids": list(r.event_ids), "first": r.first_global_position,
                         "last": r.last_global_position})
        j.close()


def _await(path: str, timeout: float = 120.0) -> None:
    """A start gate that a SIGKILL cannot wedge: poll for a file. (A multiprocessing
    Barrier's lock, held by a process killed inside it, blocks the others for good.)"""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no start signal {path}")
        time.sleep(0.0005)


def _lines(path: str, prefix: bytes) -> int:
    try:
        return sum(1 for line in Path(path).read_bytes().splitlines() if line.startswith(prefix))
    except FileNotFoundError:
        return 0


def run_history(ctx, url: str, workdir: Path, race: Race, *, processes: int, seed: int, kill: bool = False,
                fault: tuple[int, str] | None = None) -> dict:
    """One racing history: `processes` racers on `race.handles`, released together once all
    are connected; with `kill` one of them is SIGKILLed at a random moment after its
    first operation began; `fault` = (process, rule) arms a fault in one racer.
    Returns the history files and what happened to each process."""
    rng = random.Random(seed)
    go = str(workdir / f"go-{seed}")
    files = [str(workdir / f"h{seed}-p{i}.jsonl") for i in range(processes)]
    procs = []
    for i in range(processes):
        rule = fault[1] if fault and fault[0] == i else None
        p = ctx.Process(target=racer, args=(url, i, race, seed * 100 + i, files[i], go, rule))
        p.start()
        procs.append(p)
    deadline = time.monotonic() + 120
    while not all(_lines(f, b'{"type": "ready"') for f in files) and time.monotonic() < deadline:
        if any(p.exitcode is not None for p in procs):
            break
        time.sleep(0.001)
    Path(go).touch()
    killed = None
    if kill:
        killed = rng.randrange(processes)
        while not _lines(files[killed], b'{"type": "invoke"') and procs[killed].exitcode is None \
                and time.monotonic() < deadline:
            time.sleep(0.0005)
        time.sleep(rng.uniform(0.0, 0.01))
        procs[killed].kill()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            p.join()
    errors = [json.loads(line)["error"] for f in files if os.path.exists(f)
              for line in Path(f).read_bytes().splitlines() if line.startswith(b'{"type": "crash"')]
    return {"files": files, "exitcodes": [p.exitcode for p in procs], "killed": killed, "errors": errors}


# -- the hypothesis crash-and-reopen machine's writer -----------------------------------

def writer(url: str, conn) -> None:
    """Append what the parent sends, answer with the results. ("fault", spec) arms a
    fault for the next appends (an `exit` one ends this process mid-append)."""
    with open_or_create_journal(url) as j:
        while True:
            try:
                kind, arg = conn.recv()
            except EOFError:
                return
            if kind == "fault":
                faults.configure(arg)
                conn.send(("ok", None))
            elif kind == "append":
                try:
                    conn.send(("ok", j.append(arg)))
                except KvLedgerError as exc:
                    conn.send(("error", exc.code.value))
            elif kind == "sleep_append":  # slow inside the transaction, to be killed there
                faults.configure(f"before_commit:sleep={arg[0]}")
                conn.send(("started", None))
                conn.send(("ok", j.append(arg[1])))
            else:
                return


# -- fault points: one append (or checkpoint) with a rule armed -------------------------

def fault_child(url: str, spec: str | None, what: str) -> None:
    """Arm `spec`, then do `what` on the journal: "batch" appends a publish on two
    handles and a second publish on the first one (two rounds: mid_batch lies between
    them); "checkpoint" overwrites the checkpoint "c". An `exit` rule ends the process
    at its point with journal.faults.EXIT_CODE."""
    from factories import guard_of, publish_op

    if spec is not None:  # None: keep what the environment armed
        faults.configure(spec)
    with open_or_create_journal(url) as j:
        if what == "checkpoint":
            j.save_checkpoint("c", 2, b"new")
            return
        a, b = guard_of(j.head("A")), guard_of(j.head("B"))
        first = publish_op("A", a, "x1")
        then = publish_op("A", _next(first), "x3")
        j.append([first, publish_op("B", b, "x2"), then])


def _next(op):
    from kvledger.journal import Guard

    h = op.writes[0].head
    return Guard(h.generation, h.snapshot_version, h.stream_position)


# -- a scripted race: a fork decided on a view another process has since moved ----------

def scripted_fork(url: str, history: str, ready, go, mutant: bool) -> None:
    """Cache H's state, signal, wait until another process moved H, then fork H from
    the cached view. Real journal: the guard fails, the service re-reads and commits
    on the new head. Mutant: the stale check passes and the fork commits on a base
    that no longer exists."""
    log = _Log(history)
    with open_or_create_journal(url) as j:
        if mutant:
            unguard(j)
        service = CommandService(RecordingJournal(j, log), source_instance="scripted-fork")
        s = service.state("H")
        ready.set()
        go.wait(60)
        log(type="invoke", op="fork-1", process=0, f="fork", t=time.monotonic_ns())
        try:
            r = service.execute(c.Fork(parent_handle_id="H", base_generation=s.generation,
                                       base_snapshot_version=s.snapshot_version, child_handle_ids=("H~1",),
                                       prefix_length=s.committed_length, operation_id="fork-1"))
        except KvLedgerError as exc:
            log(type="fail", op="fork-1", t=time.monotonic_ns(), error=exc.code.value)
            return
        log(type="ok", op="fork-1", t=time.monotonic_ns(), receipt={
            "event_ids": list(r.event_ids), "first": r.first_global_position, "last": r.last_global_position})


def scripted_emit(url: str, history: str, ready, go) -> None:
    """Once the forker has cached H: emit H's next output (moves its stream), then go."""
    log = _Log(history)
    ready.wait(60)
    with open_or_create_journal(url) as j:
        service = CommandService(RecordingJournal(j, log), source_instance="scripted-emit")
        s = service.state("H")
        log(type="invoke", op="emit-1", process=1, f="emit", t=time.monotonic_ns())
        r = service.execute(c.EmitOutput(handle_id="H", base_generation=s.generation,
                                         base_snapshot_version=s.snapshot_version, output_index=len(s.outputs),
                                         token_id=9, operation_id="emit-1"))
        log(type="ok", op="emit-1", t=time.monotonic_ns(), receipt={
            "event_ids": list(r.event_ids), "first": r.first_global_position, "last": r.last_global_position})
    go.set()
