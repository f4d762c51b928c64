"""Issue 44, damaged record bodies: whatever a stored record's body holds (one byte, TEXT,
a truncated zstd frame, random bytes, a zstd bomb), `verify` reports it (TAMPERED, exit 1)
and `replay` and `export` refuse it in one coded line (exit 2): never INTERNAL_ERROR,
never a traceback. What a reader inflates is bounded by the format's limits, checked
before inflating (journal.inflate), not by the frame's own word or its compression ratio."""

from __future__ import annotations

import contextlib
import io
import json
import random
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.cli import main
from kvledger.journal import inflate
from kvledger.journal.audit import audit_record, unpack_record
from kvledger.journal.readback import Damage
from kvledger.journal.record_format import encode_record, pack_record

from bench.hostile_records import frame, lists, raw_block, record5, rle_blocks
from stored_rows import cli, demo_records, one_coded_line, records, sql

GIB = 1 << 30
MIB = 1 << 20
BOMBS = {
    # a few KB stating gigabytes: refused on the size it states, nothing inflated
    "states 4 GiB": record5(1, 1, frame(4 * GIB, rle_blocks(4 * GIB))),
    # under the record limit, zeros from its lists on: refused at its first list page
    "states 512 MiB of zeros": record5(1, 1, frame(512 * MIB, rle_blocks(512 * MIB))),
    # within the ratio the old bound let through (1024x): refused at its lists, not after 64 MiB
    "64 KiB of frame, 64 MiB of zeros": record5(1, 1, frame(64 * MIB, rle_blocks(64 * MIB, block=4096))),
    # lists that fit the size it states, an item of zeros whose CRC does not match
    "lists that fit, an item of zeros": record5(1, 1, frame(
        16 + 8 * MIB + 1, [raw_block(lists([8 * MIB, 1], [1, 1])), *rle_blocks(8 * MIB + 1)])),
    # a frame stating 100 bytes that inflates to gigabytes
    "states 100 bytes, holds 1 GiB": record5(1, 1, frame(100, rle_blocks(GIB))),
    # no stated size at all
    "states no size": record5(1, 1, frame(None, rle_blocks(64 * MIB))),
    # format 4: the lists in the header, a frame of zeros behind them
    "format 4, an item over the limit": msgspec.msgpack.encode(
        [4, [256 * MIB], [1], [], [], frame(256 * MIB, rle_blocks(256 * MIB))]),
    "format 4, 16 MiB listed": msgspec.msgpack.encode(
        [4, [8 * MIB, 8 * MIB], [1, 1], [], [], frame(16 * MIB, rle_blocks(16 * MIB))]),
}


# -- the journal: a short demo, its records damaged one at a time -------------------------

@pytest.fixture
def demo(shared_journal):
    return demo_records(shared_journal)


def run(*args: str) -> tuple[int, str, str]:
    """The CLI in this process, its output captured (hypothesis runs many examples in one test)."""
    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
        sys.stdout.flush()
    out.seek(0)
    return code, out.read(), err.getvalue()


def readers(db_url: str, tmp: Path) -> list[tuple[int, str, str]]:
    """What `replay --json` and `export` do with the journal as it is now."""
    return [run("replay", "--json", "--db", db_url),
            run("export", "--db", db_url, "--out", str(tmp / "out.jsonl"))]


def damaged(db_url: str, tmp: Path, last: int, body: bytes | str) -> tuple[dict, list[tuple[int, str, str]]]:
    """verify's report and the readers' outcomes with the record ending at `last` stored
    as `body`; the record restored after."""
    [(before,)] = sql(db_url, "SELECT body FROM kvl_records WHERE last_position = :p", p=last)
    sql(db_url, "UPDATE kvl_records SET body = :b WHERE last_position = :p", b=body, p=last)
    try:
        code, out, err = run("verify", "--json", "--db", db_url)
        assert code == 1 and err == "", (code, err)
        return json.loads(out), readers(db_url, tmp)
    finally:
        sql(db_url, "UPDATE kvl_records SET body = :b WHERE last_position = :p", b=bytes(before), p=last)


