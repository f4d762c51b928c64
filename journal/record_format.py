"""The record format the journal writes, 7, and the frame it shares with formats 5 and 6.

A record is a msgpack header (`Frame`: the format, how many items and receipts) around a
zstd frame holding each item's and then each receipt's length (little-endian uint32),
then their CRC-32s, then their bytes; like items' lengths repeat, so zstd stores the lists
in next to nothing. An item is an event's canonical JSON or a block of decode steps
(journal.blocks; format 6 stored a row a step, journal.legacy); after the compact receipts
(journal.readback) of the operations stored as events comes the record's Context
(journal.step_rows). A block is one item with one CRC; when it fails, the block's CRC
column names the first damaged step. Each record's chain digest is SHA-256(previous
record's chain || SHA-256(body)): a changed byte anywhere breaks the chain there, and the
CRCs name the first event (or step) whose bytes changed.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import zstandard

from kvledger.journal import inflate
from kvledger.journal.inflate import compress, decompressor
from kvledger.journal.legacy import RowReader, pack_header4, row_run
from kvledger.journal.readback import FORMATS, Damage, Record, RecordParts, Steps, cut, partial_run
from kvledger.journal.step_reader import BadRow, StepReader, block_runs
from kvledger.journal.step_rows import MARK, ROW_ERRORS
from kvledger.schemas.errors import ErrorCode, KvLedgerError

# 7: format 6 (journal.legacy) with a run of decode steps as one block of columns. Every
# record is written in it, with its Context whether or not it holds a step.
FORMAT = 7
GENESIS = bytes(32)  # the chain before the first record


class Frame(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Formats 5 to 7: the lists travel inside the frame, which holds each event's and then each
    receipt's length (little-endian uint32), then their CRC-32s, then their bytes. Lengths
    of like events repeat, so zstd stores them in far less than the header's msgpack lists
    took (the CRCs, random, cost the same either way)."""

    format: int
    events: int
    receipts: int
    data: bytes  # zstd


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Frame).decode
_FORMAT5 = b"\x94\x05"  # a msgpack array of four whose first item is 5: Frame's start
_FORMAT6 = b"\x94\x06"  # formats 6 and 7 have format 5's header
_FORMAT7 = b"\x94\x07"
_MARK = bytes([MARK])


def encode_record(events: Sequence[bytes], receipts: Sequence[bytes], fmt: int) -> bytes:
    """A record of `fmt` with the receipts in its stored form (3 and later: compact_receipt;
    6 and 7: then the Context). The journal writes FORMAT; tests forge the others."""
    crc = zlib.crc32
    return pack_record(RecordParts(
        fmt, list(map(len, events)), list(map(crc, events)), list(map(len, receipts)), list(map(crc, receipts)),
        b"".join([*events, *receipts])))  # one join: `+` copies the record's MBs again


def pack_record(p: RecordParts) -> bytes:
    """The stored bytes of `p` (a zstd format: 2 and later), its lists taken as given (a
    forger's CRCs too)."""
    if p.format < 2:
        raise ValueError(f"format {p.format} is zlib's: pack_record writes zstd records")
    if p.format >= 5:
        lists = [*p.event_lengths, *p.receipt_lengths, *p.event_crcs, *p.receipt_crcs]
        if 4 * len(lists) + len(p.data) > inflate.MAX_RECORD_BYTES:  # every reader refuses it: never write one
            raise KvLedgerError(ErrorCode.FIELD_TOO_LARGE, f"a commit of {len(p.data)} bytes, over the "
                                f"{inflate.MAX_RECORD_BYTES} a record holds: commit it in parts")
        frame = struct.pack(f"<{len(lists)}I", *lists) + p.data
        return _encode(Frame(p.format, len(p.event_lengths), len(p.receipt_lengths), compress(frame)))
    return pack_header4(p)


def chain(previous: bytes, body: bytes) -> bytes:
    return hashlib.sha256(previous + hashlib.sha256(body).digest()).digest()


def frame_parts(body: bytes) -> tuple[RecordParts, str | None] | Damage | None:
    """A format 5 to 7 record's parts (see journal.audit's parts); None: no such frame."""
    if body[:1] == b"\x94" and len(body) > 1 and body[1:2] not in (b"\x05", b"\x06", b"\x07") and body[1] < 0x80:
        # the header of format 5 and later, of a format this code does not know
        return Damage(None, f"record format {body[1]}, this kvledger reads {', '.join(map(str, FORMATS))}")
    if body[:2] in (_FORMAT5, _FORMAT6, _FORMAT7):
        try:
            h5 = _decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Damage(None, f"unreadable header: {exc}")
        k = h5.events + h5.receipts
        try:
            size = zstandard.frame_content_size(h5.data)
        except zstandard.ZstdError:
            size = -1
        if h5.events < 0 or h5.receipts < 0 or size < 9 * k:
            return Damage(None, "its header's counts do not fit its data")
        if size > inflate.MAX_RECORD_BYTES:
            return Damage(None, f"its data states {size} bytes, more than a record holds ({inflate.MAX_RECORD_BYTES})")
        if size > inflate.INFLATE_AT_ONCE:
            return _streamed5(h5, size)
        raw, problem = inflate.at_once(h5.format, h5.data, size, decompressor())
        if len(raw) < 8 * k:
            return Damage(None, problem or "its data ends inside its lists")
        lists = list(struct.unpack_from(f"<{2 * k}I", raw))
        e = h5.events
        bad = None if problem else inflate.item_limits(lists[:k], "lists")
        if bad is not None:
            return Damage(None, bad)
        return RecordParts(h5.format, lists[:e], lists[k:k + e], lists[e:k], lists[k + e:], raw[8 * k:]), problem
    return None


