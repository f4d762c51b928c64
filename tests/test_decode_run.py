"""A decode run written from its columns (journal.run_writer, SqlJournal.append_run) against
the same run appended as its operations (the port's default, the general path): the
same stored rows byte for byte, the same answers, for random batches, including steps
the block path declines (an id not in engine.ids' form), stale bases (another writer
moved a head), model calls, and random digests, counts and id prefixes."""

from __future__ import annotations

import itertools
import sqlite3
import tempfile

import psycopg
import pytest
from conftest import pipelined_postgres
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.engine import commands as c
from kvledger.engine import ids
from kvledger.engine.service import CommandService, ManualClock
from kvledger.journal.port import Journal
from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.decode_batch import BatchBuilder, DecodeBatch
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.events import ForwardCall

from hardening_db import conninfo
from lane_helpers import fixed_commit_time, same_ids
from lifecycle_helpers import make_manifest

PROMPT = (3, 1, 4, 1)
TABLES = ("kvl_records", "kvl_heads", "kvl_record_ids", "kvl_manifests")

step = st.fixed_dictionaries({
    "digest": st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(bytes.hex)),
    "token": st.integers(0, 1 << 40),
    "workspace": st.sampled_from([0, 1, 64, 1 << 40]),
    "txn": st.sampled_from(["engine", "engine", "engine", "other_prefix", "not_engine_form"]),
    "stale": st.sampled_from([False] * 5 + [True]),  # another writer moves its handle first
    "call": st.sampled_from([None, None, "engine", "engine", "other_prefix", "not_engine_form"]),
    "call_numbers": st.tuples(st.integers(0, 1 << 20), st.integers(1, 64), st.integers(1, 8), st.integers(1, 1 << 20),
                              st.integers(0, 64)),
})
batches = st.integers(1, 6).flatmap(lambda n: st.lists(st.lists(step, min_size=n, max_size=n), min_size=1,
                                                        max_size=3))


def _txn(kind: str, k: int) -> str:
    if kind == "other_prefix":
        return f"0be7000000000001{k:016x}"
    if kind == "not_engine_form":
        return f"txn-{k}"
    return ids.new_id()


def _batch(rows: list[tuple], abi: str) -> DecodeBatch:
    """A batch of (handle, txn, its state as the sender knows it, token, next txn, digest[,
    workspace, call]) steps."""
    batch = BatchBuilder()
    for h, txn, s, token, nxt, digest, *detail in rows:
        t = s.open_txns[0]
        i = batch.add(h, txn, t.interval_start + t.interval_count, len(s.outputs), token, nxt, digest, abi)
        batch.detail(i, workspace_bytes=detail[0] if detail else 0, call=detail[1] if detail else None)
    return batch.build()


def _call(kind: str | None, call_ids: dict[str, str], numbers: tuple[int, ...]) -> ForwardCall | None:
    """A step's model call: the round's one call id (a batch's steps share one forward
    call), in engine.ids' form or not."""
    if kind is None:
        return None
    index, size, new_pad, key_extent, threads = numbers
    return ForwardCall(call_ids[kind], index, size, new_pad, key_extent, threads)


def _arrival(h: str, txn: str) -> list[c.Command | c.Relative]:
    """A request's arrival: its allocation and the start of its prefill."""
    return [c.Allocate(handle_id=h, manifest=make_manifest(request_id=h, prompt=PROMPT), reserved_capacity=40),
            c.Relative(c.BeginAppend(handle_id=h, txn_id=txn, kind="prefill", base_generation=None,
                                     base_snapshot_version=None, interval_start=0, interval_count=len(PROMPT),
                                     token_ids=PROMPT, cache_positions=(0, 1, 2, 3), mask_key_extent=len(PROMPT),
                                     cache_abi_sha256=""))]


def _started(service: CommandService, handles: list[str]) -> dict[str, str]:
    """The handles allocated and their prefills started, in one commit: each one's txn."""
    txn = {h: ids.new_id() for h in handles}
    cmds = [_arrival(h, txn[h]) for h in handles]
    service.execute_many([a for a, _ in cmds] + [b for _, b in cmds])
    return txn


