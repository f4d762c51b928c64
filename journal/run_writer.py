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


_FEW_PREFIXES = 8  # up to this many a run's prefixes are numbered by masks, more by sorting


class RunWritten(NamedTuple):
    record: RecordRow
    receipts: RunReceipts
    tails: dict[str, tuple[int, int]]  # as record_rows.Written's


def _wrap(v: int) -> int:
    """v modulo 2**64 as a signed 64-bit int (what a reader adds back, modulo 2**64)."""
    return ((v + _HALF) & _MASK) - _HALF


def validate_run(run: DecodeRun) -> None:
    """INVALID_ARGUMENT unless the run's columns line up, on distinct handles (batching.validate's
    checks of a step; a step's head follows from its guard, three events on)."""
    n = len(run.handle_ids)
    columns = (run.request_ids, run.cache_abis, run.generations, run.snapshots, run.positions,
               run.prefix_identities, run.publish_txns, run.start_txns, run.committed, run.accepted, run.layers,
               run.workspace, run.rows_sha256, run.outputs, run.tokens, run.calls)
    if any(len(col) != n for col in columns) or len(set(run.handle_ids)) != n:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "a decode run's columns differ in length, or name a "
                            "handle twice")


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


def _numbered(slots: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Each prefix (uint64) of `slots` (k x n) numbered in order of first appearance, read
    step by step and in slot order within a step, as a Context numbers them; and the
    prefixes in that order, as their 16 hex digits."""
    import numpy as np

    order = list(dict.fromkeys(slots.T.ravel().tolist()))
    if len(order) <= _FEW_PREFIXES:  # one process's ids share a prefix: a mask a prefix
        number = np.zeros(slots.shape, np.int64)
        for k, v in enumerate(order[1:], 1):
            number[slots == v] = k
    else:
        first = np.array(order, np.uint64)
        by_value = np.argsort(first)
        number = by_value[np.searchsorted(first[by_value], slots)]
    return number, [f"{v:016x}" for v in order]


def _template(n: int) -> np.ndarray:
    """A run's n x 30 values with what is the same in every run of n steps filled in: the
    stream index, the op counter's and the gaps' differences (a copy, the caller's own)."""
    found = _templates.get(n)
    if found is None:
        import numpy as np

        from kvledger.journal.blocks import VALUES

        found = np.zeros((n, VALUES), np.int64)
        found[:, 0] = np.arange(n)
        found[1:, 23] = 4
        found[:, 24:27] = 1
        if len(_templates) > 64:  # a cache: batch sizes come and go
            _templates.clear()
        _templates[n] = found
    return found.copy()


_templates: dict[int, np.ndarray] = {}


def run_record(run: DecodeRun, last: int, previous_chain: bytes, now: int, prevs: dict[str, int],
               runs: list[tuple[int, int]]) -> RunWritten | None:
    """The record of the run after global position `last`, linked to `previous_chain`,
    committed at `now`; `prevs`: each handle's last record; `runs`: id_runs_of(run).
    None: a step is not in the block path's form."""
    import numpy as np  # only once a record holds a step: the journal's API imports no numpy

    from kvledger.journal.blocks import pack_matrix

    n = len(run)
    seq, mono, wall = run.local_sequence, run.monotonic_ns, run.observed_wall_time
    op = lower_hex(run.prefix, 8)
    publish, start = _hex_column(run.publish_txns, 16), _hex_column(run.start_txns, 16)
    if (op is None or publish is None or start is None
            or not (0 <= seq and seq + 3 * n < _U64 and 0 <= mono < _U64 and 0 <= wall < _U64)):
        return None
    txns = np.frombuffer(publish + start, ">u8").reshape(2, n, 2)  # [publish, start] x step x (prefix, counter)
    m = _template(n)
    # A step names its prefixes in this order, as StepWriter numbers them: publish txn,
    # start txn, call, the op's. A step without a call stands the op's in the call's slot:
    # the op's own slot comes next, so the order of first appearances is the same.
    op_prefix = int.from_bytes(op)
    called = [i for i, k in enumerate(run.calls) if k is not None]
    if called:
        calls = [k for k in run.calls if k is not None]
        numbers = [(k.index, k.threads, k.size, k.new_pad, k.key_extent) for k in calls]
        raw = _hex_column([k.call_id for k in calls], 16)
        if raw is None or set(map(type, itertools.chain.from_iterable(numbers))) != {int}:
            return None
        call_ids = np.frombuffer(raw, ">u8").reshape(len(called), 2)
        slots = np.full((4, n), op_prefix, np.uint64)
        slots[2, called] = call_ids[:, 0]
        try:
            m[called, 13:18] = numbers
        except OverflowError:  # a count past int64: not a block's
            return None
        m[called, 19] = 1
        m[called, 29] = np.diff(call_ids[:, 1], prepend=np.uint64(0)).view(np.int64)  # from the last call's
    else:
        slots = np.full((3, n), op_prefix, np.uint64)
    slots[:2] = txns[:, :, 0]
    numbers_of, prefixes = _numbered(slots)
    m[:, 1:4] = numbers_of[[-1, 0, 1]].T
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
    source = run.source_instance
    streams = [(h, r, g, source, abis[abi])
               for h, r, g, abi in zip(run.handle_ids, run.request_ids, run.generations, run.cache_abis)]
    try:
        m[:, 5:13] = np.array([run.positions, run.snapshots, run.committed, run.accepted, run.layers, run.workspace,
                               run.outputs, run.tokens], np.int64).T
        m[:, 5] += 1  # the step's first event's position
    except OverflowError:  # a count past int64: not a block's
        return None
    if m[:, 5:18].min() < 0:
        return None
    m[:, 18] = [d is not None for d in run.rows_sha256]
    # differences from the step before (the first's from zero), as StepWriter stores them
    dmono = _wrap(mono)
    m[0, 20:24] = (_wrap(seq - 3), dmono, _wrap(wall - dmono), _wrap(run.first_counter))
    counters = txns[:, :, 1]
    m[0, 27:29] = [_wrap(int(c)) for c in counters[:, 0]]
    m[1:, 27:29] = (counters[:, 1:] - counters[:, :-1]).T.view(np.int64)  # modulo 2**64, as _wrap
    first_position = last + 1
    body = encode_record([pack_matrix(m, digests)],
                         [_encode(Context(first_position, now, prefixes, streams))], FORMAT)
    handles = list(run.handle_ids)
    position = last + 3 * n
    record = RecordRow(position, first_position, chain(previous_chain, body), body, handles,
                       pack_prev([prevs.get(h, PREV_NONE) for h in handles]), runs)
    return RunWritten(record, RunReceipts(run, first_position, now), {h: (p + 3, position)
                                                                   for h, p in zip(handles, run.positions)})
