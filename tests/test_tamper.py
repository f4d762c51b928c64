"""Issue 17 class 4, tamper evidence: a changed byte anywhere in what an append stored
(an event's bytes inside its record, the record's compressed data or header, its indexed
columns, its lookup rows) makes `verify` report TAMPERED naming the event concerned.
Every event of a small demo journal is edited in turn, on both backends."""

from __future__ import annotations

import hashlib
import json
import zlib

import msgspec
import pytest

from kvledger.journal import open_journal
from kvledger.journal.audit import decode_record, unpack_record
from kvledger.journal.keys import pack_prev, unpack_prev
from kvledger.journal.record_format import chain, pack_record
from kvledger.journal.steps import MARK, is_row
from kvledger.replay import verify_journal

from stored_rows import cli, demo_records, sql

pytestmark = pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")


@pytest.fixture
def demo(shared_journal):
    """A small demo journal, all of it in records: (url, records as (last, first, body)).
    Each test puts back what it edits: the next one finds the demo's journal."""
    db_url, records = demo_records(shared_journal)
    assert sql(db_url, "SELECT count(*) FROM kvl_events") == [(0,)]
    return db_url, records


def tampered(db_url: str) -> list[int | None]:
    """Where verify reports TAMPERED (global positions), the journal as it now is."""
    with open_journal(db_url) as journal:
        result = verify_journal(journal)
    assert not result.ok or not any(f.code == "TAMPERED" for f in result.findings)
    return [f.global_position for f in result.findings if f.code == "TAMPERED"]


def with_body(db_url: str, last: int, body: bytes) -> list[int | None]:
    """TAMPERED findings with the record ending at `last` stored as `body`; then restored."""
    [(before,)] = sql(db_url, "SELECT body FROM kvl_records WHERE last_position = :p", p=last)
    sql(db_url, "UPDATE kvl_records SET body = :b WHERE last_position = :p", b=body, p=last)
    try:
        return tampered(db_url)
    finally:
        sql(db_url, "UPDATE kvl_records SET body = :b WHERE last_position = :p", b=bytes(before), p=last)


def edit_event(body: bytes, index: int, *, rechecksum: bool) -> tuple[bytes, int]:
    """The record with one byte of its event `index` changed, its CRCs kept or
    recomputed, and the event a reader names: in an event stored as JSON a digit or
    letter turned into another one (the JSON still parses), named itself; in a decode
    step (a format 6 row, or a step of a format 7 block: three events) a byte of its row
    digest, named by the step's first event."""
    h = unpack_record(body)
    assert h.format >= 2  # zstd
    data = bytearray(h.data)
    item, first = _item_of(h, index)
    start = sum(h.event_lengths[:item])
    stored = data[start:start + h.event_lengths[item]]
    if stored[0] == MARK:  # a format 7 block: a byte of the digest of the step holding the event
        k, n = (index - first) // 3, _steps_in(bytes(stored))
        first += 3 * k
        data[start + len(stored) - 36 * n + 32 * k] ^= 0x01
    elif is_row(bytes(stored)):  # a format 6 row: its digest, msgpack bin 8 of 32 bytes
        at = stored.index(b"\xc4\x20") + 2
        data[start + at] ^= 0x01
    else:
        first = index
        at = max(i for i, c in enumerate(stored) if chr(c).isalnum())  # the last value byte
        data[start + at] = ord("1") if stored[at] != ord("1") else ord("2")
    crcs = h.event_crcs
    if rechecksum:
        crcs = [zlib.crc32(data[sum(h.event_lengths[:i]):sum(h.event_lengths[:i + 1])])
                for i in range(len(h.event_lengths))]
    return pack_record(msgspec.structs.replace(h, event_crcs=crcs, data=bytes(data))), first


def _steps_in(item: bytes) -> int:
    """The decode steps a step item holds: a format 7 block's count, or a format 6 row's one."""
    return int.from_bytes(item[1:5], "little") if item[0] == MARK else 1


def _item_of(h, index: int) -> tuple[int, int]:
    """The item that holds the record's event `index`, and that item's first event."""
    at = 0
    for item in range(len(h.event_lengths)):
        start = sum(h.event_lengths[:item])
        stored = h.data[start:start + h.event_lengths[item]]
        width = 3 * _steps_in(stored) if h.format >= 6 and is_row(stored) else 1
        if index < at + width:
            return item, at
        at += width
    raise IndexError(index)


def test_the_demo_journal_verifies_clean_and_its_chain_links_every_record(demo):
    db_url, records = demo
    assert tampered(db_url) == []


