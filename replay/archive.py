"""Audit journal files: export a journal to JSONL and import one into an empty journal.

A file holds the stored event bodies verbatim, one per line, in global order: no
re-encoding, so an exported and re-imported journal stores the same bytes. Import
derives what the database keeps beside the events (head rows, receipts, manifests)
by folding the events with engine.evolve; a receipt is rebuilt per operation_id with
fingerprint "imported" (the original fingerprint is not in the events), so a retry
of a pre-export command against the copy is a CONFLICT, never a silent double write.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from kvledger.engine.evolve import evolve
from kvledger.engine.heads import head as head_facts  # the head row exactly as the service writes it
from kvledger.engine.state import HandleState
from kvledger.journal.contract import HeadFacts, ImportTables
from kvledger.journal.port import Journal
from kvledger.replay.kv_blocks import kv_head, kv_head_facts
from kvledger.replay.sources import jsonl_bodies
from kvledger.replay.verify import Checker, Finding
from kvledger.schemas import events as ev
from kvledger.schemas.canonical import canonical_json
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import HandleResult, Receipt

IMPORTED_FINGERPRINT = "imported"


class ImportSummary(msgspec.Struct, frozen=True):
    events: int
    handles: int
    receipts: int
    manifests: int


def export_jsonl(journal: Journal, out: str | Path, progress: Callable[[int], None] | None = None) -> int:
    """Write every stored body, one per line, in global order. `out` "-" is stdout; a
    file is written beside its destination and renamed into place, so a failed export
    never leaves a truncated journal that looks complete."""
    if str(out) == "-":
        return _write(journal, sys.stdout.buffer, progress)
    out = Path(out)
    if not out.parent.is_dir():
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"directory {out.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would surprise a reader of the file
        with os.fdopen(fd, "wb") as f:
            n = _write(journal, f, progress)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write(journal: Journal, f: BinaryIO, progress: Callable[[int], None] | None) -> int:
    n = 0
    for _, body in journal.read_raw():
        f.write(body)
        f.write(b"\n")
        n += 1
        if progress is not None and n % 4096 == 0:
            progress(n)
    if progress is not None:
        progress(n)
    return n


def import_jsonl(journal: Journal, path: str | Path) -> ImportSummary:
    """Load an exported file into an empty journal, all or nothing, one line at a time.
    Each line must decode, be in the canonical form the journal writes (no duplicate
    keys: the bytes re-encode to themselves) and pass verify's checks given the lines
    before it. The first line that does not is refused with its code and FILE:LINE
    (decode codes as the decoder gives them, NON_CANONICAL_EVENT, else CORRUPT_JOURNAL
    naming verify's finding), and the transaction rolls back: the journal is unchanged.
    Memory holds what the tables need (states, receipts), not the file."""
    lines = jsonl_bodies(path)  # opens now, before the journal is touched
    checker = Checker(keep=1)
    tables = TableDeriver()

    def events() -> Iterator[tuple[ev.Event, bytes]]:
        for n, body in lines:
            e = checker.feed(body, line=n)
            if checker.findings:
                raise _refusal(path, n, checker.findings[0])
            assert e is not None  # no finding: it decoded
            tables.add(e, checker.states.get(e.stream_id))  # the checker's fold, not a second one
            yield e, body

    journal.import_events(events(), tables.result)
    return ImportSummary(checker.events, len(tables.states), len(tables.ops), len(tables.manifests))


_DECODE_CODES = {c.value: c for c in (ErrorCode.MALFORMED_EVENT, ErrorCode.UNKNOWN_EVENT_TYPE,
                                      ErrorCode.UNKNOWN_SCHEMA_VERSION, ErrorCode.FIELD_TOO_LARGE,
                                      ErrorCode.NON_CANONICAL_EVENT)}


def _refusal(path: str | Path, n: int, f: Finding) -> KvLedgerError:
    """A line's first finding as the import's error: its own code when it is about the
    line's form, CORRUPT_JOURNAL (naming verify's code) when the journal would be."""
    code = _DECODE_CODES.get(f.code)
    if code is not None:
        return KvLedgerError(code, f"{path}:{n}: {f.message}".translate(_ESCAPES))
    return KvLedgerError(ErrorCode.CORRUPT_JOURNAL,
                         f"{path}:{n}: {f.code}: {f.message} (see `kvledger verify --journal {path}`)"
                         .translate(_ESCAPES))


# Ids in a hostile file may hold newlines: escaped, a message stays one line and cannot
# forge a second coded line on stderr.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(32), 127)} | {10: "\\n", 13: "\\r", 9: "\\t"}


class _OpFacts(msgspec.Struct):
    """What a rebuilt receipt needs of an operation's events (not the events themselves)."""

    event_ids: list[str]
    first: int
    last: int
    wall_ns: int  # the commit's wall clock is not in the events; the newest observation is
    handles: dict[str, HandleResult]  # each handle as it stood after the operation


class TableDeriver:
    """Head rows, receipts and manifests as the command service would have written them,
    built one event at a time."""

    def __init__(self) -> None:
        self.states: dict[str, HandleState] = {}
        self.kv: dict[str, tuple[int, int, int]] = {}  # KV-event streams' heads (replay.kv_blocks.kv_head)
        self.ops: dict[str, _OpFacts] = {}
        self.manifests: dict[str, bytes] = {}

    def add(self, e: ev.Event, after: HandleState | None = None) -> None:
        """Fold `e` in; `after` is the handle's state after it when the caller has it."""
        if isinstance(e, ev.KV_EVENT_CLASSES):
            head = self.kv[e.stream_id] = kv_head(self.kv.get(e.stream_id), e)  # type: ignore[arg-type]  # narrowed by the tuple
            result = HandleResult(e.stream_id, head[0], head[1], head[2], 0)
        else:
            s = self.states[e.stream_id] = after if after is not None else evolve(self.states.get(e.stream_id), e)
            result = HandleResult(s.handle_id, s.generation, s.snapshot_version, s.stream_position,
                                  s.committed_length)
        if isinstance(e, ev.RequestAllocateEvent):
            self.manifests.setdefault(e.payload.manifest_sha256, canonical_json(e.payload.manifest))
        if e.operation_id is None:
            return
        op = self.ops.get(e.operation_id)
        if op is None:
            op = self.ops[e.operation_id] = _OpFacts([], e.global_position, e.global_position, 0, {})
        op.event_ids.append(e.event_id)
        op.last = e.global_position
        op.wall_ns = max(op.wall_ns, e.observed_wall_time)
        op.handles[e.stream_id] = result

    def result(self) -> ImportTables:
        heads = {h: head_facts(s) for h, s in self.states.items()}
        heads.update((sid, kv_head_facts(sid, head)) for sid, head in self.kv.items())
        receipts = [Receipt(operation_id=op_id, fingerprint=IMPORTED_FINGERPRINT,
                            handles=tuple(op.handles.values()), event_ids=tuple(op.event_ids),
                            first_global_position=op.first, last_global_position=op.last,
                            committed_wall_ns=op.wall_ns)
                    for op_id, op in self.ops.items()]
        return ImportTables(heads, receipts, list(self.manifests.items()))


def derive_tables(events: Iterable[ev.Event]) -> tuple[dict[str, HeadFacts], list[Receipt],
                                                        list[tuple[str, bytes]]]:
    """Head rows, receipts and manifests as the command service would have written them."""
    tables = TableDeriver()
    for e in events:
        tables.add(e)
    t = tables.result()
    return dict(t.heads), list(t.receipts), list(t.manifests)