def assert_reported(report: dict, first: int, last: int, outcomes: list[tuple[int, str, str]],
                    clean: list[tuple[int, str, str]] | None = None) -> None:
    """TAMPERED inside the record; each reader refused in one coded line, never
    INTERNAL_ERROR (or, given `clean`, read exactly what the undamaged journal gives)."""
    tampered = [f["global_position"] for f in report["findings"] if f["code"] == "TAMPERED"]
    assert tampered and first <= tampered[0] <= last, report["findings"][:3]
    for i, (code, out, err) in enumerate(outcomes):
        if clean is not None and code == 0 and (out, err) == clean[i][1:]:
            continue  # the damage changed nothing this reader reads (verify found it by the chain)
        assert code == 2 and out == "", (code, out[:200], err)
        assert not one_coded_line(err).startswith("INTERNAL_ERROR"), err


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
def test_damaged_bodies_are_findings_for_verify_and_coded_refusals_for_readers(demo, tmp_path):
    """One byte (0x94 opens a format 5 header: it read past the body), a truncated frame,
    random bytes, nothing, and each zstd bomb, in a record in the middle and the last."""
    db_url, records = demo
    rng = random.Random(44)
    for last, first, body in (records[len(records) // 2], records[-1]):
        fmt, events, receipts, data = msgspec.msgpack.decode(body)
        bodies = {"0x94": b"\x94", "0x00": b"\x00", "empty": b"", "cut": body[:len(body) - 7],
                  "truncated frame": msgspec.msgpack.encode([fmt, events, receipts, data[:len(data) // 2]]),
                  "random": rng.randbytes(300), **BOMBS}
        # what no CRC covers: the header's format byte and its split of items into events and receipts
        headers = [[other, events, receipts] for other in (5, 6, 7) if other != fmt]
        headers += [[fmt, events + d, receipts - d] for d in (-1, 1) if events + d >= 0 and receipts - d >= 0]
        bodies.update({f"header {h}": msgspec.msgpack.encode([*h, data]) for h in headers})
        for name, bad in bodies.items():
            report, outcomes = damaged(db_url, tmp_path, last, bad)
            assert_reported(report, first, last, outcomes)
            for _, _, err in outcomes:
                assert f"ending at position {last}" in err, (name, err)


def test_a_text_body_is_a_finding_and_a_coded_refusal(tmp_path):
    """SQLite keeps a str given for the BLOB column as TEXT."""
    from kvledger.migrations.storage import init_database

    url = f"sqlite:///{tmp_path / 'j.db'}"
    init_database(url)
    code, _, err = run("demo", "--requests", "2", "--db", url, "--json")
    assert code == 0, err
    rows = sql(url, "SELECT last_position, first_position FROM kvl_records ORDER BY last_position")
    last, first = rows[len(rows) // 2]
    for text in ("text", "\x94", "\x94\x05"):
        report, outcomes = damaged(url, tmp_path, last, text)
        assert_reported(report, first, last, outcomes)
        # the record after it is read from where it ends and links to it: it alone is blamed
        assert [f["global_position"] for f in report["findings"] if f["code"] == "TAMPERED"] == [first]


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_zstd_bomb_is_refused_on_what_the_format_allows_before_inflating(name):
    """Each bomb is damage, found where the format's limits are checked: its stated size,
    its lists (before an item is inflated), or its first item's CRC (after one item)."""
    found = audit_record(BOMBS[name])
    assert isinstance(found, Damage)
    expected = {
        "states 4 GiB": f"more than a record holds ({inflate.MAX_RECORD_BYTES})",
        "states 512 MiB of zeros": "its lists name an item of 0 bytes",
        "64 KiB of frame, 64 MiB of zeros": "its lists name an item of 0 bytes",
        "lists that fit, an item of zeros": "its bytes do not match their CRC",
        "states 100 bytes, holds 1 GiB": "compressed data damaged",
        "states no size": "its header's counts do not fit its data",
        "format 4, an item over the limit": f"(an item holds 1 to {inflate.MAX_ITEM_BYTES})",
        "format 4, 16 MiB listed": "its bytes do not match their CRC",
    }[name]
    assert expected in found.message, found
    if "CRC" in expected:
        assert found.index == 0  # named at its first event, after inflating that one item


def test_a_record_that_compresses_past_1024x_reads_back(db_url, tmp_path, capsys):
    """A KV-event batch of 4M repeated token ids (12 MB of JSON) compresses to ~1.3 KB: the
    old bound (1,024 times the frame, plus 1 MiB) read the acknowledged record as damaged,
    and replay, export and serve refused the journal."""
    line = json.dumps({"seq": 0, "ts": 1.0, "events": [{
        "type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
        "token_ids": [0] * ((1 << 22) - 1), "block_size": 16}]})
    path = tmp_path / "big.jsonl"
    path.write_text(line + "\n")
    code, _, err = cli(capsys, "kv-events", "import", str(path), "--dialect", "vllm", "--db", db_url)
    assert code == 0, err
    [(size, body)] = [(len(r.body), r.body) for r in records(db_url)]
    assert len(line) / size > 4096  # compressed far past the old bound
    code, out, err = cli(capsys, "verify", "--db", db_url, "--json")
    assert code == 0 and json.loads(out)["ok"], (err, out[:500])
    code, out, err = cli(capsys, "export", "--db", db_url, "--out", str(tmp_path / "e.jsonl"))
    assert code == 0, err
    [event] = (tmp_path / "e.jsonl").read_bytes().splitlines()
    assert b'"token_ids":[0,0,0' in event and len(event) > 8 << 20
    code, out, err = cli(capsys, "replay", "--db", db_url, "--json")
    assert code == 0 and json.loads(out)["position"] == 1, err


@pytest.mark.parametrize("fmt", [2, 3, 4, 5])
def test_a_record_larger_than_one_inflation_reads_piece_by_piece(fmt):
    """Past INFLATE_AT_ONCE a record's items are inflated one at a time (each checked
    against its CRC): the same events as one inflation gives, and damage named in place."""
    rng = random.Random(fmt)
    events = [b'{"e":"%s"}' % rng.randbytes(600_000).hex().encode() for _ in range(6)]
    assert sum(map(len, events)) > inflate.INFLATE_AT_ONCE
    body = encode_record(events, [], fmt)
    found = audit_record(body, eager=False)
    assert found.events == events
    parts = unpack_record(body)
    data = bytearray(parts.data)
    data[sum(map(len, events[:3])) + 5] ^= 1  # a byte of the fourth event
    bad = audit_record(pack_record(msgspec.structs.replace(parts, data=bytes(data))), eager=False)
    assert bad.index == 3 and bad.events == events[:3], bad.message


# -- a fuzz test over a real journal's records -----------------------------------------

@pytest.fixture(scope="module")
def fuzz_journal(tmp_path_factory):
    """A demo journal on SQLite, what its readers print undamaged, and its records."""
    from kvledger.migrations.storage import init_database

    tmp = tmp_path_factory.mktemp("fuzz")
    url = f"sqlite:///{tmp / 'j.db'}"
    init_database(url)
    code, _, err = run("demo", "--requests", "2", "--db", url, "--json")
    assert code == 0, err
    rows = sql(url, "SELECT last_position, first_position, body FROM kvl_records ORDER BY last_position")
    clean = readers(url, tmp)
    assert [c for c, _, _ in clean] == [0, 0]
    return url, tmp, clean, [(last, first, bytes(body)) for last, first, body in rows]


def _mutations(body: bytes) -> st.SearchStrategy[bytes]:
    n = len(body)
    flip = st.tuples(st.integers(0, n - 1), st.integers(0, 7)).map(
        lambda f: body[:f[0]] + bytes([body[f[0]] ^ (1 << f[1])]) + body[f[0] + 1:])
    truncate = st.integers(0, n - 1).map(lambda k: body[:k])
    extend = st.binary(min_size=1, max_size=64).map(lambda extra: body + extra)
    replace = st.tuples(st.integers(0, n - 1), st.binary(min_size=1, max_size=16)).map(
        lambda r: body[:r[0]] + r[1] + body[r[0] + len(r[1]):])
    return st.one_of(flip, truncate, extend, replace, st.binary(max_size=512))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damage_to_a_stored_record_is_found_and_refused(fuzz_journal, data):
    url, tmp, clean, records = fuzz_journal
    last, first, body = data.draw(st.sampled_from(records), label="record")
    bad = data.draw(_mutations(body), label="body")
    if bad == body:
        return
    report, outcomes = damaged(url, tmp, last, bad)
    assert_reported(report, first, last, outcomes, clean)
