"""Records: the journal's stored form since revision 0003, one row per commit.

A record holds the commit's events as the canonical JSON bodies the one-row-per-event
layout stored (the same bytes, so readers, `verify` and `export` see exactly what they
saw before) and the commit's receipts, compressed together. Compression does what a
columnar encoding would, at a fraction of the code: a batch of decode chains repeats
every field name and most values, and 2.5 KB of JSON per decoded token stores in about
140 bytes, receipts included. Format 2 compresses with zstd level 1: against format 1's
zlib level 1 it writes 37% fewer bytes in a fifth of the CPU time (docs/COMPACT.md);
formats 3 to 5 shrink the receipts and the header (below); formats 6 and 7 store a
decode step as values rather than three events (journal.steps, journal.blocks). Every
older format stays readable.

Tamper evidence (issue 17): each event and receipt carries a CRC-32 of its own bytes in
the record's lists (format 5: inside the frame), and each record a chain digest, SHA-256(previous record's chain ||
SHA-256(body)). A changed byte anywhere in a record breaks the chain there; its CRCs
name the first event whose bytes changed (a decode step's: its first event; in a format 7
block, the block's CRC column names the step). The chain costs 32 bytes a commit.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import zstandard

from kvledger.journal import inflate
from kvledger.journal.step_reader import BadRow, StepReader, block_runs
from kvledger.journal.step_rows import MARK, ROW_ERRORS
from kvledger.journal.step_values import StepRun, StepValues, lower_hex
from kvledger.schemas.canonical import canonical_json
from kvledger.schemas.codec import decode_event, encode_event
from kvledger.schemas.decode_fingerprint import chain_events, decode_chain_fingerprint
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import Event
from kvledger.schemas.manifest import Manifest
from kvledger.schemas.receipts import HandleResult, Receipt, receipt_encoder

# 7: 6, with a run of decode steps as one block of columns (journal.blocks), written
# when a record holds a step; 6: 5, with decode steps as msgpack rows (journal.steps);
# 5: 4, with the lengths and CRCs inside the zstd frame; 4: 3, and a decode chain's
# fingerprint derived from its events; 3: zstd, compact receipts; 2: zstd, receipts as
# JSON; 1: zlib
FORMAT = 7
EVENTS_FORMAT = 5  # what a record with no step row is written in
FORMATS = (1, 2, 3, 4, 5, 6, 7)
GENESIS = bytes(32)  # the chain before the first record
LEVEL = 1  # zstd's level 1: its higher levels cost far more CPU for a few percent
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_MANIFEST = 1 << 24


class _Header(msgspec.Struct, array_like=True, frozen=True, gc=False):
    format: int
    event_lengths: list[int]
    event_crcs: list[int]
    receipt_lengths: list[int]
    receipt_crcs: list[int]
    data: bytes  # the events' bytes, then the receipts', compressed (format 1: zlib; 2 and 3: zstd)


class _Header5(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Format 5: the lists travel inside the frame, which holds each event's and then each
    receipt's length (little-endian uint32), then their CRC-32s, then their bytes. Lengths
    of like events repeat, so zstd stores them in ~1 byte a token where the header's
    msgpack lists took ~12 (the CRCs, random, cost the same either way)."""

    format: int
    events: int
    receipts: int
    data: bytes  # zstd


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Header).decode
_decode5 = msgspec.msgpack.Decoder(_Header5).decode
_FORMAT5 = b"\x94\x05"  # a msgpack array of four whose first item is 5: _Header5's start
_FORMAT6 = b"\x94\x06"  # formats 6 and 7 have format 5's header
_FORMAT7 = b"\x94\x07"
_MARK = bytes([MARK])


