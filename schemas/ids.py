"""The id format shared by who draws ids (engine.ids), who stores them (the journal keeps a
decode step's ids as counters) and who reads them back (replay matches a step's txn by
its counter): 32 lowercase hex digits, a 16-digit prefix then a 16-digit counter.
"""

from __future__ import annotations


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


def counter_of(value: object) -> int | None:
    """The counter (last 16 digits) of an id of 32 lowercase hex digits, or None."""
    raw = lower_hex(value, 16)
    return None if raw is None else int.from_bytes(raw[8:])