def test_an_edited_last_record_of_a_head_is_found(demo):
    db_url, records = demo
    heads = sql(db_url, "SELECT handle_id, last_record FROM kvl_heads ORDER BY handle_id")
    assert heads and all(r in {last for last, _, _ in records} for _, r in heads)
    handle, pointer = heads[0]
    for wrong in (pointer - 1, None, records[0][0] if records[0][0] != pointer else records[-1][0]):
        sql(db_url, "UPDATE kvl_heads SET last_record = :r WHERE handle_id = :h", r=wrong, h=handle)
        try:
            found = tampered(db_url)
        finally:
            sql(db_url, "UPDATE kvl_heads SET last_record = :r WHERE handle_id = :h", r=pointer, h=handle)
        assert found, wrong
    assert tampered(db_url) == []
    [(stored_chain,)] = sql(db_url, "SELECT chain FROM kvl_records WHERE last_position = :p", p=records[-1][0])
    link = bytes(32)
    for _, _, body in records:
        link = chain(link, body)
    assert bytes(stored_chain) == link
    assert sum(len(decode_record(b, "").events) for _, _, b in records) == records[-1][0]


def test_an_edited_byte_in_any_event_is_named(demo):
    """Every event of the journal: one byte of its bytes changed inside its record (the
    CRCs left as committed) is TAMPERED at exactly that event's position, first."""
    db_url, records = demo
    named = rows = 0
    for last, first, body in records:
        for i in range(last - first + 1):
            edited, named_at = edit_event(body, i, rechecksum=False)
            found = with_body(db_url, last, edited)
            assert found and found[0] == first + named_at, (first + i, found)
            named += 1
            rows += named_at != i
    assert named == records[-1][0]
    assert rows  # the demo's decode steps are step rows: each of their events was edited too
    assert tampered(db_url) == []  # every edit was restored


def test_a_record_rewritten_with_fresh_checksums_breaks_the_chain(demo):
    """An editor who also recomputes the CRCs still cannot fix the chain: the record is
    TAMPERED from its first event on, and the records after it are not blamed."""
    db_url, records = demo
    for last, first, body in records:
        assert with_body(db_url, last, edit_event(body, last - first, rechecksum=True)[0]) == [first]


@pytest.mark.parametrize("stride", [193])  # prime: flips move through every field; 97 cost CI ~25 s more
def test_a_flipped_stored_byte_names_an_event_of_its_record(demo, stride):
    """Single bytes of the stored records (header, CRCs, compressed data), every
    `stride`-th one and each record's first and last: a finding inside that record."""
    db_url, records = demo
    for last, first, body in records:
        for at in sorted({0, len(body) - 1, *range(0, len(body), stride)}):
            flipped = bytearray(body)
            flipped[at] ^= 0x01
            found = with_body(db_url, last, bytes(flipped))
            assert found and first <= found[0] <= last, (first, last, at, found)


def test_an_edited_indexed_column_names_the_record(demo):
    """first_position, last_position and chain of each record; one lookup key of each."""
    db_url, records = demo
    for last, first, _ in records:
        edits = [
            ("UPDATE kvl_records SET first_position = first_position + 1 WHERE last_position = :p",
             "UPDATE kvl_records SET first_position = first_position - 1 WHERE last_position = :p"),
            ("UPDATE kvl_records SET last_position = last_position + 1000000 WHERE last_position = :p",
             "UPDATE kvl_records SET last_position = last_position - 1000000 WHERE last_position = :p + 1000000"),
        ]
        for edit, undo in edits:
            sql(db_url, edit, p=last)
            try:
                found = tampered(db_url)
            finally:
                sql(db_url, undo, p=last)
            assert found and first <= found[0] <= last, (edit, first, last, found)
        [(link,)] = sql(db_url, "SELECT chain FROM kvl_records WHERE last_position = :p", p=last)
        flipped = bytes([link[0] ^ 0x01]) + bytes(link[1:])
        sql(db_url, "UPDATE kvl_records SET chain = :c WHERE last_position = :p", c=flipped, p=last)
        try:
            found = tampered(db_url)
        finally:
            sql(db_url, "UPDATE kvl_records SET chain = :c WHERE last_position = :p", c=bytes(link), p=last)
        assert found and found[0] == first
        # the stream chain (revision 0006): a record's pointers, and no stream rows for it
        [(prev,)] = sql(db_url, "SELECT stream_prev FROM kvl_records WHERE last_position = :p", p=last)
        pointers = unpack_prev(bytes(prev))
        for wrong in ([*pointers[:-1], pointers[-1] + 1], pointers[:-1], [p + 7 for p in pointers]):
            sql(db_url, "UPDATE kvl_records SET stream_prev = :b WHERE last_position = :p", b=pack_prev(wrong), p=last)
            try:
                found = tampered(db_url)
            finally:
                sql(db_url, "UPDATE kvl_records SET stream_prev = :b WHERE last_position = :p", b=bytes(prev), p=last)
            assert first in found, (wrong, first, last, found)
        sql(db_url, "INSERT INTO kvl_record_streams (stream_key, last_position) VALUES (7, :p)", p=last)
        try:
            found = tampered(db_url)
        finally:
            sql(db_url, "DELETE FROM kvl_record_streams WHERE stream_key = 7 AND last_position = :p", p=last)
        assert first in found, (first, last, found)
        for table, key in (("kvl_record_ids", "first_key"), ("kvl_record_ids", "last_key")):
            [(k,)] = sql(db_url, f"SELECT min({key}) FROM {table} WHERE last_position = :p", p=last)
            sql(db_url, f"UPDATE {table} SET {key} = {key} + 1 WHERE last_position = :p AND {key} = :k", p=last, k=k)
            try:
                found = tampered(db_url)
            finally:
                sql(db_url, f"UPDATE {table} SET {key} = {key} - 1 WHERE last_position = :p AND {key} = :k",
                    p=last, k=k + 1)
            assert first in found, (table, first, last, found)
    assert tampered(db_url) == []