def _streamed5(h5: Frame, size: int) -> tuple[RecordParts, str | None] | Damage:
    """A format 5 to 7 frame too large to inflate at once: its lists first, checked
    against the format's limits and the size it states, then its items one at a time."""
    inf = inflate.Inflater(h5.format, h5.data)
    k, e = h5.events + h5.receipts, h5.events
    lists = inflate.read_lists(inf, k, size)
    if isinstance(lists, str):
        return Damage(None, lists)
    data, problem = inflate.read_items(inf, lists[:k], lists[k:])
    return RecordParts(h5.format, lists[:e], lists[k:k + e], lists[e:k], lists[k + e:], data), problem


_BLOCK_LISTS = struct.Struct("<4I")  # a one-block record's lists: the block's length, the context's, their CRCs


def block_records(bodies: Sequence[bytes], fold: bool = False) -> list[Record | None]:
    """decode_record of each body that a commit of decode steps alone writes (a block and
    its context, in format 7), None for the others and for anything amiss in one, which
    decode_record then reads and names. The blocks of one shape are read together, a few
    array calls for all of them (journal.step_reader.block_runs), and without the general
    path's lists and loops: replay's cost is per record, so reading records together pays."""
    found: list[Record | None] = [None] * len(bodies)
    parts = [(i, *x) for i, body in enumerate(bodies) if (x := _block_parts(body)) is not None]
    if not parts:
        return found
    from kvledger.journal import blocks  # numpy: only where a block is read

    shapes: dict[tuple[int, bytes], list[tuple[int, bytes, StepReader]]] = {}
    for i, item, reader in parts:
        shapes.setdefault((len(item), item[:blocks.HEADER]), []).append((i, item, reader))
    for group in shapes.values():
        try:
            m, digests = blocks.read_many([item for _, item, _ in group])
        except ValueError:
            continue  # decode_record names what is wrong
        runs = block_runs([reader for _, _, reader in group], m, digests, [0] * len(group), fold)
        for (i, item, reader), run in zip(group, runs):
            if run is not None:
                steps = Steps([item], reader)
                steps.add(0, 1, run)
                found[i] = Record(None, [], compact=True, steps=steps)
    return found


def _block_parts(body: bytes) -> tuple[bytes, StepReader] | None:
    """A one-block record's block and its context's reader, its CRCs checked; or None."""
    if body[:2] != _FORMAT7:
        return None
    try:
        h = _decode(body)
        size = zstandard.frame_content_size(h.data)
        if h.events != 1 or h.receipts != 1 or not 16 <= size <= inflate.INFLATE_AT_ONCE:
            return None
        raw = decompressor().decompress(h.data, allow_extra_data=False)
        length, rest, crc, crc_rest = _BLOCK_LISTS.unpack_from(raw)
        item, context = raw[16:16 + length], raw[16 + length:]
        if (len(raw) != 16 + length + rest or item[:1] != _MARK or zlib.crc32(item) != crc
                or zlib.crc32(context) != crc_rest):
            return None
        return item, StepReader(context)
    except (msgspec.DecodeError, msgspec.ValidationError, zstandard.ZstdError, struct.error, *ROW_ERRORS):
        return None


_BRACE = ord("{")


class _Items(NamedTuple):
    """A format 6 or 7 record's items cut and CRC-checked: what each step of audit_items reads."""

    parts: list[bytes]  # its items, receipts and Context, cut at their stated lengths
    ok: list[bool]  # each part's length and CRC hold
    firsts: bytes  # each item's first byte: "{" an event's JSON, MARK a block, else a row
    steps: Steps
    reader: StepReader | None  # the Context's; None: it is damaged, `unread` says how
    unread: str
    problem: str | None  # what inflating the record found
    fold: bool


def _checked_parts(h: RecordParts, problem: str | None) -> tuple[list[bytes], list[bool], int]:
    """The record's parts (its items, receipts, then its Context), whether each one's
    length and CRC hold, and the bytes they state; all CRCs at once when nothing is amiss."""
    lengths, crcs = h.event_lengths + h.receipt_lengths, h.event_crcs + h.receipt_crcs
    parts, total = cut(h.data, lengths), sum(lengths)
    if problem is None and len(h.data) == total and list(map(zlib.crc32, parts)) == crcs:
        return parts, [True] * len(parts), total
    return parts, [len(p) == k and zlib.crc32(p) == c for p, k, c in zip(parts, lengths, crcs)], total


