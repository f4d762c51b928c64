"""Records: the journal's stored form since revision 0003, one row per commit.

A record holds the commit's events as the canonical JSON bodies the one-row-per-event
layout stored (the same bytes, so readers, `verify` and `export` see exactly what they
saw before) and the commit's receipts, compressed together. Compression does what a
columnar encoding would, at a fraction of the code: a batch of decode chains repeats
every field name and most values, and 2.5 KB of JSON per decoded token stores in about
270 bytes (zlib level 1, the fastest; see docs/PERFORMANCE.md).

Tamper evidence (issue 17): each event and receipt carries a CRC-32 of its own bytes in
the record's header, and each record a chain digest, SHA-256(previous record's chain ||
SHA-256(body)). A changed byte anywhere in a record breaks the chain there; its CRCs
name the first event whose bytes changed. The chain costs 32 bytes a commit.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence

import msgspec

from kvledger.schemas.errors import ErrorCode, KvLedgerError

FORMAT = 1
GENESIS = bytes(32)  # the chain before the first record
LEVEL = 1


class _Header(msgspec.Struct, array_like=True, frozen=True, gc=False):
    format: int
    event_lengths: list[int]
    event_crcs: list[int]
    receipt_lengths: list[int]
    receipt_crcs: list[int]
    data: bytes  # zlib of the events' bytes, then the receipts'


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Header).decode


class Record(msgspec.Struct, frozen=True, gc=False):
    events: list[bytes]
    receipts: list[bytes]


class Damage(msgspec.Struct, frozen=True):
    """What an audit found wrong in one stored record: `index` is the first event whose
    bytes are not what was committed (None: the record as a whole, e.g. its header);
    `events` are the ones before it, still exact."""

    index: int | None
    message: str
    events: list[bytes] = []


def encode_record(events: Sequence[bytes], receipts: Sequence[bytes]) -> bytes:
    crc = zlib.crc32
    return _encode(_Header(
        FORMAT, [len(e) for e in events], [crc(e) for e in events],
        [len(r) for r in receipts], [crc(r) for r in receipts],
        zlib.compress(b"".join(events) + b"".join(receipts), LEVEL)))


def chain(previous: bytes, body: bytes) -> bytes:
    return hashlib.sha256(previous + hashlib.sha256(body).digest()).digest()


def stable_key(value: str) -> int:
    """A signed 64-bit key for an id (a stream or operation id) in the records' lookup
    tables: 8 bytes a row where the id itself would take 32 or more. Two ids may share a
    key; a lookup reads the records it names and keeps the exact id."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little", signed=True)


def decode_record(body: bytes, where: str) -> Record:
    """A stored record's events and receipts; a damaged one is CORRUPT_JOURNAL (the
    readers' answer: `verify` names what changed)."""
    found = audit_record(body)
    if isinstance(found, Damage):
        raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL,
                            f"the record {where} is damaged: {found.message} (run `kvledger verify`)")
    return found


def audit_record(body: bytes) -> Record | Damage:
    try:
        h = _decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return Damage(None, f"unreadable header: {exc}")
    if h.format != FORMAT:
        return Damage(None, f"record format {h.format}, this kvledger reads {FORMAT}")
    counts = (len(h.event_lengths), len(h.event_crcs), len(h.receipt_lengths), len(h.receipt_crcs))
    if counts[0] != counts[1] or counts[2] != counts[3] or min(h.event_lengths + h.receipt_lengths, default=0) < 0:
        return Damage(None, "header lists do not match")
    data, problem = _inflate(h.data)
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
    return Record(events, receipts)


def _inflate(data: bytes) -> tuple[bytes, str | None]:
    """The decompressed bytes, and what is wrong with the stream (None: nothing)."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(data)
        if d.eof and not d.unused_data:
            return out, None
        return out, "compressed data ends early or has trailing bytes"
    except zlib.error:
        pass
    # Damaged: what inflates before the damage is still exact, so the first event it
    # does not reach whole is the one named. Inflate in small steps to keep that much.
    d, parts = zlib.decompressobj(), []
    try:
        for i in range(0, len(data), 64):
            parts.append(d.decompress(data[i:i + 64]))
    except zlib.error as exc:
        return b"".join(parts), f"compressed data damaged ({exc})"
    return b"".join(parts), "compressed data damaged"
