"""Record format 7's blocks (journal.blocks): a run of decode steps as columns.

- Any thirty int64s a step and any digests pack and read back exactly, whatever widths
  their columns need (1, 2, 4 or 8 bytes) and in whatever order those widths fall.
- A changed byte anywhere in a step's columns, its digest or its CRC is named at that
  step by the CRC column; one in the header at the first step.
- A block whose CRCs hold but whose values no Step could hold (forged, or written by a
  faulty writer) is refused at the first such step, by the run's fast check and by the
  step-by-step one alike; a record holding one is damaged exactly there, the events
  before it intact.
"""

from __future__ import annotations

import shutil
import struct
import zlib

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvledger.journal import blocks
from kvledger.journal.audit import audit_record, unpack_record
from kvledger.journal.blocks import VALUES, damaged, invalid, pack, read, step_ok
from kvledger.journal.readback import Damage
from kvledger.journal.record_format import block_records, pack_record
from kvledger.journal.steps import BadRow, StepReader

from stored_rows import records

I64 = st.integers(-(1 << 63), (1 << 63) - 1)
# a column's values, drawn to need a given width
WIDE = st.sampled_from([(-128, 127), (-(1 << 15), (1 << 15) - 1), (-(1 << 31), (1 << 31) - 1),
                        (-(1 << 63), (1 << 63) - 1)])


@st.composite
def runs(draw):
    n = draw(st.integers(1, 9))
    bounds = [draw(WIDE) for _ in range(VALUES)]
    rows = [(tuple(draw(st.integers(*bounds[c])) for c in range(VALUES)),
             draw(st.one_of(st.none(), st.binary(min_size=32, max_size=32)))) for _ in range(n)]
    return rows


@settings(max_examples=200, deadline=None)
@given(runs())
def test_a_block_reads_back_its_values_and_digests(rows):
    block = pack(rows)
    m, digests = read(block)
    assert m.T.tolist() == [list(v) for v, _ in rows]
    assert digests == b"".join(bytes(32) if d is None else d for _, d in rows)
    assert damaged(block) == 0  # every CRC holds
    # the CRC column as the format defines it: of a step's thirty values as int64, then its digest
    n = len(rows)
    assert struct.unpack_from(f"<{n}I", block, len(block) - 4 * n) == tuple(
        zlib.crc32(struct.pack("<30q", *v) + (bytes(32) if d is None else d)) for v, d in rows)


EDGES = [-(1 << 63), -(1 << 31) - 1, -(1 << 31), -(1 << 15) - 1, -(1 << 15), -129, -128, -1, 0, 127, 128,
         (1 << 15) - 1, 1 << 15, (1 << 31) - 1, 1 << 31, (1 << 63) - 1]


@settings(max_examples=300, deadline=None)
@given(runs())
@example([(tuple(EDGES[(i + k) % len(EDGES)] for i in range(VALUES)), None) for k in range(2)])
@example([(tuple(EDGES[i % len(EDGES)] for i in range(VALUES)), bytes(32))])
def test_a_few_steps_pack_without_numpy_to_the_same_bytes(rows):
    """Up to blocks.FEW steps a block's columns are built in plain Python (the writer of a
    one-step commit runs cold after a forward call: kvledger.hf at batch 1): the same
    widths and bytes as the array path, at every width's edge."""
    values = [v for v, _ in rows]
    flat = struct.pack(f"<{VALUES * len(rows)}q", *(x for v in values for x in v))
    assert blocks._few_columns(values) == blocks._columns(flat, len(rows))
    # each column as narrow as its values allow: the least width whose signed range holds them
    assert list(blocks._columns(flat, len(rows))[0]) == [
        next(w for w in (1, 2, 4, 8) if -(1 << (8 * w - 1)) <= min(col) and max(col) < 1 << (8 * w - 1))
        for col in zip(*values)]
    if len(rows) <= blocks.FEW:  # and pack takes that path
        digests = b"".join(bytes(32) if d is None else d for _, d in rows)
        assert pack(rows) == b"".join([struct.pack("<BI", blocks.MARK, len(rows)), *blocks._columns(flat, len(rows)),
                                       digests, struct.pack(f"<{len(rows)}I", *blocks._crcs(flat, digests))])


