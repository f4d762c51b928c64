"""Crash-test child processes, forked from the zygote (kvledger.recovery.crash_trials):
the run child (a journaled worker that gets killed), the check child (recovery and
the checks after a crash), and the uninterrupted baseline run."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import msgspec

from kvledger.engine.service import BatchSurface
from kvledger.journal import faults
from kvledger.recovery.crash_backends import Backend
from kvledger.schemas.errors import ErrorCode, KvLedgerError

if TYPE_CHECKING:
    from kvledger.engine import commands as c
    from kvledger.engine.port import Clock, CommandPort, CommitHook, RejectHook, Results
    from kvledger.engine.state import HandleState
    from kvledger.journal.port import Journal
    from kvledger.schemas.decode_batch import DecodeBatch
    from kvledger.schemas.manifest import ArtifactIdentity
    from kvledger.worker.model import Transformer
    from kvledger.worker.serving import RequestSpec, Worker

# A child's result or a trial's: JSON values, written to a file by the child and read
# back by the parent.
Result = dict[str, Any]


class _WorkerShape(TypedDict):
    capacity: int
    prefill_chunk: int
    prefill_tokens: int
    max_running: int


REQUESTS, MAX_NEW_TOKENS = 5, 8
WORKER: _WorkerShape = {"capacity": 64, "prefill_chunk": 16, "prefill_tokens": 32, "max_running": 4}
CHECKPOINT_EVERY = 2  # iterations between projection checkpoints in the run child
CHECKPOINT = "crash-test"


# -- the workload ---------------------------------------------------------------------

def workload(seed: int, vocab: int = 512) -> list[RequestSpec]:
    """Plain greedy requests with ragged prompts (one long one, prefilled in chunks),
    arriving two per iteration; more requests than running slots, so one waits."""
    from kvledger.worker.serving import RequestSpec

    rng = random.Random(seed)
    return [RequestSpec(request_id=f"crash-{i}", max_new_tokens=MAX_NEW_TOKENS, arrival_step=i // 2,
                        prompt=tuple(rng.randrange(vocab) for _ in range(40 if i == 1 else rng.randint(3, 12))))
            for i in range(REQUESTS)]


# -- children -------------------------------------------------------------------------

_MODEL: tuple[Transformer, ArtifactIdentity] | None = None


def _model() -> tuple[Transformer, ArtifactIdentity]:
    global _MODEL
    if _MODEL is None:
        from kvledger.worker.loading import load_model

        _MODEL = load_model()
    return _MODEL


# What the trials' children run, imported by the zygote: a module a child imports is
# imported again by every trial (the layers' packages load their modules when first used).
CHILD_MODULES = ("kvledger.engine.remote", "kvledger.migrations.storage", "kvledger.recovery.recover",
                 "kvledger.replay.run", "kvledger.replay.verify", "kvledger.worker.serving", "kvledger.worker.reexec")


def warm(backend_modules: Sequence[str] = ()) -> None:
    """Zygote warm-up: the children's modules imported (`backend_modules`: those that open
    the trials' journals), one torch thread, the model built and one call run, so a forked
    child starts in milliseconds. No database is opened here."""
    import importlib

    import torch

    for name in (*CHILD_MODULES, *backend_modules):
        importlib.import_module(name)

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

    def __init__(self, service: CommandPort, ack_path: str) -> None:
        import msgspec

        from kvledger.schemas.receipts import Receipt

        self._service, self._receipt = service, Receipt
        self._fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._encode = msgspec.json.Encoder().encode

    # The rest of the port is the wrapped service's: a hook added here runs on its commits.
    @property
    def journal(self) -> Journal:
        return self._service.journal

    @property
    def source_instance(self) -> str:
        return self._service.source_instance

    @property
    def clock(self) -> Clock:
        return self._service.clock

    @property
    def states(self) -> Mapping[str, HandleState]:
        return self._service.states

    @property
    def on_commit(self) -> list[CommitHook]:
        return self._service.on_commit

    @property
    def on_reject(self) -> list[RejectHook]:
        return self._service.on_reject

    def state(self, handle_id: str, *, refresh: bool = False) -> HandleState | None:
        return self._service.state(handle_id, refresh=refresh)

    def close(self) -> None:
        self._service.close()

    def submit_many(self, cmds: Sequence[c.Command | c.Relative], *,
                    defer: bool = True) -> Callable[[], Results]:
        # execute and execute_many (BatchSurface) come through here too
        return self._acked(self._service.submit_many(cmds, defer=defer))

    def submit_batch(self, steps: DecodeBatch, cmds: Sequence[c.Command | c.Relative], *,
                     defer: bool = True) -> Callable[[], Results]:
        return self._acked(self._service.submit_batch(steps, cmds, defer=defer))

    def _acked(self, wait: Callable[[], Results]) -> Callable[[], Results]:
        def acknowledged() -> Results:
            results = wait()
            lines = [self._encode({"op": r.operation_id, "first": r.first_global_position,
                                   "last": r.last_global_position, "events": r.event_ids}) + b"\n"
                     for r in results if isinstance(r, self._receipt)]
            if lines:
                os.write(self._fd, b"".join(lines))
                os.fsync(self._fd)
            return results

        return acknowledged


if TYPE_CHECKING:
    def _implements_port(service: _Acking) -> CommandPort:
        return service  # mypy checks the acking wrapper against the port here


def _acking_service(journal: Journal, ack_path: str, writer: str = "thread") -> _Acking:
    """A command service (in this process, or in a writer process) whose acknowledged
    receipts go to `ack_path`, and whose journal notes every transaction's operation ids
    before sending it (`<ack_path>.intents`, journal.faults.intend): the checker's unit of
    all-or-nothing."""
    from kvledger.engine.remote import command_service

    faults.record_intents(ack_path + ".intents")
    os.environ["KVLEDGER_INTENTS_LOG"] = ack_path + ".intents"  # for a writer process
    return _Acking(command_service(journal, writer=writer, source_instance="kvledger-crash-test"), ack_path)


def run_child(url: str, specs: list[RequestSpec], ack_path: str, fault_spec: str | None, fault_log: str,
              ready_fd: int, count_faults: bool = False, writer: str = "thread") -> Result:
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.replay import WindowSpec, replay_incremental
    from kvledger.worker.serving import Worker

    if count_faults:
        fault_spec = ",".join(f"{p}:count" for p in faults.POINTS)
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

        def sidecar(w: Worker) -> None:  # a projector beside the worker, checkpointing as it goes
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


def acknowledged(path: str) -> int:
    """How many acknowledgements an ack log holds: its whole lines (a torn last line has
    no newline: its fsync never returned, as _read_lines skips it). The crash parent polls
    this while the run child writes."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def _read_lines(path: str) -> list[Any]:  # JSON values, one a line
    acks: list[Any] = []
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


