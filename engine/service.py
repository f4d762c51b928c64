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
from typing import TYPE_CHECKING, NoReturn, Self, TypeVar

import msgspec

from kvledger.engine import commands as c
from kvledger.engine import lanes
from kvledger.engine.batch_plan import plan_lanes, plan_run, plan_step, runnable
from kvledger.engine.chain import apply
from kvledger.engine.decide import Draft
from kvledger.engine.decide_batch import decide_batch, plain_after
from kvledger.engine.evolve import fold
from kvledger.engine.heads import guard, head
from kvledger.engine.ids import new_id
from kvledger.engine.plans import Plan, RunPlan
from kvledger.engine.port import Clock, CommandPort, CommitHook, RejectHook, Results
from kvledger.engine.state import HandleState
from kvledger.journal.contract import Check, Operation, Rejection, StreamWrite
from kvledger.journal.port import RETRY_S, STEP_VERSIONS, TRANSIENT, Journal, RunReceipts, RunThen, retried
from kvledger.schemas import events as ev
from kvledger.schemas.canonical import canonical_json
from kvledger.schemas.codec import decode_event, encode_event
from kvledger.schemas.decode_batch import DecodeBatch
from kvledger.schemas.decode_batch import validate as validate_batch
from kvledger.schemas.decode_fingerprint import DECODE_CHAIN
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt

MAX_ATTEMPTS = 64

T = TypeVar("T")


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


