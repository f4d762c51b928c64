"""One rejected command per stable error code; each leaves the journal byte-for-byte unchanged."""

from __future__ import annotations

import msgspec
import pytest

from kvledger import CacheLayout, Ledger, full_layers
from kvledger.engine import commands as c
from kvledger.schemas import events as ev
from kvledger.schemas.canonical import layers_sha256
from kvledger.schemas.errors import ErrorCode as E
from kvledger.schemas.errors import KvLedgerError

from factories import make_manifest
from lifecycle_helpers import ManualClock, allocate, base, decode, emit, prefill


@pytest.fixture
def ledger(db_url):
    with Ledger.open(db_url, clock=ManualClock()) as led:
        allocate(led, "H")
        prefill(led, "H")
        emit(led, "H", 55)  # committed 4, frontier [55]
        yield led


def everything(led: Ledger):
    return list(led.journal.read_raw()), led.journal.heads(), led.journal.last_position()


def expect(led: Ledger, code: E, fn, *args, **kwargs) -> None:
    before = everything(led)
    with pytest.raises(KvLedgerError) as err:
        fn(*args, **kwargs)
    assert err.value.code is code, err.value
    assert everything(led) == before


def open_decode(led, txn="t1"):
    b = base(led, "H")
    led.begin_append("H", txn_id=txn, kind="decode", base=b, start=4, token_ids=(55,))
    return b


def open_decode_at(led, txn):
    emit(led, "H", 66)
    b = base(led, "H")
    s = led.state("H")
    led.begin_append("H", txn_id=txn, kind="decode", base=b, start=s.committed_length, token_ids=(66,))
    return b


def test_position_mask_mismatch(ledger):
    b = base(ledger, "H")
    expect(ledger, E.POSITION_MASK_MISMATCH, ledger.begin_append, "H", txn_id="x", kind="decode",
           base=b, start=4, token_ids=(55,), layout=CacheLayout(cache_positions=(3,)))
    expect(ledger, E.POSITION_MASK_MISMATCH, ledger.begin_append, "H", txn_id="x", kind="decode",
           base=b, start=4, token_ids=(55,), layout=CacheLayout(mask_key_extent=4))
    expect(ledger, E.POSITION_MASK_MISMATCH, ledger.begin_append, "H", txn_id="x", kind="decode",
           base=b, start=3, token_ids=(44,))  # overwrites a committed slot


def test_abi_mismatch(ledger):
    other = make_manifest(adapters=("lora-b",))
    from kvledger.schemas.manifest import cache_abi_sha256

    expect(ledger, E.ABI_MISMATCH, ledger.begin_append, "H", txn_id="x", kind="decode",
           base=base(ledger, "H"), start=4, token_ids=(55,),
           layout=CacheLayout(cache_abi_sha256=cache_abi_sha256(other)))


def test_partial_layer_set(ledger):
    b = open_decode(ledger)
    expect(ledger, E.PARTIAL_LAYER_SET, ledger.publish, "H", txn_id="t1", base=b,
           layers=full_layers(2, 4, 1)[:1])
    half = full_layers(2, 4, 1)
    half = (half[0], msgspec.structs.replace(half[1], v_complete=False))
    expect(ledger, E.PARTIAL_LAYER_SET, ledger.publish, "H", txn_id="t1", base=b, layers=half)
    dup = (full_layers(2, 4, 1)[0],) * 2
    expect(ledger, E.PARTIAL_LAYER_SET, ledger.publish, "H", txn_id="t1", base=b, layers=dup)


def test_row_digests_for_all_layers_or_none(ledger):
    """A publish stores one digest over every layer's rows: one layer's alone proves nothing."""
    b = open_decode(ledger)
    layers = full_layers(2, 4, 1)
    some = (msgspec.structs.replace(layers[0], rows_sha256="a" * 64), layers[1])
    expect(ledger, E.INVALID_ARGUMENT, ledger.publish, "H", txn_id="t1", base=b, layers=some)
    every = tuple(msgspec.structs.replace(r, rows_sha256=f"{r.layer}" * 64) for r in layers)
    ledger.publish("H", txn_id="t1", base=b, layers=every)
    (publish,) = [e for e in ledger.journal.read_stream("H") if isinstance(e, ev.AppendPublishEvent)][-1:]
    assert publish.payload.rows_sha256 == layers_sha256(["0" * 64, "1" * 64])


