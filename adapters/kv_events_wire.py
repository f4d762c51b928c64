"""The KV-event wire format of vLLM and SGLang, as pure functions (no sockets).

A live message is a ZMQ multipart `[topic, seq, payload]` (vLLM) or `[seq, payload]`
(SGLang): seq an 8-byte big-endian integer, the payload a msgpack `EventBatch`, either
positional `[ts, events, data_parallel_rank]` or a map with those keys. An event is a
map tagged by `"type"` (vLLM >= 0.26; fields at their default are omitted) or a
positional array `["BlockStored", ...]` (older vLLM, SGLang; trailing fields may be
missing). Hashes are ints or bytes; bytes become lowercase hex here.

A replay reply, as a DEALER receives it, is `[b"", topic, seq, payload]` (vLLM with the
topic), `[b"", seq, payload]` (SGLang, older vLLM) or the end marker `[b"", -1, b""]`.
In every form the seq is the second-last frame and the payload the last.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvledger.schemas import kv_events as kv
from kvledger.schemas.errors import ErrorCode, KvLedgerError

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_SEQ = (1 << 63) - 2  # the next seq expected after it still fits the journal's int64 columns

# Positional field order of each event type, as the array form sends them.
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": ("medium",),
}
_CLASSES: dict[str, type] = {"BlockStored": kv.BlockStored, "BlockRemoved": kv.BlockRemoved,
                             "AllBlocksCleared": kv.AllBlocksCleared}
_KNOWN = {name: frozenset(_FIELDS[name]) for name in _FIELDS}
_TEXT = ("medium", "lora_name", "kv_cache_spec_kind")  # the string fields
_decode = msgspec.msgpack.Decoder()


def _bad(message: str) -> KvLedgerError:
    return KvLedgerError(ErrorCode.MALFORMED_EVENT, message)


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise _bad(f"a seq frame has 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def batch_seq(seq: int) -> int:
    """`seq`, or MALFORMED_EVENT for one no batch has: only the replay's end marker is
    negative, and the journal's int64 column holds seq + 1."""
    if not 0 <= seq <= MAX_SEQ:
        raise _bad(f"a batch's seq is in 0..{MAX_SEQ}, not {seq}")
    return seq


