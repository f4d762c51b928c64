"""Decode steps stored as values, not events: record formats 6 (a row a step) and 7 (a block
of columns a run; journal.blocks) (docs/COMPACT.md, steps 12 and 21).

A worker's decode step writes three events (append_publish, output_emit, append_start)
and a receipt. In the form the service's decode lane marks derived (engine/decode_step.py,
Operation.derived), nearly every field of the four is fixed by a handful of values: the
envelope repeats across the three events, the positions and sequence numbers count up,
the snapshot versions are the base plus one, the start's interval is the committed length
and the emitted token. Formats 1 to 5 stored the three JSON bodies (about 1.9 KB, 140
bytes once compressed with their neighbours) and a compact receipt; format 6 stores a
`Step` row: the values that are not fixed, with ids as counters under a prefix and
clocks as differences from the step before, so a record of 64 steps keeps ~60 bytes a
step, 32 of them the row digest.

Readers rebuild the three events as the structs `decode_event` would give, and their
JSON with the same encoder, so `read_all`, `export` and `verify` see the bytes format 5
stored (tests/test_steps.py holds that over generated chains); the receipt comes back
through schemas.decode_fingerprint as in format 4. The writer turns an operation into a
row only when every relation the rebuild assumes holds, with exact types, and stores the
others as before (`StepWriter.row` returns None); for the service's own decode lane
(Operation.stamped) the relations hold by construction and only what the lane takes
from its caller is checked (tests/test_decode_step.py rebuilds every such row).

A row is one item of the record with one CRC, in place of three events' and a receipt's:
a damaged row is named by its first event. The record's shared values (its first global
position, the commit time, the id prefixes, each stream's envelope and cache ABI) are a
`Context` stored after the receipts.

Format 6 stored a Step as msgpack, one row an item; format 7 (written since step 21)
stores a record's run of steps as one block of the same values, column by column
(journal.blocks), so that a fold reads a run as arrays rather than decoding it row by
row. Both are read; what a reader gives is the same for either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Annotated

import msgspec
from msgspec import Meta

from kvledger.journal.contract import Operation
from kvledger.schemas import events as ev
from kvledger.schemas.decode_fingerprint import DECODE_CHAIN, decode_chain_fingerprint
from kvledger.schemas.events import INT64_MAX, Count, Id
from kvledger.schemas.receipts import HandleResult, Receipt, receipt_encoder

if TYPE_CHECKING:
    import numpy as np  # imported where a run is read: the API's import loads no numpy

# The schema versions a row rebuilds its events at. A later version of any of the three
# is not a row: the writer stores such events as JSON (a new row layout would be a format).
VERSIONS = (2, 1, 3)
_V_PUBLISH, _V_EMIT, _V_START = VERSIONS
_U64 = 1 << 64
_MASK, _HALF = _U64 - 1, 1 << 63
_GAPS = (1, 1, 1)  # the event ids' counters after the operation's, as the decode lane draws them
_PUBLISH, _EMIT, _START = DECODE_CHAIN
# What the rows store is read back within the events' own bounds: a forged row fails here,
# as a forged JSON event fails decode_event, never as a value no event could hold.
Positive = Annotated[int, Meta(gt=0, le=INT64_MAX)]
Sha256 = Annotated[bytes, Meta(min_length=32, max_length=32)]


class Call(msgspec.Struct, array_like=True, frozen=True, gc=False):
    prefix: int  # of call_id, in Context.prefixes
    counter: int  # call_id's counter less the previous row's (the batch's rows share one call)
    index: Count
    size: Positive
    new_pad: Positive
    key_extent: Positive
    threads: Count


class Step(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One decode step. Differences are from the previous row of the record (the first
    row's from zero): consecutive steps of one writer differ by small, repeating numbers."""

    stream: int  # index in Context.streams
    position: Count  # the publication's stream position; the emit's and the start's follow
    sequence: int  # local_sequence less the previous row's plus three
    mono: int  # monotonic_ns less the previous row's
    wall: int  # observed_wall_time less the previous row's, less `mono`: the clocks' drift
    prefix: int  # of the operation and event ids, in Context.prefixes
    op: int  # the operation id's counter less the previous row's
    gaps: tuple[int, int, int]  # event ids' counters: publish - op, emit - publish, start - emit
    publish_txn: tuple[int, int]  # prefix, counter less the previous row's
    start_txn: tuple[int, int]
    snapshot: Count  # the publication's base snapshot version
    committed: Count  # committed length after it: the start's interval begins there
    accepted: Count
    layers: Count
    workspace: Count
    digest: Sha256 | None  # rows_sha256, its 32 bytes
    output: Count  # output_index
    token: Count
    call: Call | None