class Record:
    """A record's events and receipts, each as the JSON bytes the one-row-per-event layout
    stored. A format 3 to 6 record's receipts are expanded from its events when first read
    (most reads want events only); a format 6 record's step rows are rebuilt as events
    when it is read, and as JSON only when its bytes are wanted (`decoded` needs none)."""

    __slots__ = ("_compact", "_events", "_receipts", "_steps")

    def __init__(self, events: list[bytes] | None, receipts: list[bytes], compact: bool = False,
                 steps: _Steps | None = None) -> None:
        self._events, self._receipts, self._compact, self._steps = events, receipts, compact, steps

    @property
    def events(self) -> list[bytes]:
        if self._events is None:
            assert self._steps is not None  # a record without rows has its JSON
            self._events = self._steps.json()
        return self._events

    @property
    def count(self) -> int:
        """How many events (global positions) it holds, without rebuilding a step's."""
        steps = self._steps
        if steps is None:
            return len(self.events)
        stored_as_steps = sum(end - start for start, end in zip(steps.starts, steps.ends))
        return len(steps.items) - stored_as_steps + 3 * sum(run.count for run in steps.runs)

    @property
    def step_rows(self) -> int:
        """How many of its operations are stored as step rows (format 6)."""
        return 0 if self._steps is None else sum(run.count for run in self._steps.runs)

    def decoded(self) -> list[Event]:
        """The events (decode_event's, for the ones stored as JSON)."""
        if self._steps is None:
            return [decode_event(e) for e in self.events]
        return self._steps.decoded()

    def folded(self) -> list[Event | StepRun]:
        """The events, each run of step rows as its StepRun (what a projector folds at once)."""
        if self._steps is None:
            return list(self.decoded())  # a copy: list[Event] is not list[Event | StepRun] to mypy
        return self._steps.folded()

    @property
    def receipts(self) -> list[bytes]:
        if self._compact:
            expanded = (expand_receipts(self._receipts, self.events) if self._steps is None
                        else self._steps.receipts(self._receipts))
            if isinstance(expanded, str):  # its CRCs held: a writer's fault, not a flipped byte
                raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"a record's receipts do not fit its events: "
                                                               f"{expanded} (run `kvledger verify`)")
            self._receipts, self._compact = expanded, False
        return self._receipts

    @property
    def stored_receipts(self) -> list[bytes]:
        """The receipts in the record's own form (format 3: compact, until first expanded;
        format 6: its operations' that are no step row)."""
        return self._receipts

    def ids(self) -> tuple[set[str], set[str]] | None:
        """The event ids and the operation ids of its events (None: one does not decode)."""
        keys = self._keys()
        return None if keys is None else ({k.event_id for k in keys}, {k.operation_id for k in keys})

    def streams(self) -> list[str] | None:
        """The streams its events name, in the order they first name them (None: an event
        that does not decode)."""
        if self._steps is not None:  # a step row names its stream without its events' JSON
            try:
                return list(dict.fromkeys(x.stream_id for x in self._steps.decoded(fold=True)))
            except KvLedgerError:
                return None
        keys = self._keys()
        return None if keys is None else list(dict.fromkeys(k.stream_id for k in keys))

    def stream_events(self, stream_id: str) -> list[Event]:
        """Its events of one stream, in order."""
        if self._steps is None:
            return [decode_event(e) for e in self.events if _event_keys(e).stream_id == stream_id]
        out: list[Event] = []
        for x in self._steps.decoded(fold=True):
            if x.stream_id == stream_id:
                out += x.events() if type(x) is StepValues else (x,)
        return out

    def _keys(self) -> list[_EventKeys] | None:
        try:
            return [_event_keys(e) for e in self.events]
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None


# -- compact receipts (format 3) -------------------------------------------------------
# A receipt repeats what its events hold: their ids and positions, its operation id, the
# handles it wrote and where their streams ended. Format 3 stores only what they do not
# hold: how many of the record's events are its own (operations' events follow each other
# in receipt order), the fingerprint (32 bytes when it is a SHA-256 in hex), the commit
# time and each written handle's generation, snapshot version and committed length. The
# JSON receipt is rebuilt from them, byte for byte what format 2 stored (tests/test_records.py).
# Format 4 stores no fingerprint (nil) for a decode chain in the worker's form: its three
# events determine the command, so schemas.decode_fingerprint rebuilds it (32 random
# bytes a decoded token that zstd cannot remove; docs/COMPACT.md, step 10).


class _Compact(msgspec.Struct, array_like=True, frozen=True, gc=False):
    count: int
    fingerprint: Any  # str, the 32 bytes of a SHA-256 (msgspec takes no str | bytes union), or nil: derived
    committed_wall_ns: int
    heads: list[int]  # generation, snapshot_version, committed_length of each handle, in write order


class _EventKeys(msgspec.Struct, frozen=True, gc=False):
    event_id: str
    stream_id: str
    stream_position: int
    global_position: int
    operation_id: str


_compact_decode = msgspec.msgpack.Decoder(_Compact).decode
_event_keys = msgspec.json.Decoder(_EventKeys).decode


def compact_receipt(r: Receipt, derived: bool = False) -> bytes:
    """`derived`: the fingerprint is its events' (Operation.derived), stored as nil."""
    heads = [x for h in r.handles for x in (h.generation, h.snapshot_version, h.committed_length)]
    return compact_parts(len(r.event_ids), None if derived else r.fingerprint, r.committed_wall_ns, heads)


def compact_parts(count: int, fingerprint: str | None, wall_ns: int, heads: list[int]) -> bytes:
    """compact_receipt from what it keeps: the receipt's event count, its fingerprint (None:
    derived), its wall clock, and each handle's generation, snapshot_version and
    committed_length in write order."""
    fp: str | bytes | None = fingerprint
    if fingerprint is not None and (raw := lower_hex(fingerprint, 32)) is not None:
        fp = raw  # only a lowercase hex one reads back the same
    return _encode(_Compact(count, fp, wall_ns, heads))


