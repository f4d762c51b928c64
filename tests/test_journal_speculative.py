"""The one-round-trip append (PostgreSQL): it commits only when its predictions hold,
and every misprediction falls back to the general path with the same results."""

from __future__ import annotations

import os

import pytest
from conftest import pipelined_postgres

from kvledger.journal import Rejection
from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt

from factories import allocate_op, guard_of, publish_op
from stored_rows import FIXTURES


@pytest.fixture
def pg_url(pg_admin):
    return pg_admin.create()


@pytest.fixture(params=[False, True], ids=["plain", "pipeline"])
def pipelined(request, monkeypatch):
    """Loopback connections send statements one by one; remote ones pipeline them.
    Run both ways here (the server is on loopback)."""
    pipelined_postgres(monkeypatch, request.param)
    return request.param


def _spy(journal):
    calls = {"fast": 0, "committed": 0}
    real = journal.sql.append_if

    def append_if(*args):
        calls["fast"] += 1
        ok = real(*args)
        calls["committed"] += ok
        return ok

    journal.sql.append_if = append_if
    return calls


def test_fast_path_commits_and_falls_back(pg_url, pipelined):
    with open_or_create_journal(pg_url) as a, open_or_create_journal(pg_url) as b:
        calls = _spy(a)
        a.append([allocate_op(f"h{i}") for i in range(4)])  # creates: general path
        ops = [publish_op(f"h{i}", guard_of(a.head(f"h{i}")), f"p1-{i}") for i in range(4)]
        first = a.append(ops)
        assert calls == {"fast": 1, "committed": 1}
        assert [r.first_global_position for r in first] == [5, 6, 7, 8]
        # a retry of a fast-committed batch: the verdict is false, the general path replays
        assert a.append(ops) == first and calls["committed"] == 1
        # another writer moves the journal: the prediction is stale, nothing is written twice
        b.append([publish_op("h0", guard_of(b.head("h0")), "other")])
        a._skip = 0
        second = a.append([publish_op("h1", guard_of(a.head("h1")), "p2-1")])
        assert isinstance(second[0], Receipt) and second[0].first_global_position == 10
        # a stale guard on the fast path: STALE_BASE, no row changed
        a._skip = 0
        before = (list(a.read_raw()), a.heads())
        [r] = a.append([publish_op("h2", guard_of(a.head("h2")), "p3-2"),
                        publish_op("h3", ops[3].writes[0].expected, "p3-3")])[1:]
        assert isinstance(r, Rejection) and r.code == ErrorCode.STALE_BASE
        after = list(a.read_raw())
        assert after[:len(before[0])] == before[0] and len(after) == len(before[0]) + 1
        assert a.heads()["h3"] == before[1]["h3"]
        assert [p for p, _ in a.read_raw()] == list(range(1, len(after) + 1))
        assert a.conn.info.transaction_status == 0  # idle: the failed attempt rolled back


def test_a_fast_append_is_one_statement_that_commits_itself(pg_url, monkeypatch):
    """On a journal without pre-0003 rows the one-statement append is this session's
    function (pg_temp.kvl_append_if): the writer lock and the append in one statement,
    committed by autocommit, nothing else on the wire; another connection reads it."""
    import psycopg

    with open_or_create_journal(pg_url) as a, open_or_create_journal(pg_url) as b:
        a.append([allocate_op(f"h{i}") for i in range(3)])  # creates: general path
        a.append([publish_op("h0", guard_of(a.head("h0")), "warm")])  # the first fast one makes the function
        ops = [publish_op(f"h{i}", guard_of(a.head(f"h{i}")), f"p-{i}") for i in (1, 2)]
        sent = []
        real = psycopg.Cursor.execute

        def spy(self, query, *args, **kwargs):
            sent.append(str(query).split("(")[0])
            return real(self, query, *args, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, "execute", spy)
        results = a.append(ops)
        monkeypatch.undo()
        assert sent == ["SELECT pg_temp.kvl_append_if"]
        assert all(isinstance(r, Receipt) for r in results) and a.conn.info.transaction_status == 0
        assert [e.operation_id for e in b.read_all()][-2:] == ["p-1", "p-2"]