# A Context's stream: stream_id, request_id, handle_generation, source_instance, cache ABI (32 bytes)
StreamEntry = tuple[Id, Id, Count, Id, Sha256]


class Context(msgspec.Struct, array_like=True, frozen=True, gc=False):
    first_position: Count  # the record's first event's global position
    committed_wall_ns: Count
    prefixes: list[str]
    streams: list[StreamEntry]


_encode = msgspec.msgpack.Encoder().encode
_json = msgspec.json.Encoder().encode
_decode_step = msgspec.msgpack.Decoder(Step).decode

# Record format 7 stores a record's run of steps as one block of columns (journal.blocks).
Row = tuple[tuple[int, ...], bytes | None]  # a step's thirty values (journal.blocks' order) and its digest
MARK = 0xC1  # a block's first byte: one msgpack never writes, and not an event's "{"
_RUNNING = (21, 27, 28)  # a block's columns a fold reads as running sums: mono, publish and start txn


class _ContextParts(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A Context with its streams left undecoded (Raw): consecutive records of a decode
    loop name the same streams, and decoding their 64 tables' strings again and again
    was ~15 µs a record."""

    first_position: Count
    committed_wall_ns: Count
    prefixes: list[str]
    streams: msgspec.Raw


_decode_parts = msgspec.msgpack.Decoder(_ContextParts).decode
_decode_streams = msgspec.msgpack.Decoder(list[StreamEntry]).decode
_streams: dict[bytes, list[StreamEntry]] = {}  # stream tables by their bytes
_last_streams: tuple[bytes, list[StreamEntry]] = (b"", [])  # the table read last, checked first


def decode_context(data: bytes) -> Context:
    """A record's Context, as msgspec.msgpack.Decoder(Context) gives it (raising what it
    raises); a streams table read before is shared (read-only) rather than decoded again."""
    global _last_streams
    parts = _decode_parts(data)
    raw, (last, streams) = parts.streams, _last_streams
    # The table is the context's last item: the record before's, if its bytes end this one
    # (a compare, where copying and hashing the table's ~5 KB to look it up was ~2 µs).
    if not (len(raw) == len(last) and data.endswith(last)):
        key = bytes(raw)
        found = _streams.get(key)
        if found is None:
            found = _decode_streams(key)
            if len(_streams) >= 64:  # a cache, not a registry
                _streams.clear()
            _streams[key] = found
        streams, _last_streams = found, (key, found)
    return Context(parts.first_position, parts.committed_wall_ns, parts.prefixes, streams)


# A row as a tuple of Step's fields, checked as Step is: a run's rows transpose into columns.
_ROW = tuple.__class_getitem__(tuple(f.type for f in msgspec.structs.fields(Step)))
_decode_row = msgspec.msgpack.Decoder(_ROW).decode
# What a row that does not rebuild raises (StepReader.values, StepReader.run).
ROW_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError, IndexError, TypeError, OverflowError)


def is_row(item: bytes) -> bool:
    """A record item that is a step row (a msgpack array), not an event (JSON, `{`)."""
    return item[:1] != b"{"


class StepWriter:
    """Turns a record's operations into rows, in order; `context()` once all are in."""

    def __init__(self, first_position: int, committed_wall_ns: int) -> None:
        self.first_position, self.committed_wall_ns = first_position, committed_wall_ns
        self.prefixes: dict[str, int] = {}
        self.streams: dict[tuple[str, str, int, str, bytes], int] = {}
        self.count = 0
        self._abis: dict[str, bytes] = {}
        self._last = (0, 0, 0, 0, 0, 0, 0)  # sequence, mono, wall, op, publish txn, start txn, call

    def row(self, op: Operation) -> Row | None:
        """The row of a derived decode chain, or None: it is stored as events."""
        if not op.derived or len(op.writes) != 1 or op.checks or op.manifests:
            return None
        if op.step is not None:  # the lane's values: what it took from its caller is checked below
            return self.values_row(op.step)
        w = op.writes[0]
        if len(w.events) != 3:
            return None
        p, o, s = w.events
        if type(p) is not _PUBLISH or type(o) is not _EMIT or type(s) is not _START:
            return None
        pp, op_, sp, head, call = p.payload, o.payload, s.payload, w.head, s.payload.call
        pos, seq, mono, wall, gen = p.stream_position, p.local_sequence, p.monotonic_ns, p.observed_wall_time, \
            p.handle_generation
        v, c, token, op_id = pp.base_snapshot_version, pp.committed_length, op_.token_id, op.operation_id
        # What the row stores is msgpack ints (never a bool or a float, which would
        # encode otherwise); values_row checks the rest.
        if (type(pos) is not int or type(seq) is not int or type(mono) is not int or type(wall) is not int
                or type(gen) is not int or type(v) is not int or type(c) is not int
                or type(pp.accepted_count) is not int or type(pp.layers_complete) is not int
                or type(op_.output_index) is not int or (counter := counter_of(op_id)) is None):
            return None
        prefix, n = op_id[:16], counter
        sid, rid, src = p.stream_id, p.request_id, p.source_instance
        if op.stamped:
            # The service's decode lane stamped these events: every relation below holds
            # by construction (tests/test_steps.py holds the lane to it), except what it
            # takes from the caller as given and what another thread may interleave.
            if (type(sp.token_ids[0]) is not int or type(sp.cache_positions[0]) is not int
                    or p.event_id != f"{prefix}{n + 1:016x}" or o.event_id != f"{prefix}{n + 2:016x}"
                    or s.event_id != f"{prefix}{n + 3:016x}"):
                return None
        # Everything else the rebuild derives, as JSON both ways: equal JSON is what a
        # reader must get back (1 and True, or 2 and 2.0, are equal but encode apart).
        # Event ids follow the operation's (the service's decode lane draws them so).
        elif _json((o.stream_id, s.stream_id, w.handle_id, o.request_id, s.request_id, o.handle_generation,
                  s.handle_generation, o.source_instance, s.source_instance, p.operation_id, o.operation_id,
                  s.operation_id, p.caused_by_event_id, o.caused_by_event_id, s.caused_by_event_id,
                  p.schema_version, o.schema_version, s.schema_version, o.stream_position, s.stream_position,
                  o.local_sequence, s.local_sequence, o.monotonic_ns, s.monotonic_ns, o.observed_wall_time,
                  s.observed_wall_time, p.event_id, o.event_id, s.event_id, pp.result_snapshot_version,
                  pp.logits_ready, op_.snapshot_version, sp.kind, sp.base_snapshot_version, sp.interval_start,
                  sp.interval_count, sp.token_ids, sp.cache_positions, sp.mask_key_extent, head.generation,
                  head.snapshot_version, head.stream_position, head.committed_length)) != _json((
                sid, sid, sid, rid, rid, gen, gen, src, src, op_id, op_id, op_id, None, None, None,
                *VERSIONS, pos + 1, pos + 2, seq + 1, seq + 2, mono, mono, wall, wall, f"{prefix}{n + 1:016x}",
                f"{prefix}{n + 2:016x}", f"{prefix}{n + 3:016x}", v + 1, True, v + 1, "decode", v + 1, c, 1,
                (token,), (c,), c + 1, gen, v + 1, pos + 2, c)):
            return None
        parts = row_parts(pp.rows_sha256, call)
        if parts is None:
            return None
        digest, counted = parts
        return self.values_row(StepValues(
            0, sid, rid, gen, src, sp.cache_abi_sha256, pos, seq, mono, wall, prefix, n, _GAPS, pp.txn_id,
            sp.txn_id, v, c, pp.accepted_count, pp.layers_complete, pp.workspace_bytes, digest,
            op_.output_index, token, counted))

    def values_row(self, x: StepValues) -> Row | None:
        """The row of a decode step's values (its thirty values in journal.blocks' order,
        and its digest), or None. Checked here: what a caller gives the decode lane (the
        token, the workspace, the call's numbers, the ids' form) and that every value is
        an int64; the rest the lane derived."""
        seq, mono, wall, call = x.local_sequence, x.monotonic_ns, x.observed_wall_time, x.call
        if (type(x.token) is not int or type(x.workspace) is not int or not 0 <= seq < _U64
                or not 0 <= mono < _U64 or not 0 <= wall < _U64):
            return None
        ptxn, stxn = self._id(x.publish_txn), self._id(x.start_txn)
        abi = self._abis.get(x.cache_abi_sha256)
        if abi is None:
            abi = lower_hex(x.cache_abi_sha256, 32)
            if abi is None:
                return None
            self._abis[x.cache_abi_sha256] = abi
        if ptxn is None or stxn is None:
            return None
        last = self._last
        digest, gaps = x.digest, x.gaps
        if (digest is not None and len(digest) != 32) or len(gaps) != 3:
            return None
        if call is None:
            cp = ki = kt = ks = kn = ke = c = 0
            ccount = last[6]
        else:
            call_id, ccount, kc = call
            ki, kt, ks, kn, ke = kc.index, kc.threads, kc.size, kc.new_pad, kc.key_extent
            if type(ki) is not int or type(kt) is not int or type(ks) is not int or type(kn) is not int \
                    or type(ke) is not int:
                return None
            cp, c = self._prefix(call_id), ((ccount - last[6] + _HALF) & _MASK) - _HALF
        counts = (x.stream_position, x.snapshot, x.committed, x.accepted, x.layers, x.workspace, x.output, x.token,
                  ki, kt, ks, kn, ke)
        # A value a block cannot hold, or a negative count (no reader would take it), is
        # stored as events, as an int msgpack could not hold was in format 6. The indexes
        # are the writer's own, and a difference below is reduced into int64.
        if min(counts) < 0 or max(counts) >= _HALF or min(gaps) < -_HALF or max(gaps) >= _HALF:
            return None
        n = x.op
        # differences modulo 2**64 as signed 64-bit ints (what a reader adds back, modulo 2**64)
        dmono = ((mono - last[1] + _HALF) & _MASK) - _HALF
        values = (
            self._stream(x.stream_id, x.request_id, x.handle_generation, x.source_instance, abi),
            self._prefix(x.prefix), ptxn[0], stxn[0], cp, *counts, digest is not None, call is not None,
            ((seq - last[0] - 3 + _HALF) & _MASK) - _HALF, dmono, ((wall - last[2] - dmono + _HALF) & _MASK) - _HALF,
            ((n - last[3] + _HALF) & _MASK) - _HALF, *gaps,
            ((ptxn[1] - last[4] + _HALF) & _MASK) - _HALF, ((stxn[1] - last[5] + _HALF) & _MASK) - _HALF, c)
        self._last = (seq, mono, wall, n, ptxn[1], stxn[1], ccount)
        self.count += 1
        return values, digest

    def pack(self, items: list[bytes | Row]) -> list[bytes]:
        """A record's items with each run of rows (values_row's) as one block."""
        from kvledger.journal.blocks import pack  # numpy: only once a record holds a step

        out: list[bytes] = []
        run: list[Row] = []
        for item in items:
            if isinstance(item, bytes):
                if run:
                    out.append(pack(run))
                    run = []
                out.append(item)
            else:
                run.append(item)
        if run:
            out.append(pack(run))
        return out

    def context(self) -> bytes:
        return _encode(Context(self.first_position, self.committed_wall_ns, list(self.prefixes),
                               list(self.streams)))

    def _prefix(self, prefix: str) -> int:
        n = self.prefixes.get(prefix)
        if n is None:
            n = self.prefixes[prefix] = len(self.prefixes)
        return n

    def _id(self, value: str) -> tuple[int, int] | None:
        """(prefix index, counter) of an id of 32 lowercase hex digits (engine.ids'), or
        None (parsed_counter: each id parsed once)."""
        n = parsed_counter(value)
        return None if n is None else (self._prefix(value[:16]), n)

    def _stream(self, *key: str | int | bytes) -> int:
        n = self.streams.get(key)  # type: ignore[arg-type]  # the five fields of Context.streams
        if n is None:
            n = self.streams[key] = len(self.streams)  # type: ignore[index]  # as above
        return n


