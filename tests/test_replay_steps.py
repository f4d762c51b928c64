"""A decode step read back whole (record format 6's StepValues) is folded at once by the
projector (Projector._step); the result must be what its three events give one by one.

Over whole journals on both backends (the demo, which holds prefills, decode steps,
finishes and releases, and 64 handles decoding in lockstep): the projection state after
`read_fold` equals the one after `read_all`, and so does every report built from it
(ledgers, byte-time, peaks and where they were reached, service metrics); a replay
resumed from any position, inside a step included, ends in the same state; a projector
that has not seen a step's handle fails the same way on both paths.
"""

from __future__ import annotations

import pytest

from kvledger.journal import open_journal
from kvledger.journal.steps import StepValues
from kvledger.replay.metrics import WindowSpec
from kvledger.replay.projector import Projector
from kvledger.replay.report import build, to_json
from kvledger.replay.sources import fold_items
from kvledger.schemas.errors import KvLedgerError

from stored_rows import cli

WINDOW = WindowSpec(slo_ttft_ns=10**7, slo_tbt_ns=10**6, width_ns=10**6)


@pytest.fixture
def journals(db_url, capsys):
    """The url of a journal holding the demo's requests and a lockstep decode."""
    from kvledger.engine.service import CommandService

    from bench.tokens import Lockstep

    code, _, err = cli(capsys, "demo", "--requests", "3", "--db", db_url, "--json")
    assert code == 0, err
    with open_journal(db_url) as journal:
        run = Lockstep(CommandService(journal), 4, 8, "fold")
        for _ in range(6):
            run.step()
    return db_url


def _same(a: Projector, b: Projector) -> None:
    assert a.snapshot() == b.snapshot()
    assert a.position == b.position and a.last_event_id == b.last_event_id
    assert to_json(build(a, WINDOW)) == to_json(build(b, WINDOW))


def test_a_fold_of_whole_steps_is_the_fold_of_their_events(journals):
    with open_journal(journals) as journal:
        items = list(journal.read_fold())
        steps = sum(type(x) is StepValues for x in items)
        assert steps >= 6 * 64  # the lockstep's steps came whole, and the demo's
        by_events = Projector().feed(journal.read_all())
        by_steps = Projector().feed(items)
        _same(by_events, by_steps)
        # and item by item (a step leaves no workspace behind, as its emit does not)
        a, b = Projector(), Projector()
        events = iter(journal.read_all())
        for item in items[:400]:
            b.feed((item,))
            a.feed(next(events) for _ in range(3 if type(item) is StepValues else 1))
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
        first_step = next(x for x in journal.read_fold() if type(x) is StepValues)
        for cut in (first_step.global_position - 1, first_step.global_position, first_step.global_position + 1,
                    first_step.global_position + 2, len(events) // 2, len(events) - 4):
            p = Projector().feed(events[:cut])
            p.feed(journal.read_fold(after=cut))
            _same(whole, p)


def test_a_step_whose_handle_the_fold_has_not_seen_fails_as_its_event_does(journals):
    with open_journal(journals) as journal:
        step = next(x for x in journal.read_fold() if type(x) is StepValues)
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
        for after in [*range(0, 40), *range(40, last + 1, 7), last]:
            expanded = [e for x in journal.read_fold(after)
                        for e in (x.events() if type(x) is StepValues else (x,))]
            assert expanded == list(journal.read_all(after)), after
