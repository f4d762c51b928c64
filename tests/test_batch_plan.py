"""One decode step of a DecodeBatch against its chain on the general path.

engine.decide_batch decides a plain step column-wise (decide_batch.plain_after) and
engine.batch_plan turns it into the journal's Operation with step values. Here, over real
states of a handle moved off in every way a step can meet one (a lifecycle, capacity,
aborted txn, open append, output count off) and steps moved off in every column a batch
carries: a plain decision leaves exactly the state the general path (engine.chain:
decide and evolve) leaves, and any other is the general path's own, refusal for refusal;
the plain step is taken for the plain case, so the comparison means something; and a
plain step's operation has its chain's fingerprint, guard and head, and its values
rebuild the events the general path stamps, id for id. The same over a journal, batch
against chains, is tests/test_decide_batch.py.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger import Ledger
from kvledger.engine import commands as c
from kvledger.engine import ids
from kvledger.engine.batch_plan import plan_step
from kvledger.engine.chain import general_after
from kvledger.engine.decide_batch import decide_batch
from kvledger.engine.heads import guard, head
from kvledger.engine.service import CommandService, ManualClock
from kvledger.engine.state import HandleState, OpenTxn
from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.decode_batch import BatchBuilder, DecodeBatch
from kvledger.schemas.decode_fingerprint import decode_chain_fingerprint
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.events import ForwardCall

from lifecycle_helpers import allocate, emit

H = "h-decode"
DIGEST = "ab" * 32
MONO = 7_500_000


@pytest.fixture(scope="module")
def journal(tmp_path_factory):
    with open_or_create_journal(f"sqlite:///{tmp_path_factory.mktemp('decode')}/j.db") as j:
        yield j


@pytest.fixture(scope="module")
def states(journal) -> list[HandleState]:
    """Real states of one handle as a ledger leaves them: after its prefill started, and
    after each of a few decode steps started (the states a decode step meets)."""
    ledger = Ledger(journal)
    allocate(ledger, H, capacity=12)
    s = ledger.state(H)
    b = (s.generation, s.snapshot_version)
    ledger.begin_append(H, txn_id=f"{'7a' * 8}{0:016x}", kind="prefill", base=b, start=0, token_ids=s.prompt)
    out = [ledger.state(H)]
    ledger.publish(H, txn_id=f"{'7a' * 8}{0:016x}", base=b)
    for i in range(1, 4):
        emit(ledger, H, 100 + i)
        s = ledger.state(H)
        b = (s.generation, s.snapshot_version)
        ledger.begin_append(H, txn_id=f"{'7a' * 8}{i:016x}", kind="decode", base=b, start=s.committed_length,
                            token_ids=(s.outputs[-1],))
        out.append(ledger.state(H))
        ledger.publish(H, txn_id=f"{'7a' * 8}{i:016x}", base=b)
    return out


def _plain(s: HandleState, token: int, **change: object) -> DecodeBatch:
    """The plain step on `s` as a one-step batch, with some of its values changed."""
    t = s.open_txns[0]
    at = t.interval_start + t.interval_count
    step: dict[str, object] = dict(
        handle_id=s.handle_id, txn_id=t.txn_id, position=at, output_index=len(s.outputs), token=token,
        next_txn_id=f"{'7b' * 8}{at:016x}", rows_sha256=DIGEST, cache_abi_sha256=s.cache_abi_sha256,
        workspace_bytes=0, base=None, call=None)
    step.update(change)
    batch = BatchBuilder()
    detail = {k: step.pop(k) for k in ("workspace_bytes", "base", "call")}
    batch.detail(batch.add(**step), **detail)  # type: ignore[arg-type]  # the fields of add and detail, by name
    return batch.build()


def _general(s: HandleState, batch: DecodeBatch) -> dict[str, HandleState] | tuple[str, str]:
    try:
        return general_after({s.handle_id: s}, c.batch_step(batch, 0), MONO)
    except KvLedgerError as exc:
        return (exc.code.value, exc.message)


def test_the_plain_step_is_decided_plain_and_leaves_the_general_paths_state(states):
    for s in states:
        for base in (None, (s.generation, s.snapshot_version)):
            batch = _plain(s, 4242, base=base)
            decided = decide_batch(batch, {H: s}, MONO)
            after = decided.plain[0]
            assert after is not None and decided.refused == [None]
            assert _general(s, batch) == {H: after}
            assert after.stream_position == s.stream_position + 3 and after.outputs == (*s.outputs, 4242)


FIELDS = 24  # more than the fields `cases` may move off the plain step


@st.composite
def cases(draw, states: list[HandleState]) -> tuple[HandleState, DecodeBatch]:
    # At most two fields off the plain case at once: with each field off independently,
    # nearly every example would be off in many ways and the plain decision never taken.
    off_set = draw(st.sets(st.integers(0, FIELDS - 1), max_size=2))
    field = iter(range(FIELDS))

    def _off(right, *wrong):
        """`right`, or one of the wrong values when this field is one of those moved off."""
        return draw(st.sampled_from(wrong)) if next(field) in off_set else right

    s0 = draw(st.sampled_from(states))
    t = s0.open_txns[0]
    g, v, at = s0.generation, s0.snapshot_version, t.interval_start + t.interval_count
    token = draw(st.integers(0, 50_000))
    nxt = f"{'7b' * 8}{at:016x}"
    batch = _plain(
        s0, token,
        handle_id=_off(H, "other"), txn_id=_off(t.txn_id, "nope", nxt),
        base=_off(None, (g, v), (g + 1, v), (g, v - 1), (g, v + 1)),
        rows_sha256=_off(DIGEST, None), workspace_bytes=_off(0, 64),
        output_index=_off(len(s0.outputs), len(s0.outputs) + 1, max(len(s0.outputs) - 1, 0)),
        next_txn_id=_off(nxt, t.txn_id, "gone"),
        position=_off(at, at + 1, at - 1),
        cache_abi_sha256=_off(s0.cache_abi_sha256, "", "cd" * 32),
        call=_off(None, ForwardCall(call_id="call-1", index=2, size=4, new_pad=1, key_extent=at + 1, threads=2)))
    s = msgspec.structs.replace(
        s0,
        lifecycle=_off(s0.lifecycle, "FINISHED", "CANCELLED", "RELEASED"),
        reserved_capacity=_off(s0.reserved_capacity, at, at + 1, at - 1),
        aborted_txn_ids=_off(s0.aborted_txn_ids, (nxt,), ("gone",)),
        open_txns=_off(s0.open_txns, (), (*s0.open_txns, OpenTxn("x", "decode", v, at, 1, (1,))),
                       (msgspec.structs.replace(t, kind="verify"),), (msgspec.structs.replace(t, kind="repair"),),
                       (msgspec.structs.replace(t, base_snapshot_version=v - 1),)),
        outputs=_off(s0.outputs, s0.outputs + (9,), s0.outputs[:-1]),
    )
    return s, batch


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_step_is_decided_as_the_general_path_decides_its_chain(states, data):
    s, batch = data.draw(cases(states))
    decided = decide_batch(batch, {H: s}, MONO)
    general = _general(s, batch)
    if decided.plain[0] is not None:
        assert general == {batch.handle_ids[0]: decided.plain[0]}, "the plain decision differs from the general"
    elif decided.refused[0] is not None:
        assert general == (decided.refused[0].code.value, decided.refused[0].message)
    else:
        assert isinstance(general, dict)


def test_a_plain_steps_operation_is_its_chains(journal, states, monkeypatch):
    """plan_step against the general path's plan of the same chain, ids drawn from the
    same counter: the values rebuild the stamped events, id for id; the fingerprint is the
    chain's; the write is guarded by the state decided against and leaves its head."""
    for k, s in enumerate(states):
        for rows, call in ((DIGEST, None), (None, ForwardCall(f"{'c1' * 8}{k:016x}", 0, 2, 1, 9, 1))):
            batch = _plain(s, 300 + k, rows_sha256=rows, call=call, workspace_bytes=64 * k)
            [after] = decide_batch(batch, {H: s}, MONO).plain
            assert after is not None
            service = CommandService(journal, clock=ManualClock().at(MONO / 1e6), local_sequence=40)
            monkeypatch.setattr(ids, "_prefix", "5eed0000000000aa")
            monkeypatch.setattr(ids, "_counter", itertools.count(1 << 40))
            op = plan_step(s, batch, 0, service.local_sequence, service.source_instance, MONO,
                           service.clock.wall_ns())
            assert op is not None and op.step is not None
            monkeypatch.setattr(ids, "_counter", itertools.count(1 << 40))
            chain = c.bind_current(c.batch_chain(batch, 0), {H: s}.get)
            plan = service._plan(chain, ids.new_id(), {H: s})
            assert list(op.step.events()) == plan.events
            assert op.operation_id == plan.op.operation_id
            assert op.fingerprint == plan.op.fingerprint == decode_chain_fingerprint(*plan.events)
            [w] = op.writes
            assert (w.handle_id, w.expected, w.head) == (H, guard(s), head(after)) and plan.states == {H: after}


