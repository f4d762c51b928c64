"""The command service: load state, decide, stamp, append through the conditional write.

State is cached per handle and trusted only as far as the journal's guard agrees: a
STALE_BASE from the journal means another writer moved the head, so the service
re-reads that stream and decides again. If the command itself named the old base,
the second decide rejects it; otherwise it commits against the new head.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Self

import msgspec

from kvledger.engine import commands as c
from kvledger.engine.decide import Draft, decide
from kvledger.engine.decode_lane import Values, chain_values, columns_values, own_form, plan_step
from kvledger.engine.decode_step import decode_after, decode_payloads
from kvledger.engine.evolve import evolve, fold
from kvledger.engine.heads import guard, head
from kvledger.engine.ids import new_id
from kvledger.engine.port import Clock, CommandPort, CommitHook, RejectHook
from kvledger.engine.state import HandleState
from kvledger.journal.contract import Check, Journal, Operation, Rejection, StreamWrite
from kvledger.journal.steps import VERSIONS as STEP_VERSIONS
from kvledger.schemas import events as ev
from kvledger.schemas.canonical import canonical_json
from kvledger.schemas.codec import decode_event, encode_event
from kvledger.schemas.decode_batch import DecodeBatch
from kvledger.schemas.decode_batch import validate as validate_batch
from kvledger.schemas.decode_fingerprint import DECODE_CHAIN
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt

MAX_ATTEMPTS = 64


class SystemClock:
    def monotonic_ns(self) -> int:
        return time.monotonic_ns()

    def wall_ns(self) -> int:
        return time.time_ns()


class ManualClock:
    """A clock its caller sets, in ms: tests and fixtures state when an event happens,
    and their journals regenerate byte for byte."""

    WALL_EPOCH_NS = 1_700_000_000_000_000_000

    def __init__(self) -> None:
        self.ns = 0

    def at(self, ms: float) -> ManualClock:
        self.ns = round(ms * 1_000_000)
        return self

    def monotonic_ns(self) -> int:
        return self.ns

    def wall_ns(self) -> int:
        return self.WALL_EPOCH_NS + self.ns


@dataclass(slots=True)  # one a decode step: slots make it cheaper to build and read
class Plan:
    # As decided: bound, with its operation id. None for a step of the decode lane, whose
    # bound chain is built by command() only if a retry or a refusal hook needs it.
    cmd: c.Command | None
    op: Operation
    states: dict[str, HandleState]
    stamped: list[ev.Event]  # its events; empty when op.step holds them as values
    chain: c.Chain | Callable[[], c.Chain] | None = None  # the lane's step as its caller gave it

    @property
    def events(self) -> list[ev.Event]:
        """Its events; a lane step's are built here, once (for hooks and strict checks)."""
        if self.op.step is not None and not self.stamped:
            self.stamped = list(self.op.step.events())
        return self.stamped

    def command(self) -> c.Command:
        if self.cmd is None:
            chain = self.chain() if callable(self.chain) else self.chain
            base = self.op.writes[0].expected
            assert chain is not None and base is not None  # the lane keeps its chain, and writes an existing handle
            self.cmd = msgspec.structs.replace(_bound(chain, base.generation, base.snapshot_version),
                                               operation_id=self.op.operation_id)
        return self.cmd

    def handles(self) -> tuple[str, ...]:
        return (self.op.writes[0].handle_id,) if self.cmd is None else c.handles_of(self.cmd)

    def wrote(self, r: Receipt) -> bool:
        """`r` is this plan's commit, not an earlier one's receipt answered to a retry of
        its operation id (event ids are unique: the first tells them apart)."""
        if self.op.step is not None:
            return r.event_ids[:1] == (self.op.step.first_event_id,)
        return r.event_ids == tuple([e.event_id for e in self.stamped])


