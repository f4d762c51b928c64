"""A decode step read back whole (record format 6's StepValues) is folded at once by the
projector (Projector._step), and a record's consecutive steps (StepRun) together, as
columns (replay.runs); the result must be what their three events give one by one.

Over whole journals on both backends (the demo, which holds prefills, decode steps,
finishes and releases, and 64 handles decoding in lockstep): the projection state after
`read_fold` equals the one after `read_all`, and so does every report built from it
(ledgers, byte-time, peaks and where they were reached, service metrics); a replay
resumed from any position, inside a step included, ends in the same state; a projector
that has not seen a step's handle fails the same way on both paths. Records that mix
steps with other operations, name a handle twice, or carry a workspace fold the same.
"""

from __future__ import annotations

import msgspec
import pytest

from kvledger.cli import main
from kvledger.journal import open_journal
from kvledger.journal.steps import StepRun, StepValues
from kvledger.replay.metrics import WindowSpec
from kvledger.replay.projector import Projector
from kvledger.replay.report import build, to_json
from kvledger.replay.sources import fold_items
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.events import ForwardCall

from budget import scaled

WINDOW = WindowSpec(slo_ttft_ns=10**7, slo_tbt_ns=10**6, width_ns=10**6)


def _build(url: str) -> None:
    """The demo's requests and a lockstep decode."""
    from kvledger.engine.service import CommandService

    from bench.tokens import Lockstep

    assert main(["demo", "--requests", "3", "--db", url, "--json"]) == 0
    with open_journal(url) as journal:
        run = Lockstep(CommandService(journal), 4, 8, "fold")
        for _ in range(6):
            run.step()


@pytest.fixture
def journals(shared_journal):
    """The url of a journal holding the demo's requests and a lockstep decode: built once,
    read by every test here."""
    return shared_journal("steps", _build)


@pytest.fixture
def own_journal(db_url):
    """The same journal, this test's own to edit."""
    _build(db_url)
    return db_url


def _same(a: Projector, b: Projector) -> None:
    assert a.snapshot() == b.snapshot()
    assert a.position == b.position and a.last_event_id == b.last_event_id
    assert to_json(build(a, WINDOW)) == to_json(build(b, WINDOW))


def test_a_fold_of_whole_steps_is_the_fold_of_their_events(journals):
    with open_journal(journals) as journal:
        items = list(journal.read_fold())
        steps = sum(x.count for x in items if type(x) is StepRun)
        assert steps >= 6 * 64  # the lockstep's steps came whole, and the demo's
        assert all(x.columns is not None for x in items if type(x) is StepRun)  # folded as columns
        by_events = Projector().feed(journal.read_all())
        by_steps = Projector().feed(items)
        _same(by_events, by_steps)
        # and item by item (a step leaves no workspace behind, as its emit does not)
        a, b = Projector(), Projector()
        events = iter(journal.read_all())
        for item in items[:400]:
            b.feed((item,))
            a.feed(next(events) for _ in range(3 * item.count if type(item) is StepRun else 1))
            assert a.ledger.values() == b.ledger.values() and a.handles == b.handles and a.work == b.work
        # and what `kvledger replay` folds is the same
        _same(by_events, Projector().feed(fold_items(journal)))
        # with a trajectory (a point per event) the steps go event by event: the same points
        a, b = Projector(trajectory=True).feed(journal.read_all()), Projector(trajectory=True).feed(items)
        assert a.trajectory == b.trajectory and a.snapshot() == b.snapshot()


