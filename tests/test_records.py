"""The record format (journal/record_format.py, journal/legacy.py): format 4 (zstd, compact receipts, a decode
chain's fingerprint derived from its events) rebuilds every receipt byte for byte;
format 2 (zstd, JSON receipts) and format 1 (zlib) records written before it read back
the same; damage is named, never inflated without bound;
manifests read back in either stored form."""

from __future__ import annotations

import zlib
from typing import Any

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvledger.engine import commands as c
from kvledger.journal.audit import audit_record, decode_record, unpack_record
from kvledger.journal.keys import (
    MAX_RUN,
    counted_keys,
    counted_runs,
    id_key,
    id_keys,
    id_runs,
    op_key,
    stab,
    stable_key,
)
from kvledger.journal.legacy import Header4 as _Header
from kvledger.journal.manifests import pack_manifest, unpack_manifest
from kvledger.journal.readback import Damage, compact_receipt
from kvledger.journal.record_format import FORMAT, encode_record, pack_record
from kvledger.journal.record_format import Frame as _Header5
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.receipts import receipt_decoder, receipt_encoder

EVENTS = [b'{"event_type":"append_start","n":%d}' % i for i in range(50)]
RECEIPTS = [b'{"operation_id":"op-%d"}' % i for i in range(7)]


def _format2(events: list[bytes], receipts: list[bytes]) -> bytes:
    """A record as written before format 3: receipts as JSON."""
    return encode_record(events, receipts, fmt=2)


def _format1(events: list[bytes], receipts: list[bytes]) -> bytes:
    """A record as revision 0003's first writer stored it: zlib level 1."""
    crc = zlib.crc32
    return msgspec.msgpack.encode(_Header(
        1, [len(e) for e in events], [crc(e) for e in events], [len(r) for r in receipts],
        [crc(r) for r in receipts], zlib.compress(b"".join(events) + b"".join(receipts), 1)))


@pytest.mark.parametrize("encode", [_format2, _format1], ids=["format2", "format1"])
def test_both_formats_read_back_exactly(encode):
    body = encode(EVENTS, RECEIPTS)
    record = decode_record(body, "t")
    assert record.events == EVENTS and record.receipts == RECEIPTS


def test_zstd_records_are_smaller_than_format_1():
    events = [b'{"event_type":"output_emit","payload":{"output_index":%d,"token_id":%d}}' % (i, i * 7919 % 50000)
              for i in range(2000)]
    new, old = encode_record(events, [], fmt=5), _format1(events, [])
    assert unpack_record(new).format == 5
    assert len(new) < len(old)


@pytest.mark.parametrize("encode", [_format2, _format1], ids=["format2", "format1"])
def test_a_changed_event_byte_is_named(encode):
    h = msgspec.msgpack.decode(encode(EVENTS, RECEIPTS), type=_Header)
    crcs = list(h.event_crcs)
    crcs[17] ^= 1  # as if event 17's bytes had changed under an unchanged CRC
    found = audit_record(msgspec.msgpack.encode(msgspec.structs.replace(h, event_crcs=crcs)))
    assert isinstance(found, Damage) and found.index == 17 and len(found.events) == 17


@pytest.mark.parametrize("encode", [_format2, _format1], ids=["format2", "format1"])
def test_a_forged_length_never_inflates_beyond_what_the_data_can_hold(encode):
    h = msgspec.msgpack.decode(encode(EVENTS, RECEIPTS), type=_Header)
    lengths = list(h.event_lengths)
    lengths[-1] = 1 << 40
    found = audit_record(msgspec.msgpack.encode(msgspec.structs.replace(h, event_lengths=lengths)))
    assert isinstance(found, Damage)
    with pytest.raises(KvLedgerError) as err:
        decode_record(msgspec.msgpack.encode(msgspec.structs.replace(h, event_lengths=lengths)), "at 9")
    assert err.value.code.value == "CORRUPT_JOURNAL"


@pytest.mark.parametrize("fmt, header", [(2, _Header), (5, _Header5)], ids=["format2", "format5"])
def test_flipped_compressed_bytes_are_damage_inside_the_record(fmt, header):
    """Format 5's frame also holds the lists: a flip there is damage, never a misread."""
    h = msgspec.msgpack.decode(encode_record(EVENTS, RECEIPTS, fmt=fmt), type=header)
    for at in range(0, len(h.data), 3):
        data = bytearray(h.data)
        data[at] ^= 0x5A
        found = audit_record(msgspec.msgpack.encode(msgspec.structs.replace(h, data=bytes(data))))
        if isinstance(found, Damage):
            assert found.index is None or 0 <= found.index < len(EVENTS)
            assert found.events == EVENTS[:len(found.events)]  # what it keeps is exact
        else:  # the flip landed where zstd does not look (it cannot change a byte we read)
            assert found.events == EVENTS and found.stored_receipts == RECEIPTS


