"""The batch fold against its definition: random decode batches, folded as stored (each
record's block of steps as columns, held and folded a slice at a time by replay.runs)
and folded as their events one by one (engine.evolve and the projector's hooks, the
general path), leave the same projection and the same report.

Groups of handles of random sizes and layer counts decode in lockstep, one DecodeBatch
a group a step, in a random order of groups, with new groups allocated and prefilled
between them (events that settle and flush held runs), on a clock that moves forward,
stands still or steps back; the slice bound is drawn too, so that held runs are cut at
every place. A replay resumed at a random position, inside a step included, ends in
the same state.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.engine.service import CommandService, ManualClock
from kvledger.journal import open_journal
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import runs
from kvledger.replay.metrics import WindowSpec
from kvledger.replay.projector import Projector
from kvledger.replay.report import build, to_json

from bench.tokens import Lockstep

WINDOW = WindowSpec(slo_ttft_ns=10**7, slo_tbt_ns=10**6, width_ns=10**6)
_examples = itertools.count()


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """An empty journal's file, copied for each example: creating one is far slower."""
    path = tmp_path_factory.mktemp("batch_fold") / "template.db"
    open_or_create_journal(f"sqlite:///{path}").close()
    return path


def _same(a: Projector, b: Projector) -> None:
    assert a.snapshot() == b.snapshot()
    assert a.position == b.position and a.last_event_id == b.last_event_id
    assert to_json(build(a, WINDOW)) == to_json(build(b, WINDOW))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups=st.lists(st.tuples(st.integers(1, 5), st.sampled_from((1, 2, 32))), min_size=1, max_size=3),
       plan=st.lists(st.tuples(st.integers(0, 2), st.integers(-3, 20)), min_size=1, max_size=24),
       slice_steps=st.sampled_from((1, 3, 8, 4096)), cut=st.integers(0, 1 << 20))
def test_decode_batches_fold_as_their_events(template, groups, plan, slice_steps, cut):
    copy = template.with_name(f"example-{next(_examples)}.db")
    shutil.copy(template, copy)
    clock = ManualClock().at(1.0)
    with open_journal(f"sqlite:///{copy}") as journal:
        service = CommandService(journal, clock=clock)
        made: dict[int, Lockstep] = {}
        ms = 1.0
        for g, dt in plan:
            ms = max(0.0, ms + dt)  # dt < 0: the clock steps back, 0: it stands still
            clock.at(ms)
            g %= len(groups)
            if g not in made:  # allocations and prefill starts between the batches
                batch, layers = groups[g]
                made[g] = Lockstep(service, layers, len(plan) + 1, f"g{g}", batch=batch)
            else:
                made[g].step()
        events = list(journal.read_all())
        whole = Projector().feed(events)
        bound = runs._SLICE
        runs._SLICE = slice_steps
        try:
            _same(whole, Projector().feed(journal.read_fold()))
            at = cut % (len(events) + 1)
            resumed = Projector().feed(events[:at])
            _same(whole, resumed.feed(journal.read_fold(after=at)))
        finally:
            runs._SLICE = bound
