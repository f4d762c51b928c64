"""The operation of a decided plain decode step, as the journal's DecodeStep.

engine.decide_batch decides a step and gives the state it leaves; this turns it into the
Operation the journal appends: its ids (an operation id and three event ids, drawn in
the general path's order), its fingerprint (schemas.decode_fingerprint, the one its
chain's command gives) and the step's facts in their events' form (journal.contract's
DecodeStep), with no event structs: the journal derives what a record stores of it.
None when a step has no such form (seeded ids, a value of another type): the caller
plans it by the general path, which stamps its events.
"""

from __future__ import annotations

from kvledger.engine.heads import guard, head
from kvledger.engine.ids import new_counted
from kvledger.engine.state import HandleState
from kvledger.journal.contract import Operation, StreamWrite
from kvledger.journal.port import DecodeStep
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
