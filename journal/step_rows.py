"""The stored layout of decode steps: a format 6 row (`Step`, msgpack), the record's shared
`Context`, and what a format 7 block (journal.blocks) holds a step as (`Row`).

A row's values are differences from the row before (the first row's from zero): ids as
counters under a prefix in Context.prefixes, clocks as differences, the stream as an index
in Context.streams. A row is one item of the record with one CRC, in place of three
events' and a receipt's: a damaged row is named by its first event.
"""

from __future__ import annotations

import msgspec

from kvledger.journal.step_values import Call, Sha256, StreamEntry
from kvledger.schemas.events import Count


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


class Context(msgspec.Struct, array_like=True, frozen=True, gc=False):
    first_position: Count  # the record's first event's global position
    committed_wall_ns: Count
    prefixes: list[str]
    streams: list[StreamEntry]



_encode = msgspec.msgpack.Encoder().encode
_decode_step = msgspec.msgpack.Decoder(Step).decode

# Record format 7 stores a record's run of steps as one block of columns (journal.blocks).
Row = tuple[tuple[int, ...], bytes | None]  # a step's thirty values (journal.blocks' order) and its digest
MARK = 0xC1  # a block's first byte: one msgpack never writes, and not an event's "{"


class _ContextParts(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A Context with its streams left undecoded (Raw): consecutive records of a decode
    loop name the same streams, and decoding their tables' strings again and again
    cost more than the rest of the context."""

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
    # (a compare: cheaper than copying and hashing the table to look it up).
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
# What a row that does not rebuild raises (journal.legacy.RowReader.values and .run).
ROW_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError, IndexError, TypeError, OverflowError)


def is_row(item: bytes) -> bool:
    """A record item that is a step row (a msgpack array), not an event (JSON, `{`)."""
    return item[:1] != b"{"
