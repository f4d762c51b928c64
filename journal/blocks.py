"""Record format 7: a record's run of decode steps as one block of columns
(docs/reference/storage-format.md).

Format 6 stored each decode step as a msgpack row, one item with one CRC: replaying a
record decoded, cut and checked every row and moved every value through Python before
numpy saw it, the largest part of a replayed token. Format 7 stores a
run of consecutive steps as one item: the same values (journal.step_rows.Step, as the
thirty int64s below) column by column, each column as wide as its values need, then the
row digests, then a CRC-32 a step. A reader checks the item's one CRC and reads each width
group with one `numpy.frombuffer`. The CRC column is read only when the item's CRC fails:
it names the first damaged step, as a row's CRC did.

    MARK, n (uint32), 30 widths (1, 2, 4 or 8 bytes), the columns grouped by width (each
    group in column order, n values a column, little-endian signed), n digests of 32
    bytes (zeros: no digest), n CRC-32s (uint32) of a step's 30 values as int64 and its
    digest

The thirty values, ordered so that a run's checks are slices:
    0-4    indexes: stream, prefix, publish txn prefix, start txn prefix, call prefix
    5-14   counts (>= 0): position, snapshot, committed, accepted, layers, workspace,
           output, token, call index, call threads
    15-17  the call's size, new_pad and key_extent (> 0 with a call)
    18-19  flags: a digest, a call
    20-29  differences (any int64): sequence, mono, wall, op, the three gaps, publish
           txn, start txn, call counter
Without a call its columns are 0 (NO_CALL); without a digest its bytes are.

journal.steps and journal.step_reader import this module where a block is written or read:
the journal's API imports no numpy (tests/test_layers.py).
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence

import numpy as np

from kvledger.journal.step_rows import MARK, Row

VALUES = 30
HEADER = 5 + VALUES
NO_DIGEST = bytes(32)
NO_CALL = (4, 13, 14, 15, 16, 17, 29)  # the columns a step without a call stores as 0
_WIDTHS = (1, 2, 4, 8)
_ROW = 8 * VALUES  # a step's values as int64, which its CRC covers with its digest


def pack(rows: Sequence[Row]) -> bytes:
    """The block of `rows` (each value an int64: StepWriter.values_row checks it).

    Written for the writer's hot loop, where an array call costs far more than in a tight
    loop (bench.ab --frames): the values become int64 bytes in one struct call,
    which the step CRCs read as they are, and the array calls are the least a column's
    width and its group's bytes take."""
    n = len(rows)
    values = [r[0] for r in rows]
    flat = struct.pack(f"<{VALUES * n}q", *itertools.chain.from_iterable(values))
    digests = b"".join([NO_DIGEST if d is None else d for _, d in rows])
    return _block(flat, n, _few_columns(values) if n <= FEW else _columns(flat, n), digests)


def pack_matrix(m: np.ndarray, digests: bytes) -> bytes:
    """pack of n steps whose values are the rows of `m` (n x 30, int64) and whose digests
    are `digests` (n x 32 bytes, NO_DIGEST for none): a run's block built from its columns
    (journal.run_writer)."""
    n = len(m)
    flat = np.ascontiguousarray(m, "<i8").tobytes()
    return _block(flat, n, _few_columns(m.tolist()) if n <= FEW else _matrix_columns(m), digests)


def _block(flat: bytes, n: int, columns: list[bytes], digests: bytes) -> bytes:
    """The block of n steps: their values as int64 (`flat`), their columns' bytes, their
    digests (n x 32 bytes)."""
    return b"".join([struct.pack("<BI", MARK, n), *columns, digests, struct.pack(f"<{n}I", *_crcs(flat, digests))])


def _columns(flat: bytes, n: int) -> list[bytes]:
    """The widths and the width groups' bytes of n steps' values (`flat`, as int64)."""
    return _matrix_columns(np.frombuffer(flat, "<i8").reshape(n, VALUES))