def _decoding(journal: Journal, handles: list[str]) -> tuple[CommandService, DecodeBatch]:
    """A service with `handles` started, and a batch of one decode step each."""
    service = CommandService(journal, clock=ManualClock().at(5.0))
    txn = _started(service, handles)
    abi = service.state(handles[0]).cache_abi_sha256
    return service, _batch([(h, txn[h], service.state(h), 7 + i, ids.new_id(), None) for i, h in enumerate(handles)],
                           abi)


def _journal(url: str, columns: bool, rounds: list[list[dict]], extra: bool = False) -> tuple[dict[str, list], list]:
    """The tables of a journal the rounds were written to, each a batch of one step a
    handle, and every answer; `columns` False: runs appended as their operations. With
    `extra`, each round's commit also allocates a handle and starts its prefill (a
    worker's arrival beside its decode steps); the tables are then its events."""
    n = len(rounds[0])
    handles = [f"run-{i}" for i in range(n)]
    with open_or_create_journal(url) as journal:
        if not columns:
            journal.append_run = lambda run, ops, **kw: Journal.append_run(journal, run, ops, **kw)  # type: ignore[method-assign]  # the default
        service = CommandService(journal, clock=ManualClock().at(5.0))
        other = CommandService(journal, clock=ManualClock().at(6.0), source_instance="other")
        txn = {h: ids.new_id() for h in handles}
        cmds = [_arrival(h, txn[h]) for h in handles]
        out: list = list(service.execute_many([a for a, _ in cmds] + [b for _, b in cmds]))
        abi = service.state(handles[0]).cache_abi_sha256
        counter = itertools.count()
        for steps in rounds:
            moved = {}
            for h, x in zip(handles, steps):
                if x["stale"]:  # another writer decodes the handle's step first: the service's head is stale
                    moved[h] = ids.new_id()
                    out += other.execute_steps(_batch([(h, txn[h], other.state(h, refresh=True), 7, moved[h],
                                                        None)], abi))
            call_ids = {"engine": ids.new_id(), "other_prefix": f"0ca1100000000002{next(counter):016x}",
                        "not_engine_form": f"call-{next(counter)}"}
            rows = [(h, txn[h], service.state(h), x["token"], _txn(x["txn"], next(counter)), x["digest"],
                     x["workspace"], _call(x["call"], call_ids, x["call_numbers"])) for h, x in zip(handles, steps)]
            batch = _batch(rows, abi)
            arrivals = _arrival(f"new-{len(out)}", ids.new_id()) if extra else []
            results = service.submit_batch(batch, arrivals, defer=False)()
            for h, nxt_step, r in zip(handles, batch.next_txn_ids, results):
                if not isinstance(r, KvLedgerError):
                    txn[h] = nxt_step
                elif h in moved:
                    txn[h] = moved[h]
            out += [(r.code, r.message) if isinstance(r, KvLedgerError) else r for r in results]
        stored = ({"events": list(journal.read_raw()), "heads": journal.heads()} if extra else None)
    return stored or _tables(url), out


def _tables(url: str) -> dict[str, list]:
    queries = {t: f"SELECT * FROM {t} ORDER BY 1" for t in TABLES}  # constant table names
    if url.startswith("sqlite"):
        con = sqlite3.connect(url.removeprefix("sqlite:///"))
        try:
            return {t: con.execute(q).fetchall() for t, q in queries.items()}
        finally:
            con.close()
    with psycopg.connect(conninfo(url)) as pg:
        return {t: [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
                    for row in pg.execute(q).fetchall()] for t, q in queries.items()}


