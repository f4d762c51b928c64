"""The journal contract, run against every backend (SQLite file and a real PostgreSQL)."""

from __future__ import annotations

import msgspec
import pytest
from conftest import BACKEND_NAMES, pipelined_postgres

from kvledger.engine import commands as c
from kvledger.engine import ids
from kvledger.engine.service import CommandService, ManualClock
from kvledger.journal import Check, Guard, Operation, Rejection, StreamWrite
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import verify_journal
from kvledger.schemas import events as ev
from kvledger.schemas.canonical import canonical_json
from kvledger.schemas.decode_batch import BatchBuilder
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt

from factories import allocate_op, envelope, guard_of, head, publish_op
from lifecycle_helpers import make_manifest


@pytest.fixture(params=[*BACKEND_NAMES, "postgres_pipeline"] if "postgres" in BACKEND_NAMES else BACKEND_NAMES)
def backend(request, monkeypatch):
    """Every backend, and PostgreSQL once more as a remote server is written to: its
    statements pipelined, each result known only when fetched (KVLEDGER_PG_PIPELINE=on:
    the server here is on loopback, where they go one by one)."""
    if request.param != "postgres_pipeline":
        return request.param
    pipelined_postgres(monkeypatch, True)
    return "postgres"


@pytest.fixture
def journal(db_url):
    j = open_or_create_journal(db_url)
    yield j
    j.close()


def snapshot_of(j):
    """Everything the journal stores, to prove a rejected call changed nothing."""
    return (list(j.read_raw()), j.heads(), j.last_position())


def test_allocate_then_publish_reads_back(journal):
    [r] = journal.append([allocate_op("h1")])
    assert isinstance(r, Receipt) and r.first_global_position == 1 == r.last_global_position
    base = guard_of(journal.head("h1"))
    assert base == Guard(0, 0, 1)
    [p] = journal.append([publish_op("h1", base, "op-1")])
    assert isinstance(p, Receipt)
    assert p.handles[0].snapshot_version == 1 and p.handles[0].stream_position == 2
    stream = journal.read_stream("h1")
    assert [e.event_type for e in stream] == ["request_allocate", "append_publish"]
    assert [e.global_position for e in stream] == [1, 2]
    assert [e.stream_position for e in journal.read_stream("h1", after=1)] == [2]
    assert [e.global_position for e in journal.read_all(after=1)] == [2]
    assert journal.receipt("op-1") == p
    assert journal.receipt("nope") is None
    assert journal.last_position() == 2
    m = stream[0].payload.manifest
    assert journal.manifest(stream[0].payload.manifest_sha256) == canonical_json(m)


def test_stale_base_writes_nothing(journal):
    journal.append([allocate_op("h1")])
    base = guard_of(journal.head("h1"))
    assert isinstance(journal.append([publish_op("h1", base, "win")])[0], Receipt)
    before = snapshot_of(journal)
    [r] = journal.append([publish_op("h1", base, "lose")])
    assert isinstance(r, Rejection) and r.code == ErrorCode.STALE_BASE
    assert snapshot_of(journal) == before
    assert journal.receipt("lose") is None


def test_retry_returns_identical_receipt_and_writes_nothing(journal):
    journal.append([allocate_op("h1")])
    base = guard_of(journal.head("h1"))
    op = publish_op("h1", base, "op-1")
    [first] = journal.append([op])
    before = snapshot_of(journal)
    [again] = journal.append([op])  # the base is stale now: the receipt still comes back
    assert again == first
    assert msgspec.json.encode(again) == msgspec.json.encode(first)
    assert snapshot_of(journal) == before


def test_changed_retry_is_conflict(journal):
    journal.append([allocate_op("h1")])
    base = guard_of(journal.head("h1"))
    journal.append([publish_op("h1", base, "op-1")])
    before = snapshot_of(journal)
    [r] = journal.append([publish_op("h1", guard_of(journal.head("h1")), "op-1", fingerprint="other")])
    assert isinstance(r, Rejection) and r.code == ErrorCode.CONFLICT
    assert snapshot_of(journal) == before


