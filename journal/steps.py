"""Decode steps stored as values, not events: record formats 6 (a row a step) and 7 (a block
of columns a run; journal.blocks) (docs/reference/storage-format.md).

A worker's decode step writes three events (append_publish, output_emit, append_start)
and a receipt. In the form the service marks derived when it plans a decided batch
(engine/batch_plan.py, Operation.derived), nearly every field of the four is fixed by a handful of values: the
envelope repeats across the three events, the positions and sequence numbers count up,
the snapshot versions are the base plus one, the start's interval is the committed length
and the emitted token. Formats 1 to 5 stored the three JSON bodies and a compact
receipt; format 6 stores a `Step` row: the values that are not fixed, with ids as
counters under a prefix and clocks as differences from the step before, so little but
the random row digest is left a step.

Readers rebuild the three events as the structs `decode_event` would give, and their
JSON with the same encoder, so `read_all`, `export` and `verify` see the bytes format 5
stored (tests/test_steps.py holds that over generated chains); the receipt comes back
through schemas.decode_fingerprint as in format 4. The writer turns an operation into a
row only when every relation the rebuild assumes holds, with exact types, and stores the
others as before (`StepWriter.row` returns None); for the service's own plan of a decided batch
(Operation.stamped) the relations hold by construction and only what the plan takes
from its caller is checked (tests/test_batch_plan.py rebuilds every such row).

A row is one item of the record with one CRC, in place of three events' and a receipt's:
a damaged row is named by its first event. The record's shared values (its first global
position, the commit time, the id prefixes, each stream's envelope and cache ABI) are a
`Context` stored after the receipts.

Format 6 stored a Step as msgpack, one row an item; format 7 (written since)
stores a record's run of steps as one block of the same values, column by column
(journal.blocks), so that a fold reads a run as arrays rather than decoding it row by
row. Both are read; what a reader gives is the same for either.

This module writes them (StepWriter, format 7 only); journal.step_values holds a step's
values, journal.step_rows the stored layout, journal.step_reader reads blocks back and
journal.legacy.RowReader format 6's rows. The names
the other layers and the tests import from here stay importable from here.
"""

from __future__ import annotations

import msgspec

from kvledger.journal.contract import Operation
from kvledger.journal.step_reader import BadRow, StepReader, block_runs
from kvledger.journal.step_rows import (
    MARK,
    ROW_ERRORS,
    Context,
    Row,
    Step,
    _encode,
    decode_context,
    is_row,
)
from kvledger.journal.step_values import (
    _EMIT,
    _HALF,
    _MASK,
    _PUBLISH,
    _START,
    _U64,
    VERSIONS,
    Call,
    DecodeStep,
    FoldItem,
    StepColumns,
    StepRun,
    StepValues,
    StreamEntry,
    parsed_counter,
    row_parts,
)
from kvledger.schemas.ids import counter_of, lower_hex

_json = msgspec.json.Encoder().encode
_GAPS = (1, 1, 1)  # the event ids' counters after the operation's, as engine.batch_plan draws them


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
        if (x := op.step) is not None:  # the plan's facts: what it took from its caller is checked
            parts = row_parts(x.rows_sha256, x.call)  # the digest and call id in a row's form
            return None if parts is None else self._row(x, *parts)
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
            # The service's batch plan stamped these events: every relation below holds
            # by construction (tests/test_steps.py holds the lane to it), except what it
            # takes from the caller as given and what another thread may interleave.
            if (type(sp.token_ids[0]) is not int or type(sp.cache_positions[0]) is not int
                    or p.event_id != f"{prefix}{n + 1:016x}" or o.event_id != f"{prefix}{n + 2:016x}"
                    or s.event_id != f"{prefix}{n + 3:016x}"):
                return None
        # Everything else the rebuild derives, as JSON both ways: equal JSON is what a
        # reader must get back (1 and True, or 2 and 2.0, are equal but encode apart).
        # Event ids follow the operation's (engine.batch_plan draws them so).
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
        and its digest), or None."""
        return self._row(x, x.digest, x.call)

    def _row(self, x: StepValues | DecodeStep, digest: bytes | None, call: tuple[str, int, Call] | None
             ) -> Row | None:
        """values_row of `x` with its digest and call in a row's form. Checked here: what a
        caller gives a batch (the token, the workspace, the call's numbers, the ids' form)
        and that every value is an int64; the rest the plan derived."""
        seq, mono, wall = x.local_sequence, x.monotonic_ns, x.observed_wall_time
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
        gaps = x.gaps
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

    @staticmethod
    def formed(x: DecodeStep) -> bool:
        """Its digest and call id are in a row's form: a planned step stored as events
        only for another reason keeps its receipt derived (journal.record_rows)."""
        return row_parts(x.rows_sha256, x.call) is not None

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



__all__ = [
    "MARK",
    "ROW_ERRORS",
    "VERSIONS",
    "BadRow",
    "Call",
    "Context",
    "FoldItem",
    "Row",
    "Step",
    "StepColumns",
    "StepReader",
    "StepRun",
    "StepValues",
    "StepWriter",
    "StreamEntry",
    "block_runs",
    "counter_of",
    "decode_context",
    "is_row",
    "lower_hex",
    "parsed_counter",
    "row_parts",
]