def _context_reader(fmt: int, context: bytes, ok: bool, problem: str | None) -> tuple[StepReader | None, str]:
    """The reader of a record's Context (format 6's rows: a RowReader), or None and why
    not, which the first step item (or the record) is then blamed for."""
    if not ok:
        return None, problem or "its context's bytes do not match their CRC"
    try:
        return (StepReader if fmt == 7 else RowReader)(context), ""
    except ROW_ERRORS as exc:
        return None, f"its context does not decode: {exc}"


def _audit_block(a: _Items, reader: StepReader, i: int, index: int) -> tuple[int, int] | Damage:
    """Format 7's block at item `i`, its first event at `index`, read into the steps: the
    next event's index and item, or the damage, at the first bad step the CRC column or
    the rebuild names (the steps before it kept)."""
    if a.firsts[i] != MARK:
        return Damage(index, "a format 7 record's step item is no block", a.steps.json(i))
    if not a.ok[i]:  # the CRC column names the step
        exact, k = reader.damaged_block(a.parts[i], index)
        if exact:
            a.steps.add(i, i + 1, partial_run(exact))
        return Damage(index + 3 * k, a.problem or "its bytes do not match their CRC", a.steps.json(i + 1))
    try:
        run = reader.block(a.parts[i], index, a.fold)
    except BadRow as bad:
        if bad.values:
            a.steps.add(i, i + 1, partial_run(bad.values))
        return Damage(index + 3 * bad.offset, f"its step does not rebuild: {bad.error}", a.steps.json(i + 1))
    a.steps.add(i, i + 1, run)
    return index + 3 * run.count, i + 1


def _audit_rows(a: _Items, reader: StepReader, i: int, index: int) -> tuple[int, int] | Damage:
    """Format 6's rows from item `i` to the next JSON event or bad CRC, read as one run
    (journal.legacy.row_run): the next event's index and item, or the damage."""
    if not a.ok[i]:
        return Damage(index, a.problem or "its bytes do not match their CRC", a.steps.json(i))
    n = len(a.firsts)
    j = a.firsts.find(b"{", i + 1)
    j = n if j < 0 else j
    if False in a.ok[i:j]:
        j = a.ok.index(False, i, j)
    found = row_run(reader, a.steps, a.parts, (i, j), index, a.fold)
    return found if isinstance(found, Damage) else (found, j)


def _audit_steps(a: _Items, blocks: bool) -> Damage | None:
    """Every item in order, so that the damage named is the first bad item's: an event's
    JSON by its CRC, a run of steps by its reader."""
    step = _audit_block if blocks else _audit_rows
    index = i = 0
    while i < len(a.firsts):
        if a.firsts[i] == _BRACE:
            if not a.ok[i]:
                return Damage(index, a.problem or "its bytes do not match their CRC", a.steps.json(i))
            index, i = index + 1, i + 1
            continue
        if a.reader is None:
            return Damage(index, a.unread, a.steps.json(i))
        found = step(a, a.reader, i, index)
        if isinstance(found, Damage):
            return found
        index, i = found
    return None


def audit_items(h: RecordParts, problem: str | None, eager: bool, fold: bool) -> Record | Damage:
    """A format 6 or 7 record's items audited (see journal.audit.audit_record): events'
    JSON, blocks (7) or rows (6), then the compact receipts and the Context."""
    n = len(h.event_lengths)
    if not h.receipt_lengths:
        return Damage(None, f"a format {h.format} record without its context")
    parts, ok, total = _checked_parts(h, problem)
    reader, why = _context_reader(h.format, parts[-1], ok[-1], problem)
    steps = Steps(parts[:n], reader)  # type: ignore[arg-type]  # used only once a row needs it
    firsts = bytes([p[0] if p else 0 for p in parts[:n]])
    blocks = h.format == 7
    damage = _audit_steps(_Items(parts, ok, firsts, steps, reader, why, problem, fold), blocks)
    if damage is not None:
        return damage
    if not blocks and not steps.runs:  # format 6 was written only for a record with a step row
        return Damage(None, "a format 6 record without a step row", steps.json())
    if not all(ok[n:-1]):
        return Damage(None, problem or "a receipt's bytes do not match their CRC", steps.json())
    if reader is None:
        return Damage(None, why, steps.json())
    if problem is not None or len(h.data) != total:
        return Damage(None, problem or f"{len(h.data) - total} bytes after its context", steps.json())
    compact = parts[n:-1]
    if eager:
        expanded = steps.receipts(compact)
        if isinstance(expanded, str):
            return Damage(None, f"its receipts do not fit its events: {expanded}", steps.json())
        return Record(None, expanded, steps=steps)
    return Record(None, compact, compact=True, steps=steps)
