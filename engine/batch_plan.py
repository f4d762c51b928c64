"""Decided plain decode steps as the journal takes them: one DecodeRun (journal.decode_run).

engine.decide_batch decides a step and gives the state it leaves; `plan_run` turns the
steps a batch takes first on their handles into one run: their columns, one block of ids
(an operation id and three event ids a step, in the general path's order), each step's
guard and head, with no event structs or fingerprints: the journal derives what a record
and a receipt hold of them (a fingerprint when a receipt is read, DecodeRun.fingerprint). A later
step on one of those handles is a run of one (`plan_step`, as an Operation). None when
a step has no such form (seeded ids, a value of another type): the caller plans it by
the general path, which stamps its events.
"""

from __future__ import annotations

from kvledger.engine.heads import guard, head
from kvledger.engine.ids import new_block
from kvledger.engine.state import HandleState
from kvledger.journal.contract import Operation
from kvledger.journal.port import DecodeRun
from kvledger.schemas.decode_batch import DecodeBatch


def plan_step(s: HandleState, after: HandleState, batch: DecodeBatch, i: int, local_sequence: int,
              source_instance: str, mono: int, wall: int) -> Operation | None:
    """The operation of step i of `batch`, decided on the handle in state `s` to leave
    `after` (its events' local sequence numbers follow `local_sequence`), or None: a run
    of one step, as an Operation."""
    if not runnable(batch, i):
        return None
    run = plan_run(batch, [(i, s, after)], local_sequence, source_instance, mono, wall)
    return None if run is None else run.operation(0)


def runnable(batch: DecodeBatch, i: int) -> bool:
    """Step i's caller-given values have the types a run's columns hold: what the
    fingerprint encodes as given."""
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
    cols: tuple[list, ...] = tuple([] for _ in range(15))  # type: ignore[type-arg]  # DecodeRun's columns, in order
    (handles, requests, abis, guards, heads, ptxns, stxns, committed, accepted, layers, workspace, rows, outputs,
     tokens, calls) = cols
    ws = batch.workspace_bytes
    for i, s, after in members:
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
    return DecodeRun(source_instance, mono, wall, prefix, first, local_sequence + 1, *map(tuple, cols))
