"""A stored record read back: its parts (RecordParts, or the Damage an audit found), its
events and receipts (Record), its decode steps as runs (Steps), and the compact receipts
of formats 3 and later. What every format's reader gives; journal.record_format reads
the current format's frame, journal.legacy the older ones, journal.audit picks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from kvledger.journal.step_reader import StepReader
from kvledger.journal.step_values import StepRun, StepValues
from kvledger.schemas.codec import decode_event, encode_event
from kvledger.schemas.decode_fingerprint import chain_events, decode_chain_fingerprint
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import Event
from kvledger.schemas.ids import lower_hex
from kvledger.schemas.receipts import HandleResult, Receipt, receipt_encoder

# Every format this kvledger reads: 7 is written (journal.record_format), 1 to 6 are
# read-only (journal.legacy)
FORMATS = (1, 2, 3, 4, 5, 6, 7)
_encode = msgspec.msgpack.Encoder().encode


class Record:
    """A record's events and receipts, each as the JSON bytes the one-row-per-event layout
    stored. A format 3 to 6 record's receipts are expanded from its events when first read
    (most reads want events only); a format 6 record's step rows are rebuilt as events
    when it is read, and as JSON only when its bytes are wanted (`decoded` needs none)."""

    __slots__ = ("_compact", "_events", "_receipts", "_steps")

    def __init__(self, events: list[bytes] | None, receipts: list[bytes], compact: bool = False,
                 steps: Steps | None = None) -> None:
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
        if len(steps.items) == 1 and len(steps.runs) == 1:  # a decode loop's record: one block
            return 3 * steps.runs[0].count
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
        steps = self._steps
        if steps is None:
            return list(self.decoded())  # a copy: list[Event] is not list[Event | StepRun] to mypy
        if len(steps.items) == 1 and len(steps.runs) == 1:  # a decode loop's record: one block
            return [steps.runs[0]]
        return steps.folded()

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
# events determine the command, so schemas.decode_fingerprint rebuilds it (random bytes
# that zstd cannot remove).


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


def cut(data: bytes, lengths: list[int]) -> list[bytes]:
    """`data` cut into consecutive slices of `lengths` (short or empty where it ends early)."""
    ends = list(itertools.accumulate(lengths))
    return [data[a:b] for a, b in zip([0, *ends], ends)]


# -- formats 6 and 7: decode steps among the events -------------------------------------
# The frame's lists are format 5's; its "events" are items, each an event's JSON, a step
# row (format 6, journal.steps) or a block of steps (format 7, journal.blocks), and after
# the compact receipts of the operations stored as events comes the record's Context. A
# row is one item, one CRC: damage in it names its first event. A block is one item too;
# when its CRC fails, its CRC column names the first damaged step.


class Steps:
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


def partial_run(values: list[StepValues]) -> StepRun:
    """The steps of a run before its damage, which are exact."""
    return StepRun(values[0].global_position, len(values), None, values[-1].event_id, values)