def expand_receipts(compact: Sequence[bytes], events: Sequence[bytes]) -> list[bytes] | str:
    """The JSON receipts of compact ones over the record's events, or what does not fit."""
    out: list[bytes] = []
    at = 0
    try:
        for c in compact:
            r = _compact_decode(c)
            own = [_event_keys(e) for e in events[at:at + r.count]]
            if r.count < 1 or len(own) != r.count:
                return f"receipt {len(out)} claims {r.count} events from event {at} of {len(events)}"
            at += r.count
            last: dict[str, int] = {}
            for e in own:
                last[e.stream_id] = e.stream_position  # dicts keep first-seen order: the write order
            if len(r.heads) != 3 * len(last):
                return f"receipt {len(out)} has heads for {len(r.heads) / 3:g} handles, its events {len(last)}"
            h = r.heads
            fp = r.fingerprint.hex() if isinstance(r.fingerprint, bytes) else r.fingerprint
            if fp is None:  # formats 4 and 5: a decode chain's, rebuilt from its three events
                chain = chain_events([decode_event(e) for e in events[at - r.count:at]])
                if chain is None:
                    return f"receipt {len(out)} marks its fingerprint derived, but its events are no decode chain"
                fp = decode_chain_fingerprint(*chain)
            if not isinstance(fp, str):
                return f"receipt {len(out)} has a fingerprint of type {type(fp).__name__}"
            out.append(receipt_encoder.encode(Receipt(
                own[0].operation_id, fp,
                tuple(HandleResult(sid, h[3 * i], h[3 * i + 1], pos, h[3 * i + 2]) for i, (sid, pos) in
                      enumerate(last.items())),
                tuple(e.event_id for e in own), own[0].global_position, own[-1].global_position,
                r.committed_wall_ns)))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return f"receipt {len(out)} is unreadable: {exc}"
    except KvLedgerError as exc:  # an event of a derived receipt that does not decode
        return f"receipt {len(out)}'s events do not decode: {exc.message}"
    if at != len(events):
        return f"{len(events) - at} events after the last receipt's"
    return out


class Damage(msgspec.Struct, frozen=True):
    """What an audit found wrong in one stored record: `index` is the first event whose
    bytes are not what was committed (None: the record as a whole, e.g. its header);
    `events` are the ones before it, still exact."""

    index: int | None
    message: str
    events: list[bytes] = []


def encode_record(events: Sequence[bytes], receipts: Sequence[bytes], fmt: int = EVENTS_FORMAT) -> bytes:
    """A record of `fmt` (2 to 5) with the receipts in its stored form (3 to 5: compact_receipt)."""
    crc = zlib.crc32
    return pack_record(RecordParts(
        fmt, list(map(len, events)), list(map(crc, events)), list(map(len, receipts)), list(map(crc, receipts)),
        b"".join([*events, *receipts])))  # one join: `+` copies the record's MBs again


class RecordParts(msgspec.Struct):
    """A record taken apart: its format, the lists (in format 5 stored inside the frame)
    and the events' and receipts' bytes, decompressed. For tests that forge records, and
    for the audit."""

    format: int
    event_lengths: list[int]
    event_crcs: list[int]
    receipt_lengths: list[int]
    receipt_crcs: list[int]
    data: bytes


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
        return _encode(_Header5(p.format, len(p.event_lengths), len(p.receipt_lengths), compress(frame)))
    return _encode(_Header(p.format, p.event_lengths, p.event_crcs, p.receipt_lengths, p.receipt_crcs,
                           compress(p.data)))


def unpack_record(body: bytes) -> RecordParts:
    """`body` taken apart (zstd formats, undamaged); see audit_record for the checks."""
    found = _parts(body)
    if isinstance(found, Damage) or found[1] is not None:
        raise ValueError(f"not an undamaged zstd record: {found}")
    return found[0]


def compress(data: bytes) -> bytes:
    # making a compressor is ~20 µs, 4x the compression of a one-step record (a batch-1 decode's)
    compressor: zstandard.ZstdCompressor = _own("compressor", lambda: zstandard.ZstdCompressor(level=LEVEL))
    return compressor.compress(data)


def pack_manifest(body: bytes) -> bytes:
    """A manifest kvl_manifests stores itself (one from `import`): zstd-compressed.
    Canonical JSON starts with `{`, never with zstd's magic or MANIFEST_REF, so every
    stored form reads back unambiguously."""
    return compress(body)


# An appended allocation's event already holds its manifest, in its record, compressed
# with its neighbours' (~100 bytes each, against ~900 alone): kvl_manifests then keeps
# only where that event is, as b"@<global position>".
MANIFEST_REF = b"@"