def split_live(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """(topic, seq, payload) of one PUB message; SGLang's form has topic b""."""
    if len(frames) == 3:
        return frames[0], batch_seq(seq_of(frames[1])), frames[2]
    if len(frames) == 2:
        return b"", batch_seq(seq_of(frames[0])), frames[1]
    raise _bad(f"a KV-event message has 2 or 3 frames, not {len(frames)}")


def split_replay(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay reply; None for the end marker."""
    if len(frames) < 2:
        raise _bad(f"a replay reply has at least 2 frames, not {len(frames)}")
    seq = seq_of(frames[-2])
    if seq == -1 and not frames[-1]:
        return None
    return batch_seq(seq), frames[-1]


def _hash(h: Any) -> int | str:
    if isinstance(h, bytes):
        return h.hex()
    if isinstance(h, int) and not isinstance(h, bool):
        return h
    raise _bad(f"a block hash is int or bytes, not {type(h).__name__}")


def _hashes(value: Any) -> tuple[int | str, ...]:
    if not isinstance(value, list):
        raise _bad("block_hashes is not a list")
    return tuple([h.hex() if isinstance(h, bytes) else _hash(h) for h in value])


def _event(raw: Any) -> kv.KvEvent:
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _FIELDS.get(kind)
        if names is None:
            raise _bad(f"unknown KV event type {kind[:64]!r}")
        if len(raw) - 1 > len(names):
            raise _bad(f"{kind} has {len(raw) - 1} fields, more than the {len(names)} known")
        fields = dict(zip(names, raw[1:]))
    else:
        raise _bad("a KV event is a map tagged by 'type' or an array starting with its type")
    if not isinstance(kind, str) or kind not in _CLASSES:
        raise _bad(f"unknown KV event type {str(kind)[:64]!r}")
    cls = _CLASSES[kind]
    for name in _TEXT:
        if isinstance(fields.get(name), bytes):  # JSON would keep it as base64 text: another value
            raise _bad(f"{kind}: {name} is bytes, not a string")
    if "block_hashes" in fields:
        fields["block_hashes"] = _hashes(fields["block_hashes"])
    parent = fields.get("parent_block_hash")
    if parent is not None:
        fields["parent_block_hash"] = _hash(parent)
    if fields.get("extra_keys") is not None:
        fields["extra_keys"] = _plain(fields["extra_keys"])
    known = _KNOWN[kind]
    if not known.issuperset(fields):
        # A newer engine's field: kept as sent (never dropped, never a failed batch).
        unknown = {k: _plain(fields.pop(k)) for k in list(fields) if k not in known}
        fields["unknown_fields"] = unknown
    try:
        event: kv.KvEvent = cls(**fields)
    except TypeError as exc:
        raise _bad(f"{kind}: {exc}") from None
    return event


def _plain(value: Any) -> Any:
    """extra_keys as JSON can hold them: bytes become hex."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


# The fast path, in C: vLLM's own form (a positional batch of maps tagged by "type", every
# field known). Anything else (SGLang's arrays, a map batch, a field a newer vLLM added)
# takes the general path below, which keeps unknown fields. The wire types carry the
# limits of schemas.kv_events (a bytes hash of 256 bytes is 512 hex characters), so what
# passes here reads back from the journal (tests/test_kv_events_wire.py checks both agree).
WireHash = int | Annotated[bytes, Meta(max_length=256)]
WireName = Annotated[str, Meta(max_length=256)]
WireHashes = Annotated[list[WireHash], Meta(max_length=1 << 20)]


class _Wire(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, gc=False):
    pass


class _WStored(_Wire, tag="BlockStored"):
    block_hashes: WireHashes
    parent_block_hash: WireHash | None = None
    token_ids: Annotated[tuple[int, ...], Meta(max_length=1 << 22)] = ()
    block_size: Annotated[int, Meta(ge=0)] = 0
    lora_id: int | None = None
    medium: WireName | None = None
    lora_name: WireName | None = None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: WireName | None = None
    kv_cache_spec_sliding_window: int | None = None


class _WRemoved(_Wire, tag="BlockRemoved"):
    block_hashes: WireHashes
    medium: WireName | None = None
    group_idx: int | None = None


class _WCleared(_Wire, tag="AllBlocksCleared"):
    pass


class _WBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: Annotated[list[_WStored | _WRemoved | _WCleared], Meta(max_length=1 << 20)]
    data_parallel_rank: int | None = None


_fast = msgspec.msgpack.Decoder(_WBatch)


_hex: Callable[[Any], str] = bytes.hex


def _hexed(hashes: list[WireHash]) -> tuple[int | str, ...]:
    try:
        return tuple(map(_hex, hashes))  # every hash bytes (vLLM's): no Python frame per hash
    except TypeError:
        return tuple([h.hex() if isinstance(h, bytes) else h for h in hashes])


def _from_wire(events: list[_WStored | _WRemoved | _WCleared]) -> tuple[list[kv.KvEvent], bool]:
    """The events as kv events, and whether one has extra_keys (any shape: only a JSON
    round trip tells whether the journal reads them back). One loop, no call per event:
    this runs for every batch received."""
    out: list[kv.KvEvent] = []
    add = out.append
    extra = False
    for w in events:
        if type(w) is _WStored:
            parent = w.parent_block_hash
            keys = w.extra_keys
            if keys is not None:
                extra, keys = True, _plain(keys)
            add(kv.BlockStored(
                _hexed(w.block_hashes), parent.hex() if isinstance(parent, bytes) else parent,
                w.token_ids, w.block_size, w.lora_id, w.medium, w.lora_name, keys, w.group_idx,
                w.kv_cache_spec_kind, w.kv_cache_spec_sliding_window))
        elif type(w) is _WRemoved:
            add(kv.BlockRemoved(_hexed(w.block_hashes), w.medium, w.group_idx))
        else:
            add(kv.AllBlocksCleared())
    return out, extra


def decode_batch(payload: bytes) -> tuple[float, tuple[kv.KvEvent, ...], int | None]:
    """(ts, events, data_parallel_rank) of one payload; MALFORMED_EVENT if it is none."""
    try:
        b = _fast.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass  # not vLLM's exact form: the general path decides, and names what is wrong
    else:
        decoded, extra = _from_wire(b.events)
        if extra or not math.isfinite(b.ts):
            return b.ts, _readable(b.ts, tuple(decoded), b.data_parallel_rank), b.data_parallel_rank  # JSON has no NaN
        return b.ts, tuple(decoded), b.data_parallel_rank
    try:
        raw = _decode.decode(payload)
    except msgspec.DecodeError as exc:
        raise _bad(f"payload is not msgpack: {exc}") from None
    if isinstance(raw, list) and 2 <= len(raw) <= 3:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    elif isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise _bad("payload is not an EventBatch [ts, events, data_parallel_rank]")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise _bad("EventBatch needs a numeric ts and a list of events")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise _bad("data_parallel_rank is not an int")
    return float(ts), _readable(float(ts), tuple([_event(e) for e in events]), rank), rank


_json_encode = msgspec.json.Encoder().encode
_read_back = msgspec.json.Decoder(kv.KvEventsBatch).decode


def _readable(ts: float, events: tuple[kv.KvEvent, ...], rank: int | None) -> tuple[kv.KvEvent, ...]:
    """The events as the journal's reader will read them back (stored as JSON, read as a
    kv.KvEventsBatch); refuses a batch it would refuse, which would poison every later
    replay. (A Struct built in Python, or passed through msgspec.convert, is unchecked.)"""
    if not math.isfinite(ts):
        raise _bad(f"EventBatch ts is {ts}, not a finite number")
    try:
        return _read_back(_json_encode(kv.KvEventsBatch(0, 0, ts, events, rank))).events
    except msgspec.ValidationError as exc:
        raise _bad(f"KV event: {exc}") from None


class Encoded(msgspec.Struct, frozen=True, gc=False):
    """A batch's events as the journal stores them: the JSON msgspec writes for their
    tuple of kv events (a msgspec.Raw, which an encoder copies where it would have encoded
    the tuple), and how many there are."""

    json: msgspec.Raw
    count: int


def decode_batch_encoded(payload: bytes) -> tuple[float, Encoded, int | None]:
    """decode_batch, with the events encoded at once: the recorder's form. The events'
    objects die young, while the batch waits for its commit as one bytes object, and the
    encoding reads them while they are still in the cache, cheaper than later on the
    committer."""
    ts, events, rank = decode_batch(payload)
    return ts, Encoded(msgspec.Raw(_json_encode(events)), len(events)), rank


# -- encoding, for the replay server (and the tests' reference publisher) -------------
# As vLLM 0.33's ZmqEventPublisher encodes its KVEventBatch (vllm/distributed/kv_events.py),
# with structs of the same shape: the batch an array `[ts, events]` plus
# `data_parallel_rank` when set; each event a map, "type" first, then its fields in vLLM's
# order, those without a default always (None as nil), the others only when set. msgspec
# sizes such a map's header by the struct's field count (BlockStored's is map16 whatever is
# left out), so only structs give vLLM's bytes. An event vLLM 0.33 cannot send (a newer
# engine's field, TensorRT-LLM's types) is a plain map of its set fields, as recorded.
# tests/test_kv_events_vllm.py compares the bytes with vLLM's own publisher.


class _VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _VllmStored(_VllmEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: Any
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: Any = None


class _VllmRemoved(_VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _VllmCleared(_VllmEvent, tag="AllBlocksCleared"):
    pass


class _VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_VLLM: dict[str, type[_VllmEvent]] = {"BlockStored": _VllmStored, "BlockRemoved": _VllmRemoved,
                                      "AllBlocksCleared": _VllmCleared}
_HASH_FIELDS = ("parent_block_hash", "block_hash")


def _wire_hash(h: int | str) -> int | bytes:
    return bytes.fromhex(h) if isinstance(h, str) else h


def wire_event(e: kv.KvEvent) -> _VllmEvent | dict[str, Any]:
    """One recorded event as vLLM's encoder writes it, hex hashes back to bytes."""
    tag = str(type(e).__struct_config__.tag)
    fields: dict[str, Any] = {f: getattr(e, f) for f in e.__struct_fields__ if f != "unknown_fields"}
    fields.update(getattr(e, "unknown_fields", None) or {})
    if "block_hashes" in fields:
        fields["block_hashes"] = [_wire_hash(h) for h in fields["block_hashes"]]
    for key in _HASH_FIELDS:
        if fields.get(key) is not None:
            fields[key] = _wire_hash(fields[key])
    cls = _VLLM.get(tag)
    if cls is not None:
        extra = {k: v for k, v in fields.items() if k not in cls.__struct_fields__}
        if all(v is None for v in extra.values()):
            return cls(**{k: v for k, v in fields.items() if k in cls.__struct_fields__})
    return {"type": tag} | {k: v for k, v in fields.items() if v is not None}


_encode = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: tuple[kv.KvEvent, ...], rank: int | None) -> bytes:
    """A recorded batch as vLLM's payload: `[ts, events]`, `[ts, events, data_parallel_rank]`."""
    return _encode.encode(_VllmBatch(ts, [wire_event(e) for e in events], rank))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)