def _matrix_columns(m: np.ndarray) -> list[bytes]:
    """_columns of the steps' values as the rows of `m` (n x 30, int64)."""
    # as _width, a column's widest value less the sign; its width from a table: fewer array calls
    widths = bytes([_BYTES[v.bit_length()] for v in (m ^ (m >> 63)).max(axis=0).tolist()])
    cols = m.T
    return [widths, *(cols[g].astype(f"<i{w}").tobytes() for w in _WIDTHS if (g := _group(widths, w)))]


# Up to this many steps a block is built without numpy: a batch-1 commit follows a model call that evicted numpy's code.
FEW = 2
_CODES = {1: "b", 2: "h", 4: "i", 8: "q"}


def _few_columns(values: list[tuple[int, ...]]) -> list[bytes]:
    """_columns, for a few steps' values, in plain Python."""
    sizes = [list(map(_width, row)) for row in values]
    widths = bytes(sizes[0] if len(sizes) == 1 else map(max, *sizes))
    cols = list(zip(*values))
    return [widths, *(struct.pack(f"<{len(g) * len(values)}{_CODES[w]}", *itertools.chain.from_iterable(
        [cols[i] for i in g])) for w in _WIDTHS if (g := _group(widths, w)))]


def _crcs(flat: bytes, digests: bytes) -> list[int]:
    """Each step's CRC-32: of its values as int64 (`flat`: the steps' rows, one after the
    other), then its digest (`digests`: 32 bytes a step)."""
    crc = zlib.crc32
    return [crc(digests[j:j + 32], crc(flat[i:i + _ROW]))
            for i, j in zip(range(0, len(flat), _ROW), range(0, len(digests), 32))]


# a value's width in bytes by its bit length without the sign (v ^ (v >> 63): v, or ~v below zero)
_BYTES = bytes(1 if b < 8 else 2 if b < 16 else 4 if b < 32 else 8 for b in range(64))


def _width(v: int) -> int:
    """The bytes a signed little-endian column needs to hold `v` (an int64: values_row
    checks it; past int64 is an IndexError)."""
    return _BYTES[(v ^ (v >> 63)).bit_length()]


_groups: dict[tuple[bytes, int], list[int]] = {}


def _group(widths: bytes, w: int) -> list[int]:
    """The columns of width `w` (records repeat their widths: cached)."""
    key = (widths, w)
    found = _groups.get(key)
    if found is None:
        if len(_groups) > 4096:  # a cache, not a registry
            _groups.clear()
        found = _groups[key] = [i for i, x in enumerate(widths) if x == w]
    return found


def read(item: bytes) -> tuple[np.ndarray, bytes]:
    """The block's values (30 x n, int64, column by column: writable, the caller's own)
    and its digests. ValueError if its header or length does not hold; its CRCs are not
    looked at (`damaged` does)."""
    m, digests = read_many([item])
    return m[0], digests[0]


def read_many(items: Sequence[bytes]) -> tuple[np.ndarray, list[bytes]]:
    """What `read` gives of each of blocks of one shape (their first HEADER bytes and
    their lengths the same: a decode loop's records repeat them), stacked: R x 30 x n,
    one array call a width group for all of them. ValueError as `read`."""
    item = items[0]
    if len(item) < HEADER or item[0] != MARK:
        raise ValueError("not a step block")
    n = int.from_bytes(item[1:5], "little")
    layout = _layout(item[5:HEADER])
    if n < 1 or layout is None:
        raise ValueError(f"a step block of {n} steps with widths {item[5:HEADER].hex()}")
    size, groups, order = layout
    at, length = HEADER + n * size, len(item)
    if length != at + 36 * n:
        raise ValueError(f"a step block of {length} bytes, its header says {at + 36 * n}")
    if any(len(x) != length or x[:HEADER] != item[:HEADER] for x in items):
        raise ValueError("blocks of more than one shape")
    data = item if len(items) == 1 else b"".join(items)
    stored = np.empty((len(items), VALUES, n), np.int64)  # the columns in the order they are stored
    row, start = 0, HEADER
    for dtype, k in groups:
        w = dtype.itemsize
        stored[:, row:row + k] = np.ndarray((len(items), k, n), dtype, data, start, (length, n * w, w))
        row, start = row + k, start + k * n * w
    return (stored if order is None else stored[:, order]), [x[at:at + 32 * n] for x in items]