def manifest_ref(position: int) -> bytes:
    return b"@%d" % position


def manifest_ref_position(stored: bytes) -> int | None:
    """The event position a stored manifest refers to (None: not a reference)."""
    if not stored.startswith(MANIFEST_REF) or not stored[1:].isdigit() or len(stored) > 21:
        return None
    return int(stored[1:])


class _Manifested(msgspec.Struct):
    manifest: Manifest


class _AllocationBody(msgspec.Struct):
    payload: _Manifested


def allocation_manifest(event: bytes) -> bytes | None:
    """The canonical JSON of the manifest a request_allocate event holds, which is what
    kvl_manifests stored before (None: no manifest). An event body keeps its fields in
    declaration order, so the manifest is decoded and encoded again, not cut out."""
    try:
        return canonical_json(msgspec.json.decode(event, type=_AllocationBody).payload.manifest)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def unpack_manifest(stored: bytes) -> bytes:
    """The canonical JSON of a stored manifest, either form. A damaged compressed one
    comes back as stored: its digest no longer matches, which is what verify reports."""
    if not stored.startswith(ZSTD_MAGIC):
        return stored
    try:
        size = zstandard.frame_content_size(stored)
    except zstandard.ZstdError:
        return stored
    out, problem = inflate.at_once(2, stored, size, _decompressor()) if 0 <= size <= MAX_MANIFEST else (b"", "too long")
    return stored if problem else out


def chain(previous: bytes, body: bytes) -> bytes:
    return hashlib.sha256(previous + hashlib.sha256(body).digest()).digest()


def stable_key(value: str) -> int:
    """A signed 64-bit key for an id (a stream or operation id) in the records' lookup
    tables: 8 bytes a row where the id itself would take 32 or more. Two ids may share a
    key; a lookup reads the records it names and keeps the exact id."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little", signed=True)


# kvledger's own operation ids (engine.ids) are a 16-hex process prefix and a 16-hex
# counter. A hashed key scattered one writer's consecutive operations over the whole
# lookup B-tree, so every commit of 64 decode chains dirtied ~64 of its pages, more as the
# journal grew: ~40% of the WAL a commit wrote, and its commit time grew with the journal
# (docs/COMPACT.md, step 6). Keyed by the prefix's hash and then the counter, a writer's
# operations land at one end of their own range, as a log's would.
_OWN_ID = re.compile("[0-9a-f]{32}").fullmatch
_COUNTER_BITS = 40


@functools.lru_cache(maxsize=256)
def _prefix_key(prefix: str) -> int:
    return int.from_bytes(hashlib.blake2b(prefix.encode(), digest_size=3).digest(), "little") << _COUNTER_BITS


def op_key(operation_id: str) -> int:
    """The kvl_record_ops key of an operation id (revision 0004; kept for its downgrade
    and as id_key's own-id form): for an id of 32 lowercase hex digits, 24 bits of its
    first half's hash, then the low 40 bits of its second half (engine.ids' counter), so
    one writer's keys ascend; any other id, its stable_key. Two ids may share a key, as
    with stable_key."""
    if _OWN_ID(operation_id) is None:
        return stable_key(operation_id)
    return id_keys((operation_id,))[0]  # its 32-character form: the same key


def operation_ids(body: bytes) -> set[str] | None:
    """The operation ids of a stored record's events (None: a damaged record)."""
    found = record_ids(body)
    return None if found is None else found[1]


def record_ids(body: bytes) -> tuple[set[str], set[str]] | None:
    """The event ids and the operation ids of a stored record's events (None: a damaged
    record)."""
    found = audit_record(body, eager=False)
    return None if isinstance(found, Damage) else found.ids()


# Other ids that end in a decimal counter (the KV-event recorder's "kv:<stream>:<epoch>:<seq>",
# a caller's "op-17") key by 24 bits of the hash of what precedes the counter, then the
# counter's low 40 bits: one stream's or one caller's consecutive ids are consecutive keys too.
_COUNTED = re.compile(r"(.*?)([0-9]{1,12})", re.DOTALL).fullmatch
_LOW = (1 << _COUNTER_BITS) - 1
_stems: dict[str, int] = {}  # stem -> its hash's bits above the counter


def _stem(stem: str) -> int:
    bits = _stems.get(stem)
    if bits is None:
        if len(_stems) > 4096:  # a cache, not a registry: callers' stems are unbounded
            _stems.clear()
        bits = _stems[stem] = _prefix_key(stem)
    return bits