def test_batch_checks_each_guard_on_its_own(journal):
    handles = [f"h{i}" for i in range(6)]
    journal.append([allocate_op(h) for h in handles])
    bases = {h: guard_of(journal.head(h)) for h in handles}
    # h2's base is made stale first; the rest of the batch must still commit.
    journal.append([publish_op("h2", bases["h2"], "pre")])
    results = journal.append([publish_op(h, bases[h], f"b-{h}") for h in handles])
    kinds = {h: type(r).__name__ for h, r in zip(handles, results)}
    assert kinds == {h: ("Rejection" if h == "h2" else "Receipt") for h in handles}
    committed = [r for r in results if isinstance(r, Receipt)]
    positions = [r.first_global_position for r in committed]
    assert positions == sorted(positions) and len(set(positions)) == 5
    assert journal.head("h2").snapshot_version == 1  # only "pre"
    assert all(journal.head(h).snapshot_version == 1 for h in handles)
    # A refused operation moves the record's end from where the guarded updates pointed
    # the heads: each head still names its own last record (verify), and streams read whole.

    assert [f for f in verify_journal(journal).findings if f.code == "TAMPERED"] == []
    for h in handles:
        assert [e.stream_position for e in journal.read_stream(h)] == [1, 2]


def test_same_handle_twice_in_a_batch_is_sequential(journal):
    journal.append([allocate_op("h1")])
    b0 = guard_of(journal.head("h1"))
    first = publish_op("h1", b0, "a")
    b1 = Guard(b0.generation, 1, 2)
    second = publish_op("h1", b1, "b")
    stale = publish_op("h1", b0, "c")
    r = journal.append([first, second, stale])
    assert [type(x).__name__ for x in r] == ["Receipt", "Receipt", "Rejection"]
    assert journal.head("h1").snapshot_version == 2
    # a repeat of one operation id inside a batch is a retry of the first occurrence
    b2 = guard_of(journal.head("h1"))
    d = publish_op("h1", b2, "d")
    r2 = journal.append([d, d])
    assert r2[0] == r2[1] and isinstance(r2[0], Receipt)


def test_multi_stream_operation_is_all_or_nothing(journal):
    journal.append([allocate_op("a"), allocate_op("b")])
    ga, gb = guard_of(journal.head("a")), guard_of(journal.head("b"))
    journal.append([publish_op("b", gb, "move-b")])  # b is now stale for gb
    pa, pb = publish_op("a", ga, "x"), publish_op("b", gb, "x")
    both = Operation("both", "fp-both", writes=pa.writes + pb.writes)
    other = publish_op("a", ga, "other")  # a separate op later in the batch, on a
    before = snapshot_of(journal)
    [r] = journal.append([both])
    assert isinstance(r, Rejection) and r.code == ErrorCode.STALE_BASE and r.handle_id == "b"
    assert snapshot_of(journal) == before  # a's half was rolled back
    # in a batch, the spanning op fails alone and later ops still commit
    r = journal.append([both, other])
    assert isinstance(r[0], Rejection) and isinstance(r[1], Receipt)


def test_an_operation_decided_on_a_refused_one_is_refused_even_where_the_head_looks_the_same(journal):
    """ABA: an operation of a batch whose base is the head an earlier, refused operation
    of the batch would have left was decided on a state that never existed. It is
    refused even when another writer's head carries the same version numbers (an
    allocation of the same handle: generation 0, snapshot 0, position 1), and so is what
    was decided on it in turn; an operation on the real head still commits."""
    journal.append([allocate_op("X", op_id="theirs"), allocate_op("Y")])
    phantom = Guard(0, 0, 1)  # what "mine" would have left, and what "theirs" did
    assert guard_of(journal.head("X")) == phantom
    before = snapshot_of(journal)
    mine, dep = allocate_op("X", op_id="mine"), publish_op("X", phantom, "dep")
    dep2 = publish_op("X", Guard(0, 1, 2), "dep2")  # decided on dep's head
    real = publish_op("Y", guard_of(journal.head("Y")), "real")
    r = journal.append([mine, real, dep, allocate_op("Z"), dep2])
    assert [type(x).__name__ for x in r] == ["Rejection", "Receipt", "Rejection", "Receipt", "Rejection"], r
    assert r[0].code == ErrorCode.HANDLE_EXISTS
    assert r[2].code == ErrorCode.STALE_BASE and r[4].code == ErrorCode.STALE_BASE
    assert journal.head("X") == before[1]["X"] and [e.stream_position for e in journal.read_stream("X")] == [1]
    assert journal.receipt("dep") is None and journal.receipt("dep2") is None
    assert journal.head("Y").snapshot_version == 1 and journal.head("Z") is not None


