"""Named fault points in the write path: each fires where its name says, an `exit`
there leaves exactly what a crash at that moment must leave, and disarmed they cost
nothing measurable."""

from __future__ import annotations

import os
import subprocess
import sys
import timeit

import pytest

from kvledger.journal import Check, Guard, Operation, faults
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay.verify import verify_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt

import crash_workers as cw
from factories import allocate_op, guard_of, publish_op
from mutants import unguard

IN_TXN = ["before_update", "mid_batch", "after_update", "before_commit"]


@pytest.fixture(autouse=True)
def _disarm():
    faults.configure(None)
    yield
    faults.configure(None)


@pytest.fixture(scope="module")
def ctx():
    return cw.context()


def _seed(url: str) -> list[tuple[int, bytes]]:
    with open_or_create_journal(url) as j:
        j.append([allocate_op("A"), allocate_op("B")])
        j.save_checkpoint("c", 1, b"old")
        return list(j.read_raw())


def _run(ctx, url, spec, what="batch") -> int:
    p = ctx.Process(target=cw.fault_child, args=(url, spec, what))
    p.start()
    p.join(60)
    return p.exitcode


def test_parse_rules_and_aliases():
    rules = faults.parse("after_insert:exit:0.05, before_commit:sleep=0.01,mid_batch:raise@3,checkpoint:exit=9")
    assert [str(r) for r in rules] == ["before_commit:exit=86:0.05", "before_commit:sleep=0.01",
                                       "mid_batch:raise@3", "checkpoint:exit=9"]
    for bad in ("nowhere:exit", "before_update:explode", "before_update:sleep", "after_update:exit:2",
                "after_update:raise@0", "after_update"):
        with pytest.raises(ValueError):
            faults.parse(bad)
    assert not faults.ACTIVE
    faults.configure("mid_batch:count")
    assert faults.ACTIVE and [str(r) for r in faults.armed()] == ["mid_batch:count"]
    faults.configure(None)
    assert not faults.ACTIVE and faults.armed() == []


def test_probability_is_seeded_and_nth_counts_hits():
    fired = []
    for _ in range(2):
        faults.configure("after_update:raise:0.5", seed=7)
        row = []
        for _ in range(40):
            try:
                faults.fault("after_update")
                row.append(0)
            except faults.FaultInjected:
                row.append(1)
        fired.append(row)
    assert fired[0] == fired[1] and 5 < sum(fired[0]) < 35
    faults.configure("mid_batch:raise@3")
    faults.fault("mid_batch")
    faults.fault("mid_batch")
    with pytest.raises(faults.FaultInjected):
        faults.fault("mid_batch")
    faults.fault("mid_batch")
    assert faults.hits["mid_batch"] == 4


def test_disarmed_fault_point_costs_nothing_measurable():
    faults.configure(None)
    per_call = min(timeit.repeat("fault('before_update')", globals={"fault": faults.fault},
                                 number=200_000, repeat=3)) / 200_000
    # an append costs tens of microseconds at the very least; six points per append
    assert per_call < 0.5e-6, f"{per_call * 1e9:.0f} ns per disarmed fault point"


def test_every_point_is_reached_in_the_write_path(db_url):
    _seed(db_url)
    faults.configure(",".join(f"{p}:count" for p in faults.POINTS))
    with open_or_create_journal(db_url) as j:
        a = guard_of(j.head("A"))
        first = publish_op("A", a, "p1")
        h = first.writes[0].head
        then = publish_op("A", Guard(h.generation, h.snapshot_version, h.stream_position), "p2")
        j.append([first, publish_op("B", guard_of(j.head("B")), "p3"), then])
        j.save_checkpoint("c", 2, b"x")
    assert {p: faults.hits[p] for p in faults.POINTS} == {
        "before_update": 1, "mid_batch": 1, "after_update": 1, "before_commit": 1, "after_commit": 1,
        "checkpoint": 1}


@pytest.mark.parametrize("point", IN_TXN)
def test_exit_inside_the_transaction_leaves_nothing(ctx, db_url, point):
    before = _seed(db_url)
    assert _run(ctx, db_url, f"{point}:exit@1") == faults.EXIT_CODE
    with open_or_create_journal(db_url) as j:
        assert list(j.read_raw()) == before
        assert [j.receipt(x) for x in ("x1", "x2", "x3")] == [None, None, None]
        assert j.head("A").snapshot_version == j.head("B").snapshot_version == 0
        # the lock the dead writer held is free: the same batch commits now
        a, b = guard_of(j.head("A")), guard_of(j.head("B"))
        assert all(isinstance(r, Receipt) for r in j.append([publish_op("A", a, "y1"), publish_op("B", b, "y2")]))


