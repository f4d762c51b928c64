"""Where events come from: a journal database, or an audit JSONL file (one stored
event body per line, in global order) read with no database at all.

Bad input raises KvLedgerError with the decoder's stable code (MALFORMED_EVENT,
UNKNOWN_EVENT_TYPE, UNKNOWN_SCHEMA_VERSION, FIELD_TOO_LARGE) and a `FILE:LINE:` prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from kvledger.journal.port import FoldItem, Journal
from kvledger.schemas import events as ev
from kvledger.schemas.codec import MAX_EVENT_BYTES, decode_event
from kvledger.schemas.errors import ErrorCode, KvLedgerError


def jsonl_bodies(path: str | Path, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number, stored body) for each non-blank line, at most `limit` of them. The
    file is opened at the call (an unreadable path raises here, before any line) and
    read one line at a time with a bound, so a forged line cannot become an unbounded
    allocation and a pipe or FIFO is consumed as it arrives."""
    if limit is not None and limit <= 0:
        return iter(())
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"cannot read {path}: {exc.strerror}") from None
    return _lines(f, path, limit)


_PIECE = 1 << 20


def _read_line(readline: Callable[[int], bytes], most: int) -> bytes | None:
    """One line of at most `most` bytes, or None for one that goes on past them. It is
    read a piece at a time into one buffer, so such a line is held once, never whole
    (readline(most) holds its pieces and their join)."""
    line = readline(min(_PIECE, most))
    if len(line) < _PIECE or line[-1:] == b"\n":
        return line  # every line but a long one: one call
    buf = bytearray(line)
    del line
    while len(buf) < most and buf[-1:] != b"\n":
        piece = readline(min(_PIECE, most - len(buf)))
        if not piece:
            break
        buf += piece
    return bytes(buf) if len(buf) < most or buf[-1:] == b"\n" else None


def _lines(f: BinaryIO, path: str | Path, limit: int | None) -> Iterator[tuple[int, bytes]]:
    n = lineno = 0
    with f:
        readline = f.readline
        while True:
            try:
                line = _read_line(readline, MAX_EVENT_BYTES + 2)
            except OSError as exc:  # EIO, a directory on some systems, ...
                raise KvLedgerError(ErrorCode.INVALID_ARGUMENT,
                                    f"cannot read {path}: {exc.strerror}") from None
            if line == b"":
                return
            lineno += 1
            if line is None or (line[-1:] != b"\n" and len(line) > MAX_EVENT_BYTES):
                raise KvLedgerError(ErrorCode.FIELD_TOO_LARGE,
                                    f"{path}:{lineno}: line longer than {MAX_EVENT_BYTES} bytes",
                                    line=lineno)
            if line[-1:] == b"\n":
                line = line[:-2] if line[-2:-1] == b"\r" else line[:-1]
            if not line or line.isspace():
                continue
            yield lineno, line
            n += 1
            if n == limit:
                return


def jsonl_events(path: str | Path, limit: int | None = None) -> Iterator[ev.Event]:
    for lineno, body in jsonl_bodies(path, limit):
        try:
            yield decode_event(body)
        except KvLedgerError as exc:
            raise KvLedgerError(exc.code, f"{path}:{lineno}: {exc.message}") from None


# decode_event's codes: the failure a stored event's position is added to
_DECODING = {ErrorCode.MALFORMED_EVENT, ErrorCode.UNKNOWN_EVENT_TYPE, ErrorCode.UNKNOWN_SCHEMA_VERSION,
             ErrorCode.FIELD_TOO_LARGE}


def journal_events(journal: Journal, after: int = 0, limit: int | None = None) -> Iterator[ev.Event]:
    """The journal's events after `after` (at most `limit`), in global order."""
    return _named(journal.read_all(after, limit), journal, after, limit)


def fold_items(journal: Journal, after: int = 0, limit: int | None = None) -> Iterator[FoldItem]:
    """journal_events for a projector: a decode step may come whole (Journal.read_fold)."""
    if limit is not None:
        return journal_events(journal, after, limit)
    return _named(journal.read_fold(after), journal, after, limit)


def _named(items: Iterator[Any], journal: Journal, after: int, limit: int | None) -> Iterator[Any]:
    """`items`, and for an event that does not decode, an error that names its position."""
    try:
        yield from items
        return
    except KvLedgerError as exc:
        if exc.code not in _DECODING:
            raise
    # Find it as stored bytes (a failure is rare; this reads from `after` again).
    for position, body in journal.read_raw(after, limit):
        try:
            decode_event(body)
        except KvLedgerError as exc:
            raise KvLedgerError(exc.code, f"stored event at position {position}: {exc.message}") from None
    raise AssertionError("an event did not decode, and then did")  # pragma: no cover - the same bytes
