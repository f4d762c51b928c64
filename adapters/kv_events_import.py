"""`kvledger kv-events import FILE.jsonl --dialect trtllm|vllm`: recorded KV-event
streams from files, decided by the same Recorder as live ones (so order, gaps and
restarts read the same) and written in one transaction: all or nothing.

- vllm: one batch a line, `{"seq", "ts", "events", "data_parallel_rank"}`, events in
  vLLM's names (maps tagged by "type", or positional arrays); a bytes hash as hex.
- trtllm: one event a line as `LLM.get_kv_cache_events()` returns it, `{"event_id",
  "data": {"type": created|stored|removed|updated, ...}, "window_size", ...}`. The
  event_id is the seq (a jump is a gap, a step back a restart). Mapping: `created` is
  PoolCreated, `stored` a BlockStored (its blocks' hashes, their tokens' ids in order,
  medium `cache_level_N`), `removed` a BlockRemoved from the medium the block was last
  stored in or moved to, `updated` a BlockUpdated (a tier move when its cache_level
  changed). window_size becomes the group. TensorRT-LLM sends no timestamp: ts is 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from kvledger.adapters.kv_events_recorder import Recorder
from kvledger.adapters.kv_events_wire import decode_batch
from kvledger.journal.contract import HeadFacts, Operation
from kvledger.schemas import kv_events as kv
from kvledger.schemas.errors import ErrorCode, KvLedgerError

MAX_LINE = 64 << 20


def _bad(path: Path, n: int, message: str) -> KvLedgerError:
    return KvLedgerError(ErrorCode.MALFORMED_EVENT, f"{path.name}:{n}: {message}")


def _lines(path: Path) -> Iterator[tuple[int, bytes, Any]]:
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if len(line) > MAX_LINE:
                raise _bad(path, n, f"a line of {len(line)} bytes")
            try:
                yield n, line, msgspec.json.decode(line)
            except msgspec.DecodeError as exc:
                raise _bad(path, n, f"not JSON: {exc}") from None


def _vllm(raw: Any) -> tuple[int, float, list[Any], int | None]:
    if not isinstance(raw, dict) or not isinstance(raw.get("seq"), int) or not isinstance(raw.get("events"), list):
        raise ValueError("a vllm line is {\"seq\", \"ts\", \"events\", \"data_parallel_rank\"}")
    ts = raw.get("ts", 0.0)
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise ValueError("ts is not a number")
    rank = raw.get("data_parallel_rank")
    return raw["seq"], float(ts), raw["events"], rank if isinstance(rank, int) else None


class _Trtllm:
    """TensorRT-LLM's events to vLLM-named ones; remembers each block's cache level."""

    def __init__(self) -> None:
        self.level: dict[Any, str] = {}

    def convert(self, raw: Any) -> tuple[int, float, list[Any], int | None]:
        if not isinstance(raw, dict) or not isinstance(raw.get("event_id"), int) \
                or not isinstance(raw.get("data"), dict):
            raise ValueError("a trtllm line is {\"event_id\", \"data\": {\"type\", ...}, \"window_size\"}")
        d, group = raw["data"], raw.get("window_size")
        group = group if isinstance(group, int) else None
        kind = d.get("type")
        if kind == "created":
            self.level.clear()
            events: list[Any] = [kv.PoolCreated(tuple(d.get("num_blocks_per_cache_level") or ()))]
        elif kind == "stored":
            events = []
            for b in d.get("blocks") or []:
                medium = f"cache_level_{b.get('cache_level', 0)}"
                self.level[b["block_hash"]] = medium
                tokens = [t["token_id"] for t in b.get("tokens") or []]
                parent = d.get("parent_hash") if not events else events[-1].block_hashes[-1]
                events.append(kv.BlockStored((b["block_hash"],), parent, tuple(tokens), len(tokens),
                                             b.get("lora_id"), medium, group_idx=group))
        elif kind == "removed":
            by_medium: dict[str | None, list[Any]] = {}
            for h in d.get("block_hashes") or []:
                by_medium.setdefault(self.level.pop(h, None), []).append(h)
            events = [kv.BlockRemoved(tuple(hs), m, group) for m, hs in by_medium.items()]
        elif kind == "updated":
            h = d["block_hash"]
            old = self.level.get(h)
            level = d.get("cache_level") or {}
            new = f"cache_level_{level['new_value']}" if level else old
            if level:
                self.level[h] = new  # type: ignore[assignment]  # a str: built just above
            priority = (d.get("priority") or {}).get("new_value")
            events = [kv.BlockUpdated(h, old, new, priority, group)]
        else:
            raise ValueError(f"unknown trtllm event type {str(kind)[:40]!r}")
        return raw["event_id"], 0.0, events, None


def import_operations(path: Path, dialect: str, heads: dict[str, HeadFacts], stream: str) -> \
        tuple[list[Operation], Recorder]:
    """Every operation the file makes (nothing is written here); MALFORMED_EVENT with its
    line for the first bad one."""
    rec = Recorder(stream, "", heads, replayable=False, gap_reason="missing from the imported file",
                   live_duplicates=False)
    trt = _Trtllm() if dialect == "trtllm" else None
    for n, line, raw in _lines(path):
        try:
            if trt is not None:
                seq, ts, events, rank = trt.convert(raw)
                batch = (ts, msgspec.convert(msgspec.to_builtins(events), tuple[kv.KvEvent, ...]), rank)
            else:
                seq, ts, events, rank = _vllm(raw)
                # The same decoding as a live message: one path decides what an event is.
                batch = decode_batch(msgspec.msgpack.encode([ts, [_bytes_hashes(e) for e in events], rank]))
            if seq < 0:
                raise ValueError("seq is negative")
        except (ValueError, KeyError, TypeError, KvLedgerError, msgspec.ValidationError) as exc:
            raise _bad(path, n, str(exc)) from None
        rec.message(seq, line, batch, replayed=False)
    return rec.take(), rec


def _bytes_hashes(e: Any) -> Any:
    """A JSON event's hex hashes back to bytes, as they were on the wire."""
    if isinstance(e, dict):
        e = dict(e)
        if isinstance(e.get("block_hashes"), list):
            e["block_hashes"] = [_unhex(h) for h in e["block_hashes"]]
        for key in ("parent_block_hash", "block_hash"):
            if e.get(key) is not None:
                e[key] = _unhex(e[key])
    return e


def _unhex(h: Any) -> Any:
    return bytes.fromhex(h) if isinstance(h, str) else h
