"""Record formats 1 to 6, read-only: the journal writes format 7 (journal.record_format)
and reads every older record through here, as the code of its day read it.

1: zlib; 2: zstd, receipts as JSON; 3: compact receipts (journal.readback); 4: 3, and a
decode chain's fingerprint derived from its events. Formats 1 to 4 keep their lists in a
msgpack header (`Header4`). Format 5 moved the lists inside the zstd frame, the frame
format 7 still has (journal.record_format reads it); its items are events' JSON alone
(`audit_events`). Format 6 stored decode steps as msgpack rows, one an item
(journal.step_rows.Step, read by journal.step_reader.StepReader.run); its records are
audited with format 7's, which holds the same items plus blocks.

`pack_header4` writes formats 2 to 4 for tests that forge an old record; the journal never
calls it.
"""

from __future__ import annotations

import zlib

import msgspec

from kvledger.journal import inflate
from kvledger.journal.inflate import compress, decompressor
from kvledger.journal.readback import (
    FORMATS,
    Damage,
    Record,
    RecordParts,
    Steps,
    cut,
    expand_receipts,
    partial_run,
)
from kvledger.journal.step_reader import BadRow, StepReader
from kvledger.journal.step_rows import ROW_ERRORS, decode_context


class Header4(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The header of formats 1 to 4."""

    format: int
    event_lengths: list[int]
    event_crcs: list[int]
    receipt_lengths: list[int]
    receipt_crcs: list[int]
    data: bytes  # the events' bytes, then the receipts', compressed (format 1: zlib; 2 and 3: zstd)


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Header4).decode


def pack_header4(p: RecordParts) -> bytes:
    """A format 2 to 4 record of `p`, its lists taken as given (tests forge old records)."""
    return _encode(Header4(p.format, p.event_lengths, p.event_crcs, p.receipt_lengths, p.receipt_crcs,
                           compress(p.data)))


def header4_parts(body: bytes) -> tuple[RecordParts, str | None] | Damage:
    """A format 1 to 4 record's parts (see journal.audit's parts)."""
    try:
        h = _decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return Damage(None, f"unreadable header: {exc}")
    if h.format not in FORMATS:
        return Damage(None, f"record format {h.format}, this kvledger reads {', '.join(map(str, FORMATS))}")
    if h.format >= 5:
        return Damage(None, f"a format {h.format} record with the header of format 4 and before")
    counts = (len(h.event_lengths), len(h.event_crcs), len(h.receipt_lengths), len(h.receipt_crcs))
    if counts[0] != counts[1] or counts[2] != counts[3]:
        return Damage(None, "header lists do not match")
    lengths = h.event_lengths + h.receipt_lengths
    too_much = inflate.item_limits(lengths, "header lists")
    if too_much is not None:
        return Damage(None, too_much)
    if sum(lengths) > inflate.INFLATE_AT_ONCE:
        data, problem = inflate.read_items(inflate.Inflater(h.format, h.data), lengths, h.event_crcs + h.receipt_crcs)
    else:
        data, problem = inflate.at_once(h.format, h.data, sum(lengths), decompressor())
    return RecordParts(h.format, h.event_lengths, h.event_crcs, h.receipt_lengths, h.receipt_crcs, data), problem


def audit_events(h: RecordParts, problem: str | None, eager: bool) -> Record | Damage:
    """A format 1 to 5 record (events' JSON and receipts alone) audited: see audit_record."""
    data = h.data
    if problem is None and len(data) == sum(h.event_lengths) + sum(h.receipt_lengths):
        # Every slice is whole: cut and check them in bulk (a replay reads every event
        # through here); the loop below names what fails.
        parts = cut(data, h.event_lengths + h.receipt_lengths)
        if list(map(zlib.crc32, parts)) == h.event_crcs + h.receipt_crcs:
            split = len(h.event_lengths)
            return _record(h.format, parts[:split], parts[split:], eager)
    events: list[bytes] = []
    at = 0
    for i, (n, c) in enumerate(zip(h.event_lengths, h.event_crcs)):
        e = data[at:at + n]
        if len(e) < n or zlib.crc32(e) != c:
            return Damage(i, problem or "its bytes do not match their CRC", events)
        events.append(e)
        at += n
    receipts: list[bytes] = []
    for n, c in zip(h.receipt_lengths, h.receipt_crcs):
        r = data[at:at + n]
        if len(r) < n or zlib.crc32(r) != c:
            return Damage(None, problem or "a receipt's bytes do not match their CRC", events)
        receipts.append(r)
        at += n
    if problem or at != len(data):
        return Damage(None, problem or f"{len(data) - at} bytes after the last receipt", events)
    return _record(h.format, events, receipts, eager)


def _record(fmt: int, events: list[bytes], receipts: list[bytes], eager: bool) -> Record | Damage:
    # The format byte is what the CRCs do not cover: a record read as another format's (a
    # format 7 block read as a format 5 event) is named here, not exported as an event.
    bad = next((i for i, e in enumerate(events) if e[:1] != b"{"), None)
    if bad is not None:
        return Damage(bad, f"its event is no JSON object: not a format {fmt} record", events[:bad])
    if fmt >= 3 and eager:
        expanded = expand_receipts(receipts, events)
        if isinstance(expanded, str):
            return Damage(None, f"its receipts do not fit its events: {expanded}", events)
        return Record(events, expanded)
    if fmt == 5 and receipts and _is_context(receipts[-1]):  # a format 7 record relabelled 5 (same frame)
        return Damage(None, "its last receipt is a record's Context: not a format 5 record", events)
    return Record(events, receipts, compact=fmt >= 3)


def row_run(reader: StepReader, steps: Steps, items: list[bytes], span: tuple[int, int], index: int,
            fold: bool) -> int | Damage:
    """Format 6: the rows items[i:j] (span), whose CRCs held, read as one run into `steps`;
    the index of the event after them, or the damage (the steps before it kept)."""
    i, j = span
    try:
        run = reader.run(items[i:j], index, fold)
    except BadRow as bad:
        if bad.values:
            steps.add(i, i + bad.offset, partial_run(bad.values))
        return Damage(index + 3 * bad.offset, f"its step row does not rebuild: {bad.error}",
                      steps.json(i + bad.offset))
    steps.add(i, j, run)
    return index + 3 * (j - i)


def _is_context(item: bytes) -> bool:
    try:
        decode_context(item)
    except ROW_ERRORS:
        return False
    return True
