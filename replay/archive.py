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
from pathlib import Path

import msgspec

from engine.evolve import evolve
from engine.service import _head as head_facts  # the head row exactly as the service writes it
from engine.state import HandleState
from journal.contract import HeadFacts, Journal
from replay.sources import decode_line, jsonl_bodies
from replay.verify import verify_bodies
from schemas import events as ev
from schemas.canonical import canonical_json
from schemas.errors import ErrorCode, KvLedgerError
from schemas.receipts import HandleResult, Receipt

IMPORTED_FINGERPRINT = "imported"


class ImportSummary(msgspec.Struct, frozen=True):
    events: int
    handles: int
    receipts: int
    manifests: int


def export_jsonl(journal: Journal, out: str | Path, progress=None) -> int:
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


def _write(journal: Journal, f, progress) -> int:
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
    """Load an exported file into an empty journal, all or nothing. The file must pass
    `verify` first: a journal database is the source of truth, so a corrupt file is
    refused (CORRUPT_JOURNAL) rather than made authoritative."""
    rows = list(jsonl_bodies(path))
    events = [(decode_line(path, n, body), body) for n, body in rows]
    findings = verify_bodies(rows).findings
    if findings:
        f = findings[0]
        where = f"line {f.line}" if f.line is not None else f"position {f.global_position}"
        raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL,
                            f"{path}: {len(findings)} finding(s), first at {where}: {f.code}: {f.message} "
                            f"(see `kvledger verify --journal {path}`)")
    heads, receipts, manifests = derive_tables([e for e, _ in events])
    journal.import_events(events, heads, receipts, manifests)
    return ImportSummary(len(events), len(heads), len(receipts), len(manifests))


def derive_tables(events: list[ev.Event]) -> tuple[dict[str, HeadFacts], list[Receipt],
                                                    list[tuple[str, bytes]]]:
    """Head rows, receipts and manifests as the command service would have written them."""
    states: dict[str, HandleState] = {}
    ops: dict[str, list[ev.Event]] = {}
    results: dict[str, dict[str, HandleResult]] = {}
    manifests: dict[str, bytes] = {}
    for e in events:
        s = states[e.stream_id] = evolve(states.get(e.stream_id), e)
        if isinstance(e, ev.RequestAllocateEvent):
            manifests.setdefault(e.payload.manifest_sha256, canonical_json(e.payload.manifest))
        if e.operation_id is not None:
            ops.setdefault(e.operation_id, []).append(e)
            # The receipt reports each handle as it stood after the operation.
            results.setdefault(e.operation_id, {})[e.stream_id] = HandleResult(
                s.handle_id, s.generation, s.snapshot_version, s.stream_position, s.committed_length)
    heads = {h: head_facts(s) for h, s in states.items()}
    receipts = [
        Receipt(operation_id=op_id, fingerprint=IMPORTED_FINGERPRINT,
                handles=tuple(results[op_id].values()),
                event_ids=tuple(e.event_id for e in evs),
                first_global_position=evs[0].global_position,
                last_global_position=evs[-1].global_position,
                # The commit's wall clock is not in the events; the newest observation is.
                committed_wall_ns=max(e.observed_wall_time for e in evs))
        for op_id, evs in ops.items()
    ]
    return heads, receipts, list(manifests.items())
