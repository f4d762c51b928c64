"""A journal whose appends run in a writer process.

Why: a publication's journal work is Python (encoding, statements) plus a commit. In a
thread it holds the GIL that the model's Python dispatch needs, so on a CPU worker it
adds to every iteration even when the fsync itself overlaps. In a second process it
runs beside the model call, on another core, and the worker thread pays only for
sending the operations and reading the results.

The writer process owns the one writing connection (`SqlJournal.append`: same SQL,
same guards, same receipts); this process reads through its own connection (SQLite
WAL and PostgreSQL both let readers run beside the writer). One append is in flight
at a time, so results come back in request order. Nothing is acknowledged before the
writer has committed and answered; if it dies mid-append the caller gets
DATABASE_UNREACHABLE, an outcome it cannot know, as with a lost connection.

Frames on the writer's stdin/stdout: a 4-byte big-endian length, then msgpack. The
database URL is the first frame, not an argument, so credentials never show in `ps`.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import msgspec

from journal.contract import HeadFacts, Journal, Operation, Rejection
from journal.sql import SqlJournal, _validate, open_journal
from schemas.errors import ErrorCode, KvLedgerError
from schemas.events import Event
from schemas.receipts import Receipt

_LENGTH = struct.Struct(">I")


class _Reply(msgspec.Struct, frozen=True, array_like=True):
    """Positional results: one of `receipts[i]`, `rejections[i]` is set; or an error."""

    receipts: list[Receipt | None] = []
    rejections: list[Rejection | None] = []
    error_code: str | None = None
    error_message: str = ""


def _write(fd: int, payload: bytes) -> None:
    view = memoryview(_LENGTH.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


def _read(fd: int) -> bytes | None:
    """One frame, or None at end of stream."""
    head = _read_exact(fd, _LENGTH.size)
    return None if head is None else _read_exact(fd, _LENGTH.unpack(head)[0], eof_ok=False)


def _read_exact(fd: int, n: int, eof_ok: bool = True) -> bytes | None:
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


class ProcessJournal(Journal):
    """`Journal` over a writer process (appends) and a local connection (everything else)."""

    def __init__(self, url: str, reader: SqlJournal | None = None) -> None:
        """`reader`: this process's connection to the same database, if already open
        (it is closed with this journal). Errors opening it (BAD_DATABASE_URL,
        NOT_MIGRATED, ...) are raised before any process starts."""
        self.reader: SqlJournal = reader if reader is not None else open_journal(url)
        self.display_url = self.reader.display_url
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(_Reply).decode
        self._pending: Callable[[], list[Receipt | Rejection]] | None = None
        # The child imports this very package, wherever it was imported from here.
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen([sys.executable, "-m", "journal.process"], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._out, self._in = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        try:
            _write(self._out, url.encode())
            self._answer()  # the writer opened the journal (or says why not)
        except BaseException:
            self.close()
            raise

    def _answer(self) -> _Reply:
        try:
            frame = _read(self._in)
        except (EOFError, OSError) as exc:
            frame, why = None, str(exc)
        else:
            why = "exited"
        if frame is None:
            raise KvLedgerError(ErrorCode.DATABASE_UNREACHABLE,
                                f"{self.display_url}: the journal writer process {why}; "
                                "the outcome of the last append is unknown")
        reply = self._decode(frame)
        if reply.error_code is not None:
            raise KvLedgerError(ErrorCode(reply.error_code), reply.error_message)
        return reply

    # -- writing -----------------------------------------------------------------

    def append(self, operations: Sequence[Operation]) -> list[Receipt | Rejection]:
        return self.append_deferred(operations)()

    def append_deferred(self, operations: Sequence[Operation]) -> Callable[[], list[Receipt | Rejection]]:
        if self._pending is not None:
            self._pending()  # the contract says the caller waits first; never interleave
        if not operations:
            return lambda: []
        for op in operations:
            _validate(op)  # bad input fails here, before anything is sent
        try:
            _write(self._out, self._encode(list(operations)))
        except OSError as exc:
            raise KvLedgerError(ErrorCode.DATABASE_UNREACHABLE,
                                f"{self.display_url}: the journal writer process is gone ({exc})") from None
        results: list[Receipt | Rejection] | None = None

        def wait() -> list[Receipt | Rejection]:
            nonlocal results
            if results is None:
                self._pending = None
                reply = self._answer()
                results = [r if r is not None else j for r, j in zip(reply.receipts, reply.rejections)]
            return results

        self._pending = wait
        return wait

    # -- everything else: this process's own connection ---------------------------

    def read_stream(self, handle_id: str, after: int = 0) -> list[Event]:
        return self.reader.read_stream(handle_id, after)

    def read_all(self, after: int = 0, limit: int | None = None) -> Iterator[Event]:
        return self.reader.read_all(after, limit)

    def read_raw(self, after: int = 0, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
        return self.reader.read_raw(after, limit)

    def head(self, handle_id: str) -> HeadFacts | None:
        return self.reader.head(handle_id)

    def heads(self, *, prefix_identity_sha256: str | None = None) -> dict[str, HeadFacts]:
        return self.reader.heads(prefix_identity_sha256=prefix_identity_sha256)

    def receipt(self, operation_id: str) -> Receipt | None:
        return self.reader.receipt(operation_id)

    def last_position(self) -> int:
        return self.reader.last_position()

    def manifest(self, manifest_sha256: str) -> bytes | None:
        return self.reader.manifest(manifest_sha256)

    def save_checkpoint(self, name: str, position: int, state: bytes) -> None:
        self.reader.save_checkpoint(name, position, state)

    def load_checkpoint(self, name: str) -> tuple[int, bytes] | None:
        return self.reader.load_checkpoint(name)

    def import_events(self, events: Sequence[tuple[Event, bytes]], heads: Mapping[str, HeadFacts],
                      receipts: Sequence[Receipt], manifests: Sequence[tuple[str, bytes]] = ()) -> None:
        self.reader.import_events(events, heads, receipts, manifests)

    def read_receipts(self) -> Iterator[Receipt]:
        return self.reader.read_receipts()

    def close(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None:
            self._proc = None
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()  # EOF: the writer finishes its append (if any) and exits
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.reader.close()


# -- the writer process ---------------------------------------------------------------


def serve(fd_in: int, fd_out: int) -> None:
    # Only the parent ends this process, by closing the pipe: a terminal's Ctrl-C reaches
    # the whole process group, and must not cut an append the parent is waiting on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(list[Operation]).decode
    url = _read(fd_in)
    if url is None:
        return
    try:
        journal = open_journal(url.decode())
    except KvLedgerError as exc:
        _write(fd_out, encode(_Reply(error_code=exc.code.value, error_message=exc.message)))
        return
    _write(fd_out, encode(_Reply()))
    with journal:
        while (frame := _read(fd_in)) is not None:
            try:
                results = journal.append(decode(frame))
            except KvLedgerError as exc:
                reply = _Reply(error_code=exc.code.value, error_message=exc.message)
            except msgspec.ValidationError as exc:
                reply = _Reply(error_code=ErrorCode.MALFORMED_EVENT.value, error_message=str(exc))
            else:
                receipts = [r if type(r) is Receipt else None for r in results]
                reply = _Reply(receipts, [r if type(r) is Rejection else None for r in results])
            try:
                _write(fd_out, encode(reply))
            except BrokenPipeError:
                return  # the parent is gone; what committed is in the journal, unacknowledged


if __name__ == "__main__":
    # Frames own the original stdout; anything printed or logged goes to stderr instead.
    frames_out = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.fileno(), frames_out)
