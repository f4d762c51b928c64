"""The records' lookup keys: a 64-bit key for an id (stable_key, id_keys), the runs of
consecutive keys a record's ids form (id_runs, the id index of revision 0005), and a
record's links to the record before it on each stream (revision 0006). SQL stores these
beside a record; the record's bytes are journal.record_format's.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Iterable, Sequence

import msgspec


def stable_key(value: str) -> int:
    """A signed 64-bit key for an id (a stream or operation id) in the records' lookup
    tables: 8 bytes a row where the id itself would take 32 or more. Two ids may share a
    key; a lookup reads the records it names and keeps the exact id."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little", signed=True)


# kvledger's own operation ids (engine.ids) are a 16-hex process prefix and a 16-hex
# counter. A hashed key scattered one writer's consecutive operations over the whole
# lookup B-tree, so a commit dirtied a page per operation and grew with the journal. Keyed
# by the prefix's hash and then the counter, a writer's operations land at one end of
# their own range, as a log's would.
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
    not a Python step per id: much cheaper than the loop, most of all in the write path,
    where the caches are cold after each commit's fsync (numpy was slower there than the
    loop)."""
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
    high, low = _signed_stem(prefix), _LOW
    return [high + (n & low) for n in counters]


def _signed_stem(prefix: str) -> int:
    """The key bits `prefix` sets, as the signed 64-bit column holds them (two's
    complement; a counter's bits, below bit 40, add to it)."""
    high = _stem(prefix)
    return high - (1 << 64) if high >= 1 << 63 else high


def counted_runs(prefix: str, first: int, count: int) -> list[tuple[int, int]]:
    """id_runs of the keys of `count` ids from f"{prefix}{first:016x}" on, counter by counter
    (one block of a writer's ids): one run, unless the counters cross a multiple of 2**40
    or are more than a run holds."""
    low = first & _LOW
    if count <= MAX_RUN and low + count - 1 <= _LOW:
        high = _signed_stem(prefix)
        return [(high + low, high + low + count - 1)]
    return id_runs(counted_keys(prefix, range(first, first + count)))


def id_key(value: str) -> int:
    return id_keys((value,))[0]


# -- streams as a chain through the records (revision 0006) ------------------------------
# A lookup row per (stream, record), keyed by a hash of the handle id, put each commit's
# rows on random leaf pages, most of the WAL a commit wrote. Instead each record lists, per
# stream it holds, the record before it on that stream (its stream_prev column), and
# kvl_heads.last_record names the last one: read_stream follows the chain back from the
# head, and a commit writes no extra page.
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