def test_format_5_keeps_its_lists_inside_the_frame_and_reads_back_exactly():
    body = encode_record(EVENTS, RECEIPTS, fmt=5)
    h = msgspec.msgpack.decode(body, type=_Header5)
    assert (h.format, h.events, h.receipts) == (5, len(EVENTS), len(RECEIPTS))
    record = decode_record(body, "t")
    assert record.events == EVENTS and record.stored_receipts == RECEIPTS
    parts = unpack_record(body)
    assert parts.event_lengths == [len(e) for e in EVENTS] and parts.receipt_crcs == [zlib.crc32(r) for r in RECEIPTS]
    assert pack_record(parts) == body
    # like events' lengths repeat: the lists cost the frame far less than the header's msgpack lists
    old = encode_record(EVENTS, RECEIPTS, fmt=4)
    assert len(body) < len(old)


def _forged5(**change) -> bytes:
    return pack_record(msgspec.structs.replace(unpack_record(encode_record(EVENTS, RECEIPTS, fmt=5)), **change))


def test_format_5_names_a_changed_event_and_refuses_forged_lists():
    crcs = [zlib.crc32(e) for e in EVENTS]
    crcs[17] ^= 1  # as if event 17's bytes had changed under an unchanged CRC
    found = audit_record(_forged5(event_crcs=crcs))
    assert isinstance(found, Damage) and found.index == 17 and found.events == EVENTS[:17]
    for change in ({"event_lengths": [len(e) for e in EVENTS[:-1]] + [1 << 31]},  # past the data
                   {"receipt_lengths": [len(r) + 1 for r in RECEIPTS]}):
        found = audit_record(_forged5(**change))
        assert isinstance(found, Damage), change
        with pytest.raises(KvLedgerError) as err:
            decode_record(_forged5(**change), "at 9")
        assert err.value.code.value == "CORRUPT_JOURNAL"
    # a header claiming more lists than its frame holds: refused before anything is cut
    h = msgspec.msgpack.decode(encode_record(EVENTS, RECEIPTS, fmt=5), type=_Header5)
    for events in (1 << 40, len(EVENTS) + 10_000, -1):
        found = audit_record(msgspec.msgpack.encode(msgspec.structs.replace(h, events=events)))
        assert isinstance(found, Damage) and found.index is None, events


def test_manifests_read_back_in_either_stored_form():
    body = b'{"artifact_identity":{"adapter_set":[]},"schema_version":1}' * 20
    packed = pack_manifest(body)
    assert len(packed) < len(body)
    assert unpack_manifest(packed) == body
    assert unpack_manifest(body) == body  # stored before format 2: as it is
    damaged = packed[:-3] + b"\x00\x00\x00"
    assert unpack_manifest(damaged) == damaged  # verify then sees a digest that does not match


# -- format 3: receipts rebuilt from the record's events ---------------------------------

def _committed(tmp_path) -> tuple[list[bytes], list[bytes]]:
    """A journal written through the Ledger with single- and multi-handle operations
    (allocate, append, emit, a fork writing two children, a reorder of two, a truncate),
    a kv-events gap and batch in one commit (fingerprints that are not a SHA-256): the
    receipts the writer returned, as JSON, and the stored record bodies."""
    import sqlite3

    from kvledger import Ledger  # the facade imports every layer: not at module level here
    from kvledger.adapters.kv_events_recorder import Recorder

    from lifecycle_helpers import allocate, base, decode, emit, prefill

    url = f"sqlite:///{tmp_path}/j.db"
    returned: list[Any] = []
    with Ledger.open(url) as ledger:
        ledger.service.on_commit.append(lambda receipt, events: returned.append(receipt))
        allocate(ledger, "H", capacity=32)
        prefill(ledger, "H")
        emit(ledger, "H", 5)
        decode(ledger, "H", "t1")
        ledger.fork("H", base=base(ledger, "H"), child_handle_ids=["A", "B"], prefix_length=5)
        ledger.reorder("beam", rows=["A", "B"], permutation=[1, 0])
        ledger.truncate("A", base=base(ledger, "A"), new_length=3)
        ledger.finish("B", base=base(ledger, "B")[0])
        ledger.release("B", base=base(ledger, "B")[0])
        # decode chains as commands, one with its emit's base named
        allocate(ledger, "D", capacity=32)
        s = ledger.state("D")
        ledger.begin_append("D", txn_id="D0", kind="prefill", base=base(ledger, "D"), start=0, token_ids=s.prompt)
        for i in range(4):
            [r] = ledger.service.execute_many([c.Relative(_decode_chain(ledger.state("D"), i, named=i == 2))])
            assert not isinstance(r, Exception), r
        rec = Recorder("tcp://x:1", "kv", {}, replayable=False)
        rec.message(3, b"x", (1.0, (), 0), replayed=False)  # seqs 0-2 never seen: a gap, then the batch
        returned += ledger.journal.append(rec.take())
    assert all(hasattr(r, "fingerprint") for r in returned)
    assert any(not set(r.fingerprint) <= set("0123456789abcdef") for r in returned)
    assert any(len(r.handles) == 2 for r in returned)  # the fork's children, the reorder's rows
    con = sqlite3.connect(f"{tmp_path}/j.db")
    bodies = [bytes(b) for (b,) in con.execute("SELECT body FROM kvl_records ORDER BY last_position")]
    con.close()
    return [receipt_encoder.encode(r) for r in returned], bodies