def id_keys(ids: Iterable[str]) -> list[int]:
    """The keys of event and operation ids in kvl_record_ids (revision 0005): for 32
    characters whose second half parses as hex (engine.ids' form: op_key's key), 24 bits
    of the first half's hash, then the counter's low 40 bits; for an id that ends in a
    decimal counter, the same of the stem before it; else stable_key. A key only has to
    be the same wherever it is computed: it is not checked for canonical hex, so this runs
    once per id on the write path at a third of op_key's cost. Two ids may share a key."""
    if not isinstance(ids, list):
        ids = list(ids)
    if len(ids) >= _MANY and (keys := _hex_keys(ids)) is not None:
        return keys
    out: list[int] = []
    add, stem, known, top = out.append, _stem, _stems.get, 1 << 63
    for v in ids:
        key = None
        if len(v) == 32:
            try:
                key = (known(v[:16]) or stem(v[:16])) | (int(v[16:], 16) & _LOW)
            except ValueError:
                pass
        if key is None:
            counted = _COUNTED(v)
            if counted is None:
                add(stable_key(v))
                continue
            key = stem(counted[1]) | int(counted[2])
        add(key - (top << 1) if key >= top else key)  # two's complement: a signed 64-bit column
    return out


_MANY = 8  # from here on _hex_keys is the faster (at 4 ids the loop is)


def _hex_keys(ids: list[str]) -> list[int] | None:
    """id_keys of a batch of engine.ids-form ids at once, or None where the loop decides:
    each id 32 lowercase hex digits (so bytes.fromhex reads what int(_, 16) reads), all
    with the same first half (one writer's prefix). A few C-level passes over the batch,
    not a Python step per id: for 128 ids a third of the loop's time alone, ~60% of it in
    the write path, where the caches are cold after each commit's fsync (numpy was slower
    there than the loop)."""
    joined, n = "".join(ids), len(ids)
    if len(joined) != 32 * n or joined != joined.lower():
        return None
    try:
        raw = bytes.fromhex(joined)
    except ValueError:
        return None
    if len(raw) != 16 * n or set(map(len, ids)) != {32}:  # fromhex skips spaces, int(_, 16) reads them
        return None
    halves = struct.unpack(f">{2 * n}Q", raw)
    if len(set(halves[0::2])) != 1:  # lowercase: the same value is the same text
        return None
    return counted_keys(ids[0][:16], halves[1::2])


def counted_keys(prefix: str, counters: Iterable[int]) -> list[int]:
    """id_keys of the ids f"{prefix}{n:016x}" (engine.ids' form), from their counters."""
    high, low = _stem(prefix), _LOW
    if high >= 1 << 63:  # two's complement: a signed 64-bit column; the counter is below bit 40
        high -= 1 << 64
    return [high + (n & low) for n in counters]


def id_key(value: str) -> int:
    return id_keys((value,))[0]


# -- streams as a chain through the records (revision 0006) ------------------------------
# A lookup row per (stream, record), keyed by a hash of the handle id, put each commit's 64
# rows on ~64 random leaf pages: 1,328 of the 1,882 WAL bytes a decoded token wrote
# (docs/COMPACT.md). Instead each record lists, per stream it holds, the record before it
# on that stream (its stream_prev column), and kvl_heads.last_record names the last one:
# read_stream follows the chain back from the head, and a commit writes no extra page.
PREV_NONE = 0  # no earlier record holds the stream
PREV_INDEXED = -1  # the earlier records were written before 0006: kvl_record_streams has them

_prev_encode = msgspec.msgpack.Encoder().encode
_prev_decode = msgspec.msgpack.Decoder(list[int]).decode


def pack_prev(prev: Sequence[int]) -> bytes:
    return _prev_encode(prev)


def unpack_prev(stored: bytes) -> list[int] | None:
    """The pointers of a stored stream_prev (None: unreadable)."""
    try:
        return _prev_decode(stored)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def record_streams(body: bytes) -> list[str] | None:
    """Record.streams of a stored record (None: a damaged record)."""
    found = audit_record(body, eager=False)
    return None if isinstance(found, Damage) else found.streams()


# -- the id index (revision 0005) ------------------------------------------------------
# One writer's operation and event ids come from one counter (engine.ids), so a record of
# 64 decode chains holds 256 consecutive keys (id_key). kvl_record_ids stores each record's keys
# as runs of consecutive keys, one row a run: (first_key, last_key, last_position). No run
# is longer than MAX_RUN, so the runs that can hold a key k start in (k - MAX_RUN, k]: an
# index range on first_key, not a scan. Two ids may share a key (id_key hashes the prefix
# and any other id); a lookup decodes the records a run names and keeps the exact ids.
MAX_RUN = 4096