def _valid(n: int, calls: bool) -> list:
    """n steps a Step could hold: streams 0..n-1 of n, prefix 0 of 2, with calls or none."""
    rows = []
    for i in range(n):
        v = [0] * VALUES
        v[0], v[5], v[7], v[12], v[18] = i, 10 + 3 * i, 40 + i, 7 * i, 1
        v[20:30] = [i - 2, 5, -3, 4, 1, 1, 1, 2, 2, 0]
        if calls:
            v[4], v[13], v[15], v[16], v[17], v[19], v[29] = 1, i, 8, 1, 41 + i, 1, 1
        rows.append((tuple(v), bytes([i + 1]) * 32))
    return rows


@pytest.mark.parametrize("calls", [False, True])
def test_every_byte_of_a_step_is_named_at_that_step(calls):
    rows = _valid(6, calls)
    block = pack(rows)
    n, widths = len(rows), block[5:blocks.HEADER]
    for at in range(len(block)):
        edited = bytearray(block)
        edited[at] ^= 0x10
        if at < blocks.HEADER:
            expected = 0  # the header: the block does not parse, or parses to other steps
        elif at < len(block) - 36 * n:  # the columns: which step's value is this byte of?
            offset, start = at - blocks.HEADER, 0
            for w in (1, 2, 4, 8):
                size = w * n * widths.count(w)
                if offset < start + size:
                    expected = (offset - start) // w % n
                    break
                start += size
        elif at < len(block) - 4 * n:
            expected = (at - (len(block) - 36 * n)) // 32
        else:
            expected = (at - (len(block) - 4 * n)) // 4
        assert damaged(bytes(edited)) == expected, at


# One value of one step set to what no Step holds, (column, value): an index past its
# table (6 streams, 2 prefixes) or negative, a negative count, a flag not 0 or 1, a digest
# flag of 0 over digest bytes; without a call, any of a call's values; with one, a size
# of 0 or a call prefix past the table.
BAD = [(0, 6), (0, -1), (1, 2), (3, 9), (7, -1), (12, -5), (18, 2), (19, 2), (18, 0)]
BAD_WITHOUT = [(4, 1), (13, 1), (15, 8), (29, 3), (19, 3)]
BAD_WITH = [(4, 2), (15, 0), (17, 0), (19, 0)]


@pytest.mark.parametrize("calls, column, value", [(c, *b) for c in (False, True) for b in BAD]
                         + [(False, *b) for b in BAD_WITHOUT] + [(True, *b) for b in BAD_WITH])
def test_a_value_no_step_holds_is_refused_at_its_step(calls, column, value):
    for k in range(4):
        rows = _valid(4, calls)
        v = list(rows[k][0])
        v[column] = value
        rows[k] = (tuple(v), rows[k][1])
        m, digests = read(pack(rows))
        assert invalid(m, digests, 6, 2) == k, (column, value, k)
        assert [step_ok(v, d, 6, 2) for v, d in rows].index(False) == k
    assert invalid(*read(pack(_valid(4, calls))), 6, 2) is None


def test_mixed_calls_and_digests_are_valid_step_by_step():
    rows = _valid(4, True)[:2] + _valid(4, False)[2:]
    rows[1] = (rows[1][0][:18] + (0,) + rows[1][0][19:], None)  # a step without a digest: zeros
    m, digests = read(pack(rows))
    assert invalid(m, digests, 6, 2) is None


def test_a_record_with_a_forged_step_is_damaged_at_that_step(db_url):
    """A real record's block with step 5's stream index past the record's table, its CRCs
    recomputed: the record is damaged at step 5, the 5 steps before it intact."""
    from kvledger.engine.service import CommandService
    from kvledger.migrations.storage import open_or_create_journal

    from bench.tokens import Lockstep

    with open_or_create_journal(db_url) as journal:
        run = Lockstep(CommandService(journal), 2, 4, "blocks")
        run.step()
        run.step()
    body = records(db_url)[-1].body
    parts = unpack_record(body)
    assert parts.format == 7 and len(parts.event_lengths) == 1  # the 64 steps: one block
    block = parts.data[:parts.event_lengths[0]]
    rows = [(tuple(v), d) for v, d in zip(read(block)[0].T.tolist(), [block[-36 * 64:][32 * i:32 * i + 32]
                                                                       for i in range(64)])]
    v = list(rows[5][0])
    v[0] = 64  # the record's table has 64 streams
    rows[5] = (tuple(v), rows[5][1])
    forged = pack(rows)
    data = forged + parts.data[len(block):]
    lengths = [len(forged)]
    found = audit_record(pack_record(msgspec.structs.replace(
        parts, event_lengths=lengths, event_crcs=[zlib.crc32(forged)], data=data)))
    assert isinstance(found, Damage) and found.index == 15, found
    assert "does not rebuild" in found.message and len(found.events) == 15
    reader = StepReader(parts.data[-parts.receipt_lengths[-1]:])
    with pytest.raises(BadRow) as bad:
        reader.block(forged, 0)
    assert bad.value.offset == 5 and len(bad.value.values) == 5


