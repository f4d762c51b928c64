"""`kvledger kv-events import FILE.jsonl --dialect trtllm|vllm`: recorded KV-event
streams from files, decided by the same Recorder as live ones (so order, gaps and
restarts read the same) and written in one transaction: all or nothing.

- vllm: one batch a line, `{"seq", "ts", "events", "data_parallel_rank"}`, events in
  vLLM's names (maps tagged by "type", or positional arrays `["BlockStored", ...]`); a
  bytes hash as hex.
- trtllm: one event a line as `LLM.get_kv_cache_events()` returns it, `{"event_id",
  "data": {"type": created|stored|removed|updated, ...}, "window_size", ...}`. The
  event_id is the seq (a jump is a gap, a step back a restart). Mapping: `created` is
  PoolCreated, `stored` a BlockStored (its blocks' hashes, their tokens' ids in order,
  medium `cache_level_N`), `removed` a BlockRemoved from the medium the block was last
  stored in or moved to, `updated` a BlockUpdated (a tier move when its cache_level
  changed). window_size becomes the group. TensorRT-LLM sends no timestamp: ts is 0.

A line is read with a bound (the journal's event limit), parsed strictly (a key twice,
NaN, a number where an integer belongs, `true` as a number, nesting past MAX_DEPTH: all
refused) and each batch must encode as a payload `serve` can send; any refusal is one
coded error naming the line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec

from kvledger.adapters.kv_events_recorder import Recorder
from kvledger.adapters.kv_events_wire import MAX_SEQ, decode_batch
from kvledger.journal.contract import HeadFacts, Operation
from kvledger.replay.sources import jsonl_bodies
from kvledger.schemas import kv_events as kv
from kvledger.schemas.errors import ErrorCode, KvLedgerError

MAX_DEPTH = 32  # arrays and objects within each other (a vLLM batch needs 6)
_LINE_KEYS = frozenset({"seq", "ts", "events", "data_parallel_rank"})
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*")
# Where a positional vLLM event holds its hashes (kv_events_wire's field order, type first).
_POSITIONAL_HASHES = {"BlockStored": (1, 2), "BlockRemoved": (1,)}


class _Refused(ValueError):
    """Valid JSON that an import line must not be (a key twice, NaN)."""


def _bad(path: Path, n: int, message: str) -> KvLedgerError:
    return KvLedgerError(ErrorCode.MALFORMED_EVENT, f"{path}:{n}: {message}", line=n)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(f"the key {key[:40]!r} twice in one object")
            seen.add(key)
    return d


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a number JSON has")


def _too_deep(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        stack += [(x, depth + 1) for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, (list, dict))]
    return False


def _parse(line: bytes) -> Any:
    try:
        raw = json.loads(line.decode("utf-8"), object_pairs_hook=_object, parse_constant=_constant)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} arrays or objects") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 at byte {exc.start}") from None
    except _Refused:
        raise
    except ValueError as exc:  # JSONDecodeError, an integer of 4,300+ digits (its advice, after `;`, is Python's)
        raise ValueError(f"not JSON: {str(exc).split(';')[0]}") from None
    if isinstance(raw, (list, dict)) and _too_deep(raw):
        raise ValueError(f"nested deeper than {MAX_DEPTH} arrays or objects")
    return raw


def _int(value: Any, what: str, low: int = -(1 << 63), high: int = (1 << 64) - 1) -> int:
    if type(value) is not int:  # bool is an int to Python, not here
        raise ValueError(f"{what} is {_kind(value)}, not an integer")
    if not low <= value <= high:
        raise ValueError(f"{what} {value if abs(value) < 10 ** 30 else 'of ' + str(len(str(value))) + ' digits'} "
                         f"is outside {low}..{high}")
    return value


def _opt_int(value: Any, what: str, low: int = -(1 << 63)) -> int | None:
    return None if value is None else _int(value, what, low)


def _kind(value: Any) -> str:
    return {bool: "a boolean", str: "a string", list: "an array", dict: "an object", type(None): "null",
            float: "a number with a fraction"}.get(type(value), type(value).__name__)


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what} is {_kind(value)}, not an array")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is {_kind(value)}, not an object")
    return value


def _vllm(raw: Any) -> tuple[int, float, list[Any], int | None]:
    raw = _dict(raw, 'a vllm line {"seq", "ts", "events", "data_parallel_rank"}')
    if "seq" not in raw or "events" not in raw:
        raise ValueError('a vllm line is {"seq", "ts", "events", "data_parallel_rank"}: seq or events is missing')
    unknown = sorted(set(raw) - _LINE_KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0][:40]!r} (a vllm line has seq, ts, events, data_parallel_rank)")
    ts = raw.get("ts", 0.0)
    if type(ts) is not float:
        ts = _int(ts, "ts")
    return (_int(raw["seq"], "seq", 0, MAX_SEQ), float(ts), [_bytes_hashes(e) for e in _list(raw["events"], "events")],
            _opt_int(raw.get("data_parallel_rank"), "data_parallel_rank", 0))


def _bytes_hashes(e: Any) -> Any:
    """A JSON event's hex hashes back to bytes, as they were on the wire."""
    if isinstance(e, dict):
        e = dict(e)
        if isinstance(e.get("block_hashes"), list):
            e["block_hashes"] = [_unhex(h) for h in e["block_hashes"]]
        for key in ("parent_block_hash", "block_hash"):
            if e.get(key) is not None:
                e[key] = _unhex(e[key])
    if isinstance(e, list) and e and isinstance(e[0], str):
        e = list(e)
        for i in _POSITIONAL_HASHES.get(e[0], ()):
            if i < len(e) and isinstance(e[i], list):
                e[i] = [_unhex(h) for h in e[i]]
            elif i < len(e) and e[i] is not None:
                e[i] = _unhex(e[i])
    return e