_parsed: dict[str, int] = {}  # id -> its counter (parsed_counter)


def parsed_counter(value: object) -> int | None:
    """counter_of, remembered: a txn id is parsed twice (its append's start, then its
    publication a step later), and a batch's steps share one call id."""
    if type(value) is not str:
        return None
    n = _parsed.get(value)
    if n is None:
        n = counter_of(value)
        if n is None:
            return None
        if len(_parsed) > 1 << 16:  # a cache, not a registry
            _parsed.clear()
        _parsed[value] = n
    return n


def row_parts(rows_sha256: str | None, call: ev.ForwardCall | None
              ) -> tuple[bytes | None, tuple[str, int, Call] | None] | None:
    """A publication's digest and its next append's call as StepValues holds them, or None
    when either is not in the form a row stores (lowercase hex; engine.ids' call ids)."""
    digest = None if rows_sha256 is None else lower_hex(rows_sha256, 32)
    if (digest is None) != (rows_sha256 is None):
        return None
    if call is None:
        return digest, None
    n = parsed_counter(call.call_id)
    if n is None:
        return None
    # The Call's prefix and counter are a record's: values_row puts them in.
    return digest, (call.call_id[:16], n, Call(0, 0, call.index, call.size, call.new_pad, call.key_extent,
                                               call.threads))


