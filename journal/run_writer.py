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

from typing import NamedTuple

from kvledger.journal.decode_run import DecodeRun, RunReceipts
from kvledger.journal.keys import PREV_NONE, counted_keys, id_runs, pack_prev
from kvledger.journal.record_format import FORMAT, chain, encode_record
from kvledger.journal.record_rows import RecordRow
from kvledger.journal.step_rows import Context, _encode
from kvledger.journal.step_values import _HALF, _MASK, _U64, parsed_counter
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.ids import lower_hex

# Runs this short are written by the general path: the block path's array calls cost more
# than they save below this, and a batch-1 commit follows a model call that evicted numpy's
# code (blocks.FEW).
SMALL = 2


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
    return id_runs(counted_keys(run.prefix, range(run.first_counter, run.first_counter + 4 * len(run))))


def run_record(run: DecodeRun, last: int, previous_chain: bytes, now: int, prevs: dict[str, int],
               runs: list[tuple[int, int]]) -> RunWritten | None:
    """The record of the run after global position `last`, linked to `previous_chain`,
    committed at `now`; `prevs`: each handle's last record; `runs`: id_runs_of(run).
    None: a step is not in the block path's form."""
    import numpy as np  # only once a record holds a step: the journal's API imports no numpy

    from kvledger.journal.blocks import VALUES, pack_matrix

    n = len(run)
    seq, mono, wall = run.local_sequence, run.monotonic_ns, run.observed_wall_time
    if not (0 <= seq and seq + 3 * n < _U64 and 0 <= mono < _U64 and 0 <= wall < _U64):
        return None
    prefixes: dict[str, int] = {}
    ptxn_prefix, ptxn, stxn_prefix, stxn = [], [], [], []
    calls: list[tuple[int, ...]] | None = [] if any(k is not None for k in run.calls) else None
    last_call = 0
    for p, s, k in zip(run.publish_txns, run.start_txns, run.calls):
        a, b = parsed_counter(p), parsed_counter(s)
        if a is None or b is None:
            return None
        # prefixes are numbered as StepWriter numbers them: publish txn, start txn, call, then the op's
        ptxn_prefix.append(prefixes.setdefault(p[:16], len(prefixes)))
        stxn_prefix.append(prefixes.setdefault(s[:16], len(prefixes)))
        if calls is not None:
            if k is None:
                calls.append((0,) * 8)
            else:
                counter, values = parsed_counter(k.call_id), (k.index, k.threads, k.size, k.new_pad, k.key_extent)
                if counter is None or any(type(v) is not int for v in values):
                    return None
                calls.append((prefixes.setdefault(k.call_id[:16], len(prefixes)), *values, 1,
                              _wrap(counter - last_call)))
                last_call = counter
        prefixes.setdefault(run.prefix, len(prefixes))
        ptxn.append(a)
        stxn.append(b)
    op_prefix = prefixes[run.prefix]
    abis: dict[str, bytes | None] = {}
    digests: list[bytes | None] = []
    streams = []
    for h, r, g, abi, rows in zip(run.handle_ids, run.request_ids, run.guards, run.cache_abis, run.rows_sha256):
        if abi not in abis:
            abis[abi] = lower_hex(abi, 32)
        stored_abi = abis[abi]
        digest = None if rows is None else lower_hex(rows, 32)
        if stored_abi is None or (digest is None) != (rows is None):
            return None
        digests.append(digest)
        streams.append((h, r, g.generation, run.source_instance, stored_abi))
    m = np.zeros((n, VALUES), np.int64)
    try:
        m[:, 0] = np.arange(n)
        m[:, 1] = op_prefix
        m[:, 2] = ptxn_prefix
        m[:, 3] = stxn_prefix
        m[:, 5] = [g.stream_position + 1 for g in run.guards]
        m[:, 6] = [g.snapshot_version for g in run.guards]
        m[:, 7] = run.committed
        m[:, 8] = run.accepted
        m[:, 9] = run.layers
        m[:, 10] = run.workspace
        m[:, 11] = run.outputs
        m[:, 12] = run.tokens
        if calls is not None:  # the call's prefix, its five numbers, its flag and counter's difference
            m[:, [4, 13, 14, 15, 16, 17, 19, 29]] = calls
    except OverflowError:  # a count past int64: not a block's
        return None
    if m[:, 5:18].min() < 0:
        return None
    m[:, 18] = [d is not None for d in digests]
    # differences from the step before (the first's from zero), as StepWriter stores them
    dmono = _wrap(mono)
    m[0, 20:24] = (_wrap(seq - 3), dmono, _wrap(wall - dmono), _wrap(run.first_counter))
    m[1:, 23] = 4
    m[:, 24:27] = 1
    for col, counters in ((27, ptxn), (28, stxn)):
        c = np.array(counters, np.uint64)
        m[0, col] = _wrap(counters[0])
        m[1:, col] = np.diff(c).view(np.int64)
    first = last + 1
    body = encode_record([pack_matrix(m, digests)], [_encode(Context(first, now, list(prefixes), streams))], FORMAT)
    handles = list(run.handle_ids)
    position = last + 3 * n
    record = RecordRow(position, first, chain(previous_chain, body), body, handles,
                       pack_prev([prevs.get(h, PREV_NONE) for h in handles]), runs)
    return RunWritten(record, RunReceipts(run, first, now), {h: (x.stream_position, position)
                                                          for h, x in zip(handles, run.heads)})

