"""The command service in a writer process (`--writer process`).

Why: deciding a batch, encoding its events, the statements and the commit are Python
that, in a thread, holds the GIL the model's own Python dispatch needs, so they add to
every iteration however well the fsync overlaps. A worker sends its commands as data
(engine.commands.Relative: bound to the state their batch leaves) to a CommandService
in a child process, runs its next model call while that process decides and commits,
and reads the results. Same service, same journal SQL, guards, receipts and durability.

The child owns the one writing connection; the worker's process reads the journal on
its own connection (`service.journal`: SQLite WAL and PostgreSQL both let readers run
beside the writer). One batch is in flight at a time, so results come back in order.
Nothing is acknowledged before the child committed and answered. If it dies, the
caller gets DATABASE_UNREACHABLE and the outcome of the batch in flight is unknown (it
committed whole or not at all, as with a lost database connection). If the parent dies,
the child finishes the batch it received and exits when it sees the pipe closed.

Frames on the child's stdin/stdout: a 4-byte big-endian length, then msgpack. The
database URL travels in the first frame, never in argv, so `ps` shows no credentials.
Each side polls the pipe for a while before it sleeps in read() (journal.tuning.poll).
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec

from kvledger.engine import WRITERS
from kvledger.engine import commands as c
from kvledger.engine.evolve import fold
from kvledger.engine.port import CommandPort, CommitHook, RejectHook, Results
from kvledger.engine.service import BatchSurface, CommandService, SystemClock
from kvledger.engine.state import HandleState
from kvledger.journal import open_journal, tuning
from kvledger.journal.port import DecodeRun, Journal, RunReceipts, retried
from kvledger.schemas.decode_batch import DecodeBatch
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import Event
from kvledger.schemas.positional import Positional
from kvledger.schemas.receipts import Receipt

_LENGTH = struct.Struct(">I")


def command_service(journal: Journal, *, writer: str = "thread",
                    source_instance: str = "kvledger") -> CommandService | RemoteService:
    """The service a worker writes through: in this process (`thread`) or in a writer
    process on the same database (`process`), reading through `journal` either way."""
    if writer == "thread":
        return CommandService(journal, source_instance=source_instance)
    if writer == "process":
        return RemoteService(journal, source_instance=source_instance)
    raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"writer must be one of {', '.join(WRITERS)}, not {writer!r}")


class _Hello(msgspec.Struct, frozen=True, array_like=True):
    url: str
    source_instance: str


class _Request(msgspec.Struct, frozen=True, array_like=True):
    commands: list[c.Command | c.Relative]
    events: bool  # send each receipt's events back (on_commit hooks are listening)
    rejected: bool  # send each refused command back as decided (on_reject hooks)
    # The batch's plain decode steps as columns, decided before `commands`; results and
    # replies list the steps' first.
    steps: DecodeBatch | None = None


_NO_RUN = msgspec.Raw(b"\xc0")  # msgpack's nil: msgspec takes no Raw in a union with None


class _Reply(msgspec.Struct, frozen=True, array_like=True):
    """Positional: `receipts[i]` or `errors[i]` (code, message) is set; or `failure`
    (code, message) when the batch as a whole failed. With `run`, the batch's first
    `run_steps` steps were a decode run written whole (the msgpack of a _Run), and the
    lists hold the results after it."""

    receipts: list[Receipt | None] = []
    errors: list[tuple[str, str] | None] = []
    events: list[list[Event]] | None = None
    rejected: list[c.Command | c.Relative | None] | None = None
    failure: tuple[str, str] | None = None
    # Its receipts are built on the caller's side when read (RunReceipts): each costs a
    # SHA-256 fingerprint that the writer, the busier process, would otherwise pay; and
    # it is decoded only then: a worker reads of most commits only what was refused.
    run: msgspec.Raw = _NO_RUN
    run_steps: int = 0  # none: no run


class _Run(msgspec.Struct, frozen=True, array_like=True):
    run: DecodeRun
    first: int
    now: int


_encode_run = msgspec.msgpack.Encoder().encode
_decode_run = msgspec.msgpack.Decoder(_Run).decode


class _SentRun(Positional[Receipt]):
    """The receipts of a run the writer wrote whole, from its reply's bytes, decoded
    when the first one is read."""

    __slots__ = ("_steps", "_raw", "_receipts")

    def __init__(self, steps: int, raw: msgspec.Raw) -> None:
        self._steps, self._raw = steps, raw
        self._receipts: RunReceipts | None = None

    def __len__(self) -> int:
        return self._steps

    def _at(self, i: int) -> Receipt:
        if self._receipts is None:
            sent = _decode_run(self._raw)
            self._receipts = RunReceipts(sent.run, sent.first, sent.now)
        return self._receipts[i]


class RemoteService(BatchSurface):
    """What a Worker (and telemetry) use of a CommandService, served by a writer process.
    `states` stays empty: the decided states live in the writer; `state()` folds the
    handle's stream from the journal here."""

    def __init__(self, journal: Journal, *, source_instance: str = "kvledger") -> None:
        self.journal: Journal = journal
        self.display_url = journal.display_url
        self.source_instance = source_instance
        self.clock = SystemClock()  # the writer stamps with the same system clocks
        self.on_commit: list[CommitHook] = []
        self.on_reject: list[RejectHook] = []
        self.states: dict[str, HandleState] = {}
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(_Reply).decode
        self._pending: Callable[[], Results] | None = None
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-m", "kvledger.engine.remote"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self.pid = self._proc.pid
        # Placed from here: the child inherits this thread's mask, which may be the
        # model's (off the I/O CPU), and would not see the CPUs it may move to.
        tuning.pin_writer(self.pid)
        self._out, self._in = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        try:
            send(self._out, self._encode(_Hello(journal.reopen_url(),
                                                source_instance)))
            self._answer()  # the writer opened the journal, or says why not
        except BaseException:
            self.close()
            raise

    def _answer(self) -> _Reply:
        try:
            frame, why = receive(self._in, tuning.SPIN_S), "exited"
        except (EOFError, OSError) as exc:
            frame, why = None, str(exc)
        if frame is None:
            raise KvLedgerError(ErrorCode.DATABASE_UNREACHABLE,
                                f"{self.display_url}: the journal writer process {why}; "
                                "the outcome of the last batch is unknown")
        reply = self._decode(frame)
        if reply.failure is not None:
            raise KvLedgerError(ErrorCode(reply.failure[0]), reply.failure[1])
        return reply

    # -- the CommandService surface a worker uses ---------------------------------------

    def submit_many(self, cmds: Sequence[c.Command | c.Relative], *, defer: bool = True
                    ) -> Callable[[], Results]:
        """Send the batch; the returned function waits for the writer's commit and
        returns the results (see CommandService.submit_many). Commands must be data."""
        return self._send(None, cmds, defer)

    def submit_batch(self, steps: DecodeBatch, cmds: Sequence[c.Command | c.Relative], *,
                     defer: bool = True) -> Callable[[], Results]:
        """The decode batch and `cmds` in one frame, decided by the writer's
        CommandService.submit_batch; results positional over both."""
        steps.check()
        return self._send(steps, cmds, defer)

    def _send(self, steps: DecodeBatch | None, cmds: Sequence[c.Command | c.Relative], defer: bool
              ) -> Callable[[], Results]:
        if self._pending is not None:
            self._pending()  # never two batches in flight
        cmds = list(cmds)
        if steps is not None and not len(steps):
            steps = None
        if not cmds and steps is None:
            return lambda: Results(())
        self._check_sendable(cmds)
        request = _Request(cmds, bool(self.on_commit), bool(self.on_reject), steps)
        try:
            send(self._out, self._encode(request))
        except OSError as exc:
            raise KvLedgerError(ErrorCode.DATABASE_UNREACHABLE,
                                f"{self.display_url}: the journal writer process is gone ({exc})") from None
        results: Results | None = None
        n = 0 if steps is None else len(steps)

        def sent(i: int) -> c.Command | c.Relative:
            assert steps is not None or i >= n
            return c.batch_step(steps, i) if steps is not None and i < n else cmds[i - n]

        def wait() -> Results:
            nonlocal results
            if results is None:
                self._pending = None
                reply = self._answer()
                got = [r if r is not None else _error(e) for r, e in zip(reply.receipts, reply.errors)]
                run = _SentRun(reply.run_steps, reply.run) if reply.run_steps else ()
                self._notify(reply, got, lambda j: sent(len(run) + j))
                results = Results(got, run)
            return results

        self._pending = wait
        if not defer:
            wait()
        return wait

    def _check_sendable(self, cmds: list[c.Command | c.Relative]) -> None:
        if any(not isinstance(x, c.Relative) and not isinstance(x, c.Command) for x in cmds):
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "a writer process takes commands as data "
                                "(engine.commands.Command or Relative), not callables")
        if self._proc is None:
            raise KvLedgerError(ErrorCode.DATABASE_UNREACHABLE, f"{self.display_url}: service closed")

    def _notify(self, reply: _Reply, results: list[Receipt | KvLedgerError],
                sent: Callable[[int], c.Command | c.Relative]) -> None:
        """Call the observers: commits before refusals, as the service here calls them."""
        for j, r in enumerate(results):
            if isinstance(r, Receipt):
                for on_commit in self.on_commit:
                    on_commit(r, reply.events[j] if reply.events else [])
        for j, r in enumerate(results):
            if not isinstance(r, Receipt):
                cmd = (reply.rejected[j] if reply.rejected else None) or sent(j)
                for on_reject in self.on_reject:
                    on_reject(cmd, r)

    def state(self, handle_id: str, *, refresh: bool = False) -> HandleState | None:
        return fold(retried(lambda: self.journal.read_stream(handle_id), what="a read"))

    def close(self) -> None:
        """Close the pipe and wait for the writer: it finishes any batch it holds and exits."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _error(e: tuple[str, str] | None) -> KvLedgerError:
    """A reply's errors[i], set wherever its receipts[i] is not."""
    assert e is not None, "a reply with neither a receipt nor an error"
    return KvLedgerError(ErrorCode(e[0]), e[1])


