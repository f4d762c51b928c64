"""What the command service planned to write: one operation (`Plan`), or a decode
batch's leading plain steps as one run (`RunPlan`), and how a plain step's chain is bound
when a retry or a hook needs it as a command."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import msgspec

from kvledger.engine import commands as c
from kvledger.engine import lanes
from kvledger.engine.state import HandleState
from kvledger.journal.contract import Operation
from kvledger.journal.port import DecodeRun
from kvledger.schemas import events as ev
from kvledger.schemas.decode_batch import DecodeBatch
from kvledger.schemas.receipts import Receipt


@dataclass(slots=True)  # one a decode step: slots make it cheaper to build and read
class Plan:
    # As decided: bound, with its operation id. None for a plain step of a decode batch, whose
    # bound chain is built by command() only if a retry or a refusal hook needs it.
    cmd: c.Command | None
    planned: Operation | tuple[DecodeRun, int]  # its operation, or the run and index it is a step of
    states: dict[str, HandleState]
    stamped: list[ev.Event]  # its events; empty when op.step holds them as values
    chain: c.Chain | Callable[[], c.Chain] | None = None  # a plain step's chain, or how to build it

    @property
    def op(self) -> Operation:
        """Its operation (a run's step's built here, once: for retries, hooks and messages)."""
        if isinstance(self.planned, tuple):
            run, i = self.planned
            self.planned = run.operation(i)
        return self.planned

    @property
    def events(self) -> list[ev.Event]:
        """Its events; a plain step's are built here, once (for hooks and strict checks)."""
        if self.op.step is not None and not self.stamped:
            self.stamped = list(self.op.step.events())
        return self.stamped

    def command(self) -> c.Command:
        if self.cmd is None:
            chain = self.chain() if callable(self.chain) else self.chain
            base = self.op.writes[0].expected
            assert chain is not None and base is not None  # a plain step keeps its chain, and writes an existing handle
            self.cmd = msgspec.structs.replace(_bound(chain, base.generation, base.snapshot_version),
                                               operation_id=self.op.operation_id)
        return self.cmd

    def handles(self) -> tuple[str, ...]:
        if isinstance(self.planned, tuple):
            return (self.planned[0].handle_ids[self.planned[1]],)
        return (self.op.writes[0].handle_id,) if self.cmd is None else c.handles_of(self.cmd)

    def wrote(self, r: Receipt) -> bool:
        """`r` is this plan's commit, not an earlier one's receipt answered to a retry of
        its operation id (event ids are unique: the first tells them apart)."""
        if isinstance(self.planned, tuple):
            return r.event_ids[:1] == (self.planned[0].first_event_id(self.planned[1]),)
        if self.op.step is not None:
            return r.event_ids[:1] == (self.op.step.first_event_id,)
        return r.event_ids == tuple([e.event_id for e in self.stamped])


@dataclass(slots=True)
class RunPlan:
    """A batch's leading plain steps as one run: the run, the batch, and the state each
    step leaves (step i of the batch, the run's step i), or, for a batch decided in the
    lanes (engine.lanes), its handles' columns there. A step's Plan is made only when
    the run is not written whole (each step then settles, and is retried, as an
    operation) or a hook wants its events."""

    run: DecodeRun
    steps: DecodeBatch
    afters: list[HandleState] | None  # None: the lanes' run, whose states are built only if needed
    held: lanes.Columns | None = None

    def plans(self, afters: Sequence[HandleState] | None) -> list[tuple[int, Plan]]:
        """Each step's Plan; with no `afters`, Plans that settle no state (for hooks)."""
        handles = self.steps.handle_ids
        return [(i, Plan(None, (self.run, i), {} if afters is None else {handles[i]: afters[i]}, [],
                         partial(c.batch_chain, self.steps, i)))
                for i in range(len(self.run))]


def _bound(chain: c.Chain, generation: int, snapshot_version: int) -> c.Chain:
    """A Relative decode chain bound as bind_current binds a chain: its first step, the
    publish, takes the base (whatever base it carried); the later ones follow from it."""
    first, *rest = chain.steps
    publish = msgspec.structs.replace(first, base_generation=generation, base_snapshot_version=snapshot_version)
    return msgspec.structs.replace(chain, steps=(publish, *rest))