def test_an_operation_decided_on_a_conflicting_retry_is_refused(journal):
    """The same ABA through a retry: an operation id committed before, sent again with
    another fingerprint (CONFLICT), names as its head the one its original left; what the
    batch decided on it is refused. A same-fingerprint retry is answered, not refused,
    and what follows a repeat inside a batch follows its first occurrence."""
    journal.append([allocate_op("X")])
    journal.append([publish_op("X", Guard(0, 0, 1), "p1")])
    before = snapshot_of(journal)
    r = journal.append([publish_op("X", Guard(0, 0, 1), "p1", fingerprint="other"),
                        publish_op("X", Guard(0, 1, 2), "p2")])
    assert [x.code for x in r] == [ErrorCode.CONFLICT, ErrorCode.STALE_BASE], r
    assert snapshot_of(journal) == before and journal.receipt("p2") is None
    journal.append([allocate_op("Z")])
    r = journal.append([publish_op("Z", Guard(0, 0, 1), "z1"), publish_op("Z", Guard(0, 0, 1), "z1"),
                        publish_op("Z", Guard(0, 1, 2), "z2")])
    assert r[0] == r[1] and isinstance(r[2], Receipt) and guard_of(journal.head("Z")) == Guard(0, 2, 3)
    [again] = journal.append([publish_op("X", Guard(0, 0, 1), "p1")])
    assert again == journal.receipt("p1")


def test_check_guards_a_parent_without_writing_it(journal):
    journal.append([allocate_op("parent")])
    pg = guard_of(journal.head("parent"))
    child = allocate_op("child", op_id="fork-1")
    op = Operation("fork-1", "fp", writes=child.writes, checks=(Check("parent", pg),))
    assert isinstance(journal.append([op])[0], Receipt)
    assert journal.head("parent") is not None and guard_of(journal.head("parent")) == pg
    journal.append([publish_op("parent", pg, "p1")])
    child2 = allocate_op("child2", op_id="fork-2")
    op2 = Operation("fork-2", "fp", writes=child2.writes, checks=(Check("parent", pg),))
    [r] = journal.append([op2])
    assert isinstance(r, Rejection) and r.code == ErrorCode.STALE_BASE and r.handle_id == "parent"
    assert journal.head("child2") is None


def test_arrivals_create_each_head_where_its_operations_leave_it(journal):
    """A handle's creation and the operations on the heads it leaves, in one batch (an
    arrival: allocation, first append), commit as one unit: the head created where the
    last of them leaves it, pointing at the record. On a handle that exists the creation
    is refused (HANDLE_EXISTS) and so is what follows it (STALE_BASE), nothing of it
    written; the other arrivals commit."""
    journal.append([allocate_op("taken")])
    taken = journal.head("taken")
    names = ["n0", "n1", "taken", "n2", "n3"]
    ops = [op for h in names for op in (allocate_op(h, op_id=f"a-{h}"), publish_op(h, Guard(0, 0, 1), f"p-{h}"),
                                         publish_op(h, Guard(0, 1, 2), f"q-{h}"))]
    r = journal.append(ops)
    got = [x.code if isinstance(x, Rejection) else "ok" for x in r]
    assert got == ["ok"] * 6 + [ErrorCode.HANDLE_EXISTS, ErrorCode.STALE_BASE, ErrorCode.STALE_BASE] + ["ok"] * 6
    assert journal.head("taken") == taken and journal.receipt("p-taken") is None
    for h in ("n0", "n1", "n2", "n3"):
        assert guard_of(journal.head(h)) == Guard(0, 2, 3)
        assert [e.operation_id for e in journal.read_stream(h)] == [f"a-{h}", f"p-{h}", f"q-{h}"]
    # no refusal: every head points at the record written
    r = journal.append([op for h in ("m0", "m1", "m2", "m3")
                        for op in (allocate_op(h), publish_op(h, Guard(0, 0, 1), f"p-{h}"))])
    assert all(isinstance(x, Receipt) for x in r)
    assert [e.stream_position for e in journal.read_stream("m3")] == [1, 2]
    assert [f for f in verify_journal(journal).findings if f.code == "TAMPERED"] == []