def test_split_reorder_and_not_a_permutation(ledger):
    s = ledger.state("H")
    ledger.fork("H", base=(s.generation, s.snapshot_version), child_handle_ids=["A", "B"], prefix_length=4)
    expect(ledger, E.SPLIT_REORDER, ledger.reorder, "g", rows=["A", "B"], permutation=[1, 0],
           cache_permutation=[0, 1])
    expect(ledger, E.NOT_A_PERMUTATION, ledger.reorder, "g", rows=["A", "B"], permutation=[0, 0])
    expect(ledger, E.NOT_A_PERMUTATION, ledger.reorder, "g", rows=["A", "A"], permutation=[1, 0],
           bases=[(0, 0), (0, 0)])


def test_stale_base(ledger):
    b = open_decode(ledger)
    ledger.publish("H", txn_id="t1", base=b)
    expect(ledger, E.STALE_BASE, ledger.truncate, "H", base=b, new_length=2)
    expect(ledger, E.STALE_BASE, ledger.finish, "H", base=b[0] + 1)


def test_txn_aborted_and_not_open(ledger):
    b = open_decode(ledger)
    ledger.fail("H", txn_id="t1", outcome="aborted", code="TXN_ABORTED")
    expect(ledger, E.TXN_ABORTED, ledger.publish, "H", txn_id="t1", base=b)
    expect(ledger, E.TXN_NOT_OPEN, ledger.publish, "H", txn_id="never", base=b)
    expect(ledger, E.TXN_NOT_OPEN, ledger.fail, "H", txn_id="never")


def test_frontier_mismatch(ledger):
    b = base(ledger, "H")
    expect(ledger, E.FRONTIER_MISMATCH, ledger.begin_append, "H", txn_id="x", kind="decode",
           base=b, start=4, token_ids=(56,))  # a row for a token that is not the frontier
    decode(ledger, "H", "d1")  # logits ready: the next output index is 1
    expect(ledger, E.FRONTIER_MISMATCH, ledger.emit, "H", base=base(ledger, "H"), output_index=5,
           token_id=1)


def test_rejected_suffix(ledger):
    decode(ledger, "H", "d1")  # logits ready at 5
    b = base(ledger, "H")
    ledger.begin_append("H", txn_id="v", kind="verify", base=b, start=5, token_ids=(1, 2, 3))
    expect(ledger, E.REJECTED_SUFFIX, ledger.publish, "H", txn_id="v", base=b, accepted_count=1,
           layers=full_layers(2, 5, 2))


def test_prefix_still_owned(ledger):
    p = ledger.state("H").prefix_identity_sha256
    expect(ledger, E.PREFIX_STILL_OWNED, ledger.require_evictable, p)


def test_append_hole(ledger):
    decode(ledger, "H", "d1")
    emit(ledger, "H", 66)
    expect(ledger, E.APPEND_HOLE, ledger.begin_append, "H", txn_id="x", kind="decode",
           base=base(ledger, "H"), start=6, token_ids=(66,))


def test_fork_beyond_committed(ledger):
    expect(ledger, E.FORK_BEYOND_COMMITTED, ledger.fork, "H", base=base(ledger, "H"),
           child_handle_ids=["C"], prefix_length=5)


def test_truncate_grows(ledger):
    expect(ledger, E.TRUNCATE_GROWS, ledger.truncate, "H", base=base(ledger, "H"), new_length=5)


def test_release_before_finish(ledger):
    expect(ledger, E.RELEASE_BEFORE_FINISH, ledger.release, "H", base=0)


def test_handle_terminal_and_released(ledger):
    ledger.finish("H", base=0)
    expect(ledger, E.HANDLE_TERMINAL, ledger.begin_append, "H", txn_id="x", kind="decode",
           base=base(ledger, "H"), start=4, token_ids=(55,))
    ledger.release("H", base=0)
    expect(ledger, E.HANDLE_RELEASED, ledger.release, "H", base=1)
    expect(ledger, E.HANDLE_RELEASED, ledger.begin_append, "H", txn_id="x", kind="repair",
           base=base(ledger, "H"), start=4, token_ids=(55,))


