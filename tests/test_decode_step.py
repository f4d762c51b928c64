"""engine.decode_step, the one-call decision of a plain decode chain, against the general
path (decide and evolve step by step): for generated states and chains, including every
way a field can be off, the fast path either declines or gives the general path's
events, state and operation field for field; it never accepts what the general path
refuses. And it is taken for the plain chain, so the comparison means something."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger import Ledger
from kvledger.engine import commands as c
from kvledger.engine.decide import full_layers
from kvledger.engine.decode_step import decode_step
from kvledger.engine.ids import seeded
from kvledger.engine.service import CommandService, ManualClock
from kvledger.engine.state import HandleState, OpenTxn
from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.decode_fingerprint import decode_chain_fingerprint
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.events import ForwardCall

from lane_helpers import fixed_commit_time, fresh_url, same_ids
from lifecycle_helpers import allocate, emit
from stored_rows import assert_row_rebuilds

H = "h-decode"
DIGEST = "ab" * 32


@pytest.fixture(scope="module")
def journal(tmp_path_factory):
    with open_or_create_journal(f"sqlite:///{tmp_path_factory.mktemp('decode')}/j.db") as j:
        yield j


@pytest.fixture(scope="module")
def states(journal) -> list[HandleState]:
    """Real states of one handle as a ledger leaves them: after its prefill started, and
    after each of a few decode steps started (the states a decode chain meets)."""
    ledger = Ledger(journal)
    allocate(ledger, H, capacity=12)
    s = ledger.state(H)
    b = (s.generation, s.snapshot_version)
    ledger.begin_append(H, txn_id="t0", kind="prefill", base=b, start=0, token_ids=s.prompt)
    out = [ledger.state(H)]
    ledger.publish(H, txn_id="t0", base=b)
    for i in range(1, 4):
        emit(ledger, H, 100 + i)
        s = ledger.state(H)
        b = (s.generation, s.snapshot_version)
        ledger.begin_append(H, txn_id=f"t{i}", kind="decode", base=b, start=s.committed_length,
                            token_ids=(s.outputs[-1],))
        out.append(ledger.state(H))
        ledger.publish(H, txn_id=f"t{i}", base=b)
    return out


def _plain(s: HandleState, token: int) -> c.Chain:
    t = s.open_txns[0]
    at = t.interval_start + t.interval_count
    return c.Chain(handle_id=s.handle_id, steps=(
        c.Publish(handle_id=s.handle_id, txn_id=t.txn_id, base_generation=s.generation,
                  base_snapshot_version=s.snapshot_version, rows_sha256=DIGEST),
        c.EmitOutput(handle_id=s.handle_id, base_generation=None, base_snapshot_version=None,
                     output_index=len(s.outputs), token_id=token),
        c.BeginAppend(handle_id=s.handle_id, txn_id=f"next-{at}", kind="decode", base_generation=None,
                      base_snapshot_version=None, interval_start=at, interval_count=1, token_ids=(token,),
                      cache_positions=(at,), mask_key_extent=at + 1, cache_abi_sha256=s.cache_abi_sha256),
    ))


def _plan(journal, fast: bool, s: HandleState, chain: c.Chain):
    """(events, states, operation, local sequence) or the general path's refusal; ids
    are seeded, so two calls agree unless their decisions do."""
    service = CommandService(journal, clock=ManualClock().at(7.5), fast_decode=fast)
    with seeded("decode-step"):
        try:
            plan = service._plan(chain, "op-1", {s.handle_id: s})
        except KvLedgerError as exc:
            return ("refused", exc.code, exc.message)
    # The lane marks the worker's form derived: a format 4 record stores no fingerprint
    # for it, and readers rebuild it from the events (schemas.decode_fingerprint).
    if plan.op.derived:
        assert decode_chain_fingerprint(*plan.events) == plan.op.fingerprint, chain
    # The lane marks its events stamped: a record stores them as a step row on the word
    # that their relations hold, which the row's rebuild checks here.
    assert fast or not plan.op.stamped  # only the lane stamps
    if plan.op.stamped and plan.op.derived:
        assert_row_rebuilds(plan.op)
    plain = msgspec.structs.replace(plan.op, derived=False, stamped=False)
    return (plan.events, plan.states, plain, service.local_sequence)


def test_the_plain_chain_takes_the_fast_path_and_equals_the_general_one(journal, states):
    for s in states:
        chain = _plain(s, 4242)
        assert decode_step(s, chain, 1) is not None
        fast, general = _plan(journal, True, s, chain), _plan(journal, False, s, chain)
        assert fast[0] and fast == general
        events, after, op, _ = fast
        assert [e.event_type for e in events] == ["append_publish", "output_emit", "append_start"]
        assert op.fingerprint == chain.fingerprint() == decode_chain_fingerprint(*events)
        assert after[H].stream_position == s.stream_position + 3
        assert op.writes[0].expected.stream_position == s.stream_position


FIELDS = 40  # more than the fields `cases` may move off the plain chain


@st.composite
def cases(draw, states: list[HandleState]):
    # At most two fields off the plain case at once: with each field off independently,
    # nearly every example would be off in many ways and the fast path never taken.
    off_set = draw(st.sets(st.integers(0, FIELDS - 1), max_size=2))
    field = iter(range(FIELDS))

    def _off(draw, right, *wrong):
        """`right`, or one of the wrong values when this field is one of those moved off."""
        return draw(st.sampled_from(wrong)) if next(field) in off_set else right

    s = draw(st.sampled_from(states))
    t = s.open_txns[0]
    g, v, at = s.generation, s.snapshot_version, t.interval_start + t.interval_count
    token = draw(st.integers(0, 50_000))
    # the state, possibly moved off the plain case
    s = msgspec.structs.replace(
        s,
        lifecycle=_off(draw, s.lifecycle, "FINISHED", "CANCELLED", "RELEASED"),
        reserved_capacity=_off(draw, s.reserved_capacity, at, at + 1, at - 1),
        aborted_txn_ids=_off(draw, s.aborted_txn_ids, ("next",), ("gone",)),
        open_txns=_off(draw, s.open_txns, (), (*s.open_txns, OpenTxn("x", "decode", v, at, 1, (1,))),
                       (msgspec.structs.replace(t, kind="verify"),), (msgspec.structs.replace(t, kind="repair"),),
                       (msgspec.structs.replace(t, base_snapshot_version=v - 1),)),
        outputs=_off(draw, s.outputs, s.outputs + (9,), s.outputs[:-1]),
    )
    publish = c.Publish(
        handle_id=_off(draw, H, "other"), txn_id=_off(draw, t.txn_id, "nope", "next"),
        base_generation=_off(draw, g, None, g + 1), base_snapshot_version=_off(draw, v, None, v - 1, v + 1),
        layers=_off(draw, None, full_layers(s.num_layers, t.interval_start, t.interval_count)),
        accepted_count=_off(draw, None, t.interval_count, 0),
        rows_sha256=_off(draw, DIGEST, None), workspace_bytes=_off(draw, 0, 64),
        operation_id=_off(draw, None, "inner-p"))
    emit_ = c.EmitOutput(
        handle_id=_off(draw, H, "other"), base_generation=_off(draw, None, g, g + 1),
        base_snapshot_version=_off(draw, None, v + 1, v), output_index=_off(draw, len(s.outputs), len(s.outputs) + 1),
        token_id=token, operation_id=_off(draw, None, "inner-e"))
    start = c.BeginAppend(
        handle_id=_off(draw, H, "other"), txn_id=_off(draw, "next", t.txn_id, "gone"),
        kind=_off(draw, "decode", "chunk", "repair", "verify", "prefill"),
        base_generation=_off(draw, None, g, g + 1), base_snapshot_version=_off(draw, None, v + 1, v),
        interval_start=_off(draw, at, at + 1, at - 1), interval_count=_off(draw, 1, 2),
        token_ids=_off(draw, (token,), (token + 1,), (token, token)), cache_positions=_off(draw, (at,), (at + 1,)),
        mask_key_extent=_off(draw, at + 1, at), cache_abi_sha256=_off(draw, s.cache_abi_sha256, "", "cd" * 32),
        operation_id=_off(draw, None, "inner-s"),
        call=_off(draw, None, ForwardCall(call_id="call-1", index=2, size=4, new_pad=1, key_extent=at + 1, threads=2)))
    steps = _off(draw, (publish, emit_, start), (publish, emit_), (publish, start, emit_),
                 (publish, emit_, start, start))
    return s, c.Chain(handle_id=_off(draw, H, "other"), steps=steps)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_fast_path_never_differs_from_the_general_one(journal, states, data):
    s, chain = data.draw(cases(states))
    fast, general = _plan(journal, True, s, chain), _plan(journal, False, s, chain)
    decided = decode_step(s, chain, 1)
    if decided is not None:
        assert general[0] != "refused", f"the fast path accepted what the general one refuses: {general}"
    assert fast == general  # and where the lane marks a fingerprint derived, _plan checked the rebuild


def _prefilling(journal, fast: bool, at_ms: float, strict: bool = False) -> tuple[Ledger, CommandService]:
    """A ledger whose service takes the fast path or not (and validates commands, as the
    public Ledger's does, or not), with H allocated and its prefill started."""
    ledger = Ledger(journal)
    service = ledger.service = CommandService(journal, clock=ManualClock().at(at_ms), fast_decode=fast,
                                              strict=strict)
    allocate(ledger, H, capacity=40)
    s = ledger.state(H)
    ledger.begin_append(H, txn_id="t0", kind="prefill", base=(s.generation, s.snapshot_version), start=0,
                        token_ids=s.prompt)
    return ledger, service


@pytest.mark.parametrize("strict", [False, True])
def test_the_ledger_journal_is_the_same_with_and_without_the_fast_path(tmp_path, strict):
    """Whole runs through the journal: the same commands, fast path on and off, give the
    same exported events (ids and clocks are seeded and manual)."""
    exports = []
    for fast in (True, False):
        url = f"sqlite:///{tmp_path}/{fast}.db"
        with open_or_create_journal(url) as journal, seeded("run"):
            ledger, service = _prefilling(journal, fast, 1.0, strict)
            general = []
            real_plan = service._plan
            service._plan = lambda *a, general=general, real_plan=real_plan: (general.append(a), real_plan(*a))[1]
            for i in range(30):
                s = ledger.state(H)
                [r] = service.execute_many([c.Relative(_plain(s, 7 * i))])
                assert not isinstance(r, Exception)
            assert len(general) == (0 if fast else 30)  # the lane took every chain, validated or not
            exports.append(list(journal.read_all()))
    assert len(exports[0]) == 2 + 30 * 3
    assert exports[0] == exports[1]


@pytest.mark.parametrize("strict", [False, True])
def test_relative_chains_the_fast_lane_declines_decide_as_the_general_path_does(tmp_path, strict):
    """Relative chains off the plain case (a wrong output index, an unknown handle, a caller's
    operation id, a chain of two steps; with a validating service, as the public Ledger's
    is, also a malformed token id), each after a plain one, through execute_many with the
    fast lane on and off: the same results, word for word, and the same journal."""
    runs = []
    shapes = ("wrong_index", "unknown") + (("bad_token",) if strict else ()) + ("own_id", "two_steps")
    for fast in (True, False):
        with open_or_create_journal(f"sqlite:///{tmp_path}/{fast}.db") as journal, seeded("lanes"):
            ledger, service = _prefilling(journal, fast, 2.0, strict)
            results = []
            for i, shape in enumerate(shapes):
                s = ledger.state(H)
                plain = _plain(s, 11 + i)
                off = {
                    "wrong_index": msgspec.structs.replace(plain, steps=(
                        plain.steps[0], msgspec.structs.replace(plain.steps[1], output_index=9), plain.steps[2])),
                    "unknown": msgspec.structs.replace(plain, handle_id="nobody", steps=tuple(
                        msgspec.structs.replace(x, handle_id="nobody") for x in plain.steps)),
                    "own_id": msgspec.structs.replace(plain, operation_id=f"caller-{i}"),
                    "two_steps": msgspec.structs.replace(plain, steps=plain.steps[:2]),
                    "bad_token": msgspec.structs.replace(plain, steps=(
                        plain.steps[0], msgspec.structs.replace(plain.steps[1], token_id=-1), plain.steps[2])),
                }[shape]
                for r in service.execute_many([c.Relative(off)]):
                    results.append((r.code, r.message) if isinstance(r, KvLedgerError) else r.event_ids)
                if shape in ("wrong_index", "unknown", "bad_token"):
                    [r] = service.execute_many([c.Relative(_plain(ledger.state(H), 11 + i))])
                    results.append(r.event_ids)
            runs.append((results, list(journal.read_all())))
    assert runs[0] == runs[1]
    codes = [r[0] for r in runs[0][0] if isinstance(r[0], str) and r[0].isupper()]
    # the wrong index and the unknown handle are refused; the bad token id too, if validated
    assert len(codes) == 2 + strict


def test_the_lane_hands_the_journal_a_steps_values_and_the_journal_is_the_same(backend, tmp_path, request,
                                                                              monkeypatch):
    """The decode lane gives the journal a step's values (Operation.step) instead of its
    three events when ids are engine.ids' own (not seeded): the same commands with the
    values on and off write the same tables row for row, return the same receipts, and
    show on_commit hooks the same events. Digests and model calls vary, so every field a
    row stores is exercised; and the values are really taken (counted below)."""
    from kvledger.engine import ids

    from stored_rows import dump

    fixed_commit_time(monkeypatch)
    runs = []
    for values in (True, False):
        same_ids(monkeypatch)
        url = fresh_url(backend, tmp_path, request, f"values-{values}")
        with open_or_create_journal(url) as journal:
            ledger = Ledger(journal)
            service = ledger.service = CommandService(journal, clock=ManualClock().at(3.0), step_values=values)
            hooked: list = []
            service.on_commit.append(lambda r, events, hooked=hooked: hooked.append((r, list(events))))
            taken: list[bool] = []
            journal.append = lambda ops, taken=taken, append=journal.append: (  # type: ignore[method-assign]  # watch
                taken.extend(op.step is not None for op in ops), append(ops))[1]
            allocate(ledger, H, capacity=40)
            s = ledger.state(H)
            ledger.begin_append(H, txn_id=ids.new_id(), kind="prefill", base=(s.generation, s.snapshot_version),
                                start=0, token_ids=s.prompt)
            for i in range(24):
                s = ledger.state(H)
                chain = _plain(s, 5 + 3 * i)
                publish, emit_, start = chain.steps
                at = start.interval_start
                start = msgspec.structs.replace(start, txn_id=ids.new_id(), call=(
                    ForwardCall(ids.new_id(), i, 4, 8, at + 1, 2) if i % 3 == 1 else None))
                publish = msgspec.structs.replace(publish, rows_sha256=None if i % 3 == 0 else f"{i:064x}")
                service.clock.at(3.0 + i / 7)
                [r] = service.execute_many([c.Relative(msgspec.structs.replace(chain, steps=(publish, emit_, start)))])
                assert not isinstance(r, Exception), r
            runs.append((dump(url), hooked, list(journal.read_all()), sum(taken)))
    (tables, hooked, events, with_values), (tables_off, hooked_off, events_off, without) = runs
    assert with_values == 24 and without == 0  # the first publishes the prefill, in the same form
    assert tables == tables_off and hooked == hooked_off and events == events_off
    assert len(events) == 2 + 24 * 3


_ids = st.text(min_size=1, max_size=12)  # quotes, backslashes, controls, any unicode: all escaped alike
_ints = st.integers(min_value=0, max_value=2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(h=_ids, txn=_ids, nxt=_ids, abi=_ids, g=_ints, v=_ints, ws=_ints, out=_ints, token=_ints,
       at=st.integers(min_value=0, max_value=2**62), rows=st.none() | _ids,
       call=st.none() | st.builds(ForwardCall, _ids, _ints, _ints, _ints, _ints, _ints))
def test_a_steps_fingerprint_from_its_values_is_the_chains(h, txn, nxt, abi, g, v, ws, out, token, at, rows, call):
    """schemas.decode_fingerprint.step_fingerprint spells out a decode chain's canonical
    JSON: it equals Chain.fingerprint() of the bound chain for any ids and numbers."""
    from kvledger.schemas.decode_fingerprint import step_fingerprint

    chain = c.Chain(handle_id=h, steps=(
        c.Publish(handle_id=h, txn_id=txn, base_generation=g, base_snapshot_version=v, rows_sha256=rows,
                  workspace_bytes=ws),
        c.EmitOutput(handle_id=h, base_generation=None, base_snapshot_version=None, output_index=out,
                     token_id=token),
        c.BeginAppend(handle_id=h, txn_id=nxt, kind="decode", base_generation=None, base_snapshot_version=None,
                      interval_start=at, interval_count=1, token_ids=(token,), cache_positions=(at,),
                      mask_key_extent=at + 1, cache_abi_sha256=abi, call=call)))
    assert step_fingerprint(h, txn, g, v, ws, rows, out, token, nxt, at, abi, call) == chain.fingerprint()