def counter_of(value: object) -> int | None:
    """The counter (last 16 digits) of an id of 32 lowercase hex digits, or None."""
    raw = lower_hex(value, 16)
    return None if raw is None else int.from_bytes(raw[8:])


def lower_hex(value: object, size: int) -> bytes | None:
    """The `size` bytes that `value` spells in lowercase hex (what reads back as the same
    string: bytes.fromhex also takes capitals and spaces), or None."""
    if type(value) is not str or len(value) != 2 * size:
        return None
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        return None
    return raw if raw.hex() == value else None


class StepValues(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A row read back: what a fold needs of a decode step without its three events
    (replay.projector folds these at once), and `events()` for the rest."""

    global_position: int  # the publication's, the emit and the start follow; 0: not committed yet
    stream_id: str
    request_id: str
    handle_generation: int
    source_instance: str
    cache_abi_sha256: str
    stream_position: int  # the publication's
    local_sequence: int
    monotonic_ns: int
    observed_wall_time: int
    prefix: str  # of the operation's and the events' ids
    op: int  # the operation id's counter
    gaps: tuple[int, int, int]
    publish_txn: str
    start_txn: str
    snapshot: int  # base snapshot version
    committed: int
    accepted: int
    layers: int
    workspace: int
    digest: bytes | None
    output: int
    token: int
    call: tuple[str, int, Call] | None  # call id prefix, counter, the row's call

    @property
    def event_id(self) -> str:
        """The last event's id (the append_start's): where a fold of the step ends."""
        n = (self.op + self.gaps[0] + self.gaps[1] + self.gaps[2]) & _MASK
        return f"{self.prefix}{n:016x}"

    def counters(self) -> tuple[int, int, int, int]:
        """The counters of the operation's id and of its three events' ids, under `prefix`."""
        n, gaps = self.op, self.gaps
        e1 = (n + gaps[0]) & _MASK
        e2 = (e1 + gaps[1]) & _MASK
        return n, e1, e2, (e2 + gaps[2]) & _MASK

    def event_ids(self) -> list[str]:
        prefix, (_, e1, e2, e3) = self.prefix, self.counters()
        return [f"{prefix}{e1:016x}", f"{prefix}{e2:016x}", f"{prefix}{e3:016x}"]

    @property
    def first_event_id(self) -> str:
        """The publication's id: the event at `global_position`."""
        return f"{self.prefix}{(self.op + self.gaps[0]) & _MASK:016x}"

    def events(self) -> tuple[ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent]:
        i1, i2, i3 = self.event_ids()
        g, pos, seq, v, c, token = (self.global_position, self.stream_position, self.local_sequence, self.snapshot,
                                    self.committed, self.token)
        stream_id, request_id, generation, source, mono, wall = (
            self.stream_id, self.request_id, self.handle_generation, self.source_instance, self.monotonic_ns,
            self.observed_wall_time)
        operation_id = f"{self.prefix}{self.op:016x}"
        call = None
        if self.call is not None:
            cp, cn, k = self.call
            call = ev.ForwardCall(f"{cp}{cn:016x}", k.index, k.size, k.new_pad, k.key_extent, k.threads)
        digest = self.digest
        publish = _PUBLISH(
            event_id=i1, global_position=g, stream_id=stream_id, stream_position=pos,
            schema_version=_V_PUBLISH, request_id=request_id, handle_generation=generation, operation_id=operation_id,
            source_instance=source, local_sequence=seq, monotonic_ns=mono, observed_wall_time=wall,
            payload=ev.AppendPublish(self.publish_txn, v, v + 1, c, self.accepted, self.layers, True, self.workspace,
                                     None if digest is None else digest.hex()))
        v += 1
        emit = _EMIT(
            event_id=i2, global_position=g and g + 1, stream_id=stream_id, stream_position=pos + 1,
            schema_version=_V_EMIT, request_id=request_id, handle_generation=generation, operation_id=operation_id,
            source_instance=source, local_sequence=seq + 1, monotonic_ns=mono, observed_wall_time=wall,
            payload=ev.OutputEmit(self.output, token, v))
        start = _START(
            event_id=i3, global_position=g and g + 2, stream_id=stream_id, stream_position=pos + 2,
            schema_version=_V_START, request_id=request_id, handle_generation=generation, operation_id=operation_id,
            source_instance=source, local_sequence=seq + 2, monotonic_ns=mono, observed_wall_time=wall,
            payload=ev.AppendStart(self.start_txn, "decode", v, c, 1, (token,), (c,), c + 1, self.cache_abi_sha256,
                                   call))
        return publish, emit, start


