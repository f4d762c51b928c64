"""Where a record's bytes go, and what other layouts would store: `python -m bench.layout
[--layers L] [--steps N]`. Writes a service-alone journal (bench.tokens.Lockstep: 64
handles, one commit of 64 decode chains per step), then for its last 20 records prints,
per decoded token: the stored record; its events and receipts (in their stored, compact
form) as one zstd frame (the rest is the header's lengths and CRCs); the events grouped
by type; the events as columns (each field's values of one event type together, msgpack).
docs/decisions/record-format.md rests on it. A one-off measurement, not a section of `python -m bench`."""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
from typing import Any

import msgspec
import zstandard

from kvledger.engine.service import CommandService
from kvledger.journal.audit import decode_record
from kvledger.migrations.storage import open_or_create_journal

from bench.tokens import BATCH, Lockstep


def _columns(events: list[bytes]) -> bytes:
    cols: dict[str, list[Any]] = {}

    def flat(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                flat(v, f"{path}/{k}")
        else:
            cols.setdefault(path, []).append(value)

    for e in events:
        o = json.loads(e)
        flat(o, o["event_type"])
    return b"".join(msgspec.msgpack.encode(v) for _, v in sorted(cols.items()))


def measure(layers: int, steps: int, last: int = 20) -> dict[str, float]:
    path = f"{tempfile.mkdtemp()}/layout.db"
    with open_or_create_journal(f"sqlite:///{path}") as journal:
        group = Lockstep(CommandService(journal), layers, steps + 2, "layout")
        for _ in range(steps + 1):
            group.step()
    con = sqlite3.connect(path)
    try:
        rows = con.execute("SELECT last_position, body FROM kvl_records ORDER BY last_position DESC LIMIT ?",
                           (last,)).fetchall()
    finally:
        con.close()
    zstd = zstandard.ZstdCompressor(level=1).compress
    sums = dict.fromkeys(("stored", "events_and_receipts", "events", "receipts", "by_type", "columns"), 0)
    tokens = 0
    for position, body in rows:
        record = decode_record(bytes(body), f"ending at {position}")
        events, receipts = record.events, record.stored_receipts
        tokens += len(events) // 3
        sums["stored"] += len(body)
        sums["events_and_receipts"] += len(zstd(b"".join(events + receipts)))
        sums["events"] += len(zstd(b"".join(events)))
        sums["receipts"] += len(zstd(b"".join(receipts)))
        by_type = sorted(events, key=lambda e: msgspec.json.decode(e)["event_type"])
        sums["by_type"] += len(zstd(b"".join(by_type + receipts)))
        sums["columns"] += len(zstd(_columns(events) + b"".join(receipts)))
    return {k: round(v / tokens, 1) for k, v in sums.items()} | {"tokens": tokens, "batch": BATCH}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    print(json.dumps(measure(args.layers, args.steps)))


if __name__ == "__main__":
    main()