@pytest.mark.parametrize("extra", [False, True], ids=["alone", "beside_arrivals"])
@pytest.mark.parametrize("kind", ["sqlite", "postgres", "postgres_pipeline"])
def test_a_run_from_its_columns_stores_what_its_operations_store(kind, extra, request):
    """SQLite writes a run's block in its transaction; PostgreSQL in its one-statement
    append. Beside other commands (`extra`), the run is a record from its columns and
    the others the general path's record after it, in one transaction, against all of
    it by the general path in one record: the same events byte for byte, heads, answers.
    `postgres_pipeline`: the run's statements pipelined, as to a remote server, against
    its operations sent one by one."""
    pg = request.getfixturevalue("pg_admin") if kind.startswith("postgres") else None
    if kind == "postgres_pipeline":
        pipelined_postgres(request.getfixturevalue("monkeypatch"), True)

    @settings(max_examples=(25 if pg is None else 10) // (2 if extra else 1), deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(rounds=batches)
    def check(rounds: list[list[dict]]) -> None:
        with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
            runs = {}
            for columns in (True, False):
                same_ids(mp)
                fixed_commit_time(mp)
                if kind == "postgres_pipeline":
                    pipelined_postgres(mp, columns)
                url = f"sqlite:///{d}/{columns}.db" if pg is None else pg.create()
                runs[columns] = _journal(url, columns, rounds, extra)
            assert runs[True] == runs[False]

    check()


def test_a_run_beside_an_arrival_is_written_from_its_columns(tmp_path):
    """The commit's run is its own record, from its columns (its answer built when
    read), and the arrival the general path's record after it, in one transaction."""
    from kvledger.journal.port import RunReceipts

    handles = [f"mixed-{i}" for i in range(4)]
    with open_or_create_journal(f"sqlite:///{tmp_path}/m.db") as journal:
        service, batch = _decoding(journal, handles)
        [arrival, _] = _arrival("arrival", ids.new_id())
        statements: list[str] = []
        journal.conn.set_trace_callback(statements.append)  # the SQLite journal's one connection
        results = service.submit_batch(batch, [arrival], defer=False)()
        journal.conn.set_trace_callback(None)
        # the arrival's record follows the run's, which this transaction wrote: read once, before the run
        assert sum("FROM kvl_records ORDER BY last_position DESC" in q for q in statements) == 1
        run, rest = results.parts()
        assert type(run) is RunReceipts and len(run) == len(handles) and len(rest) == 1
        assert results.refused() == [] and results[-1] == journal.receipt(arrival.operation_id or rest[0].operation_id)
        con = sqlite3.connect(f"{tmp_path}/m.db")
        try:
            records = con.execute("SELECT first_position, last_position FROM kvl_records ORDER BY 1").fetchall()
        finally:
            con.close()
        first = run[0].first_global_position
        assert records[-2:] == [(first, first + 3 * len(handles) - 1), (first + 3 * len(handles),) * 2]
        assert service.state(handles[0]).stream_position == run[0].handles[0].stream_position


def test_a_run_written_whole_builds_each_receipt_when_read(tmp_path, monkeypatch):
    """A run the journal wrote whole answers with receipts built when read: a worker's
    check for refusals computes no fingerprint, and each receipt read is the one the
    journal gives a retry of its operation, built once however often it is read."""
    from kvledger.journal import decode_run

    computed = []
    real = decode_run.chain_fingerprint
    monkeypatch.setattr(decode_run, "chain_fingerprint", lambda *a: computed.append(a[0]) or real(*a))
    handles = [f"lazy-{i}" for i in range(4)]
    with open_or_create_journal(f"sqlite:///{tmp_path}/k.db") as journal:
        service, batch = _decoding(journal, handles)
        results = service.execute_steps(batch)
        assert results.refused() == [] and len(results) == len(handles)
        assert computed == []  # nothing read a receipt yet
        assert results[-1] == results[3] and results[1:3] == [results[1], results[2]]
        receipts = list(results)
        assert [r.handles[0].handle_id for r in receipts] == handles
        assert receipts == [journal.receipt(r.operation_id) for r in receipts]
        assert sorted(computed) == sorted(handles)  # each once, however often read
        with pytest.raises(IndexError):
            results[len(handles)]


@pytest.mark.sql_storage("calls the guarded head update of a run's transaction (Statements.guard_all) itself")
@pytest.mark.parametrize("stale", [None, 0, 4])
def test_a_runs_guarded_head_updates_move_every_head_or_none(db_url, stale):
    """guard_all, which writes a run's heads: every head moves and points at the run's
    record when every guard holds; one stale guard, first or last, leaves every head as
    it was."""
    from kvledger.journal.builders import allocate_op, head
    from kvledger.journal.contract import Guard, HeadFacts, StreamWrite, head_moves

    handles = [f"guarded-{i}" for i in range(5)]
    with open_or_create_journal(db_url) as journal:
        journal.append([allocate_op(h) for h in handles])
        before = {h: journal.head(h) for h in handles}
        guards = [Guard(0, 0, 2 if k == stale else 1) for k in range(len(handles))]
        rows = [(StreamWrite(h, g, head(h, 0, 1, 4, 5), ()), g) for h, g in zip(handles, guards)]
        sql, seen = journal.sql, {}

        def look(cur):
            seen["held"] = sql.guard_all(cur, head_moves(rows), 77)
            seen["after"] = dict(sql.last_record_rows(cur, handles))
            seen["facts"] = {h: HeadFacts(*sql.heads(cur, None, h)[0][1:]) for h in handles}
            raise LookedAt  # rolled back: nothing of it is the test's journal's

        with pytest.raises(LookedAt):
            sql.transaction(look)
    held, after, facts = seen["held"], seen["after"], seen["facts"]
    assert held is (stale is None)
    if stale is None:
        assert after == dict.fromkeys(handles, 77)
        assert {h: (f.snapshot_version, f.stream_position, f.committed_length) for h, f in facts.items()} == \
            dict.fromkeys(handles, (1, 4, 5))
    else:
        assert facts == before and 77 not in after.values()


class LookedAt(Exception):
    pass


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20).flatmap(lambda pool: st.lists(
    st.lists(st.integers(0, pool - 1), min_size=3, max_size=3), min_size=1, max_size=40)))
