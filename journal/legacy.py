"""Record formats 1 to 6, read-only: the journal writes format 7 (journal.record_format)
and reads every older record through here, as the code of its day read it.

1: zlib; 2: zstd, receipts as JSON; 3: compact receipts (journal.readback); 4: 3, and a
decode chain's fingerprint derived from its events. Formats 1 to 4 keep their lists in a
msgpack header (`Header4`). Format 5 moved the lists inside the zstd frame, the frame
format 7 still has (journal.record_format reads it); its items are events' JSON alone
(`audit_events`). Format 6 stored decode steps as msgpack rows, one an item
(journal.step_rows.Step, read by `RowReader`); its records are audited with format 7's,
which holds the same items plus blocks.

`pack_header4` writes formats 2 to 4 for tests that forge an old record; the journal never
calls it.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

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
from kvledger.journal.step_rows import ROW_ERRORS, _decode_row, _decode_step, decode_context
from kvledger.journal.step_values import _HALF, _MASK, StepColumns, StepRun, StepValues
from kvledger.schemas import events as ev

if TYPE_CHECKING:
    import numpy as np  # imported where a run is read: the API's import loads no numpy


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
    assert isinstance(reader, RowReader)  # audit_items reads a format 6 record with one
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


class RowReader(StepReader):
    """A format 6 record's reader: its step rows (journal.step_rows.Step, msgpack, one an
    item) as StepReader reads format 7's blocks."""

    def events(self, row: bytes, at: int) -> tuple[ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent]:
        """The three events of `row`, whose publication is the record's event `at`
        (counted from 0). Raises ValueError or msgspec's errors for a row that does not
        rebuild."""
        return self.values(row, at).events()

    def values(self, row: bytes, at: int) -> StepValues:
        """The values of a format 6 `row` (see events), its differences resolved."""
        return self._values(_decode_step(row), at)

    def run(self, rows: list[bytes], at: int, columns: bool = True) -> StepRun:
        """Consecutive rows of the record, the first its event `at`, read together: with
        `columns`, their columns for a fold and their values on request; otherwise their
        values now. Raises BadRow for the first row that does not rebuild."""
        start, ctx = self._last, self.context
        if columns:
            try:
                cols, self._last, event_id = self._columns(rows)
            except ROW_ERRORS:
                pass  # not in the columns' form (a difference stored unsigned, say) or damaged: row by row
            else:
                again = self._at(start)
                return StepRun(ctx.first_position + at, len(rows), cols, event_id,
                               lambda: [again.values(row, at + 3 * i) for i, row in enumerate(rows)])
        # Row by row, which names a damaged row as a single read would.
        values: list[StepValues] = []
        for i, row in enumerate(rows):
            try:
                values.append(self.values(row, at + 3 * i))
            except ROW_ERRORS as exc:
                raise BadRow(i, values, exc) from None
        return StepRun(ctx.first_position + at, len(rows), None, values[-1].event_id, values)

    def _columns(self, rows: list[bytes]) -> tuple[StepColumns, tuple[int, int, int, int, int, int, int], str]:
        """What `values` gives for each row, as columns of what a fold reads, the reader's
        state after the last row and its event id. Raises what `values` would (a value
        out of int64, the columns' range or a clock past int64 also raises: `run` then reads row by row)."""
        import numpy as np

        ctx, last, n = self.context, self._last, len(rows)
        cols = list(zip(*map(_decode_row, rows)))
        nstreams, nprefixes = len(ctx.streams), len(ctx.prefixes)
        (ptxn_prefix, ptxn), (stxn_prefix, stxn) = zip(*cols[8]), zip(*cols[9])
        calls = [c for c in cols[18] if c is not None]
        _check(cols[5], nprefixes)
        if calls:
            _check([c.prefix for c in calls], nprefixes)
        a, i64 = np.array, np.int64
        mono = _running(a(cols[3], i64), last[1])
        if int(mono.max()) >= _HALF:  # a clock a fold cannot hold in int64: read row by row
            raise OverflowError("a monotonic clock past int64")
        ptxn_n, stxn_n = _running(a(ptxn, i64), last[4]), _running(a(stxn, i64), last[5])
        op = (last[3] + sum(cols[6])) & _MASK
        wall = (last[2] + sum(cols[3]) + sum(cols[4])) & _MASK
        state = ((last[0] + 3 * n + sum(cols[2])) & _MASK, int(mono[-1]), wall, op, int(ptxn_n[-1]), int(stxn_n[-1]),
                 (last[6] + sum(c.counter for c in calls)) & _MASK)
        columns = StepColumns(
            _indexes(cols[0], nstreams), a(cols[1], i64), mono.view(i64), a(cols[10], i64), a(cols[11], i64),
            a(cols[14], i64), a(cols[17], i64), _indexes(ptxn_prefix, nprefixes), ptxn_n,
            _indexes(stxn_prefix, nprefixes), stxn_n, ctx.streams, ctx.prefixes)
        gaps = cols[7][-1]
        return columns, state, f"{ctx.prefixes[cols[5][-1]]}{(op + gaps[0] + gaps[1] + gaps[2]) & _MASK:016x}"


def _check(values: Sequence[int], size: int) -> bool:
    """Whether `values` index a list of `size` as a list index takes them (negative
    from the end): IndexError for one out of range, as the list would raise; False
    when one is negative."""
    if not values:
        return True
    low = min(values)
    if low < -size or max(values) >= size:
        raise IndexError("a row's index is out of its record's table")
    return low >= 0


def _indexes(values: Sequence[int], size: int) -> np.ndarray:
    """`values` as indexes into a list of `size` (checked by `_check`), none negative."""
    import numpy as np

    a = np.array(values, np.int64)
    return a if _check(values, size) else a % size


def _running(diffs: np.ndarray, start: int) -> np.ndarray:
    """Values stored as differences from the one before, the first from `start`, modulo
    2**64 (uint64 sums wrap exactly so)."""
    import numpy as np

    values = diffs.view(np.uint64)  # in place: the caller's array is its own
    values[:1] += np.uint64(start)  # an array's sum wraps silently; a scalar's warns
    return values.cumsum(out=values)
