"""The decode lane: a worker's plain decode step planned from its values.

A decode step (publish the running append, emit the token its logits chose, start the
append that processes that token) is most of what a serving journal writes. In the form
a worker sends it (a Relative chain whose later steps leave their bases to the chain,
no step with an operation id of its own, or the same as columns: schemas.decode_batch.DecodeBatch), every
field of its three events and its fingerprint follows from a handful of values and the
handle's state. This module plans such a step from those values: the state it leaves
(engine.decode_step.plain_after), its ids, its fingerprint
(schemas.decode_fingerprint.step_fingerprint) and the values a record stores of it
(journal.steps.StepValues), handed to the journal as Operation.step with no event structs.

Anything it does not plan (another form, seeded ids, a digest or id not in a row's form)
returns None, and the caller takes the path that stamps events, which gives every
refusal its exact code and message. tests/test_decode_step.py holds the two paths to
the same journal, row for row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvledger.engine import commands as c
from kvledger.engine.decode_step import decode_shape, plain_after
from kvledger.engine.heads import guard, head
from kvledger.engine.ids import new_counted
from kvledger.engine.port import CommandPort
from kvledger.engine.state import HandleState
from kvledger.journal.contract import Operation, StreamWrite
from kvledger.journal.steps import StepValues, counter_of, row_parts
from kvledger.schemas.decode_batch import BatchBuilder, DecodeBatch
from kvledger.schemas.decode_fingerprint import step_fingerprint
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.events import ForwardCall
from kvledger.schemas.receipts import Receipt

# handle_id, txn_id, rows_sha256, workspace_bytes, output_index, token, next_txn_id,
# position (where the next append starts), cache ABI, the next append's model call
Values = tuple[str, str, str | None, int, int, int, str, int, str, ForwardCall | None]


def chain_values(chain: c.Chain) -> Values | None:
    """The values of a chain in the lane's form, or None. Neither the publication's base
    nor the chain's operation id is looked at: a Relative chain has neither (its base is
    the handle's), and the caller of a bound one checks them."""
    steps = decode_shape(chain)
    if steps is None or not own_form(*steps):
        return None
    publish, emit, start = steps
    return (chain.handle_id, publish.txn_id, publish.rows_sha256, publish.workspace_bytes, emit.output_index,
            emit.token_id, start.txn_id, start.interval_start, start.cache_abi_sha256, start.call)


def own_form(publish: c.Publish, emit: c.EmitOutput, start: c.BeginAppend) -> bool:
    """A decode step in the worker's own form: no step with an operation id of its own,
    the later two leaving their bases to the chain. Its fingerprint is then a function of
    its events (schemas.decode_fingerprint), and a record marks it derived."""
    return (publish.operation_id is None and emit.operation_id is None and start.operation_id is None
            and emit.base_generation is None and emit.base_snapshot_version is None
            and start.base_generation is None and start.base_snapshot_version is None)


def split_steps(cmds: Sequence[c.Command | c.Relative]) -> tuple[DecodeBatch, list[int]] | None:
    """The batch's Relative decode chains in the lane's form whose handle no other
    command of the batch acts on, as one DecodeBatch (step j is `cmds[at[j]]`, exactly:
    `c.batch_step(batch, j) == cmds[at[j]]` up to the publication's base, which a Relative
    chain leaves to the state), with their positions `at`; None if there are none."""
    acts: dict[str, int] = {}
    found: list[tuple[int, Values]] = []
    for i, cmd in enumerate(cmds):
        inner = cmd.command if isinstance(cmd, c.Relative) else cmd
        for handle in c.handles_of(inner):
            acts[handle] = acts.get(handle, 0) + 1
        if type(cmd) is c.Relative and type(inner) is c.Chain and inner.operation_id is None:
            x = chain_values(inner)
            if x is not None:
                found.append((i, x))
    picked = [(i, x) for i, x in found if acts[x[0]] == 1]
    if not picked:
        return None
    batch = BatchBuilder()
    for _, (h, txn, rows, workspace, output_index, token, next_txn, at, abi, call) in picked:
        batch.add(h, txn, at, output_index, token, next_txn, rows, abi, workspace_bytes=workspace, call=call)
    return batch.build(), [i for i, _ in picked]


def submit_split(port: CommandPort, cmds: Sequence[c.Command | c.Relative], *,
                 defer: bool = True) -> Callable[[], list[Receipt | KvLedgerError]]:
    """A producer's iteration in one commit: its plain decode steps as one DecodeBatch
    (split_steps), the rest as commands (port.submit_batch); the results come back in
    the order of `cmds`."""
    split = split_steps(cmds)
    if split is None:
        return port.submit_many(cmds, defer=defer)
    steps, at = split
    taken = set(at)
    order = at + [i for i in range(len(cmds)) if i not in taken]
    wait = port.submit_batch(steps, [cmds[i] for i in order[len(at):]], defer=defer)

    def results() -> list[Receipt | KvLedgerError]:
        got = wait()
        out = list(got)
        for j, i in enumerate(order):
            out[i] = got[j]
        return out

    return results


def columns_values(batch: DecodeBatch, i: int) -> Values:
    return (batch.handle_ids[i], batch.txn_ids[i], batch.rows_sha256[i], batch.workspace(i),
            batch.output_indexes[i], batch.tokens[i], batch.next_txn_ids[i], batch.positions[i],
            batch.cache_abi_sha256[i], batch.call(i))


def plan_step(s: HandleState, x: Values, operation_id: str | None, local_sequence: int, source_instance: str,
              mono: int, wall: int) -> tuple[Operation, HandleState] | None:
    """The operation of the decode step `x` on the handle in state `s` (its events'
    local sequence numbers follow `local_sequence`) and the state it leaves, or None.
    Ids are drawn only once everything else holds: a new operation id unless one is
    given (it must be of engine.ids' form), then the three events'."""
    h, txn_id, rows, workspace, output_index, token, next_txn, at, abi, call = x
    if type(token) is not int or type(workspace) is not int:  # what the row and fingerprint encode as given
        return None
    after = plain_after(s, txn_id, output_index, token, next_txn, at, abi, mono)
    parts = row_parts(rows, call)
    if after is None or parts is None:
        return None
    if operation_id is None:
        drawn = new_counted()
        if drawn is None:  # seeded ids have no counters
            return None
        prefix, n = drawn
    else:
        counted = counter_of(operation_id)
        if counted is None:
            return None
        prefix, n = operation_id[:16], counted
    e1, e2, e3 = new_counted(), new_counted(), new_counted()
    if e1 is None or e2 is None or e3 is None or not e1[0] == e2[0] == e3[0] == prefix:
        return None  # seeded, a forked child's new prefix, or another writer's operation id
    g, v = s.generation, s.snapshot_version
    digest, counted_call = parts
    values = StepValues(
        0, h, s.request_id, g, source_instance, abi, s.stream_position + 1, local_sequence + 1, mono, wall,
        prefix, n, (e1[1] - n, e2[1] - e1[1], e3[1] - e2[1]), txn_id, next_txn, v, at, s.open_txns[0].interval_count,
        s.num_layers, workspace, digest, len(s.outputs), token, counted_call)
    op = Operation(operation_id or f"{prefix}{n:016x}",
                   step_fingerprint(h, txn_id, g, v, workspace, rows, len(s.outputs), token, next_txn, at, abi, call),
                   (StreamWrite(h, guard(s), head(after), ()),), derived=True, stamped=True,
                   step=values)
    return op, after