def test_a_resumed_fold_ends_where_a_whole_one_does(journals):
    with open_journal(journals) as journal:
        whole = Projector().feed(journal.read_all())
        events = list(journal.read_all())
        # after the first decode step, in the middle of one, and at its end
        run = next(x for x in journal.read_fold() if type(x) is StepRun and x.count > 2)
        first = run.global_position
        # before, inside and at the end of its first step, inside the run, at its end
        for cut in (first - 1, first, first + 1, first + 2, first + 3, first + 4, run.last_position - 1,
                    run.last_position, len(events) // 2, len(events) - 4):
            p = Projector().feed(events[:cut])
            p.feed(journal.read_fold(after=cut))
            _same(whole, p)


def test_a_step_whose_handle_the_fold_has_not_seen_fails_as_its_event_does(journals):
    with open_journal(journals) as journal:
        step = next(x for x in journal.read_fold() if type(x) is StepRun)
        after = step.global_position - 1
        fresh = [Projector(), Projector()]
        fresh[0].position = fresh[1].position = after  # as if resumed there, knowing nothing
        errors = []
        for p, items in zip(fresh, (journal.read_all(after=after), journal.read_fold(after=after))):
            with pytest.raises(KvLedgerError) as err:
                p.feed(items)
            errors.append((err.value.code, err.value.message, p.position))
        assert errors[0] == errors[1]
        assert errors[0][0].value == "CORRUPT_JOURNAL"


def test_read_fold_is_read_all_with_steps_whole_from_any_position(journals):
    """The contract of Journal.read_fold: expanded, it is read_all from the same position,
    a step that `after` cuts given as its remaining events."""
    with open_journal(journals) as journal:
        last = journal.last_position()
        # every cut in the first records, then a stride prime to a step's 3 events
        for after in [*range(0, 40), *range(40, last + 1, scaled(31, 7)), last]:
            expanded = [e for x in journal.read_fold(after)
                        for e in (x.events() if type(x) in (StepRun, StepValues) else (x,))]
            assert expanded == list(journal.read_all(after)), after


def _chain(run, h: str, workspace: int = 0, finish: bool = False, again: bool = False, call=None):
    """Lockstep's next decode chain for `h` (bench.tokens.Lockstep._step_chains), with a
    workspace; with `finish`, the chain that ends the request instead of starting again;
    with `again`, one that starts its next append under the txn id it publishes; with
    `call`, one whose next append records that model call."""
    c = run.c
    start, n, txn = run.pos[h], run.count[h], run.txn[h]
    token = (start + n) % 50_000
    publish = c.Publish(handle_id=h, txn_id=txn, base_generation=None, base_snapshot_version=None,
                        rows_sha256="ab" * 32, workspace_bytes=workspace)
    emit = c.EmitOutput(handle_id=h, base_generation=None, base_snapshot_version=None,
                        output_index=run.outputs[h], token_id=token)
    run.outputs[h] += 1
    run.pos[h] = start + n
    last = c.Finish(handle_id=h, base_generation=None) if finish else run._start(h, "decode", (token,))
    if again:
        last = msgspec.structs.replace(last, txn_id=txn)
        run.txn[h] = txn
    if call is not None:
        last = msgspec.structs.replace(last, call=call)
    return c.Relative(c.Chain(handle_id=h, steps=(publish, emit, last)))


def test_records_that_mix_steps_fold_as_their_events(db_url):
    """Commits holding a handle's step twice (once under the txn id it publishes, so both
    steps name the txn the handle had before), a step that ends its request, a step whose
    model call no row stores (stored as events, between step rows), a lone publication,
    and workspaces that raise their
    peaks, tied, inside a run: folded as columns, item by item, they leave what their
    events leave."""
    from kvledger.engine.gather import submit_split
    from kvledger.engine.service import CommandService

    from bench.tokens import Lockstep

    with open_journal(db_url) as journal:
        run = Lockstep(CommandService(journal), 2, 8, "mixed")
        run.step()
        h = run.handles
        lone = run.c.Publish(handle_id=h[6], txn_id=run.txn[h[6]], base_generation=None, base_snapshot_version=None,
                             rows_sha256="cd" * 32, workspace_bytes=4_000)
        batches = [
            [_chain(run, h[0]), _chain(run, h[1], 7_000), _chain(run, h[0], 5_000), _chain(run, h[2], finish=True),
             _chain(run, h[3], 100, call=ForwardCall("a call id no row stores", 0, 2, 1, 1, 1)),
             _chain(run, h[4], 9_000), _chain(run, h[5], 9_000), run.c.Relative(lone),
             *(_chain(run, x, 100) for x in h[7:])],
            [_chain(run, h[1], 3_000, again=True), _chain(run, h[1]), _chain(run, h[3]), _chain(run, h[1])],
        ]
        for batch in batches:  # each as a producer sends it: its decode steps as one DecodeBatch
            for r in submit_split(run.service, batch, defer=False)():
                assert not isinstance(r, Exception), r
        run.handles = [x for x in h if x not in (h[2], h[6])]
        run.step()
        items = list(journal.read_fold())
        runs = [x.count for x in items if type(x) is StepRun]
        assert [64, 3, 59, 4, 62] == runs[-5:]  # split by the events between them
        assert all(x.columns is not None for x in items if type(x) is StepRun)
        by_events = Projector().feed(journal.read_all())
        _same(by_events, Projector().feed(items))
        assert by_events.ledger.peak_workspace == 9_000
        assert by_events.ledger.peak_at["workspace"] == by_events.ledger.peak_at["instantaneous"]
        a, b = Projector(), Projector()
        events = iter(journal.read_all())
        for item in items:
            b.feed((item,))
            a.feed(next(events) for _ in range(3 * item.count if type(item) is StepRun else 1))
            assert a.ledger.values() == b.ledger.values() and a.handles == b.handles and a.work == b.work


def test_runs_without_columns_fold_one_by_one(journals):
    """A run whose rows do not fit the columns (legacy.RowReader.run reads them row by row) is
    folded step by step, to the same state."""
    with open_journal(journals) as journal:
        items = list(journal.read_fold())
        for x in items:
            if type(x) is StepRun:
                x.columns = None
        _same(Projector().feed(journal.read_all()), Projector().feed(items))


def test_a_difference_stored_unsigned_is_read_row_by_row():
    """A format 6 row may store a difference as the unsigned 64-bit number it wraps to (the
    reader adds modulo 2**64): no int64 column holds it, so the run has no columns, and
    its values are the rows' own. (A format 7 block holds int64s only.)"""
    import msgspec

    from kvledger.journal.legacy import RowReader
    from kvledger.journal.steps import Context, Step

    ctx = msgspec.msgpack.encode(Context(7, 1, ["5eed0000000000aa"], [("h", "r", 0, "src", b"a" * 32)]))
    rows = [msgspec.msgpack.encode(Step(0, 10 + 3 * i, 0, mono, 0, 0, 4, (1, 1, 1), (0, 3), (0, 4), 5 + i, 40 + i,
                                        1, 2, 0, None, i, 9, None))
            for i, mono in enumerate((1_000, (1 << 64) - 5))]  # the second clock is 5 ns before the first
    run = RowReader(ctx).run(rows, 0)
    one = RowReader(ctx)
    assert run.columns is None
    assert run.values() == [one.values(row, 3 * i) for i, row in enumerate(rows)]
    assert [x.monotonic_ns for x in run.values()] == [1_000, 995]


def test_ledgers_past_int64_fold_as_their_events(journals):
    """A B_token so large that a run's sums would not fit int64 (the one-step fold uses
    Python ints): the run is folded one step at a time, to the same state."""
    with open_journal(journals) as journal:
        items = list(journal.read_fold())
        events = list(journal.read_all())
        cut = next(i for i, x in enumerate(items) if type(x) is StepRun)
        at = items[cut].global_position - 1
        a, b = Projector().feed(events[:at]), Projector().feed(items[:cut])
        for p in (a, b):  # the handles that own no bytes yet: they will own them at this size
            for sid, h in p.handles.items():
                if sid not in p.ledger.owners:
                    p.handles[sid] = msgspec.structs.replace(h, b_token=1 << 60)
        a.feed(events[at:])
        b.feed(items[cut:])
        assert a.ledger.peak_logical > 1 << 63
        _same(a, b)


def test_consecutive_records_fold_together(journals, monkeypatch):
    """Runs of consecutive records are held and folded as one slice (replay.runs.RunFold.
    hold), each handle's step checked against its step in the record before; the lockstep's
    first records publish their prefills (handles that own no bytes yet), which fold alone
    before the rest go together. The state is the events' fold, whole and resumed."""
    from kvledger.replay.runs import RunFold

    together = RunFold._together
    taken: list[int] = []

    def spy(self, p, held):
        done = together(self, p, held)
        taken.extend([len(held)] if done else [])
        return done

    monkeypatch.setattr(RunFold, "_together", spy)
    with open_journal(journals) as journal:
        events = list(journal.read_all())
        items = list(journal.read_fold())
        _same(Projector().feed(events), Projector().feed(items))
        assert taken and max(taken) >= 4  # the lockstep's records after its first went together
        runs = [x for x in items if type(x) is StepRun]
        cut = runs[-3].global_position - 1  # resumed with two held runs still to come
        p = Projector().feed(events[:cut])
        p.feed(journal.read_fold(after=cut))
        _same(Projector().feed(events), p)


@pytest.mark.sql_storage("edits SQL rows in place: a NATS stream has no rows to edit")
@pytest.mark.parametrize("forge", ["counter", "prefix"])
def test_a_forged_step_in_held_runs_fails_as_its_event_does(own_journal, forge):
    """The last record's step 10 forged to publish a txn its handle never started, by its
    counter or its prefix (its block repacked with fresh CRCs, which a read checks; the
    chain is verify's): folded from held runs, it fails where, and as, its event does."""
    import zlib

    from kvledger.journal.audit import unpack_record
    from kvledger.journal.blocks import pack, read
    from kvledger.journal.record_format import pack_record

    from stored_rows import sql

    last, body = sql(own_journal, "SELECT last_position, body FROM kvl_records ORDER BY last_position DESC LIMIT 1")[0]
    parts = unpack_record(bytes(body))
    block = parts.data[:parts.event_lengths[0]]
    m, digests = read(block)
    n = m.shape[1]
    if forge == "counter":
        m[27, 10] += 1  # the publish txn's counter, as a difference from the step before
    else:
        assert m[2, 10] != m[1, 10]
        m[2, 10] = m[1, 10]  # the publish txn's prefix: the operation ids' instead
    forged = pack([(tuple(v), digests[32 * i:32 * i + 32] if v[18] else None) for i, v in enumerate(m.T.tolist())])
    assert len(forged) == len(block) and n == 64
    data = forged + parts.data[len(block):]
    stored = pack_record(msgspec.structs.replace(parts, event_crcs=[zlib.crc32(forged), *parts.event_crcs[1:]],
                                                 data=data))
    sql(own_journal, "UPDATE kvl_records SET body = :b WHERE last_position = :p", b=stored, p=last)
    with open_journal(own_journal) as journal:
        errors = []
        for items in (journal.read_all(), journal.read_fold()):
            p = Projector()
            with pytest.raises(KvLedgerError) as err:
                p.feed(items)
            errors.append((err.value.code, err.value.message, p.position))
    assert errors[0] == errors[1]
    assert errors[0][0].value == "CORRUPT_JOURNAL" and errors[0][2] == last - 3 * (64 - 10)


def test_a_replay_leaves_its_projection_to_the_oldest_generation(journals, monkeypatch):
    """After the fold and the report the collector is on again, and what they made is in
    the oldest generation: the next allocations start no young pass over it."""
    import gc

    from kvledger.journal import tuning
    from kvledger.replay.run import replay_journal

    passes: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            passes.append(info["generation"])

    # the fixture's demo made a Worker, which froze this process's start-up heap
    # (tuning.freeze_heap); a replay-only process has none, which is the case tested here
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    monkeypatch.setattr(tuning, "_frozen", False)
    monkeypatch.setattr(tuning, "_host_frozen", False)
    try:
        with open_journal(journals) as journal:
            assert gc.isenabled()
            report = replay_journal(journal, WINDOW)
            gc.callbacks.append(seen)
            try:
                made = [(i,) for i in range(100)]  # a young pass starts once 700 allocations wait
            finally:
                gc.callbacks.remove(seen)
        assert gc.isenabled() and passes == [] and len(made) == 100
        young = {id(x) for x in gc.get_objects(0)}
        assert report.handles and not any(id(h) in young or id(h.copy_tiers) in young for h in report.handles)
    finally:
        if frozen:
            gc.freeze()