_ids = st.text(min_size=1, max_size=12)  # quotes, backslashes, controls, any unicode: all escaped alike
_ints = st.integers(min_value=0, max_value=2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(ids_=st.tuples(_ids, _ids, _ids, _ids), numbers=st.tuples(_ints, _ints, _ints, _ints, _ints),
       at=st.integers(min_value=0, max_value=2**62), rows=st.none() | _ids,
       call=st.none() | st.builds(ForwardCall, _ids, _ints, _ints, _ints, _ints, _ints))
def test_a_steps_fingerprint_from_its_values_is_the_chains(ids_, numbers, at, rows, call):
    """schemas.decode_fingerprint.chain_fingerprint spells out a decode chain's canonical
    JSON: it equals Chain.fingerprint() of the bound chain for any ids and numbers."""
    from kvledger.schemas.decode_fingerprint import chain_fingerprint

    h, txn, nxt, abi = ids_
    g, v, ws, out, token = numbers
    chain = c.Chain(handle_id=h, steps=(
        c.Publish(handle_id=h, txn_id=txn, base_generation=g, base_snapshot_version=v, rows_sha256=rows,
                  workspace_bytes=ws),
        c.EmitOutput(handle_id=h, base_generation=None, base_snapshot_version=None, output_index=out,
                     token_id=token),
        c.BeginAppend(handle_id=h, txn_id=nxt, kind="decode", base_generation=None, base_snapshot_version=None,
                      interval_start=at, interval_count=1, token_ids=(token,), cache_positions=(at,),
                      mask_key_extent=at + 1, cache_abi_sha256=abi, call=call)))
    assert chain_fingerprint(h, g, v, rows, txn, ws, out, token, abi, at, call, nxt) == chain.fingerprint()
