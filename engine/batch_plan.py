"""The operation of a decided plain decode step, as the journal's DecodeStep.

engine.decide_batch decides a step and gives the state it leaves; this turns it into the
Operation the journal appends: its ids (an operation id and three event ids, drawn in
the general path's order), its fingerprint (schemas.decode_fingerprint, the one its
chain's command gives) and the step's facts in their events' form (journal.contract's
DecodeStep), with no event structs: the journal derives what a record stores of it.
None when a step has no such form (seeded ids, a value of another type): the caller
plans it by the general path, which stamps its events.

`plan_run` gives the steps a batch takes first on their handles as one value instead
(journal.decode_run): their columns, one block of ids, the same facts and fingerprints.
"""

from __future__ import annotations

from kvledger.engine.heads import guard, head
from kvledger.engine.ids import new_block, new_counted
from kvledger.engine.state import HandleState
from kvledger.journal.contract import Operation, StreamWrite
from kvledger.journal.port import DecodeRun, DecodeStep
from kvledger.schemas.decode_batch import DecodeBatch
from kvledger.schemas.decode_fingerprint import step_fingerprint


def plan_step(s: HandleState, after: HandleState, batch: DecodeBatch, i: int, local_sequence: int,
              source_instance: str, mono: int, wall: int) -> Operation | None:
    """The operation of step i of `batch`, decided on the handle in state `s` to leave
    `after` (its events' local sequence numbers follow `local_sequence`), or None. Ids
    are drawn only once everything else holds."""
    token, workspace, rows, call = batch.tokens[i], batch.workspace(i), batch.rows_sha256[i], batch.call(i)
    if type(token) is not int or type(workspace) is not int:  # what the fingerprint encodes as given
        return None
    drawn = new_counted()
    if drawn is None:  # seeded ids have no counters
        return None
    prefix, n = drawn
    e1, e2, e3 = new_counted(), new_counted(), new_counted()
    if e1 is None or e2 is None or e3 is None or not e1[0] == e2[0] == e3[0] == prefix:
        return None  # seeded, or a forked child's new prefix
    h, txn_id, next_txn, at, abi = (batch.handle_ids[i], batch.txn_ids[i], batch.next_txn_ids[i],
                                    batch.positions[i], batch.cache_abi_sha256[i])
    g, v = s.generation, s.snapshot_version
    step = DecodeStep(
        0, h, s.request_id, g, source_instance, abi, s.stream_position + 1, local_sequence + 1, mono, wall,
        prefix, n, (e1[1] - n, e2[1] - e1[1], e3[1] - e2[1]), txn_id, next_txn, v, at, s.open_txns[0].interval_count,
        s.num_layers, workspace, rows, len(s.outputs), token, call)
    return Operation(f"{prefix}{n:016x}", step_fingerprint(batch, i, g, v),
                     (StreamWrite(h, guard(s), head(after), ()),), derived=True, stamped=True, step=step)


def runnable(batch: DecodeBatch, i: int) -> bool:
    """Step i's caller-given values have the types a run's columns hold (as plan_step's)."""
    return type(batch.tokens[i]) is int and type(batch.workspace(i)) is int


def plan_run(batch: DecodeBatch, members: list[tuple[int, HandleState, HandleState]], local_sequence: int,
             source_instance: str, mono: int, wall: int) -> DecodeRun | None:
    """The run of the batch's steps at `members` ((index, state before, state after), on
    distinct handles, each `runnable`), their events' local sequence numbers following
    `local_sequence`; None when its ids cannot be one block (seeded)."""
    block = new_block(4 * len(members))
    if block is None:
        return None
    prefix, first = block
    cols: tuple[list, ...] = tuple([] for _ in range(16))  # type: ignore[type-arg]  # DecodeRun's columns, in order
    (handles, requests, abis, guards, heads, ptxns, stxns, committed, accepted, layers, workspace, rows, outputs,
     tokens, calls, fingerprints) = cols
    ws = batch.workspace_bytes
    for i, s, after in members:
        g, v = s.generation, s.snapshot_version
        handles.append(batch.handle_ids[i])
        requests.append(s.request_id)
        abis.append(batch.cache_abi_sha256[i])
        guards.append(guard(s))
        heads.append(head(after))
        ptxns.append(batch.txn_ids[i])
        stxns.append(batch.next_txn_ids[i])
        committed.append(batch.positions[i])
        accepted.append(s.open_txns[0].interval_count)
        layers.append(s.num_layers)
        workspace.append(0 if ws is None else ws[i])
        rows.append(batch.rows_sha256[i])
        outputs.append(len(s.outputs))
        tokens.append(batch.tokens[i])
        calls.append(batch.call(i))
        fingerprints.append(step_fingerprint(batch, i, g, v))
    return DecodeRun(source_instance, mono, wall, prefix, first, local_sequence + 1, *map(tuple, cols))
