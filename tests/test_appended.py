"""A handle's outputs grow without copying: engine.state.Appended and `appended`.

Each version must read, compare, hash, pickle and encode as the tuple it stands for,
whatever order versions are grown in (a decision that is refused and decided again
grows an older version a second time), and a fold or a decision over a long sequence
must share one storage instead of copying it every step."""

from __future__ import annotations

import pickle
import threading

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.engine.state import SHARED_FROM, Appended, appended, enc_hook

# A history: each step grows version `parent` (an index into the versions so far, 0 being
# the start) by some items.
steps = st.lists(st.tuples(st.integers(0, 40), st.lists(st.integers(-3, 3), max_size=3).map(tuple)),
                 max_size=40)


@settings(max_examples=300, deadline=None)
@given(long=st.booleans(), start=st.lists(st.integers(-3, 3), max_size=4).map(tuple), history=steps)
def test_every_version_is_the_tuple_it_stands_for(long, start, history):
    """From a short start (tuples, copied) or one just below SHARED_FROM (shared views
    after the first appends), and across the switch from one to the other."""
    if long:
        start = (9,) * (SHARED_FROM - 2) + start
    versions: list = [start]
    model: list[tuple[int, ...]] = [start]
    for parent, items in history:
        i = parent % len(versions)
        versions.append(appended(versions[i], items))
        model.append(model[i] + items)
    for v, m in zip(versions, model):
        assert len(v) == len(m) and tuple(v) == m and list(v) == list(m)
        assert v == m and m == v and hash(v) == hash(m)
        assert v[:2] == m[:2] and v[1:-1] == m[1:-1] and v[::-1] == m[::-1]
        if m:
            assert v[-1] == m[-1] and v[0] == m[0]
        assert (5, *m) == (5,) + v and v + (5,) == (*m, 5)
        assert repr(v) == repr(m) and bool(v) == bool(m)
        assert pickle.loads(pickle.dumps(v)) == m
        assert msgspec.msgpack.encode(v, enc_hook=enc_hook) == msgspec.msgpack.encode(m)
    for a, ma in zip(versions, model):  # versions compare with each other as their tuples do
        for b, mb in zip(versions[-5:], model[-5:]):
            assert (a == b) == (ma == mb)


def test_out_of_range_reads_fail_as_a_tuples_do():
    n = SHARED_FROM + 1
    v = appended(tuple(range(n - 1)), (3,))
    assert isinstance(v, Appended) and len(v) == n
    for i in (n, -n - 1):
        try:
            v[i]
        except IndexError:
            pass
        else:
            raise AssertionError(f"index {i} read past the version")
    assert appended(v, (4,))[n] == 4 and len(v) == n  # the older version does not see it


def test_a_straight_line_of_appends_shares_one_storage():
    short = appended((), (0,))
    assert type(short) is tuple  # below SHARED_FROM a tuple is copied
    start = tuple(range(SHARED_FROM))
    v = first = appended(start, (-1,))
    for i in range(1000):
        v = appended(v, (i,))
    assert isinstance(v, Appended) and v._items is first._items
    assert tuple(v) == (*start, -1, *range(1000))
    again = appended(first, (7,))  # the first version grown once more: a copy, the others unchanged
    assert again._items is not first._items and tuple(again) == (*start, -1, 7) and v[SHARED_FROM + 1] == 0


def test_threads_growing_one_version_each_get_their_own():
    base = appended((0,) * SHARED_FROM, (0,))
    got: dict[int, tuple[int, ...]] = {}
    barrier = threading.Barrier(8)

    def grow(k: int) -> None:
        barrier.wait()
        v = base
        for _ in range(200):
            v = appended(v, (k,))
        got[k] = tuple(v)

    threads = [threading.Thread(target=grow, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {k: (0,) * (SHARED_FROM + 1) + (k,) * 200 for k in range(8)}
    assert tuple(base) == (0,) * (SHARED_FROM + 1)


def test_a_long_fold_and_a_long_decision_share_their_outputs(tmp_path):
    """Projector._step and the batch path each keep one storage a handle over a long
    run: the states of the last steps are views of the same list."""
    from kvledger.engine.service import CommandService
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.replay.projector import Projector
    from kvledger.replay.sources import fold_items

    from bench.tokens import Lockstep

    with open_or_create_journal(f"sqlite:///{tmp_path}/long.db") as j:
        service = CommandService(j)
        group = Lockstep(service, 2, 300, "long")
        decided = []
        for _ in range(300):
            group.step()
            decided.append(service.states[group.handles[0]])
        p = Projector()
        folded = []
        for item in fold_items(j):
            p.feed((item,))
            s = p.handles.get(group.handles[0])
            if s is not None and len(s.outputs) >= 250:
                folded.append(s)
    for states in (decided[-50:], folded):
        assert len(states) >= 50
        assert len({id(s.outputs._items) for s in states}) == 1
        assert len({id(s.output_ns._items) for s in states}) == 1
    assert tuple(decided[-1].outputs) == tuple(p.handles[group.handles[0]].outputs)
    assert len(decided[-1].outputs) == 300


def test_outputs_and_their_times_grow_together():
    """`grown` (every append site's): tuples while short, shared views from SHARED_FROM
    on, equal to the tuples all along; a cut (a slice: a tuple again) grows on."""
    from kvledger.engine.state import grown

    outputs, times = (), ()
    model: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    kept = []
    for i in range(300):
        outputs, times = grown(outputs, times, (i % 7,), (10 * i,))
        model = (model[0] + (i % 7,), model[1] + (10 * i,))
        assert (outputs, times) == model
        assert type(outputs) is (tuple if i < SHARED_FROM else Appended)
        kept.append((outputs, times))
    assert len({id(o._items) for o, _ in kept[SHARED_FROM:]}) == 1
    assert len({id(t._items) for _, t in kept[SHARED_FROM:]}) == 1
    cut = (outputs[:200], times[:200])
    outputs, times = grown(*cut, (1, 2), (3, 4))
    assert (outputs, times) == (model[0][:200] + (1, 2), model[1][:200] + (3, 4))
    assert all(tuple(o) == model[0][:len(o)] for o, _ in kept)  # the older versions are untouched