def test_creating_an_existing_handle_is_rejected(journal):
    journal.append([allocate_op("h1")])
    before = snapshot_of(journal)
    [r] = journal.append([allocate_op("h1", op_id="again")])
    assert isinstance(r, Rejection) and r.code == ErrorCode.HANDLE_EXISTS
    assert snapshot_of(journal) == before


def test_existing_names_exactly_the_handles_with_a_stream(journal):
    journal.append([allocate_op(f"h{i}") for i in range(3)])
    asked = ["h0", "nope", "h2", "h0", "'; DROP TABLE kvl_heads; --", "h1x"]
    assert journal.existing(asked) == {"h0", "h2"}
    assert journal.existing([]) == set() and journal.existing(["h1"]) == {"h1"}
    assert set(journal.heads()) == {"h0", "h1", "h2"}


def test_malformed_operations_are_refused_before_writing(journal):
    journal.append([allocate_op("h1")])
    base = guard_of(journal.head("h1"))
    good = publish_op("h1", base, "op")
    w = good.writes[0]
    gap = msgspec.structs.replace(w.events[0], stream_position=base.stream_position + 2)
    bad_ops = [
        Operation("x", "f", writes=()),
        Operation("x", "f", writes=(msgspec.structs.replace(w, events=(gap,)),)),
        Operation("x", "f", writes=(msgspec.structs.replace(
            w, events=(msgspec.structs.replace(w.events[0], global_position=9),)),)),
        Operation("x", "f", writes=(msgspec.structs.replace(
            w, events=(msgspec.structs.replace(w.events[0], schema_version=99),)),)),
        Operation("x", "f", writes=(msgspec.structs.replace(w, head=head("h1", 0, 1, 7, 1)),)),
    ]
    before = snapshot_of(journal)
    for op in bad_ops:
        with pytest.raises(KvLedgerError) as err:
            journal.append([good, op])
        assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert snapshot_of(journal) == before


def _with_event(op, **fields):
    w = op.writes[0]
    return msgspec.structs.replace(op, writes=(msgspec.structs.replace(
        w, events=(msgspec.structs.replace(w.events[0], **fields),)),))


def _renamed(op, handle):
    w = op.writes[0]
    return msgspec.structs.replace(op, writes=(msgspec.structs.replace(
        w, handle_id=handle, events=(msgspec.structs.replace(w.events[0], stream_id=handle),)),))


