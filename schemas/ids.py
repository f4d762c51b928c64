"""The id format shared by who draws ids (engine.ids), who stores them (the journal keeps a
decode step's ids as counters) and who reads them back (replay matches a step's txn by
its counter): 32 lowercase hex digits, a 16-digit prefix then a 16-digit counter. And what
any id must be for the journal to store it and read it back (id_problem).
"""

from __future__ import annotations

MAX_ID = 256  # characters: schemas.events.Id


def id_problem(value: str) -> str | None:
    """Why `value` is no id the journal can store and read back, or None: an event's Id
    holds 1 to MAX_ID characters; PostgreSQL text cannot hold NUL; a lone surrogate is no
    UTF-8 a database stores."""
    if 0 < len(value) <= MAX_ID and value.isascii() and "\x00" not in value:
        return None  # the usual id, in one test
    if not 0 < len(value) <= MAX_ID:
        return f"has {len(value)} characters (1 to {MAX_ID})"
    if "\x00" in value:
        return "contains NUL"
    try:
        value.encode()
    except UnicodeEncodeError:
        return "is not UTF-8 text (a lone surrogate)"
    return None


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
