"""One command through decide and evolve: the general path, the definition of every command.

A command is decided step by step (a Chain's steps in order, each later one bound to the
state the steps before it leave), each draft stamped into an event by the caller and
folded into the state. The command service stamps with ids and clocks; a pure caller
(engine.decide_batch asking what the general path says of a step) stamps placeholders:
the decision and the states do not depend on an event's ids or clocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from kvledger.engine import commands as c
from kvledger.engine.decide import Draft, decide
from kvledger.engine.evolve import evolve
from kvledger.engine.state import HandleState
from kvledger.schemas import events as ev
from kvledger.schemas.errors import ErrorCode, KvLedgerError

# (draft, the state of its handle before it, the step that drafted it) -> its event
Stamp = Callable[[Draft, HandleState | None, c.Command], ev.Event]


class Applied(NamedTuple):
    written: dict[str, HandleState]  # the handles the command writes, as it leaves them
    by_handle: dict[str, list[ev.Event]]  # its events, per handle, in order
    events: list[ev.Event]
    drafts: list[Draft]  # the last step's


def steps_of(cmd: c.Command) -> tuple[c.Command, ...]:
    if not isinstance(cmd, c.Chain):
        return (cmd,)
    if not cmd.steps or any(s.handle_id != cmd.handle_id for s in cmd.steps):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "a chain needs steps, all on its handle")
    if c.unnamed_base(cmd.steps[0]) is not None:  # the first step is the chain's fence
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "a chain's first step must name its base")
    return cmd.steps


def apply(cmd: c.Command, before: Mapping[str, HandleState | None], stamp: Stamp) -> Applied:
    """Decide `cmd` against `before` (every handle it acts on), stamping each draft;
    KvLedgerError with the first refusal's code and message."""
    after: dict[str, HandleState | None] = dict(before)
    written: dict[str, HandleState] = {}
    events: list[ev.Event] = []
    by_handle: dict[str, list[ev.Event]] = {}
    drafts: list[Draft] = []
    for step in steps_of(cmd):
        # Only a chain's later steps may leave their base to the steps before them.
        if (isinstance(cmd, c.Chain) and step is not cmd and (s := after[cmd.handle_id]) is not None
                and isinstance(step, c.Step) and c.unnamed_base(step)):
            step = c.bind(step, s.generation, s.snapshot_version)
        drafts = decide(after, step)
        for d in drafts:
            event = stamp(d, after.get(d.handle_id), step)
            after[d.handle_id] = written[d.handle_id] = evolve(after.get(d.handle_id), event)
            events.append(event)
            by_handle.setdefault(d.handle_id, []).append(event)
    return Applied(written, by_handle, events, drafts)


def general_after(states: Mapping[str, HandleState | None], cmd: c.Command | c.Relative,
                  monotonic_ns: int = 0) -> dict[str, HandleState]:
    """What the general path leaves of the handles `cmd` writes, decided against
    `states` as the command service decides it (a Relative command bound to them
    first), or its refusal raised: the same code and message, since the same functions
    decide. Events are stamped with placeholders."""
    if isinstance(cmd, c.Relative):
        cmd = c.bind_current(cmd.command, lambda h: states.get(h))
    before = {h: states.get(h) for h in c.handles_of(cmd)}

    def placeholder(d: Draft, state: HandleState | None, step: c.Command) -> ev.Event:
        return _placeholder(d, state, monotonic_ns)

    return apply(cmd, before, placeholder).written


def _placeholder(d: Draft, state: HandleState | None, monotonic_ns: int) -> ev.Event:
    return d.event_cls(
        event_id="-", stream_id=d.handle_id, stream_position=(0 if state is None else state.stream_position) + 1,
        schema_version=ev.CURRENT_VERSION[d.event_cls.event_type],
        request_id="-" if state is None else state.request_id,
        handle_generation=0 if state is None else state.generation, operation_id="-", source_instance="-",
        local_sequence=0, monotonic_ns=monotonic_ns, observed_wall_time=0,
        payload=d.payload,  # type: ignore[arg-type]  # decide pairs each event class with its payload (Draft)
    )