def test_an_id_the_reader_would_refuse_is_refused_before_writing(journal):
    """What every later read would fail on (an event's Id: 1 to 256 characters, no NUL,
    UTF-8) is never acknowledged: the same refusal on every backend, nothing written."""
    journal.append([allocate_op("h1")])
    base = guard_of(journal.head("h1"))
    good = publish_op("h1", base, "op")
    alloc = allocate_op("h2")
    bad_ops = {
        "empty handle": _renamed(alloc, ""),
        "handle of 257": _renamed(alloc, "h" * 257),
        "NUL in a handle": _renamed(alloc, "h\x00"),
        "lone surrogate in a handle": _renamed(alloc, "h\ud800"),
        "operation id of 257": msgspec.structs.replace(alloc, operation_id="o" * 257),
        "NUL in an operation id": msgspec.structs.replace(alloc, operation_id="o\x00"),
        "empty event id": _with_event(alloc, event_id=""),
        "NUL in an event id": _with_event(alloc, event_id="e\x00"),
        "lone surrogate in a request id": _with_event(alloc, request_id="r\ud800"),
        "source of 257": _with_event(alloc, source_instance="s" * 257),
        "NUL in a checked handle": msgspec.structs.replace(good, checks=(Check("h\x00", base),)),
        "head request id of 257": msgspec.structs.replace(alloc, writes=(msgspec.structs.replace(
            alloc.writes[0], head=msgspec.structs.replace(alloc.writes[0].head, request_id="r" * 257)),)),
    }
    before = snapshot_of(journal)
    for what, op in bad_ops.items():
        with pytest.raises(KvLedgerError) as err:
            journal.append([good, op])
        too_long = what.endswith("257")  # the reader's code for it, and PostgreSQL's for its column
        assert err.value.code is (ErrorCode.FIELD_TOO_LARGE if too_long else ErrorCode.INVALID_ARGUMENT), what
    assert snapshot_of(journal) == before
    # The edges that are ids: 256 characters, and text beyond ASCII
    edge, accented = "h" * 256, "h-\u00e9\u4e2d"
    written = journal.append([_renamed(alloc, edge), _renamed(allocate_op("h3"), accented)])
    assert all(isinstance(r, Receipt) for r in written)
    assert {edge, accented} <= set(journal.heads())
    assert [e.stream_id for e in journal.read_all()][-2:] == [edge, accented]
    assert [e.stream_id for e in journal.read_stream(accented)] == [accented]
    # (a test operation's head facts are not its events': verify's HEAD_MISMATCH, as in the other tests)
    assert not [f for f in verify_journal(journal).findings if f.code != "HEAD_MISMATCH"]


def test_gapless_positions_and_heads_listing(journal):
    journal.append([allocate_op(f"h{i}") for i in range(5)])
    for round_ in range(3):
        journal.append([publish_op(h, guard_of(f), f"{h}-{round_}") for h, f in journal.heads().items()])
    positions = [p for p, _ in journal.read_raw()]
    assert positions == list(range(1, 21))
    assert [p for p, _ in journal.read_raw(after=5, limit=4)] == [6, 7, 8, 9]
    assert set(journal.heads()) == {f"h{i}" for i in range(5)}
    assert journal.heads(prefix_identity_sha256="0" * 64).keys() == journal.heads().keys()


def test_checkpoints_round_trip(journal):
    assert journal.load_checkpoint("proj") is None
    journal.save_checkpoint("proj", 5, b"state-5")
    journal.save_checkpoint("proj", 9, b"state-9")
    assert journal.load_checkpoint("proj") == (9, b"state-9")


@pytest.mark.sql_storage("writes an old schema's event as a SQL row behind the journal")
def test_old_schema_version_is_read_back_upgraded(journal):
    """A row stored by an older kvledger (append_start v1: interval as a pair) reads as v3."""
    journal.append([allocate_op("h1")])
    v1 = {
        "event_type": "append_start", "event_id": "old-1", "stream_id": "h1", "stream_position": 2,
        "schema_version": 1, "request_id": "h1", "handle_generation": 0, "global_position": 2,
        "payload": {"txn_id": "t1", "kind": "prefill", "base_snapshot_version": 0,
                    "interval": [0, 4], "token_ids": [11, 22, 33, 44], "cache_abi_sha256": "0" * 64},
    }
    body = msgspec.json.encode(v1)
    journal.sql.transaction(lambda cur: journal.sql.insert_events(
        cur, [(2, "old-1", "h1", 2, "append_start", 1, None, body)]))
    [start] = journal.read_stream("h1", after=1)
    assert isinstance(start, ev.AppendStartEvent) and start.schema_version == 3
    p = start.payload
    assert (p.interval_start, p.interval_count, p.mask_key_extent) == (0, 4, 4)
    assert p.cache_positions == (0, 1, 2, 3)
    assert [raw for _, raw in journal.read_raw(after=1)] == [body]  # stored bytes untouched


def test_event_written_and_read_is_byte_stable(journal):
    op = allocate_op("h1")
    journal.append([op])
    [(pos, raw)] = list(journal.read_raw())
    [event] = journal.read_stream("h1")
    assert msgspec.json.encode(event) == raw
    assert msgspec.structs.replace(event, global_position=0) == op.writes[0].events[0]


def test_journal_refuses_use_after_close(db_url):
    j = open_or_create_journal(db_url)
    j.close()
    with pytest.raises(KvLedgerError):
        j.last_position()