class BatchSurface(ABC):
    """execute, execute_many and the context manager, built on `submit_many` and
    `close`: the same for this process's service and kvledger.engine.remote's writer process."""

    @abstractmethod
    def submit_many(self, cmds: Sequence[c.Command | c.Relative], *,
                    defer: bool = True) -> Callable[[], Results]: ...

    @abstractmethod
    def close(self) -> None: ...

    def execute(self, cmd: c.Command | c.Relative) -> Receipt:
        [result] = self.execute_many([cmd])
        if isinstance(result, KvLedgerError):
            raise result
        return result

    def execute_many(self, cmds: Sequence[c.Command | c.Relative]) -> Results:
        """Decide every command and commit the accepted ones in one journal transaction.
        Commands on the same handle apply in order. Results are positional.

        A Relative command is bound once, to the state the commands before it in this
        batch leave (publish, then emit from that publication, then start the next
        append). It names concrete bases from then on, so a retry after contention is
        still fenced like any other command."""
        return self.submit_many(cmds, defer=False)()

    def submit_steps(self, steps: DecodeBatch, *,
                     defer: bool = True) -> Callable[[], Results]:
        """submit_batch of the steps alone, one result a step."""
        return self.submit_batch(steps, (), defer=defer)

    def submit_batch(self, steps: DecodeBatch, cmds: Sequence[c.Command | c.Relative], *,
                     defer: bool = True) -> Callable[[], Results]:
        """submit_many of the steps' chains (c.batch_step) followed by `cmds`, in one
        commit; results are positional over both. No command may act on a step's
        handle. Sent as chains here; this process's service decides plain steps from
        the columns."""
        steps.check()
        return self.submit_many([*(c.batch_step(steps, i) for i in range(len(steps))), *cmds], defer=defer)

    def execute_steps(self, steps: DecodeBatch) -> Results:
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
    states: lanes.States = field(default_factory=lanes.States)
    local_sequence: int = 0
    # Commands from outside (the public API) are checked against the events' schema before
    # anything is decided or written: a field outside it would poison every later replay.
    # The worker's own commands are built valid and skip the cost.
    strict: bool = False
    # How long a call the database left unanswered (journal.port.TRANSIENT: a restart, a
    # lost session, a busy lock) is asked again, a commit with the same operations; 0:
    # raised at once, the outcome of a commit then unknown and the caller's to retry.
    retry_s: float = RETRY_S

    # -- state -------------------------------------------------------------------

    def state(self, handle_id: str, *, refresh: bool = False) -> HandleState | None:
        cached = self.states.get(handle_id)
        if cached is not None and not refresh:
            return cached
        after = cached.stream_position if cached is not None else 0
        state = fold(self._retried(lambda: self.journal.read_stream(handle_id, after=after)), cached)
        if state is not None:
            self.states[handle_id] = state
        return state

    # -- commands ----------------------------------------------------------------

    def close(self) -> None:
        """Nothing to release here (the caller owns the journal); kvledger.engine.remote's
        service, which has a writer process to stop, has the same method."""

    def submit_many(self, cmds: Sequence[c.Command | c.Relative], *,
                    defer: bool = True) -> Callable[[], Results]:
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
                     defer: bool = True) -> Callable[[], Results]:
        """submit_many of the steps' chains followed by `cmds`, one commit, results
        positional over both. The steps are decided at once (engine.decide_batch), at
        one clock reading, and a plain one goes to the journal as its values
        (engine.batch_plan), with no command struct; any other is decided by the
        general path as `c.batch_step(steps, i)`, so every refusal is its chain's. A
        handle's steps apply in order; no command may act on a step's handle (the
        steps, decided first, would not be what it is decided against)."""
        n = len(steps)
        if self.strict:
            steps = validate_batch(steps)
        else:
            steps.check()
        if self.strict or not _STAMPED:
            return super().submit_batch(steps, cmds, defer=defer)  # each step as its chain
        given: list[c.Command | c.Relative | None] = [None] * n + list(cmds)  # a step's chain only if needed
        results: list[Receipt | KvLedgerError | None] = [None] * len(given)
        planned: list[tuple[int, Plan]] = []
        mono, wall = self.clock.monotonic_ns(), self.clock.wall_ns()
        run = self._lane_run(steps, cmds, mono, wall) if n >= lanes.FEW else None
        if run is not None:  # every step plain: the commands after it are decided as ever
            return self._commit(given, results, self._decide(given, results, range(n, len(given))), defer, run)
        handles = steps.handle_ids
        states = {h: self.state(h) for h in handles}
        decided = decide_batch(steps, states, mono)
        local: dict[str, HandleState | None] = {}  # as the steps before leave a handle
        run = self._run(steps, states, decided.plain, local, mono, wall)
        for i in range(0 if run is None else len(run.run), n):
            after = decided.plain[i]
            h = handles[i]
            s = local[h] if h in local else self.state(h)
            op = None if after is None or s is None else plan_step(
                s, steps, i, self.local_sequence, self.source_instance, mono, wall)
            if op is None:  # the general path gives its refusal, or stamps its events
                given[i] = c.batch_step(steps, i)
                planned += self._decide(given, results, (i,), local)
            else:
                assert after is not None
                self.local_sequence += 3
                local[h] = after
                planned.append((i, Plan(None, op, {h: after}, [], partial(c.batch_chain, steps, i))))
        planned += self._decide(given, results, range(n, len(given)))
        return self._commit(given, results, planned, defer, run)

    def _lane_run(self, steps: DecodeBatch, cmds: Sequence[c.Command | c.Relative], mono: int, wall: int
                  ) -> RunPlan | None:
        """The whole batch as one run decided in the lanes (engine.lanes), or None: a step
        that is not plain there, or a command acting on a step's handle."""
        if cmds:
            on = set(steps.handle_ids)
            if any(not on.isdisjoint(c.handles_of(x)) for x in cmds):
                return None
        held = self.states.decide(steps, self.state)
        if held is None:
            return None
        run = plan_lanes(steps, held, self.local_sequence, self.source_instance, mono, wall)
        if run is None:
            return None
        self.local_sequence += 3 * len(steps)
        return RunPlan(run, steps, None, held)

    def _afters(self, run: RunPlan) -> list[HandleState]:
        """The state each step of the run leaves, the lanes' run's built from the states
        its steps were decided on (taken out of the lanes)."""
        if run.afters is None:
            steps, mono = run.steps, run.run.monotonic_ns
            run.afters = []
            for i, h in enumerate(steps.handle_ids):
                after = plain_after(self.states[h], steps.txn_ids[i], steps.output_indexes[i], steps.tokens[i],
                                    steps.next_txn_ids[i], steps.positions[i], steps.cache_abi_sha256[i], mono)
                assert after is not None  # the lanes decided each step plain
                run.afters.append(after)
        return run.afters

    def _run(self, steps: DecodeBatch, states: Mapping[str, HandleState | None], plain: Sequence[HandleState | None],
             local: dict[str, HandleState | None], mono: int, wall: int) -> RunPlan | None:
        """The batch's leading plain steps on distinct handles, as one run
        (journal.decode_run; the batch's order is the journal's), decided on `states`;
        the states they leave go into `local`. None: no such step, or ids are seeded."""
        befores: list[HandleState] = []
        afters: list[HandleState] = []
        seen: set[str] = set()
        handles = steps.handle_ids
        for i, after in enumerate(plain):
            h = handles[i]
            s = states[h]
            if h in seen or after is None or s is None or not runnable(steps, i):
                break
            seen.add(h)
            befores.append(s)
            afters.append(after)
        if not afters:
            return None
        run = plan_run(steps, 0, befores, self.local_sequence, self.source_instance, mono, wall)
        if run is None:
            return None
        self.local_sequence += 3 * len(afters)
        local.update(zip(handles, afters))
        return RunPlan(run, steps, afters)

    def _commit(self, cmds: list[c.Command | c.Relative | None], results: list[Receipt | KvLedgerError | None],
                planned: list[tuple[int, Plan]], defer: bool, run: RunPlan | None = None
                ) -> Callable[[], Results]:
        """Append the run (the batch's first steps) and the planned operations after it,
        deferred or not; the function that waits for them, decides again what contention
        refused, and returns the results. A step of a decode batch is bound in `cmds`
        only when a retry or a hook needs it."""
        first = self._send(planned, defer, run) if planned or run else None
        plans = dict(planned)

        def command(i: int) -> c.Command | c.Relative:
            plan = plans.get(i)
            if plan is not None and plan.cmd is None:  # a plain step: bound as the general path binds it
                cmds[i] = plan.command()
            found = cmds[i]
            assert found is not None  # submit_batch leaves a slot empty only for a plan
            return found

        def wait() -> Results:
            outcomes = first() if first is not None else []
            whole: Sequence[Receipt]
            pending: list[tuple[int, Plan]]
            if run is not None and not planned and type(outcomes) is RunReceipts:  # the run alone, written whole
                self._settle_run(run, outcomes)
                if len(outcomes) == len(results):
                    return Results((), outcomes)
                whole, pending = outcomes, []  # the rest were refused when decided
            else:
                whole, pending = self._settle_first(results, planned, outcomes, run, plans)
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
                append = partial(self.journal.append, [p.op for _, p in again])
                pending = self._settle(results, again, self._retried(append, what="a commit"))
            for i, p in pending:
                results[i] = KvLedgerError(ErrorCode.STALE_BASE, f"{p.op.operation_id}: gave up after "
                                                                 f"{MAX_ATTEMPTS} contended attempts")
            if self.on_reject:
                for i, r in enumerate(results):
                    if isinstance(r, KvLedgerError):
                        for hook in self.on_reject:
                            hook(command(i), r)
            # the loops above fill every slot but the run's, written whole
            return Results(results[len(whole):], whole)  # type: ignore[arg-type]

        return wait

    def _send(self, planned: list[tuple[int, Plan]], defer: bool, run: RunPlan | None
              ) -> Callable[[], Sequence[Receipt | Rejection]]:
        """Append the run and the planned operations after it; the function that waits
        for the outcomes. A commit a restarting database or a lost session left unknown
        is sent again, the same operations, until it lands (journal.port.retried)."""
        ops = [p.op for _, p in planned]

        def send(defer: bool) -> Callable[[], Sequence[Receipt | Rejection]]:
            if run is not None:
                return self.journal.append_run(run.run, ops, defer=defer)
            if defer:
                return self.journal.append_deferred(ops)
            outcomes = self.journal.append(ops)
            return lambda: outcomes

        try:
            first = send(defer)
        except KvLedgerError as exc:
            if exc.code not in TRANSIENT:
                raise
            first = partial(_reraise, exc)  # asked again when waited for
        return lambda: self._retried(first, lambda: send(False)(), what="a commit")

    def _decide(self, cmds: list[c.Command | c.Relative | None], results: list[Receipt | KvLedgerError | None],
                todo: Sequence[int], local: dict[str, HandleState | None] | None = None) -> list[tuple[int, Plan]]:
        """Build, key and plan the commands at `todo` in order, each against the states
        the earlier ones leave (starting from `local`, which it updates, over the cached
        ones); a refused one gets its result now."""
        local = {} if local is None else local
        planned: list[tuple[int, Plan]] = []
        strict = self.strict
        # Handles to allocate that this service has not seen: one read for all of them
        # instead of a stream read each (the guarded write still refuses one that appears).
        # Not for commands from outside, which are checked one by one below first.
        new = [] if strict else [h for i in todo if type(cmd := cmds[i]) is c.Allocate
                                 and type(h := cmd.handle_id) is str and h not in self.states]
        if new:
            found = self._retried(lambda: self.journal.existing(new))
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

    def _settle_first(self, results: list[Receipt | KvLedgerError | None], planned: list[tuple[int, Plan]],
                      outcomes: Sequence[Receipt | Rejection], run: RunPlan | None, plans: dict[int, Plan]
                      ) -> tuple[Sequence[Receipt], list[tuple[int, Plan]]]:
        """Settle a commit's first outcomes: the run's receipts when the journal wrote it
        whole (returned), then the planned operations'; or, the run's steps one by one
        with them (`plans` learns theirs). Returns the operations to decide again."""
        if run is not None and type(outcomes) is RunThen:  # the run written whole, then the others
            self._settle_run(run, outcomes.run)
            return outcomes.run, self._settle(results, planned, outcomes.rest)
        if run is not None:  # its steps settle, and are retried, one by one
            stepped = run.plans(self._afters(run))
            plans.update(stepped)
            planned = stepped + planned
        return (), self._settle(results, planned, outcomes)

    def _settle_run(self, run: RunPlan, receipts: RunReceipts) -> None:
        """Record a run the journal wrote whole, the batch's only operations: fresh ids
        (the journal found none stored), so each step wrote its receipt."""
        if run.held is not None:
            self.states.lanes.settle(run.held, run.steps, run.run.monotonic_ns)
        else:
            assert run.afters is not None  # a run not of the lanes carries its states
            self.states.update(zip(run.steps.handle_ids, run.afters))
        if self.on_commit:
            for k, (_, plan) in enumerate(run.plans(None)):
                receipt = receipts[k]
                for hook in self.on_commit:
                    hook(receipt, plan.events)

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

    def _retried(self, call: Callable[[], T], again: Callable[[], T] | None = None, what: str = "a read") -> T:
        return retried(call, again, what=what, seconds=self.retry_s)

    def _explain(self, cmd: c.Command, exc: KvLedgerError) -> Receipt | KvLedgerError:
        """A command that no longer decides may be a retry of one already committed."""
        op_id = cmd.operation_id
        receipt = None if op_id is None else self._retried(lambda: self.journal.receipt(op_id))
        if receipt is None:
            return exc
        if receipt.fingerprint == cmd.fingerprint():
            return receipt
        return KvLedgerError(ErrorCode.CONFLICT, f"operation {cmd.operation_id} was committed "
                                                 "with another fingerprint")

    def _plan(self, cmd: c.Command, operation_id: str, local: Mapping[str, HandleState | None]) -> Plan:
        before = {h: local[h] if h in local else self.state(h) for h in c.handles_of(cmd)}
        now_mono, now_wall = self.clock.monotonic_ns(), self.clock.wall_ns()

        def stamp(d: Draft, state: HandleState | None, step: c.Command) -> ev.Event:
            event = self._stamp(d, state, step, operation_id, before, now_mono, now_wall)
            if self.strict:
                _decodable(event)
            return event

        written, by_handle, events, drafts = apply(cmd, before, stamp)
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


# A step's values rebuild its events at the port's STEP_VERSIONS: at any other, a decode
# batch's steps are stamped as events, checked as any other operation's.
_STAMPED = tuple(ev.CURRENT_VERSION[cls.event_type] for cls in DECODE_CHAIN) == STEP_VERSIONS


def _reraise(exc: KvLedgerError) -> NoReturn:
    raise exc


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
