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

from collections.abc import Sequence

from kvledger.engine import lanes as ln
from kvledger.engine.ids import new_block
from kvledger.engine.state import HandleState
from kvledger.journal.contract import Operation
from kvledger.journal.port import DecodeRun
from kvledger.schemas.decode_batch import DecodeBatch


def plan_step(s: HandleState, batch: DecodeBatch, i: int, local_sequence: int,
              source_instance: str, mono: int, wall: int) -> Operation | None:
    """The operation of step i of `batch`, a plain step (engine.decide_batch) decided on
    the handle in state `s` (its events' local sequence numbers follow `local_sequence`),
    or None: a run of one step, as an Operation."""
    if not runnable(batch, i):
        return None
    run = plan_run(batch, i, [s], local_sequence, source_instance, mono, wall)
    return None if run is None else run.operation(0)


def runnable(batch: DecodeBatch, i: int) -> bool:
    """Step i's caller-given values have the types a run's columns hold: what the
    fingerprint encodes as given."""
    return type(batch.tokens[i]) is int and type(batch.workspace(i)) is int


def all_runnable(batch: DecodeBatch) -> bool:
    """`runnable` of every step of `batch`, a column at a time."""
    ws = batch.workspace_bytes
    return set(map(type, batch.tokens)) == {int} and (ws is None or set(map(type, ws)) == {int})


# What a run takes from the states its steps were decided on, in DecodeRun's order: request
# ids, generations, snapshots, stream positions, prefix identities, the open append's rows, layers.
StateColumns = tuple[Sequence[str], Sequence[int], Sequence[int], Sequence[int], Sequence[str], Sequence[int],
                     Sequence[int]]


def plan_run(batch: DecodeBatch, start: int, befores: Sequence[HandleState], local_sequence: int,
             source_instance: str, mono: int, wall: int) -> DecodeRun | None:
    """The run of the batch's plain steps start, start + 1, ...: one for each state in
    `befores` (distinct handles, each step `runnable` and plain: engine.decide_batch), its
    events' local sequence numbers following `local_sequence`. None when its ids cannot be
    one block (seeded). The run's columns are the batch's, sliced, but for those the
    states give (a plain step's output index is len(s.outputs): plain_after); the head a
    plain step leaves follows from the one it was decided on (DecodeRun.head)."""
    states = (tuple(s.request_id for s in befores), tuple(s.generation for s in befores),
              tuple(s.snapshot_version for s in befores), tuple(s.stream_position for s in befores),
              tuple(s.prefix_identity_sha256 for s in befores),
              tuple(s.open_txns[0].interval_count for s in befores), tuple(s.num_layers for s in befores))
    return _run(batch, slice(start, start + len(befores)), states, local_sequence, source_instance, mono, wall)


def plan_lanes(batch: DecodeBatch, held: ln.Columns, local_sequence: int, source_instance: str, mono: int,
               wall: int) -> DecodeRun | None:
    """plan_run of every step of `batch`, decided in the lanes (engine.lanes: `held`, its
    handles' columns there): the same run, its states' columns gathered by slot. None
    when a step is not `runnable` or its ids cannot be one block."""
    if not all_runnable(batch):
        return None
    states = (held.objs_of(ln.REQUEST), held.ints_of(ln.G), held.ints_of(ln.V), held.ints_of(ln.P),
              held.objs_of(ln.PREFIX), held.ints_of(ln.COUNT), held.ints_of(ln.LAYERS))
    return _run(batch, slice(0, len(batch)), states, local_sequence, source_instance, mono, wall)


def _run(batch: DecodeBatch, at: slice, states: StateColumns, local_sequence: int, source_instance: str,
         mono: int, wall: int) -> DecodeRun | None:
    """The run of the batch's steps `at` (a tuple's whole slice is the tuple itself), decided
    on states whose columns are `states`; None when its ids cannot be one block."""
    n = at.stop - at.start
    block = new_block(4 * n)
    if block is None:
        return None
    prefix, first = block
    requests, generations, snapshots, positions, prefixes, accepted, layers = states
    ws = batch.workspace_bytes
    calls = (None,) * n if batch.call_ids is None else tuple(map(batch.call, range(at.start, at.stop)))
    return DecodeRun(
        source_instance, mono, wall, prefix, first, local_sequence + 1, batch.handle_ids[at], tuple(requests),
        batch.cache_abi_sha256[at], tuple(generations), tuple(snapshots), tuple(positions), tuple(prefixes),
        batch.txn_ids[at], batch.next_txn_ids[at], batch.positions[at], tuple(accepted), tuple(layers),
        (0,) * n if ws is None else ws[at], batch.rows_sha256[at], batch.output_indexes[at], batch.tokens[at], calls)