def _decode_chain(s, i: int, named: bool = False):
    """The worker's decode chain for handle state `s` (`named`: the emit names its base)."""
    from kvledger.engine import commands as c

    t = s.open_txns[0]
    at = t.interval_start + t.interval_count
    g, v = (s.generation, s.snapshot_version + 1) if named else (None, None)
    return c.Chain(handle_id=s.handle_id, steps=(
        c.Publish(handle_id=s.handle_id, txn_id=t.txn_id, base_generation=None, base_snapshot_version=None,
                  rows_sha256=f"{i:064x}", workspace_bytes=64 * i),
        c.EmitOutput(handle_id=s.handle_id, base_generation=g, base_snapshot_version=v,
                     output_index=len(s.outputs), token_id=100 + i),
        c.BeginAppend(handle_id=s.handle_id, txn_id=f"D{i + 1}", kind="decode", base_generation=None,
                      base_snapshot_version=None, interval_start=at, interval_count=1, token_ids=(100 + i,),
                      cache_positions=(at,), mask_key_extent=at + 1, cache_abi_sha256=s.cache_abi_sha256),
    ))


def test_format_4_rebuilds_each_receipt_byte_for_byte(tmp_path):
    """Every receipt the writer returned, rebuilt from the stored records: compact ones
    (format 3's), and decode chains' whose fingerprints are derived from their events
    (format 4), which the journal above holds, besides a chain whose fingerprint is stored."""
    from kvledger.journal.readback import _compact_decode

    returned, bodies = _committed(tmp_path)
    stored = []
    marks = []
    for body in bodies:
        assert unpack_record(body).format == FORMAT == 7  # txn ids like D1: no step rows, one format all the same
        marks += [_compact_decode(r).fingerprint is None for r in decode_record(body, "t").stored_receipts]
        record = decode_record(body, "t")
        stored += record.receipts
        audited = audit_record(body)
        assert not isinstance(audited, Damage) and audited.receipts == record.receipts
    assert stored == returned
    # Decode chains sent as commands take the general path, which stores their fingerprints;
    # the writer derives one only with a step row (fixtures/journal_format5 holds format 4's).
    assert marks.count(True) == 0
    # and each is what format 2 stored: the same record with its receipts as JSON
    for body in bodies:
        record = decode_record(body, "t")
        again = decode_record(_format2(record.events, record.receipts), "t")
        assert again.events == record.events and again.receipts == record.receipts


def test_a_compact_receipt_that_does_not_fit_its_events_is_damage(tmp_path):
    _, bodies = _committed(tmp_path)
    body = next(b for b in bodies if len(decode_record(b, "t").events) > 1)
    record = decode_record(body, "t")
    receipts = [receipt_decoder.decode(r) for r in record.receipts]
    # the first receipt claims one event fewer: the events no longer add up
    short = msgspec.structs.replace(receipts[0], event_ids=receipts[0].event_ids[:-1])
    forged = encode_record(record.events, [compact_receipt(short)] + [compact_receipt(r) for r in receipts[1:]], fmt=5)
    found = audit_record(forged)
    assert isinstance(found, Damage) and "do not fit" in found.message
    with pytest.raises(KvLedgerError) as err:
        decode_record(forged, "at 1").receipts  # noqa: B018 - the property rebuilds, and refuses
    assert err.value.code.value == "CORRUPT_JOURNAL"


