"""Hostile record bodies (issue 44): `verify` over a journal holding a zstd bomb record.

The bomb is a format 5 record whose half-megabyte frame states 512 MiB of zeros behind
lists that fit the format (eight items of 64 MiB): the old bound (1,024 times the frame,
plus 1 MiB) let it inflate whole before verify reported it; journal.inflate checks the
lists and inflates one item before its CRC fails. Also the frame-crafting helpers the
tests use (tests/test_record_bodies.py).
"""

from __future__ import annotations

import sqlite3
import struct
from collections.abc import Callable
from pathlib import Path

import msgspec

BLOCK = 128 * 1024  # zstd's largest block
MIB = 1 << 20


def frame(size: int | None, blocks: list[bytes]) -> bytes:
    """A zstd frame stating `size` bytes (None: no size) made of the blocks given."""
    if size is None:
        header = bytes([0x00, 0x58])  # no content size; a window of 128 MiB
    else:
        header = bytes([0xC0, 0x58]) + struct.pack("<Q", size)  # an 8-byte content size
    blocks = list(blocks)
    blocks[-1] = bytes([blocks[-1][0] | 1]) + blocks[-1][1:]  # the last block's flag
    return b"\x28\xb5\x2f\xfd" + header + b"".join(blocks)


def raw_block(data: bytes) -> bytes:
    return struct.pack("<I", len(data) << 3)[:3] + data


def rle_blocks(n: int, byte: int = 0, block: int = BLOCK) -> list[bytes]:
    """Blocks of `n` bytes of `byte`: 4 bytes of frame for each `block` of them."""
    out = [struct.pack("<I", (1 << 1) | (block << 3))[:3] + bytes([byte])] * (n // block)
    if n % block:
        out.append(struct.pack("<I", (1 << 1) | ((n % block) << 3))[:3] + bytes([byte]))
    return out


def lists(lengths: list[int], crcs: list[int]) -> bytes:
    """Format 5's lists: each item's length, then each CRC (little-endian uint32)."""
    return struct.pack(f"<{2 * len(lengths)}I", *lengths, *crcs)


def record5(events: int, receipts: int, data: bytes) -> bytes:
    """A format 5 record around a frame (journal.record_format.Frame)."""
    return msgspec.msgpack.encode([5, events, receipts, data])


def bomb(items: int = 8, item: int = 64 * MIB) -> bytes:
    """`items` items of `item` zero bytes behind lists that fit, in 4 KiB RLE blocks: a
    frame of about 1/1,000 of what it states."""
    head = lists([item] * items, [1] * items)
    return record5(items, 0, frame(len(head) + items * item, [raw_block(head), *rle_blocks(items * item, block=4096)]))


def verify_bomb(tmp: Path, mode: str, ready: Callable[[], None]) -> None:
    from kvledger.journal.builders import allocate_op, guard_of, publish_op
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.replay import verify_journal

    url = f"sqlite:///{tmp / 'journal.db'}"
    with open_or_create_journal(url) as journal:
        journal.append([allocate_op("a"), allocate_op("b")])
        for step in range(20):
            journal.append([publish_op(h, guard_of(journal.head(h)), f"p{step}-{h}") for h in ("a", "b")])
    db = sqlite3.connect(tmp / "journal.db")
    with db:
        db.execute("UPDATE kvl_records SET body = ? WHERE last_position = "
                   "(SELECT max(last_position) FROM kvl_records)", (bomb(),))
    db.close()
    with open_or_create_journal(url) as journal:
        ready()
        result = verify_journal(journal)
    if not any(f.code == "TAMPERED" for f in result.findings):
        raise RuntimeError(f"the bomb was not reported: {result.findings[:3]}")


SCENARIOS = {"verify_zstd_bomb_peak_mb": verify_bomb}
GOALS = {"verify_zstd_bomb_peak_mb": ("<=", 96.0)}
