"""What verify checks about a stored row beyond the event it decodes to: that the indexed
columns (which reads select and order by) agree with the body, and what can still be said
about a body that does not decode. Pure functions over rows as the database returned them;
none raises on any input.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvledger.journal.contract import StoredEvent, StoredReceipt
from kvledger.schemas import events as ev
from kvledger.schemas.receipts import Receipt, receipt_decoder

_UNSET = msgspec.Raw(b"null")
_SMALL = 512  # an envelope field longer than this is not decoded for a finding's names


class _Envelope(msgspec.Struct):
    """The envelope of a body that failed to decode, as raw JSON spans: nothing is
    allocated for a huge or deeply nested field, and no field's type can fail."""

    event_type: msgspec.Raw = _UNSET
    schema_version: msgspec.Raw = _UNSET
    global_position: msgspec.Raw = _UNSET
    event_id: msgspec.Raw = _UNSET
    stream_id: msgspec.Raw = _UNSET
    stream_position: msgspec.Raw = _UNSET


_envelope = msgspec.json.Decoder(_Envelope)


class Names(msgspec.Struct, frozen=True):
    """Whatever an undecodable body still says about itself, each field only if it has
    the right type."""

    global_position: int | None = None
    event_id: str | None = None
    stream_id: str | None = None
    event_type: str | None = None
    stream_position: int | None = None
    schema_version: int | None = None


_KINDS = {"global_position": int, "event_id": str, "stream_id": str, "event_type": str,
          "stream_position": int, "schema_version": int}


def names(body: Any) -> Names:
    try:
        env = _envelope.decode(body)
    except (msgspec.DecodeError, RecursionError, TypeError):
        return Names()
    found: dict[str, Any] = {}  # JSON values, each of its field's kind (checked below)
    for field, kind in _KINDS.items():
        raw = getattr(env, field)
        if len(raw) > _SMALL:
            continue
        try:
            value = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            continue
        if type(value) is kind:
            found[field] = value
    return Names(**found)


# Columns compared with the body, in table order: (column, what the body says).
EVENT_COLUMNS = ("global_position", "event_id", "stream_id", "stream_position", "event_type",
                 "schema_version", "operation_id")


def column_problems(row: StoredEvent, e: ev.Event, stored_version: int | None) -> list[str]:
    """Each indexed column of `row` that disagrees with its decoded body `e`. The
    schema_version column describes the stored body, before any upcast."""
    problems = []
    for column in EVENT_COLUMNS:
        want = stored_version if column == "schema_version" else getattr(e, column)
        got = getattr(row, column)
        if not same(got, want):
            problems.append(f"column {column} is {short(got)}, the body says {short(want)}")
    return problems


def receipt_problems(row: StoredReceipt) -> tuple[Receipt | None, list[str]]:
    """The receipt a row's body holds, and each column that disagrees with it."""
    if not isinstance(row.body, bytes):
        return None, [f"body is stored as {type(row.body).__name__}, not bytes"]
    try:
        r = receipt_decoder.decode(row.body)
    except (msgspec.DecodeError, RecursionError) as exc:
        return None, [f"body does not decode: {str(exc)[:200]}"]
    problems = [f"column {c} is {short(getattr(row, c))}, the body says {short(getattr(r, c))}"
                for c in ("operation_id", "fingerprint", "first_global_position", "last_global_position")
                if not same(getattr(row, c), getattr(r, c))]
    return r, problems


def same(a: Any, b: Any) -> bool:
    """Equal and of the same type: a SQLite column holding '7' is not the body's 7."""
    return type(a) is type(b) and a == b


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def position_of(value: Any) -> int | None:
    return value if type(value) is int else None