class StepReader:
    """Rebuilds a record's rows in order (each row's differences are from the one before)."""

    def __init__(self, context: bytes) -> None:
        self.context = decode_context(context)  # raises msgspec's errors: the caller names the damage
        self._abis: list[str] = []  # the streams' cache ABIs in hex, made when a row's values are
        self._last = (0, 0, 0, 0, 0, 0, 0)

    def events(self, row: bytes, at: int) -> tuple[ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent]:
        """The three events of `row`, whose publication is the record's event `at`
        (counted from 0). Raises ValueError or msgspec's errors for a row that does not
        rebuild."""
        return self.values(row, at).events()

    def values(self, row: bytes, at: int) -> StepValues:
        """The values of a format 6 `row` (see events), its differences resolved."""
        return self._values(_decode_step(row), at)

    def _values(self, x: Step, at: int) -> StepValues:
        ctx, last, prefixes = self.context, self._last, self.context.prefixes
        stream_id, request_id, generation, source, _ = ctx.streams[x.stream]
        abis = self._abis or self._hex_abis()
        seq = (last[0] + 3 + x.sequence) & _MASK
        mono = (last[1] + x.mono) & _MASK
        wall = (last[2] + x.mono + x.wall) & _MASK
        op = (last[3] + x.op) & _MASK
        ptxn, stxn = (last[4] + x.publish_txn[1]) & _MASK, (last[5] + x.start_txn[1]) & _MASK
        ccount = last[6]
        call = x.call
        if call is not None:
            ccount = (ccount + call.counter) & _MASK
        self._last = (seq, mono, wall, op, ptxn, stxn, ccount)
        return StepValues(
            ctx.first_position + at, stream_id, request_id, generation, source, abis[x.stream], x.position,
            seq, mono, wall, prefixes[x.prefix], op, x.gaps, f"{prefixes[x.publish_txn[0]]}{ptxn:016x}",
            f"{prefixes[x.start_txn[0]]}{stxn:016x}", x.snapshot, x.committed, x.accepted, x.layers, x.workspace,
            x.digest, x.output, x.token, None if call is None else (prefixes[call.prefix], ccount, call))

    def _hex_abis(self) -> list[str]:
        self._abis = [s[4].hex() for s in self.context.streams]
        return self._abis

    def receipt(self, events: tuple[ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent]) -> bytes:
        """The JSON receipt of a step's operation, as the writer returned it."""
        p, o, s = events
        return receipt_encoder.encode(Receipt(
            p.operation_id or "", decode_chain_fingerprint(p, o, s),
            (HandleResult(p.stream_id, p.handle_generation, p.payload.result_snapshot_version, s.stream_position,
                          p.payload.committed_length),),
            (p.event_id, o.event_id, s.event_id), p.global_position, s.global_position,
            self.context.committed_wall_ns))

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

    def _at(self, last: tuple[int, int, int, int, int, int, int]) -> StepReader:
        """A reader of the same record whose rows continue from `last` (a run's values
        read later, on request)."""
        again = StepReader.__new__(StepReader)
        again.context, again._abis, again._last = self.context, self._abis, last
        return again

    def block(self, item: bytes, at: int, columns: bool = True) -> StepRun:
        """A format 7 block (journal.blocks) whose first step is the record's event `at`:
        as `run` reads rows. Raises BadRow for a block that does not parse (its first
        step) or the first step whose values no Step could hold."""
        from kvledger.journal import blocks

        try:
            m, digests = blocks.read_many([item])
        except ValueError as exc:
            raise BadRow(0, [], exc) from None
        run = block_runs([self], m, digests, [at], columns)[0]
        if run is None:
            ctx = self.context
            bad = blocks.invalid(m[0], digests[0], len(ctx.streams), len(ctx.prefixes))
            assert bad is not None  # block_runs refuses only such a block
            raise BadRow(bad, self._block_values(m[0], digests[0], at, bad),
                         ValueError(f"step {bad} of its block holds a value out of its range")) from None
        return run

    def damaged_block(self, item: bytes, at: int) -> tuple[list[StepValues], int]:
        """A block whose CRC fails: the step to name (the first whose CRC fails, or one
        before it whose values no Step could hold) and the values of the steps before it."""
        from kvledger.journal import blocks

        k = blocks.damaged(item)
        if k == 0:
            return [], 0
        m, digests = blocks.read(item)
        bad = blocks.invalid(m[:, :k], digests[:32 * k], len(self.context.streams), len(self.context.prefixes))
        k = k if bad is None else bad
        return self._block_values(m, digests, at, k), k

    def _block_values(self, m: np.ndarray, digests: bytes, at: int, count: int) -> list[StepValues]:
        """The StepValues of a block's first `count` steps (`m` as blocks.read gives it)."""
        out = []
        for i, v in enumerate(m[:, :count].T.tolist()):
            x = Step(v[0], v[5], v[20], v[21], v[22], v[1], v[23], (v[24], v[25], v[26]), (v[2], v[27]),
                     (v[3], v[28]), v[6], v[7], v[8], v[9], v[10], digests[32 * i:32 * i + 32] if v[18] else None,
                     v[11], v[12], Call(v[4], v[29], v[13], v[15], v[16], v[17], v[14]) if v[19] else None)
            out.append(self._values(x, at + 3 * i))
        return out


