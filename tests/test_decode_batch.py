"""schemas.decode_batch: one value for a batch of decode steps, checked in one place."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.engine import commands as c
from kvledger.schemas.decode_batch import BatchBuilder, DecodeBatch, decode, encode, validate
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import ForwardCall


def _batch(n: int = 3, calls: bool = True, bases: bool = False) -> DecodeBatch:
    b = BatchBuilder()
    for i in range(n):
        b.add(f"h{i}", f"t{i}", 4 + i, i, 100 + i, f"n{i}", None if i % 2 else "ab" * 32, "cd" * 32)
        b.detail(i, workspace_bytes=8 * i, base=(0, i) if bases and i else None,
                 call=ForwardCall(f"call{i}", i, n, 1, 5 + i, 2) if calls and i != 1 else None)
    return b.build()


def test_a_built_batch_crosses_msgpack_whole_and_reads_back_its_steps():
    batch = _batch(bases=True)
    back = decode(encode(batch))
    assert back == batch and len(back) == 3
    assert back.call(1) is None and back.call(2) == ForwardCall("call2", 2, 3, 1, 7, 2)
    assert back.base(0) is None and back.base(2) == (0, 2) and back.workspace(2) == 16
    chain = c.batch_chain(back, 2)
    publish, emit, start = chain.steps
    assert (publish.base_generation, publish.base_snapshot_version) == (0, 2)
    assert (emit.token_id, start.token_ids, start.interval_start, start.call) == (102, (102,), 6, back.call(2))
    assert type(c.batch_step(back, 0)) is c.Relative and type(c.batch_step(back, 2)) is c.Chain


def test_columns_left_out_when_every_step_takes_the_default():
    batch = _batch(calls=False)
    assert batch.call_ids is None and batch.bases is None and batch.call_sizes is None
    assert BatchBuilder().build() == DecodeBatch((), (), (), (), (), (), (), ())


@pytest.mark.parametrize("change, words", [
    ({"tokens": (1, 2)}, "column tokens has 2 values for 3 steps"),
    ({"bases": ((0, 0),)}, "column bases"),
    ({"call_threads": None}, "given together"),
    ({"call_sizes": (3, 0, 0)}, "positive"),
])
def test_a_batch_whose_columns_do_not_line_up_is_refused_with_its_reason(change, words):
    bad = msgspec.structs.replace(_batch(), **change)
    for check in (bad.check, lambda: decode(encode(bad)), lambda: validate(bad)):
        with pytest.raises(KvLedgerError) as raised:
            check()
        assert raised.value.code is ErrorCode.INVALID_ARGUMENT and words in raised.value.message


@pytest.mark.parametrize("change", [{"handle_ids": ("", "a", "b")}, {"tokens": (1, -2, 3)},
                                    {"rows_sha256": ("xy", None, None)}, {"cache_abi_sha256": ("e" * 65,) * 3},
                                    {"positions": (1, 2, 1 << 63)}])
def test_validate_holds_a_value_built_in_python_to_the_events_bounds(change):
    with pytest.raises(KvLedgerError) as raised:
        validate(msgspec.structs.replace(_batch(), **change))
    assert raised.value.code is ErrorCode.INVALID_ARGUMENT and raised.value.message.startswith("decode batch:")
    with pytest.raises(KvLedgerError):
        validate("not a batch")


_values = st.one_of(st.none(), st.integers(-3, (1 << 64) - 1), st.text(max_size=70), st.binary(max_size=8),
                    st.tuples(st.integers(-1, 3), st.integers(-1, 3)))
_column = st.one_of(st.none(), st.lists(_values, max_size=4).map(tuple))


@settings(max_examples=300, deadline=None)
@given(st.lists(_column, min_size=0, max_size=18), st.binary(max_size=64))
def test_any_frame_decodes_to_a_checked_batch_or_a_one_line_refusal(columns, noise):
    """A frame from another process: any msgpack array (or bytes) is a batch whose
    columns line up and whose values are in bounds, or INVALID_ARGUMENT."""
    for data in (msgspec.msgpack.encode(columns), noise):
        try:
            batch = decode(data)
        except KvLedgerError as exc:
            assert exc.code is ErrorCode.INVALID_ARGUMENT and "\n" not in exc.message
        else:
            batch.check()
            for i in range(len(batch)):
                c.batch_chain(batch, i)  # every step reads as its chain
