"""Reading a stored record of any format: its parts (`unpack_record`), its audit
(`audit_record`: its events and receipts, or the Damage found, named by the first event
whose bytes changed) and the readers' answer (`decode_record`: a damaged record is
CORRUPT_JOURNAL). Format 7 is journal.record_format's, 1 to 6 journal.legacy's.
"""

from __future__ import annotations

from kvledger.journal.legacy import audit_events, header4_parts
from kvledger.journal.readback import Damage, Record, RecordParts
from kvledger.journal.record_format import audit_items, block_records, frame_parts
from kvledger.schemas.errors import ErrorCode, KvLedgerError


def parts(body: bytes) -> tuple[RecordParts, str | None] | Damage:
    """The record's parts (its data as far as it inflates), with what is wrong with its
    compressed stream (None: nothing), or the damage that leaves no list to check. What
    is inflated is bounded by the format's limits (journal.inflate), checked first."""
    found = frame_parts(body)
    return header4_parts(body) if found is None else found


def unpack_record(body: bytes) -> RecordParts:
    """`body` taken apart (zstd formats, undamaged); see audit_record for the checks."""
    found = parts(body)
    if isinstance(found, Damage) or found[1] is not None:
        raise ValueError(f"not an undamaged zstd record: {found}")
    return found[0]


def audit_record(body: bytes, eager: bool = True, fold: bool = False) -> Record | Damage:
    """The record's events and receipts (a format 3 to 6 record's receipts rebuilt now
    unless not `eager`; with `fold`, a format 6 record's runs as columns too), or the
    damage found."""
    found = parts(body)
    if isinstance(found, Damage):
        return found
    h, problem = found
    if h.format >= 6:
        return audit_items(h, problem, eager, fold)
    return audit_events(h, problem, eager)


def decode_record(body: bytes, where: str, fold: bool = False) -> Record:
    """A stored record's events and receipts; a damaged one is CORRUPT_JOURNAL (the
    readers' answer: `verify` names what changed). With `fold`, its runs of step rows
    are read as columns too (StepRun.columns), for a projector."""
    found = block_records([body], fold)[0] or audit_record(body, eager=False, fold=fold)
    if isinstance(found, Damage):
        raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL,
                            f"the record {where} is damaged: {found.message} (run `kvledger verify`)")
    return found


def operation_ids(body: bytes) -> set[str] | None:
    """The operation ids of a stored record's events (None: a damaged record)."""
    found = record_ids(body)
    return None if found is None else found[1]


def record_ids(body: bytes) -> tuple[set[str], set[str]] | None:
    """The event ids and the operation ids of a stored record's events (None: a damaged
    record)."""
    found = audit_record(body, eager=False)
    return None if isinstance(found, Damage) else found.ids()


def record_streams(body: bytes) -> list[str] | None:
    """Record.streams of a stored record (None: a damaged record)."""
    found = audit_record(body, eager=False)
    return None if isinstance(found, Damage) else found.streams()