def id_runs(keys: Iterable[int]) -> list[tuple[int, int]]:
    """The keys as runs (first, last) of consecutive keys, in order, none longer than MAX_RUN."""
    ordered = sorted(set(keys))
    if not ordered:
        return []
    if ordered[-1] - ordered[0] == len(ordered) - 1 and len(ordered) <= MAX_RUN:
        return [(ordered[0], ordered[-1])]  # one writer's consecutive ids: one run, no loop
    runs: list[tuple[int, int]] = []
    longest = MAX_RUN - 1
    first = last = ordered[0]
    for k in ordered:
        if k == last + 1 and k - first <= longest:
            last = k
        elif k != first:
            runs.append((first, last))
            first = last = k
    runs.append((first, last))
    return runs


def stab(runs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """For each run (a, b) of wanted keys, the bounds (lo, hi, a) of a query for the
    stored runs it meets: first_key BETWEEN lo AND hi AND last_key >= a."""
    return [(max(a - MAX_RUN + 1, -(1 << 63)), b, a) for a, b in runs]


def decode_record(body: bytes, where: str, fold: bool = False) -> Record:
    """A stored record's events and receipts; a damaged one is CORRUPT_JOURNAL (the
    readers' answer: `verify` names what changed). With `fold`, its runs of step rows
    are read as columns too (StepRun.columns), for a projector."""
    found = block_records([body], fold)[0] or audit_record(body, eager=False, fold=fold)
    if isinstance(found, Damage):
        raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL,
                            f"the record {where} is damaged: {found.message} (run `kvledger verify`)")
    return found


_BLOCK_LISTS = struct.Struct("<4I")  # a one-block record's lists: the block's length, the context's, their CRCs


def block_records(bodies: Sequence[bytes], fold: bool = False) -> list[Record | None]:
    """decode_record of each body that a commit of decode steps alone writes (a block and
    its context, in format 7), None for the others and for anything amiss in one, which
    decode_record then reads and names. The blocks of one shape are read together, a few
    array calls for all of them (journal.step_reader.block_runs), and without the general
    path's lists and loops (a record at a time, ~40 array calls a block: docs/COMPACT.md,
    step 23)."""
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
                steps = _Steps([item], reader)
                steps.add(0, 1, run)
                found[i] = Record(None, [], compact=True, steps=steps)
    return found


def _block_parts(body: bytes) -> tuple[bytes, StepReader] | None:
    """A one-block record's block and its context's reader, its CRCs checked; or None."""
    if body[:2] != _FORMAT7:
        return None
    try:
        h = _decode5(body)
        size = zstandard.frame_content_size(h.data)
        if h.events != 1 or h.receipts != 1 or not 16 <= size <= inflate.INFLATE_AT_ONCE:
            return None
        raw = _decompressor().decompress(h.data, allow_extra_data=False)
        length, rest, crc, crc_rest = _BLOCK_LISTS.unpack_from(raw)
        item, context = raw[16:16 + length], raw[16 + length:]
        if (len(raw) != 16 + length + rest or item[:1] != _MARK or zlib.crc32(item) != crc
                or zlib.crc32(context) != crc_rest):
            return None
        return item, StepReader(context)
    except (msgspec.DecodeError, msgspec.ValidationError, zstandard.ZstdError, struct.error, *ROW_ERRORS):
        return None


def _parts(body: bytes) -> tuple[RecordParts, str | None] | Damage:
    """The record's parts (its data as far as it inflates), with what is wrong with its
    compressed stream (None: nothing), or the damage that leaves no list to check. What
    is inflated is bounded by the format's limits (journal.inflate), checked first."""
    if body[:1] == b"\x94" and len(body) > 1 and body[1:2] not in (b"\x05", b"\x06", b"\x07") and body[1] < 0x80:
        # the header of format 5 and later, of a format this code does not know
        return Damage(None, f"record format {body[1]}, this kvledger reads {', '.join(map(str, FORMATS))}")
    if body[:2] in (_FORMAT5, _FORMAT6, _FORMAT7):
        try:
            h5 = _decode5(body)
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
        raw, problem = inflate.at_once(h5.format, h5.data, size, _decompressor())
        if len(raw) < 8 * k:
            return Damage(None, problem or "its data ends inside its lists")
        lists = list(struct.unpack_from(f"<{2 * k}I", raw))
        e = h5.events
        bad = None if problem else inflate.item_limits(lists[:k], "lists")
        if bad is not None:
            return Damage(None, bad)
        return RecordParts(h5.format, lists[:e], lists[k:k + e], lists[e:k], lists[k + e:], raw[8 * k:]), problem
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
        data, problem = inflate.at_once(h.format, h.data, sum(lengths), _decompressor())
    return RecordParts(h.format, h.event_lengths, h.event_crcs, h.receipt_lengths, h.receipt_crcs, data), problem