def test_the_general_path_takes_its_lock_with_begin(pg_url, monkeypatch):
    """An append the one statement cannot take (here, creations) opens its transaction
    and takes the writer lock in one query, sends no lock of its own after it, and
    writes its record with the record's lookup rows in one statement (statements one by
    one, as on loopback: a pipeline sends BEGIN as psycopg's own)."""
    import psycopg

    pipelined_postgres(monkeypatch, False)
    with open_or_create_journal(pg_url) as a:
        a.append([allocate_op("warm")])
        sent = []
        real = psycopg.Cursor.execute

        def spy(self, query, *args, **kwargs):
            sent.append(str(query))
            return real(self, query, *args, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, "execute", spy)
        results = a.append([allocate_op(f"h{i}") for i in range(3)])
        monkeypatch.undo()
        assert sent[0] == "BEGIN; LOCK TABLE kvl_events IN EXCLUSIVE MODE"
        assert not [q for q in sent[1:] if "LOCK" in q or q.startswith("BEGIN")]
        [record] = [q for q in sent if "INTO kvl_records" in q or "INTO kvl_record_ids" in q]
        assert "INTO kvl_records" in record and "INTO kvl_record_ids" in record and "UPDATE kvl_heads" in record
        assert all(isinstance(r, Receipt) for r in results) and a.conn.info.transaction_status == 0


def test_an_append_inside_a_snapshot_leaves_the_snapshot_open(pg_url):
    """The same connection's read transaction is open: the write goes in a savepoint,
    is refused (the snapshot is read-only), and the snapshot reads on as it was."""
    from psycopg.pq import TransactionStatus

    with open_or_create_journal(pg_url) as a:
        a.append([allocate_op("h0")])
        with a.snapshot() as snap:
            before = snap.chain_at()
            with pytest.raises(KvLedgerError):
                a.append([allocate_op("h1")])
            assert a.conn.info.transaction_status == TransactionStatus.INTRANS
            assert snap.chain_at() == before
        assert [p for p, _ in a.read_raw()] == [1]


