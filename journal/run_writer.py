"""A decode run's record, built from its columns (journal.decode_run).

What journal.steps.StepWriter and journal.record_rows.build_record make of the run's
steps one Operation at a time (a format-7 record holding one block of the steps'
values, and their receipts), made a column at a time: the thirty values of every step
(journal.blocks' order) are arrays, differences between steps are array differences.
`run_record` gives None when a step is not in the form the block path takes (an id
not in engine.ids' form, a value out of a column's range, a recorded model call): the
caller then appends `run.operations()`, the general path, which stores the same steps
(tests/test_decode_run.py holds the records equal byte for byte).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvledger.journal.decode_run import DecodeRun, RunReceipts
from kvledger.journal.keys import PREV_NONE, counted_runs, pack_prev
from kvledger.journal.record_format import FORMAT, chain, encode_record
from kvledger.journal.record_rows import RecordRow
from kvledger.journal.step_rows import Context, _encode
from kvledger.journal.step_values import _HALF, _MASK, _U64
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.ids import lower_hex

if TYPE_CHECKING:
    import numpy as np

# Runs this short are written by the general path: the block path's array calls cost more
# than they save below this, and a batch-1 commit follows a model call that evicted numpy's
# code (blocks.FEW).
SMALL = 2
_NO_DIGEST = "0" * 64  # a step without a digest stores blocks.NO_DIGEST (its flag says which)


class RunWritten(NamedTuple):
    record: RecordRow
    receipts: RunReceipts
    tails: dict[str, tuple[int, int]]  # as record_rows.Written's


def _wrap(v: int) -> int:
    """v modulo 2**64 as a signed 64-bit int (what a reader adds back, modulo 2**64)."""
    return ((v + _HALF) & _MASK) - _HALF


def validate_run(run: DecodeRun) -> None:
    """INVALID_ARGUMENT unless the run's columns line up and each head ends three events
    after its guard, on distinct handles (batching.validate's checks of a step)."""
    n = len(run.handle_ids)
    columns = (run.request_ids, run.cache_abis, run.guards, run.heads, run.publish_txns, run.start_txns,
               run.committed, run.accepted, run.layers, run.workspace, run.rows_sha256, run.outputs, run.tokens,
               run.calls)
    if any(len(col) != n for col in columns) or len(set(run.handle_ids)) != n:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "a decode run's columns differ in length, or name a "
                            "handle twice")
    for h, g, x in zip(run.handle_ids, run.guards, run.heads):
        if x.stream_position != g.stream_position + 3:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"decode run: head of {h} does not end at its "
                                "last event")


def id_runs_of(run: DecodeRun) -> list[tuple[int, int]]:
    """The id keys of the run's operation and event ids, as runs (keys.id_runs)."""
    return counted_runs(run.prefix, run.first_counter, 4 * len(run))


def _hex_column(column: Sequence[str], size: int) -> bytes | None:
    """The bytes a column of strings of `size` lowercase-hex bytes each spell, one after
    the other (schemas.ids.lower_hex of each, in one call), or None if one is not such."""
    try:
        if set(map(len, column)) != {2 * size}:  # each as long: the joined text cuts where each ends
            return None
        return lower_hex("".join(column), size * len(column))
    except TypeError:  # a value that is not a str
        return None


def _numbered(slots: list[np.ndarray]) -> tuple[np.ndarray, list[str]]:
    """Each slot's prefix (uint64) numbered in order of first appearance, read step by step
    and in slot order within a step, as a Context numbers them; and the prefixes in that
    order, as their 16 hex digits."""
    import numpy as np

    unique, first = np.unique(np.stack(slots, axis=1).ravel(), return_index=True)
    by_first = np.argsort(first)
    number = np.empty(len(unique), np.int64)
    number[by_first] = np.arange(len(unique))
    return number[np.searchsorted(unique, np.stack(slots))], [f"{v:016x}" for v in unique[by_first].tolist()]