def _streamed5(h5: _Header5, size: int) -> tuple[RecordParts, str | None] | Damage:
    """A format 5 to 7 frame too large to inflate at once: its lists first, checked
    against the format's limits and the size it states, then its items one at a time."""
    inf = inflate.Inflater(h5.format, h5.data)
    k, e = h5.events + h5.receipts, h5.events
    lists = inflate.read_lists(inf, k, size)
    if isinstance(lists, str):
        return Damage(None, lists)
    data, problem = inflate.read_items(inf, lists[:k], lists[k:])
    return RecordParts(h5.format, lists[:e], lists[k:k + e], lists[e:k], lists[k + e:], data), problem


def audit_record(body: bytes, eager: bool = True, fold: bool = False) -> Record | Damage:
    """The record's events and receipts (a format 3 to 6 record's receipts rebuilt now
    unless not `eager`; with `fold`, a format 6 record's runs as columns too), or the
    damage found."""
    found = _parts(body)
    if isinstance(found, Damage):
        return found
    h, problem = found
    if h.format >= 6:
        return _audit6(h, problem, eager, fold)
    data = h.data
    if problem is None and len(data) == sum(h.event_lengths) + sum(h.receipt_lengths):
        # Every slice is whole: cut and check them in bulk (a replay reads every event
        # through here); the loop below names what fails.
        parts = _cut(data, h.event_lengths + h.receipt_lengths)
        if list(map(zlib.crc32, parts)) == h.event_crcs + h.receipt_crcs:
            cut = len(h.event_lengths)
            return _record(h.format, parts[:cut], parts[cut:], eager)
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


def _cut(data: bytes, lengths: list[int]) -> list[bytes]:
    """`data` cut into consecutive slices of `lengths` (short or empty where it ends early)."""
    ends = list(itertools.accumulate(lengths))
    return [data[a:b] for a, b in zip([0, *ends], ends)]


# -- formats 6 and 7: decode steps among the events -------------------------------------
# The frame's lists are format 5's; its "events" are items, each an event's JSON, a step
# row (format 6, journal.steps) or a block of steps (format 7, journal.blocks), and after
# the compact receipts of the operations stored as events comes the record's Context. A
# row is one item, one CRC: damage in it names its first event. A block is one item too;
# when its CRC fails, its CRC column names the first damaged step.


class _Steps:
    """A format 6 or 7 record's items, with its decode steps read back as runs (StepRun: a
    block, or the rows between two JSON events), run k covering items starts[k] to ends[k]."""

    __slots__ = ("ends", "items", "reader", "runs", "starts")

    def __init__(self, items: list[bytes], reader: StepReader) -> None:
        self.items, self.reader = items, reader
        self.runs: list[StepRun] = []
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int, run: StepRun) -> None:
        self.starts.append(start)
        self.ends.append(end)
        self.runs.append(run)

    @property
    def rows(self) -> list[StepValues]:
        return [x for run in self.runs for x in run.values()]

    def _between(self, upto: int | None = None) -> Iterable[tuple[list[bytes], StepRun | None]]:
        """The JSON items before each run, with the run; then the items after the last
        (with None); all of the first `upto` items."""
        upto = len(self.items) if upto is None else upto
        at = 0
        for start, end, run in zip(self.starts, self.ends, self.runs):
            if start >= upto:
                break
            yield self.items[at:start], run
            at = end
        yield self.items[at:upto], None

    def decoded(self, fold: bool = False) -> list[Any]:
        """Its events, a step's rebuilt; with `fold`, each step as its StepValues."""
        out: list[Any] = []
        for items, run in self._between():
            out += map(decode_event, items)
            if run is not None:
                out += run.values() if fold else run.events()
        return out

    def folded(self) -> list[Any]:
        """Its events, each run of steps as its StepRun."""
        out: list[Any] = []
        for items, run in self._between():
            out += map(decode_event, items)
            if run is not None:
                out.append(run)
        return out

    def json(self, upto: int | None = None) -> list[bytes]:
        """The events' JSON (of the first `upto` items; a run cut short by damage gives
        its steps before the damage)."""
        out: list[bytes] = []
        for items, run in self._between(upto):
            out += items
            if run is not None:
                out += [encode_event(e) for e in run.events()]
        return out

    def receipts(self, compact: Sequence[bytes]) -> list[bytes] | str:
        """The JSON receipts: a step's rebuilt, the others expanded from their compact
        form over their events, in the record's order."""
        out: list[bytes] = []
        taken = 0
        try:
            for items, run in self._between():
                at = 0
                while at < len(items):
                    if taken == len(compact):
                        return f"event item {at} has no receipt"
                    count = _compact_decode(compact[taken]).count
                    own = items[at:at + count]
                    if count < 1 or len(own) != count:
                        return f"receipt {len(out)} claims {count} events from an item of {len(items)} between steps"
                    expanded = expand_receipts(compact[taken:taken + 1], own)
                    if isinstance(expanded, str):
                        return expanded.replace("receipt 0", f"receipt {len(out)}")
                    out += expanded
                    at += count
                    taken += 1
                if run is not None:
                    out += [self.reader.receipt(x.events()) for x in run.values()]
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return f"receipt {len(out)} is unreadable: {exc}"
        if taken != len(compact):
            return f"{len(compact) - taken} receipts after the last event's"
        return out