def test_verify_exits_1_and_names_the_edited_event(demo, capsys):
    db_url, records = demo
    last, first, body = records[len(records) // 2]
    edited, named = edit_event(body, 1, rechecksum=False)
    sql(db_url, "UPDATE kvl_records SET body = :b WHERE last_position = :p", b=edited, p=last)
    try:
        code, out, err = cli(capsys, "verify", "--db", db_url, "--json")
    finally:
        sql(db_url, "UPDATE kvl_records SET body = :b WHERE last_position = :p", b=body, p=last)
    assert code == 1, err
    report = json.loads(out)
    assert [f["global_position"] for f in report["findings"] if f["code"] == "TAMPERED"][0] == first + named


def test_a_manifest_is_stored_as_a_reference_to_its_allocation_and_an_edited_one_is_named(demo):
    """An appended allocation's manifest is kept once, in its event: kvl_manifests points
    at that event, readers get its canonical JSON back, and a reference moved to another
    allocation, or to nowhere, is a DIGEST_MISMATCH at the allocation whose manifest it is."""
    db_url, _ = demo
    rows = sql(db_url, "SELECT manifest_sha256, body FROM kvl_manifests ORDER BY body")
    assert len(rows) == 2 and all(bytes(b).startswith(b"@") for _, b in rows)
    with open_journal(db_url) as journal:
        for sha, _ in rows:
            assert hashlib.sha256(journal.manifest(sha)).hexdigest() == sha
        allocations = {e.payload.manifest_sha256: e.global_position for e in journal.read_all()
                       if e.event_type == "request_allocate"}
    (sha_a, ref_a), (_, ref_b) = rows
    for wrong in (bytes(ref_b), b"@999999", b"@0"):
        sql(db_url, "UPDATE kvl_manifests SET body = :b WHERE manifest_sha256 = :s", b=wrong, s=sha_a)
        try:
            with open_journal(db_url) as journal:
                result = verify_journal(journal)
        finally:
            sql(db_url, "UPDATE kvl_manifests SET body = :b WHERE manifest_sha256 = :s", b=bytes(ref_a), s=sha_a)
        assert [(f.code, f.global_position) for f in result.findings] == [("DIGEST_MISMATCH", allocations[sha_a])]
    assert tampered(db_url) == []


def test_a_stream_chain_that_does_not_go_back_is_refused_not_followed(db_url):
    """A record's stream_prev edited to name the record itself, or a later one: reading
    the stream is CORRUPT_JOURNAL at once (a chain followed as stored would loop)."""
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.schemas.errors import ErrorCode, KvLedgerError

    from factories import allocate_op, guard_of, publish_op

    with open_or_create_journal(db_url) as j:
        j.append([allocate_op("a"), allocate_op("b")])
        for step in range(3):
            j.append([publish_op(h, guard_of(j.head(h)), f"p{step}-{h}") for h in ("a", "b")])
        whole = j.read_stream("a")
    [(last, prev)] = sql(db_url, "SELECT last_position, stream_prev FROM kvl_records "
                                 "ORDER BY last_position DESC LIMIT 1")
    for wrong in ([last, last], [last + 2, last + 2]):
        sql(db_url, "UPDATE kvl_records SET stream_prev = :b WHERE last_position = :p", b=pack_prev(wrong), p=last)
        try:
            with open_journal(db_url) as j, pytest.raises(KvLedgerError) as refused:
                j.read_stream("a")
        finally:
            sql(db_url, "UPDATE kvl_records SET stream_prev = :b WHERE last_position = :p", b=bytes(prev), p=last)
        assert refused.value.code is ErrorCode.CORRUPT_JOURNAL and "not back" in refused.value.message
    with open_journal(db_url) as j:
        assert j.read_stream("a") == whole
