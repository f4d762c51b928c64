"""Bounded inflation of a record's compressed data (journal.record_format), and each thread's zstd
contexts.

A record's compressed frame states how many bytes it holds, and a crafted one can state
gigabytes in a few kilobytes. What a reader inflates is bounded by the format's limits,
never by the frame's own word or by its compressed size (a valid record of repeated
tokens compresses nearly as well as a crafted one): a record holds at most
MAX_RECORD_BYTES, an item (an event, a step row or block, a receipt, a context) at most
MAX_ITEM_BYTES and at least one byte. A frame stating up to INFLATE_AT_ONCE inflates in
one call; a larger one a piece at a time (`Inflater`), its lists checked before any item
is inflated and each item's CRC as it is read, so damage is found after at most one item
(and a failing item is not kept).
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import zstandard

from kvledger.schemas.codec import MAX_EVENT_BYTES

MAX_RECORD_BYTES = 1 << 30
MAX_ITEM_BYTES = MAX_EVENT_BYTES  # what decode_event reads at most
INFLATE_AT_ONCE = 4 << 20
# Compressed bytes inflated per call: zstd inflates at most 32 KiB per input byte (an RLE
# block, 4 bytes for 128 KiB), so a step's output is 8 MiB at the most.
_STEP = 256
LEVEL = 1  # zstd's level 1: its higher levels cost far more CPU for a few percent
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def at_once(fmt: int, data: bytes, expected: int, decompressor: zstandard.ZstdDecompressor
            ) -> tuple[bytes, str | None]:
    """The decompressed bytes in one call (about `expected` of them at most, which the
    caller bounds: a forged frame cannot make it inflate more), and what is wrong with
    the stream (None: nothing). `decompressor`: the calling thread's."""
    try:
        if fmt == 1:
            d = zlib.decompressobj()
            out = d.decompress(data, expected + 1)
            if d.eof and not d.unused_data and len(out) == expected:
                return out, None
        else:
            # every format 2 frame states its size: one that states another is damaged
            if zstandard.frame_content_size(data) != expected:
                return b"", "compressed data states another length than the header"
            z = decompressor.decompressobj()
            out = z.decompress(data)
            if z.eof and not z.unused_data and len(out) == expected:
                return out, None
        return out[:expected + 1], "compressed data ends early, has trailing bytes or is too long"
    except (zlib.error, zstandard.ZstdError):
        pass
    # Damaged: what inflates before the damage is still exact, so the first event it
    # does not reach whole is the one named. Inflate in small steps to keep that much.
    parts: list[bytes] = []
    try:
        step = (zlib.decompressobj() if fmt == 1 else zstandard.ZstdDecompressor().decompressobj()).decompress
        for i in range(0, len(data), 64):
            parts.append(step(data[i:i + 64]))
            if sum(map(len, parts)) > expected:
                break
    except (zlib.error, zstandard.ZstdError) as exc:
        return b"".join(parts)[:expected + 1], f"compressed data damaged ({exc})"
    return b"".join(parts)[:expected + 1], "compressed data damaged"


class Inflater:
    """A compressed stream read a bounded piece at a time: `pieces(n)` yields its next n
    bytes as they inflate (fewer where it ends or is damaged: `problem` says which), so
    nothing beyond what was asked and one step's output (at most 8 MiB) is held, whatever
    the stream states or contains."""

    def __init__(self, fmt: int, data: bytes) -> None:
        self._obj = zlib.decompressobj() if fmt == 1 else zstandard.ZstdDecompressor().decompressobj()
        self._data, self._at = data, 0
        self._held = b""  # inflated past what was asked
        self.problem: str | None = None

    def pieces(self, n: int) -> Iterator[bytes]:
        want = n
        if self._held:
            piece, self._held = self._held[:want], self._held[want:]
            want -= len(piece)
            yield piece
        while want > 0 and self.problem is None and self._at < len(self._data):
            chunk = self._data[self._at:self._at + _STEP]
            self._at += _STEP
            try:
                out = self._obj.decompress(chunk)
            except (zlib.error, zstandard.ZstdError) as exc:
                self.problem = f"compressed data damaged ({exc})"
                return
            if len(out) > want:
                out, self._held = out[:want], out[want:]
            want -= len(out)
            if out:
                yield out

    def read(self, n: int) -> bytes:
        return b"".join(self.pieces(n))

    def ended(self) -> bool:
        """Whether the stream ends exactly here: no more output, no trailing input."""
        if self.read(1):
            return False
        obj = self._obj
        return self.problem is None and obj.eof and not obj.unused_data and self._at >= len(self._data)


