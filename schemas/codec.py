"""Event encoding and decoding, with upcasting and stable error codes for bad input."""

from __future__ import annotations

from typing import Any

import msgspec

from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import CURRENT_VERSION, Event
from kvledger.schemas.upcast import UPCASTERS

MAX_EVENT_BYTES = 64 << 20

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Event)


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes | str) -> Event:
    """Decode one stored event. Old payload versions are upcast; bad input raises
    KvLedgerError with MALFORMED_EVENT, UNKNOWN_EVENT_TYPE, UNKNOWN_SCHEMA_VERSION or
    FIELD_TOO_LARGE."""
    if len(data) > MAX_EVENT_BYTES:
        raise KvLedgerError(ErrorCode.FIELD_TOO_LARGE, f"event of {len(data)} bytes")
    try:
        event = _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return _decode_slow(data, exc)
    except RecursionError:  # msgspec's own depth limit: a forged line, never a real event
        raise KvLedgerError(ErrorCode.MALFORMED_EVENT, "JSON nested too deeply") from None
    if event.schema_version != CURRENT_VERSION[event.event_type]:
        return _decode_slow(data, None)
    return event


def _decode_slow(data: bytes | str, typed_error: Exception | None) -> Event:
    """An event the typed decoder refused or read at an older version: the refusal's
    stable code, or the event upcast to the current version."""
    raw = _json_object(data)
    event_type, version = _kind(raw)
    if version == CURRENT_VERSION[event_type]:
        raise _validation_error(typed_error)
    upgraded: dict[str, Any] = {**raw, "payload": _upcast(raw, event_type, version),
                                "schema_version": CURRENT_VERSION[event_type]}
    try:
        event: Event = msgspec.convert(upgraded, Event)  # a Union is no type[T]: typed here
        return event
    except msgspec.ValidationError as exc:
        raise _validation_error(exc) from None
    except RecursionError:
        raise KvLedgerError(ErrorCode.MALFORMED_EVENT, "JSON nested too deeply") from None


def _json_object(data: bytes | str) -> dict[str, Any]:
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise KvLedgerError(ErrorCode.MALFORMED_EVENT, f"not JSON: {exc}") from None
    except RecursionError:
        raise KvLedgerError(ErrorCode.MALFORMED_EVENT, "JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise KvLedgerError(ErrorCode.MALFORMED_EVENT, "an event must be a JSON object")
    return raw


def _kind(raw: dict[str, Any]) -> tuple[str, int]:
    """The event's type and schema version, each one this kvledger knows."""
    event_type = raw.get("event_type")
    if not isinstance(event_type, (str, type(None))):  # a list or object is not even hashable
        raise KvLedgerError(ErrorCode.MALFORMED_EVENT,
                            f"event_type must be a string, not {type(event_type).__name__}")
    if event_type not in CURRENT_VERSION:
        raise KvLedgerError(
            ErrorCode.UNKNOWN_EVENT_TYPE, f"unknown event_type {str(event_type)[:64]!r}"
        )
    version = raw.get("schema_version")
    current = CURRENT_VERSION[event_type]
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise KvLedgerError(ErrorCode.MALFORMED_EVENT, f"bad schema_version {str(version)[:32]!r}")
    if version > current:
        raise KvLedgerError(
            ErrorCode.UNKNOWN_SCHEMA_VERSION,
            f"{event_type} schema_version {version} is newer than this kvledger knows ({current})",
        )
    return event_type, version


def _upcast(raw: dict[str, Any], event_type: str, version: int) -> dict[str, Any]:
    """An older version's payload, upcast one version at a time to the current one."""
    payload = raw.get("payload")
    if not isinstance(payload, dict):
        raise KvLedgerError(ErrorCode.MALFORMED_EVENT, "payload must be a JSON object")
    try:
        for v in range(version, CURRENT_VERSION[event_type]):
            step = UPCASTERS.get((event_type, v))
            if step is None:
                raise KvLedgerError(
                    ErrorCode.UNKNOWN_SCHEMA_VERSION, f"no upcaster for {event_type} v{v}"
                )
            payload = step(payload, raw)
    except KvLedgerError:
        raise
    except Exception as exc:  # noqa: BLE001 - an upcaster over a v1 payload that is not even valid v1
        raise KvLedgerError(
            ErrorCode.MALFORMED_EVENT, f"{event_type} v{version} payload cannot be upcast: {exc}"
        ) from None
    return payload


def noncanonical(body: bytes, event: Event) -> str | None:
    """Why `body` is not the encoding this journal writes of `event` (None when it is).
    A stored or imported body must re-encode to itself: otherwise two bodies with the
    same meaning differ in bytes (whitespace, escapes, key order, a duplicate key whose
    first value a different parser would keep), and a digest over one names neither."""
    if _encoder.encode(event) == body:
        return None
    if _stored_version(body) < CURRENT_VERSION[event.event_type]:
        # Written by an older kvledger in its own field order, then upcast on decode:
        # only the JSON itself can be compared (a duplicate key shortens the re-encoding).
        try:
            if msgspec.json.encode(msgspec.json.decode(body)) == body:
                return None
        except (msgspec.DecodeError, RecursionError):
            pass
    duplicate = _duplicate_key(body)
    if duplicate is not None:
        return f"duplicate key {duplicate[:64]!r}"
    return ("does not re-encode to itself (whitespace, key order, escapes, number form or an "
            "omitted default differ from the encoding kvledger writes)")


class _Version(msgspec.Struct):
    schema_version: int = 0


_version_decoder = msgspec.json.Decoder(_Version)


def _stored_version(body: bytes) -> int:
    try:
        return _version_decoder.decode(body).schema_version
    except (msgspec.DecodeError, RecursionError):
        return 0


def _duplicate_key(body: bytes) -> str | None:
    """The first key that appears twice in one object. The slow path of a rejection:
    msgspec keeps the last value silently, so only a pairs-preserving parse can tell."""
    import json

    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for k, _ in items:
            if k in seen and not found:
                found.append(k)
            seen.add(k)
        return dict(items)

    try:
        json.loads(body, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    return found[0] if found else None


def _validation_error(exc: Exception | None) -> KvLedgerError:
    text = str(exc)
    code = ErrorCode.FIELD_TOO_LARGE if "length <=" in text else ErrorCode.MALFORMED_EVENT
    return KvLedgerError(code, text)
