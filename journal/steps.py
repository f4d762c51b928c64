"""Decode steps stored as one row each: record format 6 (docs/COMPACT.md, step 12).

A worker's decode step writes three events (append_publish, output_emit, append_start)
and a receipt. In the form the service's decode lane marks derived (engine/decode_step.py,
Operation.derived), nearly every field of the four is fixed by a handful of values: the
envelope repeats across the three events, the positions and sequence numbers count up,
the snapshot versions are the base plus one, the start's interval is the committed length
and the emitted token. Formats 1 to 5 stored the three JSON bodies (about 1.9 KB, 140
bytes once compressed with their neighbours) and a compact receipt; format 6 stores a
`Step` row: the values that are not fixed, with ids as counters under a prefix and
clocks as differences from the step before, so zstd keeps ~35 bytes a step, most of
them the row digest.

Readers rebuild the three events as the structs `decode_event` would give, and their
JSON with the same encoder, so `read_all`, `export` and `verify` see the bytes format 5
stored (tests/test_steps.py holds that over generated chains); the receipt comes back
through schemas.decode_fingerprint as in format 4. The writer turns an operation into a
row only when every relation the rebuild assumes holds, with exact types, and stores the
others as before (`StepWriter.row` returns None).

A row is one item of the record with one CRC, in place of three events' and a receipt's:
a damaged row is named by its first event. The record's shared values (its first global
position, the commit time, the id prefixes, each stream's envelope and cache ABI) are a
`Context` stored after the receipts.
"""

from __future__ import annotations

import re

import msgspec

from kvledger.journal.contract import Operation
from kvledger.schemas import events as ev
from kvledger.schemas.decode_fingerprint import DECODE_CHAIN, decode_chain_fingerprint
from kvledger.schemas.receipts import HandleResult, Receipt, receipt_encoder

# The schema versions a row rebuilds its events at. A later version of any of the three
# is not a row: the writer stores such events as JSON (a new row layout would be a format).
VERSIONS = (2, 1, 3)
_V_PUBLISH, _V_EMIT, _V_START = VERSIONS
_HEX32 = re.compile("[0-9a-f]{32}").fullmatch
_U64 = 1 << 64
_MASK, _HALF = _U64 - 1, 1 << 63
_PUBLISH, _EMIT, _START = DECODE_CHAIN


class Call(msgspec.Struct, array_like=True, frozen=True, gc=False):
    prefix: int  # of call_id, in Context.prefixes
    counter: int  # call_id's counter less the previous row's (the batch's rows share one call)
    index: int
    size: int
    new_pad: int
    key_extent: int
    threads: int