def check_child(url: str, specs: list[RequestSpec], ack_path: str, baseline: dict[str, list[int]]) -> Result:
    from kvledger.engine.evolve import fold
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.recovery.recover import recover, verify_findings
    from kvledger.replay import WindowSpec, replay_incremental, replay_journal, to_json
    from kvledger.worker.serving import Worker

    model, artifact = _model()
    out: Result = {}
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
        partial: list[str | None] = []
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
        rep = recover(j, served=(model, artifact))
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
            outputs = list(st.outputs) if st is not None else None
            want = baseline.get(s.request_id)
            if outputs != want:
                mismatches.append(_mismatch(model, s, outputs, want))
        out["output_mismatches"] = mismatches
        # 4. a second recovery changes nothing
        again = recover(j, served=(model, artifact))
        out["second_recover_writes"] = again.events_written
        # 5. the projection checkpoint resumes to what a full replay gives
        window = WindowSpec(slo_ttft_ns=10**9, slo_tbt_ns=10**9)
        stored = j.load_checkpoint(CHECKPOINT)
        out["checkpoint_position"] = stored[0] if stored else None
        incremental, _ = replay_incremental(j, window, name=CHECKPOINT)
        out["checkpoint_ok"] = to_json(incremental) == to_json(replay_journal(j, window))
    return out


def _mismatch(model: Transformer, spec: RequestSpec, got: list[int] | None, want: list[int] | None) -> Result:
    """A differing output, with the top-2 logit margin of the uninterrupted run at the
    first difference (from a cache-free forward): a tie within ~1e-6 is a rounding
    flip of a recovered continuation, anything larger is a bug."""
    d: Result = {"request": spec.request_id, "got": got, "want": want}
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

def fork(fn: Callable[..., Any], *args: Any, result: str | None = None, log: str | None = None,
         **kwargs: Any) -> int:  # fn(*args, **kwargs) runs in the child
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


def wait_child(pid: int, timeout: float) -> int | None:
    """Exit status (negative: killed by that signal), or None after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.001)


def kill_group(pid: int) -> int:
    """SIGKILL a child and its process group (its writer process, if any): a crash of
    the machine or container the worker runs in, not of one process of it."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@contextlib.contextmanager
def reaped(pid: int) -> Iterator[None]:
    """Kill the child `pid` (its group) if the parent stops waiting for it by an
    exception (an interrupt): no run child keeps writing after its parent is gone."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(ChildProcessError):  # already reaped
            kill_group(pid)
        raise


def baseline_run(backend: Backend, specs: list[RequestSpec], root: Path, writer: str) -> Result:
    """One uninterrupted run, counting how often each fault point is reached."""
    url = backend.fresh(-1)
    path = root / "baseline.json"
    pid = fork(run_child, url, specs, str(root / "baseline.acks"), None, str(root / "baseline.faults"), -1,
               count_faults=True, writer=writer, result=str(path), log=str(root / "baseline.log"))
    with reaped(pid):
        status = wait_child(pid, 300)
        if status is None:
            kill_group(pid)
    out = json.loads(path.read_text()) if path.exists() else {}
    error = out.get("__error__")
    if error and error["code"]:  # e.g. the database is unreachable: the child's own code
        raise KvLedgerError(ErrorCode(error["code"]), f"baseline run: {error['message']}")
    if status != 0 or error or out.get("errors"):
        detail = error["message"] if error else (out.get("errors") or ["no result"])[0]
        raise RuntimeError(f"the uninterrupted baseline run failed ({detail}): see {root / 'baseline.log'}")
    backend.release(-1)
    out["acks"] = acknowledged(str(root / "baseline.acks"))
    return out