_BRACE = ord("{")


def _audit6(h: RecordParts, problem: str | None, eager: bool, fold: bool) -> Record | Damage:
    n = len(h.event_lengths)
    if not h.receipt_lengths:
        return Damage(None, f"a format {h.format} record without its context")
    lengths, crcs, data = h.event_lengths + h.receipt_lengths, h.event_crcs + h.receipt_crcs, h.data
    parts, total = _cut(data, lengths), sum(lengths)
    whole = problem is None and len(data) == total
    if whole and list(map(zlib.crc32, parts)) == crcs:
        ok = [True] * len(parts)
    else:
        ok = [len(p) == k and zlib.crc32(p) == c for p, k, c in zip(parts, lengths, crcs)]
    reader: StepReader | None = None
    why = problem or "its context's bytes do not match their CRC"
    if ok[-1]:
        try:
            reader = StepReader(parts[-1])
        except ROW_ERRORS as exc:
            why = f"its context does not decode: {exc}"
    steps = _Steps(parts[:n], reader)  # type: ignore[arg-type]  # used only once a row needs it
    firsts = bytes([p[0] if p else 0 for p in parts[:n]])  # "{": an event's JSON, MARK a block, else a row
    blocks = h.format == 7
    index = i = 0
    while i < n:  # damage is named in item order: the first bad item's
        if firsts[i] == _BRACE:
            if not ok[i]:
                return Damage(index, problem or "its bytes do not match their CRC", steps.json(i))
            index, i = index + 1, i + 1
            continue
        if reader is None:
            return Damage(index, why, steps.json(i))
        if blocks:
            if firsts[i] != MARK:
                return Damage(index, "a format 7 record's step item is no block", steps.json(i))
            if not ok[i]:  # the CRC column names the step
                exact, k = reader.damaged_block(parts[i], index)
                if exact:
                    steps.add(i, i + 1, _partial(exact))
                return Damage(index + 3 * k, problem or "its bytes do not match their CRC", steps.json(i + 1))
            try:
                run = reader.block(parts[i], index, fold)
            except BadRow as bad:
                if bad.values:
                    steps.add(i, i + 1, _partial(bad.values))
                return Damage(index + 3 * bad.offset, f"its step does not rebuild: {bad.error}", steps.json(i + 1))
            steps.add(i, i + 1, run)
            index, i = index + 3 * run.count, i + 1
            continue
        if not ok[i]:
            return Damage(index, problem or "its bytes do not match their CRC", steps.json(i))
        j = firsts.find(b"{", i + 1)
        j = n if j < 0 else j
        if False in ok[i:j]:
            j = ok.index(False, i, j)
        try:
            run = reader.run(parts[i:j], index, fold)
        except BadRow as bad:
            if bad.values:
                steps.add(i, i + bad.offset, _partial(bad.values))
            return Damage(index + 3 * bad.offset, f"its step row does not rebuild: {bad.error}",
                          steps.json(i + bad.offset))
        steps.add(i, j, run)
        index, i = index + 3 * (j - i), j
    if not all(ok[n:-1]):
        return Damage(None, problem or "a receipt's bytes do not match their CRC", steps.json())
    if reader is None:
        return Damage(None, why, steps.json())
    if not whole:
        return Damage(None, problem or f"{len(data) - total} bytes after its context", steps.json())
    compact = parts[n:-1]
    if eager:
        expanded = steps.receipts(compact)
        if isinstance(expanded, str):
            return Damage(None, f"its receipts do not fit its events: {expanded}", steps.json())
        return Record(None, expanded, steps=steps)
    return Record(None, compact, compact=True, steps=steps)


def _partial(values: list[StepValues]) -> StepRun:
    """The steps of a run before its damage, which are exact."""
    return StepRun(values[0].global_position, len(values), None, values[-1].event_id, values)


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
    return Record(events, receipts, compact=fmt >= 3)


_local = threading.local()


def _own(name: str, make: Callable[[], Any]) -> Any:
    """This thread's zstd context `name`, made on first use: one may not be used by two
    threads at once, and making one costs more than a small record's work."""
    found = getattr(_local, name, None)
    if found is None:
        found = make()
        setattr(_local, name, found)
    return found


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's (making one costs ~15 µs, more than inflating a record)."""
    decompressor: zstandard.ZstdDecompressor = _own("decompressor", zstandard.ZstdDecompressor)
    return decompressor