class BatchSurface(ABC):
    """execute, execute_many and the context manager, built on `submit_many` and
    `close`: the same for this process's service and kvledger.engine.remote's writer process."""

    @abstractmethod
    def submit_many(self, cmds: Sequence[c.Command | c.Relative], *,
                    defer: bool = True) -> Callable[[], list[Receipt | KvLedgerError]]: ...

    @abstractmethod
    def close(self) -> None: ...

    def execute(self, cmd: c.Command | c.Relative) -> Receipt:
        [result] = self.execute_many([cmd])
        if isinstance(result, KvLedgerError):
            raise result
        return result

    def execute_many(self, cmds: Sequence[c.Command | c.Relative]) -> list[Receipt | KvLedgerError]:
        """Decide every command and commit the accepted ones in one journal transaction.
        Commands on the same handle apply in order. Results are positional.

        A Relative command is bound once, to the state the commands before it in this
        batch leave (publish, then emit from that publication, then start the next
        append). It names concrete bases from then on, so a retry after contention is
        still fenced like any other command."""
        return self.submit_many(cmds, defer=False)()

    def submit_steps(self, steps: DecodeBatch, *,
                     defer: bool = True) -> Callable[[], list[Receipt | KvLedgerError]]:
        """submit_batch of the steps alone, one result a step."""
        return self.submit_batch(steps, (), defer=defer)

    def submit_batch(self, steps: DecodeBatch, cmds: Sequence[c.Command | c.Relative], *,
                     defer: bool = True) -> Callable[[], list[Receipt | KvLedgerError]]:
        """submit_many of the steps' chains (c.batch_step) followed by `cmds`, in one
        commit; results are positional over both. No command may act on a step's
        handle. Sent as chains here; this process's service decides plain steps from
        the columns."""
        steps.check()
        return self.submit_many([*(c.batch_step(steps, i) for i in range(len(steps))), *cmds], defer=defer)

    def execute_steps(self, steps: DecodeBatch) -> list[Receipt | KvLedgerError]:
        return self.submit_steps(steps, defer=False)()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class CommandService(BatchSurface):
    journal: Journal
    source_instance: str = "kvledger"
    clock: Clock = field(default_factory=SystemClock)
    on_commit: list[CommitHook] = field(default_factory=list)
    on_reject: list[RejectHook] = field(default_factory=list)
    states: dict[str, HandleState] = field(default_factory=dict)
    local_sequence: int = 0
    # Commands from outside (the public API) are checked against the events' schema before
    # anything is decided or written: a field outside it would poison every later replay.
    # The worker's own commands are built valid and skip the cost.
    strict: bool = False
    # engine.decode_step decides the worker's plain decode chain in one call; off, every
    # command takes the general path (tests compare the two, and it bisects a doubt).
    fast_decode: bool = True
    # The decode lane hands the journal a step's values (journal.steps.StepValues, what a
    # record stores) instead of three event structs; off, it stamps the events (tests
    # compare the two: the journal's bytes are the same).
    step_values: bool = True

    # -- state -------------------------------------------------------------------

    def state(self, handle_id: str, *, refresh: bool = False) -> HandleState | None:
        cached = self.states.get(handle_id)
        if cached is not None and not refresh:
            return cached
        after = cached.stream_position if cached is not None else 0
        state = fold(self.journal.read_stream(handle_id, after=after), cached)
        if state is not None:
            self.states[handle_id] = state
        return state

    # -- commands ----------------------------------------------------------------

    def close(self) -> None:
        """Nothing to release here (the caller owns the journal); kvledger.engine.remote's
        service, which has a writer process to stop, has the same method."""

    def submit_many(self, cmds: Sequence[c.Command | c.Relative], *,
                    defer: bool = True) -> Callable[[], list[Receipt | KvLedgerError]]:
        """execute_many in two halves: decide and write now, and return a function that
        waits for the commit to be durable and returns the results (see
        Journal.append_deferred; `defer=False` commits before returning). The caller may
        compute meanwhile (the worker runs its next model call), but must call it before
        using this service again. Nothing is acknowledged, and no state or hook sees the
        batch, before it returns."""
        given: list[c.Command | c.Relative | None] = list(cmds)
        results: list[Receipt | KvLedgerError | None] = [None] * len(given)
        return self._commit(given, results, self._decide(given, results, range(len(given))), defer)

    def submit_batch(self, steps: DecodeBatch, cmds: Sequence[c.Command | c.Relative], *,
                     defer: bool = True) -> Callable[[], list[Receipt | KvLedgerError]]:
        """submit_many of the steps' chains followed by `cmds`, one commit, results
        positional over both. A plain step is planned by the decode lane straight from
        the columns (engine.decode_lane), with no command struct; any other takes the
        general path as `c.batch_step(steps, i)`, so every refusal is the chain's. The
        steps are decided at one clock reading. No command may act on a step's handle
        (the steps, decided first, would not be what it is decided against)."""
        n = len(steps)
        if self.strict:
            steps = validate_batch(steps)
        else:
            steps.check()
        if not self._lane or len(set(steps.handle_ids)) != n:
            return super().submit_batch(steps, cmds, defer=defer)  # as chains
        given: list[c.Command | c.Relative | None] = [None] * n + list(cmds)  # a step's chain only if needed
        results: list[Receipt | KvLedgerError | None] = [None] * len(given)
        planned: list[tuple[int, Plan]] = []
        mono, wall = self.clock.monotonic_ns(), self.clock.wall_ns()
        for i in range(n):
            s = self.state(steps.handle_ids[i])
            base = steps.base(i)
            plan = None if s is None or (base is not None and base != (s.generation, s.snapshot_version)) \
                else self._lane_plan(s, columns_values(steps, i), None, mono, wall)
            if plan is None:
                given[i] = c.batch_step(steps, i)
                planned += self._decide(given, results, (i,))
            else:
                plan.chain = partial(c.batch_chain, steps, i)
                planned.append((i, plan))
        planned += self._decide(given, results, range(n, len(given)))
        return self._commit(given, results, planned, defer)

    def _commit(self, cmds: list[c.Command | c.Relative | None], results: list[Receipt | KvLedgerError | None],
                planned: list[tuple[int, Plan]], defer: bool) -> Callable[[], list[Receipt | KvLedgerError]]:
        """Append the planned operations (deferred or not); the function that waits for
        them, decides again what contention refused, and returns the results. A step of
        the decode lane is bound in `cmds` only when a retry or a hook needs it."""
        first = None
        if planned:
            ops = [p.op for _, p in planned]
            if defer:
                first = self.journal.append_deferred(ops)
            else:
                outcomes = self.journal.append(ops)
                first = lambda: outcomes  # noqa: E731 - the already-known outcome as the wait function
        plans = dict(planned)

        def command(i: int) -> c.Command | c.Relative:
            plan = plans.get(i)
            if plan is not None and plan.cmd is None:  # the lane's: bound as the general path binds it
                cmds[i] = plan.command()
            found = cmds[i]
            assert found is not None  # submit_batch leaves a slot empty only for a plan
            return found

        def wait() -> list[Receipt | KvLedgerError]:
            pending = self._settle(results, planned, first()) if first is not None else []
            for _ in range(MAX_ATTEMPTS - 1):
                if not pending:
                    break
                for i, _ in pending:
                    command(i)
                again = self._decide(cmds, results, [i for i, _ in pending])
                plans.update(again)
                if not again:
                    pending = []
                    break
                pending = self._settle(results, again, self.journal.append([p.op for _, p in again]))
            for i, p in pending:
                results[i] = KvLedgerError(ErrorCode.STALE_BASE, f"{p.op.operation_id}: gave up after "
                                                                 f"{MAX_ATTEMPTS} contended attempts")
            if self.on_reject:
                for i, r in enumerate(results):
                    if isinstance(r, KvLedgerError):
                        for hook in self.on_reject:
                            hook(command(i), r)
            return results  # type: ignore[return-value]  # the loops above fill every slot

        return wait

    def _decide(self, cmds: list[c.Command | c.Relative | None], results: list[Receipt | KvLedgerError | None],
                todo: Sequence[int]) -> list[tuple[int, Plan]]:
        """Build, key and plan the commands at `todo` in order, each against the states
        the earlier ones leave; a refused one gets its result now."""
        local: dict[str, HandleState | None] = {}
        planned: list[tuple[int, Plan]] = []
        fast, strict = self.fast_decode, self.strict
        # Handles to allocate that this service has not seen: one read for all of them
        # instead of a stream read each (the guarded write still refuses one that appears).
        # Not for commands from outside, which are checked one by one below first.
        new = [] if strict else [h for i in todo if type(cmd := cmds[i]) is c.Allocate
                                 and type(h := cmd.handle_id) is str and h not in self.states]
        if len(new) > 1:
            found = self.journal.existing(new)
            local.update((h, None) for h in new if h not in found)
        for i in todo:
            cmd = cmds[i]
            assert cmd is not None  # what is to be decided was filled in (_commit)
            if strict:
                try:
                    cmd = cmds[i] = c.validate(cmd)
                except KvLedgerError as exc:  # not even its operation id can be looked up
                    results[i] = exc
                    continue
            if fast and type(cmd) is c.Relative and (plan := self._relative_decode(cmd.command, local)) is not None:
                if strict:
                    try:  # what the general path checks of each event it stamps
                        for event in plan.events:
                            _decodable(event)
                    except KvLedgerError as exc:
                        results[i] = exc
                        continue
                if plan.cmd is not None:  # else the lane's step: bound by _commit if needed
                    cmds[i] = plan.cmd
                local.update(plan.states)
                planned.append((i, plan))
                continue
            try:
                if isinstance(cmd, c.Relative):
                    cmd = cmds[i] = c.bind_current(cmd.command,
                                                   lambda h: local[h] if h in local else self.state(h))
                operation_id = cmd.operation_id
                if operation_id is None:
                    operation_id = new_id()
                    cmd = cmds[i] = msgspec.structs.replace(cmd, operation_id=operation_id)
                plan = self._plan(cmd, operation_id, local)
            except KvLedgerError as exc:
                results[i] = self._explain(cmd, exc) if isinstance(cmd, c.Command) else exc
                continue
            local.update(plan.states)
            planned.append((i, plan))
        return planned

    def _settle(self, results: list[Receipt | KvLedgerError | None], planned: list[tuple[int, Plan]],
                outcomes: Sequence[Receipt | Rejection]) -> list[tuple[int, Plan]]:
        """Record the journal's outcomes; return the commands to decide again."""
        pending: list[tuple[int, Plan]] = []
        # A command decided on the planned effects of an earlier one in this batch must
        # not be retried alone when that one was refused: its base never existed, and
        # a later successor could carry the same version numbers (the ABA shape).
        broken: set[str] = set()
        for (i, plan), out in zip(planned, outcomes):
            if broken and not broken.isdisjoint(touched := plan.handles()):
                broken.update(touched)
                results[i] = KvLedgerError(ErrorCode.STALE_BASE, f"{plan.op.operation_id}: an "
                                           "earlier command of this batch on the same handle was refused")
                continue
            if isinstance(out, Receipt):
                results[i] = out
                if plan.wrote(out):
                    self.states.update(plan.states)
                    for hook in self.on_commit:
                        hook(out, plan.events)
                else:  # a retry answered with the original receipt: nothing new written
                    for h in plan.states:
                        self.state(h, refresh=True)
            elif out.code == ErrorCode.CONFLICT:
                broken.update(plan.handles())
                results[i] = KvLedgerError(ErrorCode.CONFLICT, out.message)
            else:  # the head moved under us: re-read and decide again
                touched = plan.handles()
                broken.update(touched)
                for h in touched:
                    self.state(h, refresh=True)
                pending.append((i, plan))
        return pending

    def _explain(self, cmd: c.Command, exc: KvLedgerError) -> Receipt | KvLedgerError:
        """A command that no longer decides may be a retry of one already committed."""
        receipt = None if cmd.operation_id is None else self.journal.receipt(cmd.operation_id)
        if receipt is None:
            return exc
        if receipt.fingerprint == cmd.fingerprint():
            return receipt
        return KvLedgerError(ErrorCode.CONFLICT, f"operation {cmd.operation_id} was committed "
                                                 "with another fingerprint")

    def _plan(self, cmd: c.Command, operation_id: str, local: Mapping[str, HandleState | None]) -> Plan:
        if type(cmd) is c.Chain and self.fast_decode and not self.strict:
            h = cmd.handle_id
            s = local[h] if h in local else self.state(h)
            if s is not None and (plan := self._plan_decode(cmd, operation_id, s)) is not None:
                return plan
        before = {h: local[h] if h in local else self.state(h) for h in c.handles_of(cmd)}
        now_mono, now_wall = self.clock.monotonic_ns(), self.clock.wall_ns()
        after: dict[str, HandleState | None] = dict(before)
        written: dict[str, HandleState] = {}  # the handles this command writes, as it leaves them
        events: list[ev.Event] = []
        by_handle: dict[str, list[ev.Event]] = {}
        for step in self._steps(cmd):
            # Only a chain's later steps may leave their base to the steps before them.
            if (isinstance(cmd, c.Chain) and step is not cmd and (s := after[cmd.handle_id]) is not None
                    and isinstance(step, c.Step) and c.unnamed_base(step)):
                step = c.bind(step, s.generation, s.snapshot_version)
            drafts = decide(after, step)
            for d in drafts:
                event = self._stamp(d, after.get(d.handle_id), step, operation_id, before,
                                    now_mono, now_wall)
                if self.strict:
                    _decodable(event)
                after[d.handle_id] = written[d.handle_id] = evolve(after.get(d.handle_id), event)
                events.append(event)
                by_handle.setdefault(d.handle_id, []).append(event)
        writes = tuple(
            StreamWrite(h, guard(before[h]), head(written[h]), tuple(evs))
            for h, evs in by_handle.items()
        )
        checks = tuple(Check(h, guard(s)) for h, s in before.items()
                       if h not in by_handle and s is not None)
        manifests: tuple[tuple[str, bytes], ...] = ()
        if isinstance(cmd, c.Allocate):
            p = drafts[0].payload
            assert isinstance(p, ev.RequestAllocate)  # decide's one draft for an allocation
            manifests = ((p.manifest_sha256, canonical_json(cmd.manifest)),)
        op = Operation(operation_id, cmd.fingerprint(), writes, checks, manifests)
        return Plan(cmd, op, written, events)

    @property
    def _lane(self) -> bool:
        """Plain decode steps go to the journal as values (engine.decode_lane)."""
        return self.step_values and _STAMPED and not self.strict

    def _lane_plan(self, s: HandleState, x: Values, operation_id: str | None, mono: int, wall: int) -> Plan | None:
        planned = plan_step(s, x, operation_id, self.local_sequence, self.source_instance, mono, wall)
        if planned is None:
            return None
        op, after = planned
        self.local_sequence += 3
        return Plan(None, op, {s.handle_id: after}, [])

    def _relative_decode(self, chain: c.Command, local: Mapping[str, HandleState | None]) -> Plan | None:
        """A Relative decode chain bound and planned in one go, as bind_current binds a
        chain (its first step, a publish, takes the handle's base): by the decode lane, or
        with a new operation id by _plan_decode; None: the general path decides it (and
        gives any refusal)."""
        if type(chain) is not c.Chain or chain.operation_id is not None:
            return None
        steps = chain.steps
        if len(steps) != 3 or type(steps[0]) is not c.Publish:
            return None
        h = chain.handle_id
        s = local[h] if h in local else self.state(h)
        if s is None:
            return None
        if self._lane and (x := chain_values(chain)) is not None:
            plan = self._lane_plan(s, x, None, self.clock.monotonic_ns(), self.clock.wall_ns())
            if plan is not None:
                plan.chain = chain
                return plan
        return self._plan_decode(_bound(chain, s.generation, s.snapshot_version), None, s)

    def _plan_decode(self, cmd: c.Chain, operation_id: str | None, s: HandleState) -> Plan | None:
        """_plan for a plain decode chain (engine.decode_step), or None. No operation id:
        a new one, taken only once the chain decides here (ids are drawn in the general
        path's order, so a seeded run is the same either way). A chain that names its
        operation id (a retry of a Relative one) may still go by the decode lane."""
        publish = cmd.steps[0] if cmd.steps else None
        if (operation_id is not None and self._lane and type(publish) is c.Publish
                and publish.base_generation == s.generation and publish.base_snapshot_version == s.snapshot_version
                and (x := chain_values(cmd)) is not None
                and (plan := self._lane_plan(s, x, operation_id, self.clock.monotonic_ns(),
                                             self.clock.wall_ns())) is not None):
            plan.cmd = cmd
            return plan
        mono = self.clock.monotonic_ns()
        after = decode_after(s, cmd, mono)
        if after is None:
            return None
        publish, emit, start = cmd.steps
        assert type(publish) is c.Publish and type(emit) is c.EmitOutput and type(start) is c.BeginAppend  # as accepted
        # The chain's own form (the worker's): its fingerprint is a function of its events
        # (schemas.decode_fingerprint rebuilds it on read), and the journal stores a mark
        # for it instead of 32 bytes. tests/test_decode_step.py holds the two equal.
        derived = own_form(publish, emit, start)
        fingerprint = cmd.fingerprint()
        if operation_id is None:
            operation_id = new_id()
            cmd = msgspec.structs.replace(cmd, operation_id=operation_id)
        wall = self.clock.wall_ns()
        h, position, seq = s.handle_id, s.stream_position, self.local_sequence
        self.local_sequence = seq + 3
        envelope = dict(stream_id=h, request_id=s.request_id, handle_generation=s.generation,
                        operation_id=operation_id, source_instance=self.source_instance,
                        monotonic_ns=mono, observed_wall_time=wall)
        events: tuple[ev.Event, ...] = tuple(
            cls(event_id=new_id(), stream_position=position + i, schema_version=version,
                local_sequence=seq + i, payload=p, **envelope)
            for i, (cls, version, p) in enumerate(zip(_DECODE_CLASSES, _DECODE_VERSIONS,
                                                      decode_payloads(s, cmd, after)), 1))
        op = Operation(operation_id, fingerprint, (StreamWrite(h, guard(s), head(after), events),),
                       derived=derived, stamped=_STAMPED)
        return Plan(cmd, op, {h: after}, list(events))

    @staticmethod
    def _steps(cmd: c.Command) -> tuple[c.Command, ...]:
        if not isinstance(cmd, c.Chain):
            return (cmd,)
        if not cmd.steps or any(s.handle_id != cmd.handle_id for s in cmd.steps):
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "a chain needs steps, all on its handle")
        if c.unnamed_base(cmd.steps[0]) is not None:  # the first step is the chain's fence
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "a chain's first step must name its base")
        return cmd.steps

    def _stamp(self, d: Draft, state: HandleState | None, cmd: c.Command, operation_id: str,
               before: Mapping[str, HandleState | None], mono: int, wall: int) -> ev.Event:
        if state is not None:
            generation, request_id, position = state.generation, state.request_id, state.stream_position
        elif isinstance(cmd, c.Allocate):
            generation, position = cmd.generation, 0
            request_id = cmd.manifest.request_identity.request_id
        else:  # a fork child
            assert isinstance(cmd, c.Fork) and isinstance(d.payload, ev.Fork)
            parent = before[cmd.parent_handle_id]
            assert parent is not None  # decide refuses a fork of no handle
            i = d.payload.child_index
            request_id = (cmd.child_request_ids[i] if cmd.child_request_ids
                          else f"{parent.request_id}.{i}")
            generation, position = 0, 0
        self.local_sequence += 1
        return d.event_cls(
            event_id=new_id(), stream_id=d.handle_id, stream_position=position + 1,
            schema_version=ev.CURRENT_VERSION[d.event_cls.event_type], request_id=request_id,
            handle_generation=generation, operation_id=operation_id,
            source_instance=self.source_instance, local_sequence=self.local_sequence,
            # decide pairs each event class with its own payload type (Draft): mypy sees the unions
            monotonic_ns=mono, observed_wall_time=wall, payload=d.payload,  # type: ignore[arg-type]
        )