class Step(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One decode step. Differences are from the previous row of the record (the first
    row's from zero): consecutive steps of one writer differ by small, repeating numbers."""

    stream: int  # index in Context.streams
    position: int  # the publication's stream position; the emit's and the start's follow
    sequence: int  # local_sequence less the previous row's plus three
    mono: int  # monotonic_ns less the previous row's
    wall: int  # observed_wall_time less the previous row's, less `mono`: the clocks' drift
    prefix: int  # of the operation and event ids, in Context.prefixes
    op: int  # the operation id's counter less the previous row's
    gaps: tuple[int, int, int]  # event ids' counters: publish - op, emit - publish, start - emit
    publish_txn: tuple[int, int]  # prefix, counter less the previous row's
    start_txn: tuple[int, int]
    snapshot: int  # the publication's base snapshot version
    committed: int  # committed length after it: the start's interval begins there
    accepted: int
    layers: int
    workspace: int
    digest: bytes | None  # rows_sha256, its 32 bytes
    output: int  # output_index
    token: int
    call: Call | None


class Context(msgspec.Struct, array_like=True, frozen=True, gc=False):
    first_position: int  # the record's first event's global position
    committed_wall_ns: int
    prefixes: list[str]
    # stream_id, request_id, handle_generation, source_instance, cache ABI (32 bytes)
    streams: list[tuple[str, str, int, str, bytes]]


_encode = msgspec.msgpack.Encoder().encode
_decode_step = msgspec.msgpack.Decoder(Step).decode
_decode_context = msgspec.msgpack.Decoder(Context).decode


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
        self._last = (0, 0, 0, 0, 0, 0, 0)  # sequence, mono, wall, op, publish txn, start txn, call

    def row(self, op: Operation) -> bytes | None:
        """The row of a derived decode chain, or None: it is stored as events."""
        if not op.derived or len(op.writes) != 1 or op.checks or op.manifests:
            return None
        w = op.writes[0]
        if len(w.events) != 3:
            return None
        p, o, s = w.events
        if type(p) is not _PUBLISH or type(o) is not _EMIT or type(s) is not _START:
            return None
        pp, op_, sp, head = p.payload, o.payload, s.payload, w.head
        pos, seq, mono, wall, v, c = (p.stream_position, p.local_sequence, p.monotonic_ns, p.observed_wall_time,
                                      pp.base_snapshot_version, pp.committed_length)
        token = op_.token_id
        # Every value the rebuild derives must be what the events hold, with its type: a
        # True where an int was, or 2.0 where 2 was, encodes to other JSON.
        if (type(pos) is not int or type(seq) is not int or type(mono) is not int or type(wall) is not int
                or not 0 <= seq < _U64 or not 0 <= mono < _U64 or not 0 <= wall < _U64
                or type(v) is not int or type(c) is not int or type(token) is not int
                or type(pp.accepted_count) is not int or type(pp.layers_complete) is not int
                or type(pp.workspace_bytes) is not int or type(op_.output_index) is not int
                or (p.schema_version, o.schema_version, s.schema_version) != VERSIONS
                or p.caused_by_event_id is not None or o.caused_by_event_id is not None
                or s.caused_by_event_id is not None
                or not (p.operation_id == o.operation_id == s.operation_id == op.operation_id)
                or not (w.handle_id == p.stream_id == o.stream_id == s.stream_id)
                or not (p.request_id == o.request_id == s.request_id)
                or not (p.handle_generation == o.handle_generation == s.handle_generation)
                or not (p.source_instance == o.source_instance == s.source_instance)
                or o.stream_position != pos + 1 or s.stream_position != pos + 2
                or o.local_sequence != seq + 1 or s.local_sequence != seq + 2
                or o.monotonic_ns != mono or s.monotonic_ns != mono
                or o.observed_wall_time != wall or s.observed_wall_time != wall
                or type(pp.result_snapshot_version) is not int or pp.result_snapshot_version != v + 1
                or pp.logits_ready is not True
                or type(op_.snapshot_version) is not int or op_.snapshot_version != v + 1
                or sp.kind != "decode" or type(sp.base_snapshot_version) is not int
                or sp.base_snapshot_version != v + 1
                or type(sp.interval_start) is not int or sp.interval_start != c
                or type(sp.interval_count) is not int or sp.interval_count != 1
                or type(sp.mask_key_extent) is not int or sp.mask_key_extent != c + 1
                or type(sp.token_ids) is not tuple or len(sp.token_ids) != 1 or type(sp.token_ids[0]) is not int
                or sp.token_ids[0] != token
                or type(sp.cache_positions) is not tuple or len(sp.cache_positions) != 1
                or type(sp.cache_positions[0]) is not int or sp.cache_positions[0] != c
                or head.generation != p.handle_generation or head.snapshot_version != v + 1
                or head.stream_position != pos + 2 or head.committed_length != c):
            return None
        ids = self._ids(op.operation_id, p.event_id, o.event_id, s.event_id)
        ptxn, stxn = self._id(pp.txn_id), self._id(sp.txn_id)
        digest = _raw(pp.rows_sha256) if pp.rows_sha256 is not None else None
        abi = _raw(sp.cache_abi_sha256)
        if ids is None or ptxn is None or stxn is None or abi is None or (digest is None) != (pp.rows_sha256 is None):
            return None
        call = sp.call
        last = self._last
        ccount = last[6]
        if call is not None:
            cid = self._id(call.call_id)
            if (cid is None or type(call.index) is not int or type(call.size) is not int
                    or type(call.new_pad) is not int or type(call.key_extent) is not int
                    or type(call.threads) is not int):
                return None
            ccount = cid[1]
            call_row: Call | None = Call(cid[0], _delta(cid[1], last[6]), call.index, call.size, call.new_pad,
                                         call.key_extent, call.threads)
        else:
            call_row = None
        dmono = _delta(mono, last[1])
        try:
            # types the JSON encoder would refuse raise here too, so such an operation
            # fails as it would have
            row = _encode(Step(
                self._stream(p.stream_id, p.request_id, p.handle_generation, p.source_instance, abi),
                pos, _delta(seq, last[0] + 3), dmono, _delta(_delta(wall, last[2]), dmono), ids[0],
                _delta(ids[1], last[3]), (_delta(ids[2], ids[1]), _delta(ids[3], ids[2]), _delta(ids[4], ids[3])),
                (ptxn[0], _delta(ptxn[1], last[4])), (stxn[0], _delta(stxn[1], last[5])),
                v, c, pp.accepted_count, pp.layers_complete, pp.workspace_bytes, digest, op_.output_index, token,
                call_row))
        except (TypeError, OverflowError, msgspec.EncodeError):
            return None
        self._last = (seq, mono, wall, ids[1], ptxn[1], stxn[1], ccount)
        self.count += 1
        return row

    def context(self) -> bytes:
        return _encode(Context(self.first_position, self.committed_wall_ns, list(self.prefixes),
                               list(self.streams)))

    def _prefix(self, prefix: str) -> int:
        n = self.prefixes.get(prefix)
        if n is None:
            n = self.prefixes[prefix] = len(self.prefixes)
        return n

    def _id(self, value: str) -> tuple[int, int] | None:
        """(prefix index, counter) of an id of 32 lowercase hex digits (engine.ids'), or None."""
        if type(value) is not str or _HEX32(value) is None:
            return None
        return self._prefix(value[:16]), int(value[16:], 16)

    def _ids(self, op_id: str, *event_ids: str) -> tuple[int, int, int, int, int] | None:
        """The prefix the operation's and its events' ids share, and their counters."""
        if type(op_id) is not str or _HEX32(op_id) is None:
            return None
        prefix = op_id[:16]
        counters = [int(op_id[16:], 16)]
        for e in event_ids:
            if type(e) is not str or e[:16] != prefix or _HEX32(e) is None:
                return None
            counters.append(int(e[16:], 16))
        return (self._prefix(prefix), *counters)  # type: ignore[return-value]  # four counters, above

    def _stream(self, *key: str | int | bytes) -> int:
        n = self.streams.get(key)  # type: ignore[arg-type]  # the five fields of Context.streams
        if n is None:
            n = self.streams[key] = len(self.streams)  # type: ignore[index]  # as above
        return n


def _raw(digest: object) -> bytes | None:
    """The 32 bytes of a lowercase hex SHA-256, or None."""
    if type(digest) is not str or len(digest) != 64:
        return None
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        return None
    return raw if raw.hex() == digest else None


class StepReader:
    """Rebuilds a record's rows in order (each row's differences are from the one before)."""

    def __init__(self, context: bytes) -> None:
        self.context = ctx = _decode_context(context)  # raises msgspec's errors: the caller names the damage
        self._abis = [s[4].hex() for s in ctx.streams]
        self._last = (0, 0, 0, 0, 0, 0, 0)

    def events(self, row: bytes, at: int) -> tuple[ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent]:
        """The three events of `row`, whose publication is the record's event `at`
        (counted from 0). Raises ValueError or msgspec's errors for a row that does not
        rebuild."""
        # Every replay of a decode step comes through here: no helper calls, no dicts.
        x = _decode_step(row)
        ctx, last, prefixes = self.context, self._last, self.context.prefixes
        stream_id, request_id, generation, source, _ = ctx.streams[x.stream]
        abi = self._abis[x.stream]
        prefix = prefixes[x.prefix]
        seq = (last[0] + 3 + x.sequence) & _MASK
        mono = (last[1] + x.mono) & _MASK
        wall = (last[2] + x.mono + x.wall) & _MASK
        op = (last[3] + x.op) & _MASK
        gaps = x.gaps
        e1 = (op + gaps[0]) & _MASK
        e2 = (e1 + gaps[1]) & _MASK
        e3 = (e2 + gaps[2]) & _MASK
        ptxn, stxn = (last[4] + x.publish_txn[1]) & _MASK, (last[5] + x.start_txn[1]) & _MASK
        v, c, pos, token = x.snapshot, x.committed, x.position, x.token
        ccount = last[6]
        call = None
        if x.call is not None:
            k = x.call
            ccount = (ccount + k.counter) & _MASK
            call = ev.ForwardCall(f"{prefixes[k.prefix]}{ccount:016x}", k.index, k.size, k.new_pad, k.key_extent,
                                  k.threads)
        operation_id = f"{prefix}{op:016x}"
        g = ctx.first_position + at
        digest = x.digest
        publish = _PUBLISH(
            event_id=f"{prefix}{e1:016x}", global_position=g, stream_id=stream_id, stream_position=pos,
            schema_version=_V_PUBLISH, request_id=request_id, handle_generation=generation, operation_id=operation_id,
            source_instance=source, local_sequence=seq, monotonic_ns=mono, observed_wall_time=wall,
            payload=ev.AppendPublish(f"{prefixes[x.publish_txn[0]]}{ptxn:016x}", v, v + 1, c, x.accepted, x.layers,
                                     True, x.workspace, None if digest is None else digest.hex()))
        v += 1
        emit = _EMIT(
            event_id=f"{prefix}{e2:016x}", global_position=g + 1, stream_id=stream_id, stream_position=pos + 1,
            schema_version=_V_EMIT, request_id=request_id, handle_generation=generation, operation_id=operation_id,
            source_instance=source, local_sequence=seq + 1, monotonic_ns=mono, observed_wall_time=wall,
            payload=ev.OutputEmit(x.output, token, v))
        start = _START(
            event_id=f"{prefix}{e3:016x}", global_position=g + 2, stream_id=stream_id, stream_position=pos + 2,
            schema_version=_V_START, request_id=request_id, handle_generation=generation, operation_id=operation_id,
            source_instance=source, local_sequence=seq + 2, monotonic_ns=mono, observed_wall_time=wall,
            payload=ev.AppendStart(f"{prefixes[x.start_txn[0]]}{stxn:016x}", "decode", v, c, 1, (token,), (c,),
                                   c + 1, abi, call))
        self._last = (seq, mono, wall, op, ptxn, stxn, ccount)
        return publish, emit, start

    def receipt(self, events: tuple[ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent]) -> bytes:
        """The JSON receipt of a step's operation, as the writer returned it."""
        p, o, s = events
        return receipt_encoder.encode(Receipt(
            p.operation_id or "", decode_chain_fingerprint(p, o, s),
            (HandleResult(p.stream_id, p.handle_generation, p.payload.result_snapshot_version, s.stream_position,
                          p.payload.committed_length),),
            (p.event_id, o.event_id, s.event_id), p.global_position, s.global_position,
            self.context.committed_wall_ns))


def _delta(value: int, previous: int) -> int:
    """value - previous modulo 2**64, as a signed 64-bit int: what msgpack stores in at
    most 9 bytes (a reader adds it back modulo 2**64), small when the two are close."""
    return ((value - previous + _HALF) & _MASK) - _HALF