def test_unknown_handle_and_handle_exists(ledger):
    expect(ledger, E.UNKNOWN_HANDLE, ledger.finish, "nobody", base=0)
    expect(ledger, E.HANDLE_EXISTS, ledger.allocate, "H", make_manifest("H"), reserved_capacity=8)
    s = ledger.state("H")
    ledger.allocate("taken", make_manifest("taken"), reserved_capacity=8)
    expect(ledger, E.HANDLE_EXISTS, ledger.fork, "H", base=(s.generation, s.snapshot_version),
           child_handle_ids=["taken"], prefix_length=1)


def test_output_not_ready(ledger):
    expect(ledger, E.OUTPUT_NOT_READY, ledger.emit, "H", base=base(ledger, "H"), output_index=1, token_id=3)


def test_capacity_exceeded(ledger):
    allocate(ledger, "small", prompt=(1, 2, 3, 4, 5), capacity=4)
    expect(ledger, E.CAPACITY_EXCEEDED, ledger.begin_append, "small", txn_id="x", kind="prefill",
           base=base(ledger, "small"), start=0, token_ids=(1, 2, 3, 4, 5))


def test_conflict(ledger):
    b = open_decode(ledger)
    ledger.publish("H", txn_id="t1", base=b, operation_id="op-7")
    expect(ledger, E.CONFLICT, ledger.publish, "H", txn_id="t1", base=b, workspace_bytes=9,
           operation_id="op-7")
    expect(ledger, E.CONFLICT, ledger.fail, "H", txn_id="t1", operation_id="op-7")
    b2 = open_decode_at(ledger, "t2")
    expect(ledger, E.CONFLICT, ledger.begin_append, "H", txn_id="t2", kind="decode", base=b2,
           start=5, token_ids=(66,))  # t2 is open: a second start under its id


def test_invalid_manifest_and_digest_mismatch(ledger):
    m = make_manifest("N")
    bad_len = msgspec.structs.replace(m, request_policy=msgspec.structs.replace(
        m.request_policy, max_context_tokens=2))
    expect(ledger, E.INVALID_MANIFEST, ledger.allocate, "N", bad_len, reserved_capacity=8)
    drift = msgspec.structs.replace(m, input_identity=msgspec.structs.replace(
        m.input_identity, prompt_token_ids=(9, 9)))
    expect(ledger, E.DIGEST_MISMATCH, ledger.allocate, "N", drift, reserved_capacity=8)


def test_invalid_argument(ledger):
    expect(ledger, E.INVALID_ARGUMENT, ledger.allocate, "N", make_manifest("N"), reserved_capacity=-1)
    expect(ledger, E.INVALID_ARGUMENT, ledger.execute, c.Fork(
        parent_handle_id="H", base_generation=0, base_snapshot_version=1, child_handle_ids=(),
        prefix_length=1))


def test_every_lifecycle_code_is_exercised():
    """Guard against a new code without a test: the codes above cover the lifecycle set."""
    import inspect
    import sys

    src = inspect.getsource(sys.modules[__name__])
    lifecycle = [code for code in E if code.name not in {
        "MALFORMED_EVENT", "UNKNOWN_EVENT_TYPE", "UNKNOWN_SCHEMA_VERSION", "FIELD_TOO_LARGE",
        "CORRUPT_JOURNAL", "BAD_DATABASE_URL", "DATABASE_UNREACHABLE", "NOT_MIGRATED", "NOT_BUILT",
        # database and driver errors: tests/test_hardening_errors.py
        "DATABASE_NOT_FOUND", "DATABASE_AUTH_FAILED", "NOT_A_DATABASE", "DATABASE_READ_ONLY",
        "PERMISSION_DENIED", "DATABASE_BUSY", "DATABASE_FULL", "CONSTRAINT_VIOLATION", "TABLE_MISSING",
        "SCHEMA_MISMATCH", "DATABASE_TOO_NEW", "DATABASE_ERROR", "INTERNAL_ERROR",
        # command-line codes, covered by tests/test_hardening_args.py
        "UNWRITABLE_OUTPUT", "OUTPUT_IS_INPUT", "CONTEXT_TOO_LONG",
        "NON_CANONICAL_EVENT",  # input, not lifecycle: tests/test_hardening_import.py
    }]
    missing = [code.name for code in lifecycle if f"E.{code.name}," not in src]
    assert missing == []