def test_envelope_helper_matches_writes():
    e = envelope(ev.FinishEvent, "h", 3, ev.Finish(reason="eos", output_count=1, committed_length=4))
    assert e.schema_version == 1 and e.stream_position == 3
    w = StreamWrite("h", Guard(0, 0, 2), head("h", 0, 0, 3, 4, "FINISHED"), (e,))
    assert w.head.lifecycle == "FINISHED"


def test_deferred_append_acknowledges_only_what_it_committed(journal, db_url):
    """append_deferred: the statements run at the call, the results come from the wait,
    and they are the results append gives: receipts for what committed, a rejection
    (and no row) for a stale base, each visible to another connection once waited."""
    [r] = journal.append_deferred([allocate_op("h1")])()
    base = guard_of(journal.head("h1"))
    wait = journal.append_deferred([publish_op("h1", base, "win"), allocate_op("h2")])
    win, h2 = wait()
    assert wait() == [win, h2]  # waiting again returns the same, commits nothing more
    assert isinstance(win, Receipt) and isinstance(h2, Receipt)
    assert (win.first_global_position, h2.last_global_position) == (2, 3)
    with open_or_create_journal(db_url) as other:  # durable and visible past this connection
        assert other.last_position() == 3 and other.receipt("win") == win
        assert [e.event_type for e in other.read_stream("h1")] == ["request_allocate", "append_publish"]
    before = snapshot_of(journal)
    [lose] = journal.append_deferred([publish_op("h1", base, "lose")])()
    assert isinstance(lose, Rejection) and lose.code == ErrorCode.STALE_BASE
    assert snapshot_of(journal) == before and journal.receipt("lose") is None
    # after a wait the journal is free again for plain appends
    [p2] = journal.append([publish_op("h1", guard_of(journal.head("h1")), "next")])
    assert isinstance(p2, Receipt) and p2.first_global_position == 4


def test_the_appending_thread_reads_only_after_its_deferred_commit(journal, monkeypatch):
    """Between append_deferred and its wait, the thread that appended may read the
    journal (a worker's on_step does, while its next batch is built). Where the COMMIT
    runs on a committer thread (SQLite), that read waits for it rather than share the
    connection mid-COMMIT: it returns only after the commit, and sees what committed."""
    import threading
    import time

    journal.append([allocate_op("h1")])
    committed = threading.Event()
    deferred = getattr(getattr(journal, "sql", None), "deferred_commit", False)  # NATS: no committer thread
    if deferred:
        end = journal.sql.end

        def slow_end(cur, commit):  # the real COMMIT, a little later
            time.sleep(0.2)
            end(cur, commit)
            committed.set()

        monkeypatch.setattr(journal.sql, "end", slow_end)
    wait = journal.append_deferred([publish_op("h1", guard_of(journal.head("h1")), "p1"), allocate_op("h2")])
    read = [e.event_type for e in journal.read_all()]
    last = journal.last_position()
    assert committed.is_set() or not deferred
    assert read == ["request_allocate", "append_publish", "request_allocate"] and last == 3
    assert all(isinstance(r, Receipt) for r in wait())
    journal.append([publish_op("h2", guard_of(journal.head("h2")), "p2")])  # free again


def _own_ids(n: int) -> list[str]:
    from kvledger.engine.ids import new_id

    return [new_id() for _ in range(n)]