def _unhex(h: Any) -> Any:
    if not isinstance(h, str):
        return h
    if not _HEX.fullmatch(h):
        raise ValueError(f"the hash {h[:40]!r} is not hex (a bytes hash is written as hex, an int hash as an int)")
    return bytes.fromhex(h)


class _Trtllm:
    """TensorRT-LLM's events to vLLM-named ones; remembers each block's cache level."""

    def __init__(self) -> None:
        self.level: dict[int | str, str] = {}

    def convert(self, raw: Any) -> tuple[int, float, list[Any], int | None]:
        raw = _dict(raw, 'a trtllm line {"event_id", "data": {"type", ...}, "window_size"}')
        d = _dict(raw.get("data"), "data")
        seq = _int(raw.get("event_id"), "event_id", 0, MAX_SEQ)
        group = _opt_int(raw.get("window_size"), "window_size")
        kind = d.get("type")
        if kind == "created":
            self.level.clear()
            levels = _list(d.get("num_blocks_per_cache_level") or [], "num_blocks_per_cache_level")
            events: list[Any] = [kv.PoolCreated(tuple(_int(n, "num_blocks_per_cache_level", 0) for n in levels))]
        elif kind == "stored":
            events = []
            parent = _hash(d.get("parent_hash"), "parent_hash", none=True)
            for b in _list(d.get("blocks") or [], "blocks"):
                b = _dict(b, "a block")
                h = _hash(b.get("block_hash"), "block_hash")
                medium = f"cache_level_{_int(b.get('cache_level', 0), 'cache_level')}"
                self.level[h] = medium
                tokens = [_int(_dict(t, "a token").get("token_id"), "token_id") for t in _list(b.get("tokens") or [],
                                                                                             "tokens")]
                events.append(kv.BlockStored((h,), parent, tuple(tokens), len(tokens),
                                             _opt_int(b.get("lora_id"), "lora_id"), medium, group_idx=group))
                parent = h
        elif kind == "removed":
            by_medium: dict[str | None, list[int | str]] = {}
            for h in _list(d.get("block_hashes") or [], "block_hashes"):
                h = _hash(h, "block_hash")
                by_medium.setdefault(self.level.pop(h, None), []).append(h)
            events = [kv.BlockRemoved(tuple(hs), m, group) for m, hs in by_medium.items()]
        elif kind == "updated":
            h = _hash(d.get("block_hash"), "block_hash")
            old = self.level.get(h)
            level = _dict(d.get("cache_level") or {}, "cache_level")
            new = f"cache_level_{_int(level.get('new_value'), 'cache_level.new_value')}" if level else old
            if new is not None:
                self.level[h] = new
            priority = _opt_int(_dict(d.get("priority") or {}, "priority").get("new_value"), "priority.new_value")
            events = [kv.BlockUpdated(h, old, new, priority, group)]
        else:
            raise ValueError(f"unknown trtllm event type {str(kind)[:40]!r}")
        return seq, 0.0, events, None


def _hash(value: Any, what: str, *, none: bool = False) -> Any:
    if value is None and none:
        return None
    if isinstance(value, str):
        return value
    return _int(value, what)


def import_operations(path: Path, dialect: str, heads: dict[str, HeadFacts], stream: str) -> \
        tuple[list[Operation], Recorder]:
    """Every operation the file makes (nothing is written here); a coded error with its
    line for the first bad one (FIELD_TOO_LARGE for a line past the bound, else
    MALFORMED_EVENT)."""
    rec = Recorder(stream, "", heads, replayable=False, gap_reason="missing from the imported file",
                   live_duplicates=False)
    trt = _Trtllm() if dialect == "trtllm" else None
    for n, line in jsonl_bodies(path):
        try:
            raw = _parse(line)
            if trt is not None:
                seq, ts, events, rank = trt.convert(raw)
                msgspec.msgpack.encode(events)  # what `serve` sends must encode: 64-bit ints, no lone surrogates
                batch = (ts, msgspec.convert(msgspec.to_builtins(events), tuple[kv.KvEvent, ...]), rank)
            else:
                seq, ts, events, rank = _vllm(raw)
                # The same decoding as a live message: one path decides what an event is.
                batch = decode_batch(msgspec.msgpack.encode([ts, events, rank]))
        except KvLedgerError as exc:
            raise _bad(path, n, exc.message) from None
        except OverflowError:
            raise _bad(path, n, "an integer outside the 64-bit range") from None
        except UnicodeEncodeError:
            raise _bad(path, n, "a string holds a lone surrogate (\\ud800-\\udfff)") from None
        except (ValueError, msgspec.ValidationError) as exc:
            raise _bad(path, n, str(exc)) from None
        rec.message(seq, line, batch, replayed=False)
    return rec.take(), rec
