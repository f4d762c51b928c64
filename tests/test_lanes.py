"""engine.lanes on its own: what it admits, how a handle leaves, the mapping it keeps.

That a batch decided in the lanes writes and answers what its steps' chains do is
tests/test_decide_batch.py's (the service end to end)."""

from __future__ import annotations

from msgspec.structs import replace

from kvledger.engine.decide_batch import admits, plain_after
from kvledger.engine.lanes import Lanes, States
from kvledger.engine.state import HandleState, OpenTxn
from kvledger.schemas.decode_batch import BatchBuilder

ABI = "ab" * 32
PROMPT = (5, 6, 7)


def _state(h: str, **kw: object) -> HandleState:
    s = HandleState(h, f"r-{h}", 0, 2, 4, "ACTIVE", PROMPT, (), 3, True, 2, 64, 256, ("gpu",), 0, ABI, "cd" * 32,
                    "ef" * 32, open_txns=(OpenTxn(f"{h}-t0", "prefill", 2, 0, 3, PROMPT),))
    return replace(s, **kw)


def _steps(states: dict[str, HandleState], k: int) -> tuple:
    b = BatchBuilder()
    for h, s in states.items():
        t = s.open_txns[0]
        b.add(h, t.txn_id, t.interval_start + t.interval_count, len(s.outputs), 100 + k, f"{h}-t{k + 1}", None, ABI)
    return b.build()


def test_a_handle_leaves_the_lanes_as_its_plain_steps_leave_it():
    lanes = Lanes()
    want = {h: _state(h) for h in ("a", "b", "c")}
    for s in want.values():
        assert admits(s) and lanes.admit([s])
    for k in range(140):  # outputs past state.SHARED_FROM: a shared Appended, as plain_after grows them
        batch = _steps(want, k)
        held = lanes.decide(batch)
        assert held is not None
        lanes.settle(held, batch, 1_000 + k)
        want = {h: plain_after(s, *_values(batch, i), 1_000 + k) for i, (h, s) in enumerate(want.items())}
    got = {h: lanes.take(h) for h in want}
    assert got == want and len(lanes) == 0


def _values(batch, i: int) -> tuple:
    return (batch.txn_ids[i], batch.output_indexes[i], batch.tokens[i], batch.next_txn_ids[i], batch.positions[i],
            batch.cache_abi_sha256[i])


def test_a_batch_off_any_handles_columns_is_not_decided_there():
    lanes = Lanes()
    states = {h: _state(h) for h in ("a", "b")}
    for s in states.values():
        lanes.admit([s])
    good = _steps(states, 0)
    assert lanes.decide(good) is not None
    for change in ({"txn_ids": ("a-t0", "x")}, {"positions": (3, 4)}, {"output_indexes": (0, 1)},
                   {"cache_abi_sha256": (ABI, "00" * 32)}, {"handle_ids": ("a", "a")}, {"handle_ids": ("a", "z")},
                   {"bases": ((0, 2), (0, 3))}, {"positions": (3.0, 3)}):
        assert lanes.decide(replace(good, **change)) is None, change
    assert lanes.decide(replace(good, bases=((0, 2), None))) is not None
    full = Lanes()
    full.admit([_state("a", reserved_capacity=3)])  # no room for the row the step starts
    columns = ("txn_ids", "positions", "output_indexes", "tokens", "next_txn_ids", "rows_sha256", "cache_abi_sha256")
    assert full.decide(replace(good, handle_ids=("a",), **{k: getattr(good, k)[:1] for k in columns})) is None


def test_a_next_txn_once_aborted_or_counts_past_int64_keep_a_handle_out():
    lanes = Lanes()
    s = _state("a", aborted_txn_ids=("a-t1",))
    assert lanes.admit([s])
    assert lanes.decide(_steps({"a": s}, 0)) is None  # its next txn was aborted: the general path refuses it
    assert not lanes.admit([_state("b", reserved_capacity=2**64)]) and "b" not in lanes
    assert not admits(_state("c", lifecycle="FINISHED")) and not admits(_state("d", open_txns=()))
    assert not admits(_state("e", open_txns=(OpenTxn("e-t0", "verify", 2, 0, 3, PROMPT),)))
    assert not admits(_state("f", open_txns=(OpenTxn("f-t0", "repair", 2, 0, 3, PROMPT),)))
    assert not admits(_state("g", open_txns=(OpenTxn("g-t0", "prefill", 1, 0, 3, PROMPT),)))  # not at its base
    assert not admits(_state("h", open_txns=(OpenTxn("h-t0", "prefill", 2, 0, 2, PROMPT[:2]),)))  # short of the end


def test_reading_a_handle_in_the_lanes_takes_it_out():
    states = States({"x": _state("x")})
    s = _state("a")
    held = states.decide(_steps({"a": s}, 0), lambda h: s if h == "a" else None)
    assert held is not None and "a" in states and "a" in states.lanes
    assert sorted(states) == ["a", "x"] and len(states) == 2
    assert states["a"] == s and "a" not in states.lanes and "a" in states
    states.decide(_steps({"a": s}, 0), lambda h: None)
    states["a"] = s  # set anew: the lanes forget it
    assert "a" not in states.lanes and states.get("a") == s
    del states["a"]
    assert "a" not in states and states.get("a") is None