def test_a_new_sqlite_journal_has_1kb_pages_and_an_older_one_keeps_its_own(tmp_path):
    """Small pages are chosen when the file is made; a journal made with 4 KB pages
    keeps them (SQLite cannot change them under WAL) and goes on appending."""
    import sqlite3

    from kvledger import Ledger
    from kvledger.migrations.storage import init_database

    from lifecycle_helpers import allocate

    new, old = tmp_path / "new.db", tmp_path / "old.db"
    init_database(f"sqlite:///{new}")
    con = sqlite3.connect(old)
    con.execute("PRAGMA page_size=4096")
    con.execute("PRAGMA journal_mode=WAL")
    con.close()
    init_database(f"sqlite:///{old}")
    for path, size in ((new, 1024), (old, 4096)):
        with Ledger.open(f"sqlite:///{path}") as ledger:
            allocate(ledger, "H")
            assert ledger.state("H").stream_position == 1
        con = sqlite3.connect(path)
        assert con.execute("PRAGMA page_size").fetchone()[0] == size
        assert con.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        con.close()


# -- operation keys (revision 0004) ----------------------------------------------------

HEX16 = st.text("0123456789abcdef", min_size=16, max_size=16)


@given(HEX16, st.integers(0, (1 << 40) - 2), st.integers(1, 1 << 20))
def test_one_writers_operation_keys_ascend_with_its_counter(prefix, a, step):
    """engine.ids' ids (a process prefix, then a counter) key in the counter's order, so
    a writer's lookup rows go in at one end of its range."""
    b = min(a + step, (1 << 40) - 1)
    ka, kb = op_key(f"{prefix}{a:016x}"), op_key(f"{prefix}{b:016x}")
    assert ka < kb and -(1 << 63) <= ka and kb < 1 << 63


@given(st.text(min_size=1, max_size=64))
def test_other_operation_ids_keep_the_hashed_key(value):
    key = op_key(value)
    assert -(1 << 63) <= key < 1 << 63
    if not (len(value) == 32 and all(ch in "0123456789abcdef" for ch in value)):
        assert key == stable_key(value)


def test_an_operation_key_depends_on_the_prefix_and_the_counter_only():
    new = [op_key(f"{p}{c:016x}") for p in ("0" * 16, "f" * 16) for c in (0, 1 << 40, 1)]
    assert new[0] == new[1] != new[2]  # the counter's low 40 bits: the 41st wraps
    assert new[0] != new[3] and new[3] == new[4]
    assert op_key("F" * 32) == stable_key("F" * 32)  # upper case is not engine.ids' form


# -- id runs (revision 0005) -----------------------------------------------------------

KEYS = st.integers(-(1 << 63), (1 << 63) - 1)


def _near(base: int) -> st.SearchStrategy[int]:
    """Keys clustered as one writer's are (consecutive with gaps), near the edges too."""
    return st.integers(0, 3 * MAX_RUN).map(lambda d: max(-(1 << 63), min((1 << 63) - 1, base + d)))


CLUSTERED = st.sampled_from([-(1 << 63), -5, 0, (1 << 63) - 3 * MAX_RUN]).flatmap(
    lambda b: st.lists(_near(b), max_size=3 * MAX_RUN))


# one writer's consecutive ids (id_runs' one-run shortcut), up to just past a run's cap
CONSECUTIVE = st.tuples(st.integers(-(1 << 63), (1 << 63) - MAX_RUN - 2), st.integers(1, MAX_RUN + 2)).map(
    lambda an: list(range(an[0], an[0] + an[1])))


@given(st.one_of(st.lists(KEYS, max_size=50), CLUSTERED, CONSECUTIVE))
@example(list(range(MAX_RUN)))
@example(list(range(MAX_RUN + 1)))
def test_id_runs_cover_exactly_the_keys_in_capped_runs(keys):
    runs = id_runs(keys)
    covered = [k for a, b in runs for k in range(a, b + 1)]
    assert covered == sorted(set(keys))  # every key once, in order, nothing else
    assert all(0 <= b - a < MAX_RUN for a, b in runs)
    # maximal: two runs are apart, or the first is full
    assert all(c > b + 1 or b - a == MAX_RUN - 1 for (a, b), (c, _) in zip(runs, runs[1:]))


@given(st.text("0123456789abcdef", min_size=16, max_size=16),
       st.one_of(st.integers(0, (1 << 64) - 1), st.integers((1 << 40) - 5000, (1 << 40) + 10)),
       st.integers(1, MAX_RUN + 8))
def test_a_block_of_counted_ids_keys_as_its_ids_do(prefix, first, count):
    """A decode run's id block (journal.run_writer): its runs from its first counter and
    size, as id_runs finds them in its ids' keys, across a 2**40 boundary and past MAX_RUN."""
    assert counted_runs(prefix, first, count) == id_runs(counted_keys(prefix, range(first, first + count)))