def _lockstep_bodies(db_url: str, steps: int, batch: int = 64) -> list[bytes]:
    """The records of `batch` handles decoding `steps` steps in lockstep: an allocation's, a
    prefill's, then one block of `batch` steps a commit."""
    from kvledger.engine.service import CommandService
    from kvledger.migrations.storage import open_or_create_journal

    from bench.tokens import Lockstep

    with open_or_create_journal(db_url) as journal:
        run = Lockstep(CommandService(journal), 2, steps + 1, "pages", batch=batch)
        for _ in range(steps):
            run.step()
    return [r.body for r in records(db_url)]


def _read(record) -> tuple:
    """What a reader sees of a record: its events, their JSON, its receipts."""
    return record.decoded(), record.events, record.receipts


def test_a_page_of_block_records_reads_as_each_record_alone(db_url):
    """block_records reads a page's one-block records together (the blocks of one shape
    in the same array calls): each reads back what the general path (audit_record) reads
    of it, events, JSON and receipts, folded or not; the other records are left to it."""
    bodies = _lockstep_bodies(db_url, 6)
    for fold in (False, True):
        found = block_records(bodies, fold)
        assert [r is None for r in found] == [True, True] + [False] * 6  # allocation, prefill: events
        for body, record in zip(bodies[2:], found[2:]):
            alone = audit_record(body, eager=False, fold=fold)
            assert not isinstance(alone, Damage)
            assert _read(record) == _read(alone)
            (run,) = record.folded()
            assert (run.columns is not None) == fold and run.count == 64


def test_a_damaged_record_in_a_page_is_left_to_the_general_path(tmp_path, sqlite_template):
    """Any byte of a one-block record flipped: block_records reads it as the general path
    does (where the flip changes nothing it reads) or leaves it (None), which then names
    the damage; the page's other records read as before. The flips read bodies, whose
    format no backend changes: they are made once, on SQLite (the other tests here read
    each backend's), of 16 handles (every column and frame part a block of 64 has, in a
    fifth of the bytes)."""
    shutil.copyfile(sqlite_template, tmp_path / "journal.db")
    bodies = _lockstep_bodies(f"sqlite:///{tmp_path}/journal.db", 3, batch=16)[2:]
    good = [_read(r) for r in block_records(bodies)]
    target = bodies[1]
    left = 0
    for at in range(len(target)):
        edited = bytearray(target)
        edited[at] ^= 0x04
        found = block_records([bodies[0], bytes(edited), bodies[2]])
        assert _read(found[0]) == good[0] and _read(found[2]) == good[2]
        alone = audit_record(bytes(edited), eager=False)
        if found[1] is None:
            left += 1
        else:
            assert not isinstance(alone, Damage) and _read(found[1]) == _read(alone), at
    assert left > len(target) * 0.9  # nearly every byte is covered by a CRC or the frame


def test_reads_in_pages_and_chunks_give_every_event_once_in_order(db_url, monkeypatch):
    """records_after reads a page's records in chunks that double (4, 8, ...) up to the
    page: whatever the page size, read_all gives each event once, at its position, and a
    fold reads the same journal as one page would."""
    from kvledger.journal.statements import Statements
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.replay.run import project

    bodies = _lockstep_bodies(db_url, 20)
    with open_or_create_journal(db_url) as journal:
        whole = list(journal.read_all())
        folded = project(journal.read_fold()).handles
        for page in (1, 3, 8, 16):
            monkeypatch.setattr(Statements, "RECORD_PAGE", page)
            events = list(journal.read_all())
            assert [e.global_position for e in events] == list(range(1, len(whole) + 1))
            assert events == whole, page
            assert project(journal.read_fold()).handles == folded, page
    assert len(bodies) == 22 and len(whole) == 2 * 64 + 20 * 3 * 64