_DECODE_CLASSES = DECODE_CHAIN  # the order schemas.decode_fingerprint reads them back in
_DECODE_VERSIONS = tuple(ev.CURRENT_VERSION[cls.event_type] for cls in _DECODE_CLASSES)
# A step row rebuilds its events at journal.steps.VERSIONS: at any other, they are stored
# as events, checked as any other operation's.
_STAMPED = _DECODE_VERSIONS == STEP_VERSIONS


def _bound(chain: c.Chain, generation: int, snapshot_version: int) -> c.Chain:
    """A Relative decode chain bound as bind_current binds a chain: its first step, the
    publish, takes the base (whatever base it carried); the later ones follow from it."""
    first, *rest = chain.steps
    publish = msgspec.structs.replace(first, base_generation=generation, base_snapshot_version=snapshot_version)
    return msgspec.structs.replace(chain, steps=(publish, *rest))


def _decodable(event: ev.Event) -> None:
    """Refuse an event the journal's own decoder would refuse when read back. Commands are
    checked field by field (commands.validate); this also covers what decide derives from
    them and from the manifest (a fork child's request id, a NaN temperature, ...)."""
    try:
        decode_event(encode_event(event))
    except KvLedgerError as exc:
        code = ErrorCode.INVALID_ARGUMENT if exc.code is ErrorCode.MALFORMED_EVENT else exc.code
        raise KvLedgerError(code, f"its {event.event_type} event would not decode: {exc.message}") from None
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError) as exc:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT,
                            f"its {event.event_type} event cannot be encoded: {exc}") from None


if TYPE_CHECKING:
    def _implements_port(service: CommandService) -> CommandPort:
        return service  # mypy checks CommandService against the port here


__all__ = ["CommandService", "ManualClock", "Rejection", "SystemClock"]