def block_runs(readers: Sequence[StepReader], m: np.ndarray, digests: Sequence[bytes], at: Sequence[int],
               columns: bool) -> list[StepRun | None]:
    """The runs of blocks of one shape (journal.blocks.read_many's values and digests),
    block r read by readers[r] from its record's event at[r] as StepReader.block reads one,
    in array calls over all the blocks at once: a decode loop's records hold one block
    each, and a record at a time paid ~40 array calls for its 64 steps. None for a block
    holding a value no Step could (StepReader.block names the step)."""
    import numpy as np

    from kvledger.journal import blocks

    n = m.shape[2]
    lo, hi = m.min(axis=2).tolist(), m.max(axis=2).tolist()
    sums = m[:, 20:30].view(np.uint64).sum(axis=2).tolist()  # uint64 sums wrap as the masks do
    finals = m[:, :, -1].tolist()
    if columns:
        # the clocks and txn counters: running sums from where each reader's last run ended
        running = m[:, _RUNNING].view(np.uint64)
        running[:, :, 0] += np.array([(r._last[1], r._last[4], r._last[5]) for r in readers], np.uint64)
        running.cumsum(axis=2, out=running)
        tops = running[:, 0].max(axis=1).tolist()
    out: list[StepRun | None] = []
    for k, reader in enumerate(readers):
        ctx, last, steps, d = reader.context, reader._last, m[k], digests[k]
        if blocks.invalid(steps, d, len(ctx.streams), len(ctx.prefixes), (lo[k], hi[k])) is not None:
            out.append(None)
            continue
        s, final = sums[k], finals[k]
        op = (last[3] + s[3]) & _MASK
        event_id = f"{ctx.prefixes[final[1]]}{(op + final[24] + final[25] + final[26]) & _MASK:016x}"
        values = partial(reader._at(last)._block_values, steps, d, at[k], n)
        cols = None
        if columns and tops[k] < _HALF:  # else a clock a fold cannot hold in int64: no columns
            mono, ptxn, stxn = running[k]
            cols = StepColumns(steps[0], steps[5], mono.view(np.int64), steps[6], steps[7], steps[10], steps[12],
                               steps[2], ptxn, steps[3], stxn, ctx.streams, ctx.prefixes)
        reader._last = ((last[0] + 3 * n + s[0]) & _MASK, (last[1] + s[1]) & _MASK, (last[2] + s[1] + s[2]) & _MASK,
                        op, (last[4] + s[7]) & _MASK, (last[5] + s[8]) & _MASK, (last[6] + s[9]) & _MASK)
        out.append(StepRun(ctx.first_position + at[k], n, cols, event_id, values if cols is not None else values()))
    return out


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