def test_a_runs_prefixes_are_numbered_in_order_of_first_appearance(steps):
    """run_writer._numbered, by masks (a few prefixes) or by sorting (many), numbers them
    as a Context does: step by step, slot by slot within a step, first seen first."""
    import numpy as np

    from kvledger.journal.run_writer import _numbered

    values = [[(0xF1 << 56) + 977 * v for v in row] for row in steps]  # past int64: uint64 only
    order: dict[int, int] = {}
    for row in values:
        for v in row:
            order.setdefault(v, len(order))
    numbers, prefixes = _numbered(np.array(values, np.uint64).T)
    assert numbers.T.tolist() == [[order[v] for v in row] for row in values]
    assert prefixes == [f"{v:016x}" for v in order]


def test_a_forged_decode_step_is_refused_and_nothing_written(db_url):
    """The port's check of an operation carrying a decode step's values (every backend
    runs it before writing): a step not at its write's next position, one carrying a
    global position, a head not three events on, a step beside events, a handle written
    twice, a write of no events: INVALID_ARGUMENT naming the fault, nothing written; the
    step as planned then commits."""
    import msgspec

    from kvledger.engine.batch_plan import plan_step
    from kvledger.schemas.errors import ErrorCode
    from kvledger.schemas.receipts import Receipt

    replace = msgspec.structs.replace
    with open_or_create_journal(db_url) as journal:
        service, batch = _decoding(journal, ["f0", "f1"])
        op = plan_step(service.state("f0"), batch, 0, 100, "forger", 1, 1)
        assert op is not None and op.step is not None
        x, [w] = op.step, op.writes
        evented = replace(w, events=x.events())
        forged = {
            "is not at f0": replace(op, step=replace(x, stream_position=x.stream_position + 1)),
            "global_position is assigned": replace(op, step=replace(x, global_position=9)),
            "does not end at its last event": replace(op, writes=(replace(
                w, head=replace(w.head, stream_position=w.head.stream_position + 1)),)),
            "are its one write's events": replace(op, writes=(evented,)),
            "writes f0 twice": replace(op, step=None, writes=(evented, evented)),
            "has no events": replace(op, step=None),
        }
        before = (list(journal.read_raw()), journal.heads())
        for fault, bad in forged.items():
            with pytest.raises(KvLedgerError) as err:
                journal.append([bad])
            assert err.value.code is ErrorCode.INVALID_ARGUMENT and fault in err.value.message, (fault, err.value)
        assert (list(journal.read_raw()), journal.heads()) == before
        [ok] = journal.append([op])
        assert isinstance(ok, Receipt) and journal.head("f0").stream_position == w.head.stream_position