def test_an_event_id_already_stored_is_refused_and_nothing_is_written(journal):
    """DESIGN.md: event ids are unique. An append reusing one is CONSTRAINT_VIOLATION
    and writes nothing of its batch, wherever the stored id sits in its run of keys."""
    handles = [f"h{i}" for i in range(4)]
    journal.append([allocate_op(h, op_id=i, event_id=e) for h, (i, e) in zip(handles, zip(_own_ids(4), _own_ids(4)))])
    ids = _own_ids(8)  # one writer's consecutive ids: one run of keys
    journal.append([publish_op(h, guard_of(journal.head(h)), ids[2 * k], event_id=ids[2 * k + 1])
                    for k, h in enumerate(handles)])
    stored = [e.event_id for e in journal.read_all()]
    before = snapshot_of(journal)
    for reused in (stored[0], stored[4], stored[5], stored[-1]):  # first, inside and last of runs
        fresh = publish_op("h0", guard_of(journal.head("h0")), _own_ids(1)[0])
        dup = publish_op("h1", guard_of(journal.head("h1")), _own_ids(1)[0], event_id=reused)
        with pytest.raises(KvLedgerError) as exc:
            journal.append([fresh, dup])
        assert exc.value.code is ErrorCode.CONSTRAINT_VIOLATION and f"event id {reused} is already" in exc.value.message
        assert snapshot_of(journal) == before
    # a retry of a stored operation is still answered with its receipt, not refused
    first = publish_op(handles[0], Guard(0, 0, 1), ids[0], event_id=ids[1])
    assert journal.append([first])[0] == journal.receipt(ids[0])


def test_an_event_id_written_twice_in_one_batch_is_refused(journal):
    journal.append([allocate_op("a"), allocate_op("b")])
    before = snapshot_of(journal)
    same = _own_ids(1)[0]
    with pytest.raises(KvLedgerError) as exc:
        journal.append([publish_op("a", guard_of(journal.head("a")), "pa", event_id=same),
                        publish_op("b", guard_of(journal.head("b")), "pb", event_id=same)])
    assert exc.value.code is ErrorCode.CONSTRAINT_VIOLATION and "written twice" in exc.value.message
    assert snapshot_of(journal) == before


def test_runs_longer_than_the_longest_stored_are_split_and_found(journal, monkeypatch):
    """Runs are capped at MAX_RUN so a lookup is an index range; with a cap of 3, a batch
    of 16 consecutive ids is 6 rows, and each id is found (receipts, refusals)."""
    from kvledger.journal import keys

    monkeypatch.setattr(keys, "MAX_RUN", 3)
    handles = [f"h{i}" for i in range(8)]
    journal.append([allocate_op(h) for h in handles])
    ids = _own_ids(16)
    ops = [publish_op(h, guard_of(journal.head(h)), ids[2 * k], event_id=ids[2 * k + 1])
           for k, h in enumerate(handles)]
    receipts = journal.append(ops)
    for k, r in enumerate(receipts):
        assert journal.receipt(ids[2 * k]) == r
    for reused in ids[1::2]:
        with pytest.raises(KvLedgerError) as exc:
            journal.append([publish_op("h0", guard_of(journal.head("h0")), _own_ids(1)[0], event_id=reused)])
        assert exc.value.code is ErrorCode.CONSTRAINT_VIOLATION


def test_an_operation_id_may_equal_one_of_its_event_ids(journal):
    """Operation and event ids are separate names (the KV-event recorder gives a one-batch
    operation its event's id): not a reuse."""
    op = allocate_op("same", op_id="kv:s:0:7", event_id="kv:s:0:7")
    [r] = journal.append([op])
    assert isinstance(r, Receipt) and journal.receipt("kv:s:0:7") == r and r.event_ids == ("kv:s:0:7",)


def test_a_stream_read_follows_its_chain_from_any_position(journal, db_url):
    """Since revision 0006 a stream's records are found by the chain each record keeps
    (stream_prev) back from its head's last record. Three handles written in commits of
    varying shape, by two connections in turn (PostgreSQL's one-statement append knows a
    previous record only from its own commits): every suffix of every stream reads back,
    and verify finds the chain whole."""

    other = open_or_create_journal(db_url)
    try:
        journal.append([allocate_op(h) for h in ("a", "b", "c")])
        for step in range(12):
            w = (journal, other)[step % 3 == 2]
            handles = ("a", "b", "c")[: 1 + step % 3]
            w.append([publish_op(h, guard_of(w.head(h)), f"s{step}-{h}") for h in handles])
        for h in ("a", "b", "c"):
            full = journal.read_stream(h)
            assert [e.stream_position for e in full] == list(range(1, len(full) + 1)) and len(full) > 4
            for after in range(len(full) + 1):
                assert other.read_stream(h, after=after) == full[after:]
        # (publish_op's events skip their starts: only the storage findings count here)
        assert [f for f in verify_journal(journal).findings if f.code == "TAMPERED"] == []
    finally:
        other.close()


