"""docs/reference/storage-format.md is a specification a second implementation can read
from: the reader below is written from that page alone (the standard library, msgspec's
generic msgpack decoder and zstandard; no kvledger module), and it must give back, byte for
byte, the events `kvledger export` writes and the anchor `kvledger head` prints."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import msgspec
import zstandard

ROOT = Path(__file__).resolve().parents[1]
M64 = (1 << 64) - 1


def _parts(body: bytes) -> tuple[int, int, list[bytes]]:
    fmt, items, receipts, data = msgspec.msgpack.decode(body)
    assert fmt in (5, 7), f"record format {fmt}"
    raw = zstandard.ZstdDecompressor().decompress(data)
    k = items + receipts
    lists = struct.unpack_from(f"<{2 * k}I", raw)
    parts, at = [], 8 * k
    for length, crc in zip(lists[:k], lists[k:]):
        part = raw[at:at + length]
        assert len(part) == length and zlib.crc32(part) == crc
        parts.append(part)
        at += length
    assert at == len(raw), "bytes after the last part"
    return fmt, items, parts


def _block(item: bytes) -> tuple[list[list[int]], list[bytes]]:
    assert item[0] == 0xC1
    n, widths = int.from_bytes(item[1:5], "little"), item[5:35]
    columns: list[list[int]] = [[] for _ in range(30)]
    at = 35
    for w in (1, 2, 4, 8):
        for c in (i for i in range(30) if widths[i] == w):
            columns[c] = [int.from_bytes(item[at + j * w:at + (j + 1) * w], "little", signed=True) for j in range(n)]
            at += n * w
    assert len(item) == at + 36 * n
    digests = [item[at + 32 * j:at + 32 * j + 32] for j in range(n)]
    return [[columns[c][j] for c in range(30)] for j in range(n)], digests


def _json(value: dict) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _step_events(v: list[int], digest: bytes, run: list[int], ctx: list, g: int) -> list[bytes]:
    run[0] = (run[0] + 3 + v[20]) & M64
    run[1] = (run[1] + v[21]) & M64
    run[2] = (run[2] + v[21] + v[22]) & M64
    for r, c in ((3, 23), (4, 27), (5, 28)):
        run[r] = (run[r] + v[c]) & M64
    if v[19]:
        run[6] = (run[6] + v[29]) & M64
    seq, mono, wall, op, ptxn, stxn, call = run
    e1 = (op + v[24]) & M64
    e2 = (e1 + v[25]) & M64
    e3 = (e2 + v[26]) & M64
    _, _, prefixes, streams = ctx
    stream_id, request_id, generation, source, abi = streams[v[0]]
    pre, pos, snap, com, token = prefixes[v[1]], v[5], v[6], v[7], v[12]

    def event(kind: str, payload: dict, eid: int, k: int, version: int) -> bytes:
        return _json({"event_type": kind, "payload": payload, "event_id": f"{pre}{eid:016x}", "global_position": g + k,
                      "stream_id": stream_id, "stream_position": pos + k, "schema_version": version,
                      "request_id": request_id, "handle_generation": generation, "operation_id": f"{pre}{op:016x}",
                      "caused_by_event_id": None, "source_instance": source, "local_sequence": seq + k,
                      "monotonic_ns": mono, "observed_wall_time": wall})

    forward = None if not v[19] else {"call_id": f"{prefixes[v[4]]}{call:016x}", "index": v[13], "size": v[15],
                                      "new_pad": v[16], "key_extent": v[17], "threads": v[14]}
    return [
        event("append_publish", {"txn_id": f"{prefixes[v[2]]}{ptxn:016x}", "base_snapshot_version": snap,
                                 "result_snapshot_version": snap + 1, "committed_length": com, "accepted_count": v[8],
                                 "layers_complete": v[9], "logits_ready": True, "workspace_bytes": v[10],
                                 "rows_sha256": digest.hex() if v[18] else None}, e1, 0, 2),
        event("output_emit", {"output_index": v[11], "token_id": token, "snapshot_version": snap + 1}, e2, 1, 1),
        event("append_start", {"txn_id": f"{prefixes[v[3]]}{stxn:016x}", "kind": "decode",
                               "base_snapshot_version": snap + 1, "interval_start": com, "interval_count": 1,
                               "token_ids": [token], "cache_positions": [com], "mask_key_extent": com + 1,
                               "cache_abi_sha256": abi.hex(), "call": forward}, e3, 2, 3),
    ]


def read_journal(path: Path) -> tuple[list[bytes], str]:
    """Every event of a SQLite journal's records, and its anchor, from the page alone."""
    db = sqlite3.connect(path)
    chain, last, events = bytes(32), 0, []
    for first, last, stored_chain, body in db.execute(
            "SELECT first_position, last_position, chain, body FROM kvl_records ORDER BY last_position"):
        chain = hashlib.sha256(chain + hashlib.sha256(body).digest()).digest()
        assert chain == stored_chain
        fmt, items, parts = _parts(body)
        ctx = msgspec.msgpack.decode(parts[-1]) if fmt == 7 else None
        own: list[bytes] = []
        run = [0] * 7
        for item in parts[:items]:
            if item[:1] == b"{":
                own.append(item)
                continue
            assert ctx is not None and ctx[0] == first
            for v, digest in zip(*_block(item)):
                own += _step_events(v, digest, run, ctx, first + len(own))
        assert len(own) == last - first + 1
        events += own
    db.close()
    return events, f"{last}:{chain.hex()}"


def test_the_format_7_fixture_reads_as_its_export():
    fixture = ROOT / "fixtures" / "journal_format7"
    events, _ = read_journal(fixture / "journal.db")
    assert any(b'"append_publish"' in e for e in events)
    assert events == (fixture / "export.jsonl").read_bytes().splitlines()


def test_a_journal_written_now_reads_as_export_and_head_say(tmp_path):
    from kvledger import Ledger
    from kvledger.journal.builders import make_manifest

    url = f"sqlite:///{tmp_path / 'kv.db'}"
    with Ledger.open(url) as ledger:
        ledger.allocate("h1", make_manifest("r1", prompt=(1, 2, 3)), reserved_capacity=16)
        s = ledger.state("h1")
        ledger.begin_append("h1", txn_id="t1", kind="prefill", base=(s.generation, s.snapshot_version), start=0,
                            token_ids=s.prompt)
    with sqlite3.connect(tmp_path / "kv.db") as db:  # what this kvledger writes: format 7, with its Context
        assert {body[:2] for (body,) in db.execute("SELECT body FROM kvl_records")} == {b"\x94\x07"}
    events, anchor = read_journal(tmp_path / "kv.db")
    run = [sys.executable, "-m", "kvledger"]
    exported = subprocess.run([*run, "export", "--db", url, "--out", "-"], capture_output=True, check=True).stdout
    head = subprocess.run([*run, "head", "--db", url], capture_output=True, text=True, check=True).stdout.strip()
    assert events == exported.splitlines() and len(events) == 2
    assert anchor == head