# widths -> a step's bytes in the columns, each width group's (dtype, columns), and where
# each column is among the stored ones (None: in place)
_Layout = tuple[int, list[tuple[np.dtype, int]], np.ndarray | None]
_layouts: dict[bytes, _Layout | None] = {}


def _layout(widths: bytes) -> _Layout | None:
    """How a block of these widths is stored, or None: a width that is none of 1, 2, 4 or 8
    (records repeat their widths: cached)."""
    if widths in _layouts:
        return _layouts[widths]
    found = None
    if all(w in _WIDTHS for w in widths):
        stored = [i for w in _WIDTHS for i in _group(widths, w)]
        order = None if stored == sorted(stored) else np.argsort(np.array(stored, np.intp))
        found = (sum(widths), [(np.dtype(f"<i{w}"), len(_group(widths, w))) for w in _WIDTHS if w in widths], order)
    if len(_layouts) > 4096:  # a cache, not a registry
        _layouts.clear()
    _layouts[widths] = found
    return found


def damaged(item: bytes) -> int:
    """The first step of a block whose CRC fails (0: the block does not parse, or no step's
    CRC fails: the damage is in what they do not cover, which the first step is named for)."""
    try:
        m, digests = read(item)
    except ValueError:
        return 0
    n = m.shape[1]
    stored = struct.unpack_from(f"<{n}I", item, len(item) - 4 * n)
    rows = np.ascontiguousarray(m.T, "<i8").tobytes()
    found = _crcs(rows, digests)
    return next((i for i, (a, b) in enumerate(zip(found, stored)) if a != b), 0)


def invalid(m: np.ndarray, digests: bytes, streams: int, prefixes: int,
            bounds: tuple[list[int], list[int]] | None = None) -> int | None:
    """The first step whose values no Step could hold (an index past its table, a negative
    count, a flag not 0 or 1, a call's values without a call), or None. A run's columns'
    least and greatest values (`bounds`, if the caller has them) settle most blocks in two
    array calls; mixed calls or digests, or a bad step, are looked at step by step."""
    lo, hi = (m.min(axis=1).tolist(), m.max(axis=1).tolist()) if bounds is None else bounds
    if (min(lo[:20]) >= 0 and hi[0] < streams and max(hi[1:4]) < prefixes and max(hi[18:20]) <= 1
            # every step has a call; or none has, and its columns are 0 (those of 0-19 are >= 0)
            and (lo[19] == 1 and hi[4] < prefixes and min(lo[15:18]) >= 1
                 or hi[19] == 0 == hi[4] == max(hi[13:18]) == lo[29] == hi[29])
            and (lo[18] == 1 or hi[18] == 0 and digests == bytes(len(digests)))):
        return None
    for i, v in enumerate(m.T.tolist()):
        if not step_ok(v, digests[32 * i:32 * i + 32], streams, prefixes):
            return i
    return None


def step_ok(v: Sequence[int], digest: bytes, streams: int, prefixes: int) -> bool:
    """Whether one step's values are a Step's (see `invalid`)."""
    if (min(v[:20]) < 0 or v[0] >= streams or max(v[1:4]) >= prefixes or v[18] > 1 or v[19] > 1
            or not (v[18] or digest == NO_DIGEST)):
        return False
    return v[4] < prefixes and min(v[15:18]) >= 1 if v[19] else not any(v[i] for i in NO_CALL)