@given(st.one_of(st.lists(KEYS, max_size=30), CLUSTERED), st.one_of(st.lists(KEYS, max_size=10), CLUSTERED))
def test_a_stab_finds_exactly_the_stored_runs_that_hold_a_wanted_key(stored_keys, wanted_keys):
    """What `first_key BETWEEN lo AND hi AND last_key >= a` selects, evaluated here as the
    database would: every stored run that holds a wanted key, and no run that does not."""
    stored, wanted = id_runs(stored_keys), set(wanted_keys)
    selected = {(f, lk) for lo, hi, a in stab(id_runs(wanted)) for f, lk in stored if lo <= f <= hi and lk >= a}
    holding = {(f, lk) for f, lk in stored if any(f <= k <= lk for k in wanted)}
    assert selected == holding


@given(st.text(max_size=20).filter(lambda t: not t[-1:].isdigit()), st.integers(0, 10**12 - 2))
def test_ids_that_end_in_a_counter_key_in_its_order(stem, n):
    """The KV-event recorder's ids (kv:<stream>:<epoch>:<seq>) and a caller's "op-17":
    consecutive counters are consecutive keys, so one stream's batches make one run."""
    a, b = id_key(f"{stem}{n}"), id_key(f"{stem}{n + 1}")
    assert b == a + 1 and -(1 << 63) <= a < b < 1 << 63


def test_id_key_is_op_key_for_own_ids_and_stable_key_for_the_rest():
    own = "0123456789abcdef" + "0000000000000011"
    assert id_key(own) == op_key(own) and id_key("g" * 32) == stable_key("g" * 32)
    assert id_key("no-counter") == stable_key("no-counter")


_HEXISH = "0123456789abcdefABCDEF"


@st.composite
def _id_batches(draw: Any) -> list[str]:
    """A batch of one writer's engine.ids-form ids, some of them bent: a character swapped
    for one int(_, 16) reads differently from bytes.fromhex (space, `_`, sign), a
    non-ASCII one, another case, another length, another writer's prefix."""
    prefix = draw(st.text(_HEXISH[:16], min_size=16, max_size=16))
    ids = [prefix + f"{n:016x}" for n in draw(st.lists(st.integers(0, (1 << 64) - 1), min_size=8, max_size=80))]
    if draw(st.booleans()):
        i = draw(st.integers(0, len(ids) - 1))
        ids[i] = draw(st.text(_HEXISH, min_size=16, max_size=16)) + ids[i][16:]
    if draw(st.booleans()):  # the same value in capitals: another prefix's text, another key
        i = draw(st.integers(0, len(ids) - 1))
        ids[i] = ids[i].upper()
    for _ in range(draw(st.integers(0, 3))):
        i, at = draw(st.integers(0, len(ids) - 1)), draw(st.integers(0, 31))
        c = draw(st.sampled_from([*_HEXISH, " ", "\t", "_", "-", "+", "g", "\u00e9", "", "00"]))
        ids[i] = ids[i][:at] + c + ids[i][at + 1:]
    return ids


_SPACED = ["0123456789abcdef" + f"{n:016x}" for n in range(16)]


@given(_id_batches())
# two spaces where bytes.fromhex skips them: an even count of digits, one byte short
@example([_SPACED[0][:24] + " " + _SPACED[0][25:], _SPACED[1][:21] + " " + _SPACED[1][22:], *_SPACED[2:]])
def test_a_batch_of_ids_keys_as_each_id_alone(ids):
    """id_keys reads a batch of engine.ids-form ids at once: each key is the one
    that id keys to alone, so lookups of journals written before it find the same runs."""
    assert id_keys(ids) == [id_key(i) for i in ids]


def test_a_threads_reused_compressor_writes_what_a_new_one_writes():
    """compress keeps one zstd context a thread: each call's frame is a fresh context's,
    whatever was compressed before it, in this thread or another."""
    import threading

    import zstandard

    from kvledger.journal.inflate import compress

    inputs = [b"", b"x" * 5000, bytes(range(256)) * 40, b'{"event_type":"append_start"}' * 90, b"y"]
    fresh = [zstandard.ZstdCompressor(level=1).compress(x) for x in inputs]
    found: dict[int, list[bytes]] = {}

    def run(k: int) -> None:
        found[k] = [compress(x) for x in (inputs if k % 2 else inputs[::-1])]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [compress(x) for x in inputs] == fresh
    assert all(found[k] == (fresh if k % 2 else fresh[::-1]) for k in range(4))