class StepColumns:
    """A run's values that a fold reads, one array each (journal.steps.StepValues names
    them): `stream` indexes `streams`, the txn prefixes index `prefixes`, the txn
    counters are uint64, the rest int64 (a clock past int64 is no run's)."""

    __slots__ = ("stream", "position", "mono", "snapshot", "committed", "workspace", "token", "ptxn_prefix",
                 "ptxn", "stxn_prefix", "stxn", "streams", "prefixes")

    def __init__(self, stream: np.ndarray, position: np.ndarray, mono: np.ndarray, snapshot: np.ndarray,
                 committed: np.ndarray, workspace: np.ndarray, token: np.ndarray, ptxn_prefix: np.ndarray,
                 ptxn: np.ndarray, stxn_prefix: np.ndarray, stxn: np.ndarray,
                 streams: list[StreamEntry], prefixes: list[str]) -> None:
        self.stream, self.position, self.mono, self.snapshot, self.committed = (stream, position, mono, snapshot,
                                                                              committed)
        self.workspace, self.token, self.ptxn_prefix, self.ptxn = workspace, token, ptxn_prefix, ptxn
        self.stxn_prefix, self.stxn, self.streams, self.prefixes = stxn_prefix, stxn, streams, prefixes


class StepRun:
    """Consecutive decode steps of one record read back together (Journal.read_fold): the
    fold takes their `columns` at once; `values()` gives each step's StepValues. Its
    steps are at global positions `global_position`, +3, ... (three events each)."""

    __slots__ = ("global_position", "count", "columns", "event_id", "_values")

    def __init__(self, global_position: int, count: int, columns: StepColumns | None, event_id: str,
                 values: list[StepValues] | Callable[[], list[StepValues]]) -> None:
        self.global_position, self.count, self.columns, self.event_id = global_position, count, columns, event_id
        self._values = values

    @property
    def last_position(self) -> int:
        return self.global_position + 3 * self.count - 1

    @property
    def first_event_id(self) -> str:
        return self.values()[0].first_event_id

    def values(self) -> list[StepValues]:
        if callable(self._values):
            self._values = self._values()
        return self._values

    def events(self) -> list[ev.Event]:
        return [e for x in self.values() for e in x.events()]


class BadRow(Exception):
    """Row `offset` of a run does not rebuild (`error`); `values` are the rows before it."""

    def __init__(self, offset: int, values: list[StepValues], error: Exception) -> None:
        super().__init__(str(error))
        self.offset, self.values, self.error = offset, values, error


# What a fold reads (Journal.read_fold): events, and decode steps whole.
FoldItem = ev.Event | StepValues | StepRun