def test_without_temp_privilege_the_fast_path_runs_its_statements_apart(pg_admin, pg_url):
    """A role that may not create temporary objects gets no session function: the same
    one-statement append, its lock and commit sent apart (and still committed whole)."""
    import psycopg
    from sqlalchemy.engine import make_url

    from kvledger.journal.pgserver import conninfo

    admin = make_url(pg_url)
    role = f"kvl_notemp_{os.getpid()}"
    try:
        with psycopg.connect(conninfo(admin), autocommit=True) as conn:  # names made here, not input
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')
            conn.execute(f'CREATE ROLE "{role}" LOGIN')
            conn.execute(f'REVOKE TEMPORARY ON DATABASE "{admin.database}" FROM PUBLIC')
            conn.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{role}"')
    except psycopg.Error as exc:
        pytest.skip(f"cannot make a role without TEMP on this server: {exc}")
    url = admin.set(username=role).render_as_string(hide_password=False)
    try:
        with open_or_create_journal(url) as a:
            calls = _spy(a)
            a.append([allocate_op(f"h{i}") for i in range(2)])
            results = a.append([publish_op(f"h{i}", guard_of(a.head(f"h{i}")), f"p-{i}") for i in range(2)])
            assert calls == {"fast": 1, "committed": 1} and a.sql._function is False
            assert all(isinstance(r, Receipt) for r in results) and a.conn.info.transaction_status == 0
            assert [p for p, _ in a.read_raw()] == [1, 2, 3, 4]
    finally:
        with psycopg.connect(conninfo(admin), autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{role}"')
            conn.execute(f'DROP ROLE "{role}"')


def test_a_refused_fast_attempt_leaves_no_stale_stream_pointer(pg_url):
    """The fast path names each handle's last record from what this connection committed.
    An attempt refused by a moved head (and then refused by the general path too) must not
    leave its would-be record behind as that last record: the next record would point to
    a record that never held the handle."""
    from kvledger.replay import verify_journal

    with open_or_create_journal(pg_url) as a, open_or_create_journal(pg_url) as b:
        a.append([allocate_op("h0"), allocate_op("h1")])
        a.append([publish_op("h0", guard_of(a.head("h0")), "a1")])  # general path: a knows h0's record
        stale = guard_of(a.head("h0"))
        b.append([publish_op("h1", guard_of(b.head("h1")), "fill")])  # the record a would write next
        b.append([publish_op("h0", stale, "b1")])  # h0 moves under a, in the record after it
        a._skip = 0
        [r] = a.append([publish_op("h0", stale, "a2")])
        assert isinstance(r, Rejection) and r.code == ErrorCode.STALE_BASE
        a._skip = 0
        assert isinstance(a.append([publish_op("h0", guard_of(a.head("h0")), "a3")])[0], Receipt)
        assert [e.stream_position for e in b.read_stream("h0")] == [1, 2, 3, 4]
        assert [f for f in verify_journal(a).findings if f.code == "TAMPERED"] == []


def test_interleaved_writers_stay_gapless(pg_url, pipelined):
    with open_or_create_journal(pg_url) as a, open_or_create_journal(pg_url) as b:
        a.append([allocate_op(f"h{i}") for i in range(6)])
        for k in range(10):
            for j, w in enumerate((a, b)):
                h = f"h{(k + j) % 6}"
                [r] = w.append([publish_op(h, guard_of(w.head(h)), f"{k}-{j}")])
                assert isinstance(r, Receipt)
        positions = [p for p, _ in a.read_raw()]
        assert positions == list(range(1, 27))
        bodies = {e.global_position for e in a.read_all()}
        assert bodies == set(positions)  # every body carries its own position


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_concurrent_writers_stay_gapless_whatever_the_default_isolation(pg_url, pipelined, isolation):
    """An operator's database may default to REPEATABLE READ or SERIALIZABLE. A write
    still reads the journal's tail only once it holds the writers' lock: two writers
    committing at once, each on its own handles, every commit lands and the positions
    stay gapless (a snapshot taken before the lock let both number their records after
    the same tail)."""
    import threading

    import psycopg

    from kvledger.journal.pgserver import conninfo

    with psycopg.connect(conninfo(pg_url), autocommit=True) as admin:
        name = admin.info.dbname  # the scratch database's own: no input reaches the statement
        admin.execute(f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = '{isolation}'")
    answers: list = []

    def writer(tag: str, n: int) -> None:  # records of unequal sizes: positions that overlap, not repeat
        with open_or_create_journal(pg_url) as j:
            answers.extend(j.append([allocate_op(f"{tag}{i}", op_id=f"a-{tag}{i}") for i in range(n)]))
            for k in range(40):
                answers.extend(j.append([publish_op(f"{tag}{i}", guard_of(j.head(f"{tag}{i}")), f"{tag}{k}-{i}")
                                         for i in range(n)]))

    threads = [threading.Thread(target=writer, args=args) for args in (("a", 4), ("b", 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = 7 * 41
    assert len(answers) == events and all(isinstance(r, Receipt) for r in answers)
    with open_or_create_journal(pg_url) as j:
        assert [p for p, _ in j.read_raw()] == list(range(1, events + 1))
        assert {e.global_position for e in j.read_all()} == set(range(1, events + 1))


@pytest.mark.parametrize("name", ['q"uote', "back\\slash", "{brace},comma", "NULL", "sp ace", "é✓", ""])
def test_awkward_ids_round_trip(pg_url, name):
    """Array parameters are bound as literals when that is exact and as lists otherwise:
    any id comes back as written."""
    handles = [f"h{name}", f"{name}x"] if name else ["h-empty", "x-empty"]
    with open_or_create_journal(pg_url) as j:
        j.append([allocate_op(h, op_id=f"a{name}{h}") for h in handles])
        j.append([publish_op(h, guard_of(j.head(h)), f"p{name}{h}") for h in handles])
        for h in handles:
            assert [e.stream_position for e in j.read_stream(h)] == [1, 2]
            assert j.head(h).snapshot_version == 1
            assert j.receipt(f"p{name}{h}").handles[0].handle_id == h


def test_binary_arrays_round_trip(pg_admin):
    """The hand-built binary array parameters read back as the values they carry."""
    import psycopg

    from kvledger.journal.pgserver import conninfo
    from kvledger.journal.postgres import _byteas, _int4s, _int8s, _register_arrays, _texts

    with psycopg.connect(conninfo(pg_admin.create(migrated=False))) as conn:
        _register_arrays(conn)
        texts = ["a", None, "é✓", "", 'q"\\', "NULL"]
        ints = [0, -1, 2**63 - 1, -(2**63), 42]
        row = conn.execute("SELECT %b, %b, %b, %b, %b, %b, cardinality(%b)",
                           (_texts(texts), _int8s(ints), _int4s([1, -2, 2**31 - 1]),
                            _byteas([b"\x00\xff", b"", None]), _texts([]), _int8s(()),
                            _texts(["x"] * 300))).fetchone()
        assert row == (texts, ints, [1, -2, 2**31 - 1], [b"\x00\xff", b"", None], [], [], 300)
        with pytest.raises(psycopg.DataError):
            _int8s([2**63])


def test_the_journal_polls_its_connection_for_replies(pg_url):
    """The journal's PostgreSQL connection polls its socket for the server's reply before
    it sleeps (journal.postgres.PollingConnection, journal.tuning.polled), and statements,
    a commit and a refusal all go through it as before."""
    from kvledger.journal.postgres import PollingConnection

    with open_or_create_journal(pg_url) as j:
        assert type(j.conn) is PollingConnection
        [r] = j.append([allocate_op("h")])
        assert isinstance(r, Receipt)
        [again] = j.append([allocate_op("h", "other")])
        assert isinstance(again, Rejection) and again.code == ErrorCode.HANDLE_EXISTS.value
        assert j.last_position() == r.last_global_position


def test_an_imported_journal_keeps_looking_for_ids_in_its_event_rows(pg_url):
    """The one-statement append leaves the one-row-per-event tables out once its connection
    has seen a record with them empty (only an import writes them, into an empty journal).
    An imported journal keeps them in: an operation reusing an imported operation's id, or
    an imported event's id, on a head whose guard holds is not written by it."""
    from kvledger.replay import import_jsonl

    with open_or_create_journal(pg_url) as j:
        import_jsonl(j, FIXTURES / "two_request_trajectory.jsonl")
        imported = list(j.read_all())[-1]
    with open_or_create_journal(pg_url) as a:
        calls = _spy(a)
        a.append([allocate_op("h1")])  # a record beside the imported rows
        assert isinstance(a.append([publish_op("h1", guard_of(a.head("h1")), "new-op")])[0], Receipt)
        assert calls == {"fast": 1, "committed": 1}
        before = list(a.read_raw())
        [r] = a.append([publish_op("h1", guard_of(a.head("h1")), imported.operation_id)])
        assert isinstance(r, Rejection) and r.code == ErrorCode.CONFLICT, r
        a._skip = 0
        with pytest.raises(KvLedgerError) as reused:
            a.append([publish_op("h1", guard_of(a.head("h1")), "fresh-op", event_id=imported.event_id)])
        assert reused.value.code == ErrorCode.CONSTRAINT_VIOLATION
        assert list(a.read_raw()) == before
        assert calls == {"fast": 3, "committed": 1}


def test_a_journal_of_records_only_stops_looking_in_the_event_rows(pg_url):
    """...and a journal with none stops looking (one statement fewer array a commit), yet
    still finds a reused id among its records."""
    with open_or_create_journal(pg_url) as a:
        calls = _spy(a)
        a.append([allocate_op("h1")])
        assert a.sql.has_event_rows(a.conn) is False
        first = a.append([publish_op("h1", guard_of(a.head("h1")), "op-1")])
        a._skip = 0
        before = list(a.read_raw())
        [r] = a.append([publish_op("h1", guard_of(a.head("h1")), "op-1", fingerprint="another")])
        assert isinstance(r, Rejection) and r.code == ErrorCode.CONFLICT, r
        assert list(a.read_raw()) == before and isinstance(first[0], Receipt)
        assert calls == {"fast": 2, "committed": 1}