def read_lists(inf: Inflater, counts: int, size: int) -> list[int] | str:
    """Format 5's lists (each item's length, then each CRC) from the frame's first
    8 * `counts` bytes, checked a page at a time before any item is inflated: each
    length within the item limits, and together the `size` the frame states. A string:
    what does not fit."""
    lengths: list[int] = []
    room = size - 8 * counts  # the items' bytes
    page = 8192
    for start in range(0, counts, page):
        n = min(page, counts - start)
        raw = inf.read(4 * n)
        if len(raw) < 4 * n:
            return inf.problem or "its data ends inside its lists"
        got = struct.unpack(f"<{n}I", raw)
        bad = item_limits(got, "lists")
        if bad is not None:
            return bad
        lengths += got
        room -= sum(got)
        if room < counts - len(lengths):
            return "its lists name more bytes than its frame states"
    if room != 0:
        return f"its lists name {size - 8 * counts - room} bytes, its frame states {size - 8 * counts}"
    raw = inf.read(4 * counts)
    if len(raw) < 4 * counts:
        return inf.problem or "its data ends inside its lists"
    return lengths + list(struct.unpack(f"<{counts}I", raw))


def read_items(inf: Inflater, lengths: Sequence[int], crcs: Sequence[int]) -> tuple[bytes, str | None]:
    """The items' bytes, each checked against its CRC as it inflates: up to the first
    that does not match, which is dropped (the record's audit then names it, with the
    problem returned), or all of them, with None."""
    parts: list[bytes] = []
    for n, crc in zip(lengths, crcs):
        pieces, got, c = [], 0, 0
        for piece in inf.pieces(n):
            pieces.append(piece)
            got += len(piece)
            c = zlib.crc32(piece, c)
        if got < n or c != crc:
            return b"".join(parts), inf.problem or ("compressed data ends early" if got < n
                                                    else "its bytes do not match their CRC")
        parts.append(pieces[0] if len(pieces) == 1 else b"".join(pieces))
    if not inf.ended():
        return b"".join(parts), inf.problem or "compressed data has trailing bytes or is too long"
    return b"".join(parts), None


def item_limits(lengths: Sequence[int], where: str = "header") -> str | None:
    """What is wrong with a record's item lengths (in its `where`), before inflating them."""
    if lengths and (min(lengths) < 1 or max(lengths) > MAX_ITEM_BYTES):
        return f"its {where} name an item of {min(lengths) if min(lengths) < 1 else max(lengths)} bytes " \
               f"(an item holds 1 to {MAX_ITEM_BYTES})"
    if sum(lengths) > MAX_RECORD_BYTES:
        return f"its {where} name {sum(lengths)} bytes, more than a record holds ({MAX_RECORD_BYTES})"
    return None


# -- this thread's zstd contexts ---------------------------------------------------------

_local = threading.local()


def _own(name: str, make: Callable[[], Any]) -> Any:
    """This thread's zstd context `name`, made on first use: one may not be used by two
    threads at once, and making one costs more than a small record's work."""
    found = getattr(_local, name, None)
    if found is None:
        found = make()
        setattr(_local, name, found)
    return found


def compress(data: bytes) -> bytes:
    # making a compressor costs more than compressing a one-step record (a batch-1 decode's)
    compressor: zstandard.ZstdCompressor = _own("compressor", lambda: zstandard.ZstdCompressor(level=LEVEL))
    return compressor.compress(data)


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's (making one costs more than inflating a record)."""
    found: zstandard.ZstdDecompressor = _own("decompressor", zstandard.ZstdDecompressor)
    return found