def test_exit_after_commit_leaves_all_of_it(ctx, db_url):
    before = _seed(db_url)
    assert _run(ctx, db_url, "after_commit:exit@1") == faults.EXIT_CODE
    with open_or_create_journal(db_url) as j:
        rows = list(j.read_raw())
        assert rows[:len(before)] == before and len(rows) == len(before) + 3
        receipts = [j.receipt(x) for x in ("x1", "x2", "x3")]
        assert all(receipts) and [r.first_global_position for r in receipts] == [3, 4, 5]
        assert j.head("A").snapshot_version == 2 and j.head("B").snapshot_version == 1


def test_exit_while_writing_a_checkpoint_keeps_the_old_one(ctx, db_url):
    _seed(db_url)
    assert _run(ctx, db_url, "checkpoint:exit@1", "checkpoint") == faults.EXIT_CODE
    with open_or_create_journal(db_url) as j:
        assert j.load_checkpoint("c") == (1, b"old")
    assert _run(ctx, db_url, "after_update:exit@1", "checkpoint") == 0  # not on this path
    with open_or_create_journal(db_url) as j:
        assert j.load_checkpoint("c") == (2, b"new")


@pytest.mark.parametrize("point", IN_TXN + ["after_commit"])
def test_raise_is_a_driver_error_and_the_commit_is_all_or_nothing(db_url, point):
    before = _seed(db_url)
    faults.configure(f"{point}:raise@1")
    with open_or_create_journal(db_url) as j:
        a, b = guard_of(j.head("A")), guard_of(j.head("B"))
        first = publish_op("A", a, "r1")
        h = first.writes[0].head
        then = publish_op("A", Guard(h.generation, h.snapshot_version, h.stream_position), "r3")
        with pytest.raises(KvLedgerError) as info:
            j.append([first, publish_op("B", b, "r2"), then])
        assert info.value.code is ErrorCode.DATABASE_UNREACHABLE and point in str(info.value)
        rows = list(j.read_raw())
        if point == "after_commit":  # committed; only the acknowledgement was lost
            assert len(rows) == len(before) + 3 and j.receipt("r3") is not None
        else:
            assert rows == before and j.receipt("r1") is None
        # the connection is usable afterwards; a retry is idempotent by operation id
        faults.configure(None)
        retry = j.append([first, publish_op("B", b, "r2"), then])
        assert all(isinstance(r, Receipt) for r in retry)
        assert len(list(j.read_raw())) == len(before) + 3


def test_environment_arms_faults_in_a_new_process(db_url, tmp_path):
    _seed(db_url)
    log = tmp_path / "faults.log"
    env = {**os.environ, "KVLEDGER_FAULTS": "after_insert:exit=7", "KVLEDGER_FAULTS_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")])}
    code = ("import crash_workers as cw; from journal import faults; "
            f"assert [str(r) for r in faults.armed()] == ['before_commit:exit=7']; "
            f"cw.fault_child({db_url!r}, None, 'batch')")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 7, p.stderr
    assert log.read_text().split()[:3] == ["before_commit", "exit", "1"]
    with open_or_create_journal(db_url) as j:
        assert j.receipt("x1") is None


def test_mutant_ignores_the_guard_and_verify_sees_the_stale_write(db_url):
    """The mutant (tests/mutants.py: the conditional write disabled) lets a stale
    read-only check (a fork's parent) and a stale write commit: the guarded update is
    the only fence (records keep no per-event unique stream position). What it lets
    through is still seen: the stale write repeats a stream position, and `verify` says
    so."""
    _seed(db_url)
    with open_or_create_journal(db_url) as j:
        stale = guard_of(j.head("A"))
        j.append([publish_op("A", stale, "fresh")])
        child = allocate_op("C", "c-op")
        forkish = Operation("fork-op", "fp", child.writes, (Check("A", stale),), child.manifests)
        [refused] = j.append([forkish])
        assert refused.code == ErrorCode.STALE_BASE
        unguard(j)  # from here on, for this connection
        [won] = j.append([forkish])
        assert isinstance(won, Receipt)  # committed against a base that no longer exists
        [stale_write] = j.append([publish_op("A", stale, "stale-write")])
        assert isinstance(stale_write, Receipt)
        found = verify_journal(j)
    repeated = [f for f in found.findings if f.code == "STREAM_POSITION_GAP"]
    assert [(f.stream_id, f.global_position) for f in repeated] == [("A", stale_write.last_global_position)]