def run_record(run: DecodeRun, last: int, previous_chain: bytes, now: int, prevs: dict[str, int],
               runs: list[tuple[int, int]]) -> RunWritten | None:
    """The record of the run after global position `last`, linked to `previous_chain`,
    committed at `now`; `prevs`: each handle's last record; `runs`: id_runs_of(run).
    None: a step is not in the block path's form."""
    import numpy as np  # only once a record holds a step: the journal's API imports no numpy

    from kvledger.journal.blocks import VALUES, pack_matrix

    n = len(run)
    seq, mono, wall = run.local_sequence, run.monotonic_ns, run.observed_wall_time
    op = lower_hex(run.prefix, 8)
    publish, start = _hex_column(run.publish_txns, 16), _hex_column(run.start_txns, 16)
    if (op is None or publish is None or start is None
            or not (0 <= seq and seq + 3 * n < _U64 and 0 <= mono < _U64 and 0 <= wall < _U64)):
        return None
    txns = np.stack([np.frombuffer(publish, ">u8").reshape(n, 2), np.frombuffer(start, ">u8").reshape(n, 2)])
    m = np.zeros((n, VALUES), np.int64)
    # A step names its prefixes in this order, as StepWriter numbers them: publish txn,
    # start txn, call, the op's. A step without a call stands the op's in the call's slot:
    # the op's own slot comes next, so the order of first appearances is the same.
    slots = [txns[0, :, 0], txns[1, :, 0], np.full(n, int.from_bytes(op), np.uint64)]
    called = [i for i, k in enumerate(run.calls) if k is not None]
    if called:
        calls = [k for k in run.calls if k is not None]
        numbers = [(k.index, k.threads, k.size, k.new_pad, k.key_extent) for k in calls]
        raw = _hex_column([k.call_id for k in calls], 16)
        if raw is None or set(map(type, itertools.chain.from_iterable(numbers))) != {int}:
            return None
        call_ids = np.frombuffer(raw, ">u8").reshape(len(called), 2)
        prefix = slots[2].copy()
        prefix[called] = call_ids[:, 0]
        slots.insert(2, prefix)
        try:
            m[called, 13:18] = numbers
        except OverflowError:  # a count past int64: not a block's
            return None
        m[called, 19] = 1
        m[called, 29] = np.diff(call_ids[:, 1], prepend=np.uint64(0)).view(np.int64)  # from the last call's
    numbers_of, prefixes = _numbered(slots)
    m[:, 2], m[:, 3], m[:, 1] = numbers_of[0], numbers_of[1], numbers_of[-1]
    if called:
        m[called, 4] = numbers_of[2][called]

    abis: dict[str, bytes] = {}
    for abi in set(run.cache_abis):
        if (stored := lower_hex(abi, 32)) is None:
            return None
        abis[abi] = stored
    digests = _hex_column([_NO_DIGEST if d is None else d for d in run.rows_sha256], 32)
    if digests is None:
        return None
    streams = [(h, r, g.generation, run.source_instance, abis[abi])
               for h, r, g, abi in zip(run.handle_ids, run.request_ids, run.guards, run.cache_abis)]
    try:
        m[:, 5:7] = np.array([(g.stream_position + 1, g.snapshot_version) for g in run.guards], np.int64)
        m[:, 7:13] = np.array([run.committed, run.accepted, run.layers, run.workspace, run.outputs, run.tokens],
                              np.int64).T
    except OverflowError:  # a count past int64: not a block's
        return None
    if m[:, 5:18].min() < 0:
        return None
    m[:, 0] = np.arange(n)
    m[:, 18] = [d is not None for d in run.rows_sha256]
    # differences from the step before (the first's from zero), as StepWriter stores them
    dmono = _wrap(mono)
    m[0, 20:24] = (_wrap(seq - 3), dmono, _wrap(wall - dmono), _wrap(run.first_counter))
    m[1:, 23] = 4
    m[:, 24:27] = 1
    counters = txns[:, :, 1]
    m[0, 27:29] = [_wrap(int(c)) for c in counters[:, 0]]
    m[1:, 27:29] = np.diff(counters, axis=1).T.view(np.int64)
    first_position = last + 1
    body = encode_record([pack_matrix(m, digests)],
                         [_encode(Context(first_position, now, prefixes, streams))], FORMAT)
    handles = list(run.handle_ids)
    position = last + 3 * n
    record = RecordRow(position, first_position, chain(previous_chain, body), body, handles,
                       pack_prev([prevs.get(h, PREV_NONE) for h in handles]), runs)
    return RunWritten(record, RunReceipts(run, first_position, now), {h: (x.stream_position, position)
                                                                   for h, x in zip(handles, run.heads)})