if TYPE_CHECKING:
    def _implements_port(service: RemoteService) -> CommandPort:
        return service  # mypy checks RemoteService against the port here


# -- frames ---------------------------------------------------------------------------


def send(fd: int, payload: bytes) -> None:
    view = memoryview(_LENGTH.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


def receive(fd: int, spin_s: float = 0.0) -> bytes | None:
    """One frame, or None at end of stream; with `spin_s`, the pipe is polled that long
    before the read sleeps (journal.tuning.poll)."""
    if spin_s:
        tuning.poll(fd, spin_s=spin_s)
    head = _read_exact(fd, _LENGTH.size, eof_ok=True)
    return None if head is None else _read_exact(fd, _LENGTH.unpack(head)[0], eof_ok=False)


def _read_exact(fd: int, n: int, eof_ok: bool) -> bytes | None:
    chunks, need = [], n
    while need:
        chunk = os.read(fd, need)
        if not chunk:
            if eof_ok and need == n:
                return None
            raise EOFError("journal writer stream ended mid-frame")
        chunks.append(chunk)
        need -= len(chunk)
    return b"".join(chunks)


# -- the writer process ---------------------------------------------------------------


def serve(fd_in: int, fd_out: int) -> None:
    # Only the parent ends this process, by closing the pipe: a terminal's Ctrl-C reaches
    # the whole process group and must not cut a commit the parent is waiting on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(_Request).decode
    frame = receive(fd_in)
    if frame is None:
        return
    hello = msgspec.msgpack.decode(frame, type=_Hello)
    try:
        journal = open_journal(hello.url)
    except KvLedgerError as exc:
        send(fd_out, encode(_Reply(failure=(exc.code.value, exc.message))))
        return
    service = CommandService(journal, source_instance=hello.source_instance)
    committed: dict[str, list[Event]] = {}
    refused: list[c.Command | c.Relative] = []  # as decided, in the order of the refusals
    # Only a request that asks for its events sets the hook: a decode step's events are
    # built for it (Operation.step holds their values), which is not free.
    keep: list[CommitHook] = [lambda receipt, events: committed.__setitem__(receipt.operation_id, events)]
    service.on_reject.append(lambda cmd, exc: refused.append(cmd))
    tuning.freeze_heap()  # what start-up loaded, before the first frame
    send(fd_out, encode(_Reply()))
    with journal:
        while (frame := receive(fd_in, tuning.SPIN_S)) is not None:
            committed.clear()
            refused.clear()
            try:
                request = decode(frame)
                service.on_commit = keep if request.events else []
                if request.steps is None:
                    results = service.execute_many(request.commands)
                else:
                    request.steps.check()  # what a frame's decoder does not: the columns line up
                    results = service.submit_batch(request.steps, request.commands, defer=False)()
            except KvLedgerError as exc:
                reply = _Reply(failure=(exc.code.value, exc.message))
            except msgspec.ValidationError as exc:
                reply = _Reply(failure=(ErrorCode.INVALID_ARGUMENT.value, str(exc)))
            else:
                reply = _reply(results, request, committed, refused)
            try:
                send(fd_out, encode(reply))
            except BrokenPipeError:
                return  # the parent is gone: what committed is in the journal, unacknowledged


def _reply(results: Results, request: _Request, committed: dict[str, list[Event]],
           refused: list[c.Command | c.Relative]) -> _Reply:
    """The reply to `request`: a run written whole goes as itself, unless hooks want each
    of its receipts' events."""
    run, rest = results.parts()
    if type(run) is RunReceipts and not request.events:
        sent = msgspec.Raw(_encode_run(_Run(run.run, run.first, run.now)))
    else:
        run, rest, sent = (), list(results), _NO_RUN
    ok = [r if type(r) is Receipt else None for r in rest]
    return _Reply(
        ok, [(e.code.value, e.message) if isinstance(e, KvLedgerError) else None for e in rest],
        [committed.get(r.operation_id, []) if r else [] for r in ok] if request.events else None,
        _at_refusals(ok, refused) if request.rejected else None, None, sent, len(run))


def _at_refusals(ok: list[Receipt | None], refused: list[c.Command | c.Relative]
                 ) -> list[c.Command | c.Relative | None]:
    it = iter(refused)
    return [None if r is not None else next(it, None) for r in ok]


if __name__ == "__main__":
    # Frames own the original stdout; anything printed or logged goes to stderr instead.
    frames_out = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.fileno(), frames_out)