def test_a_check_on_a_head_another_connection_moved_is_stale_after_any_read(db_url):
    """A check (a fork's parent) is decided on the head as stored: a connection that
    wrote the head itself, then read the journal after another connection moved it
    (last_position, read_all), still refuses a check on the head it wrote."""
    with open_or_create_journal(db_url) as a, open_or_create_journal(db_url) as b:
        a.append([allocate_op("H")])
        a.append([publish_op("H", guard_of(a.head("H")), "a-1")])
        stale = guard_of(a.head("H"))
        b.append([publish_op("H", guard_of(b.head("H")), "b-1")])
        for read in (a.last_position, lambda: list(a.read_all())):
            read()
            child = allocate_op(f"C{len(a.heads())}", f"c-op{len(a.heads())}")
            [refused] = a.append([Operation(f"fork{len(a.heads())}", "fp", child.writes, (Check("H", stale),),
                                            child.manifests)])
            assert isinstance(refused, Rejection) and refused.code == ErrorCode.STALE_BASE


def test_a_base_another_connection_reached_is_decided_on_the_journal_as_it_is(db_url):
    """A connection that knows a head as it was (it wrote it) is given the base another
    connection's commit reached since: the operation is decided on the journal during
    the call and commits, never refused on the state this connection knew before it."""
    with open_or_create_journal(db_url) as a, open_or_create_journal(db_url) as b:
        a.append([allocate_op("H")])
        a.append([publish_op("H", guard_of(a.head("H")), "a-1")])
        [moved] = b.append([publish_op("H", guard_of(b.head("H")), "b-1")])
        assert isinstance(moved, Receipt)
        [r] = a.append([publish_op("H", guard_of(b.head("H")), "a-2")])
        assert isinstance(r, Receipt), r
        assert a.head("H").snapshot_version == 3


def test_a_decode_run_beside_an_arrival_commits_whole(db_url):
    """A worker's usual commit: a decode step on each of several handles (a backend with
    a run path writes them from their columns) and an arrival beside them, in one
    transaction: every answer a receipt, each stream read back along its chain, the
    journal verified; as another connection reads it too."""
    prompt = (3, 1, 4, 1)
    handles = [f"run-{i}" for i in range(4)]

    def arrival(h: str, txn: str) -> list[c.Command | c.Relative]:
        return [c.Allocate(handle_id=h, manifest=make_manifest(request_id=h, prompt=prompt), reserved_capacity=40),
                c.Relative(c.BeginAppend(handle_id=h, txn_id=txn, kind="prefill", base_generation=None,
                                         base_snapshot_version=None, interval_start=0, interval_count=len(prompt),
                                         token_ids=prompt, cache_positions=(0, 1, 2, 3),
                                         mask_key_extent=len(prompt), cache_abi_sha256=""))]

    with open_or_create_journal(db_url) as journal:
        service = CommandService(journal, clock=ManualClock().at(5.0))
        txn = {h: ids.new_id() for h in handles}
        starts = [arrival(h, txn[h]) for h in handles]
        assert service.execute_many([a for a, _ in starts] + [b for _, b in starts]).refused() == []
        abi = service.state(handles[0]).cache_abi_sha256
        for k in range(2):
            batch = BatchBuilder()
            for i, h in enumerate(handles):
                batch.add(h, txn[h], len(prompt) + k, k, 7 + i, txn.setdefault(f"next-{h}", ids.new_id()), None, abi)
            steps = batch.build()
            results = service.submit_batch(steps, arrival(f"arrival-{k}", ids.new_id()), defer=False)()
            assert results.refused() == [] and len(results) == len(handles) + 2
            txn.update({h: txn.pop(f"next-{h}") for h in handles})
    with open_or_create_journal(db_url) as journal:
        assert [f for f in verify_journal(journal).findings if f.code == "TAMPERED"] == []
        fresh = CommandService(journal)
        assert [len(fresh.state(h).outputs) for h in handles] == [2] * len(handles)
        assert [e.event_type for e in journal.read_stream("arrival-1")] == ["request_allocate", "append_start"]
