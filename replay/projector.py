"""The projector: a deterministic fold of the journal, in global order, into per-handle
state, byte ledgers, byte-time and the facts service metrics are derived from.

Per-handle state comes from `engine.evolve.evolve`, the same fold the command service
uses, so replay cannot disagree with what the service decided. Everything else is a
side table updated by the few event types that change it; an event costs O(1) however
many handles are live. Reports (snapshots, metrics, windows) are computed on demand
from the fold's state, never per event.

The whole projection state serializes with msgspec (msgpack), so a checkpoint stored
in the journal database resumes to exactly the state a full replay reaches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from msgspec.structs import replace as _replace

from kvledger.engine.evolve import APPLY
from kvledger.engine.state import HandleState, OpenTxn, enc_hook, grown
from kvledger.journal.port import FoldItem, StepRun, StepValues
from kvledger.replay.kv_blocks import KvBlocks, KvBlockState
from kvledger.replay.ledger import LedgerAccumulator, LedgerPoint, LedgerState
from kvledger.replay.runs import RunFold
from kvledger.replay.work import Work
from kvledger.schemas import events as ev
from kvledger.schemas.canonical import canonical_json, sha256_hex
from kvledger.schemas.errors import ErrorCode, KvLedgerError

# Bump when the meaning of ProjectionState changes. Its shape (including engine's
# HandleState) is in FORMAT by its JSON schema, so a checkpoint written by other code is
# ignored and the projection rebuilt, never misread.
MEANING = 1


class ProjectionState(msgspec.Struct, kw_only=True):
    format: str = ""
    position: int = 0
    last_event_id: str | None = None
    handles: dict[str, HandleState] = {}
    outcomes: dict[str, str] = {}  # "finished" or "cancelled": a release forgets which
    inherited: dict[str, int] = {}  # fork child -> outputs it inherited (not its own)
    work: dict[str, Work] = {}
    ledger: LedgerState = msgspec.field(default_factory=LedgerState)
    kv: KvBlockState = msgspec.field(default_factory=KvBlockState)  # KV-event streams' block pools


FORMAT = f"{MEANING}:{sha256_hex(canonical_json(msgspec.json.schema(ProjectionState)))[:16]}"
_encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)  # a state's grown outputs as tuples
_decoder = msgspec.msgpack.Decoder(ProjectionState)


class Projector:
    """Feed events in global order (`feed`, or `apply` for one); read the result with
    `replay.report.build`."""

    __slots__ = ("position", "last_event_id", "handles", "outcomes", "inherited", "work", "ledger",
                 "trajectory", "kv", "runs")

    def __init__(self, state: ProjectionState | None = None, *, trajectory: bool = False) -> None:
        state = state if state is not None else ProjectionState()
        # The fold's state lives in slots, not in the Struct: apply reads and writes it
        # for every event, and a slot is the cheapest place to do that.
        self.position = state.position
        self.last_event_id = state.last_event_id
        self.handles = state.handles
        self.outcomes = state.outcomes
        self.inherited = state.inherited
        self.work = state.work
        self.ledger = LedgerAccumulator(state.ledger)
        self.kv = KvBlocks(state.kv)
        # Recording a sample per event costs more than the fold itself: only on request.
        self.trajectory: list[LedgerPoint] | None = [] if trajectory else None
        self.runs = RunFold()

    # -- checkpoints ---------------------------------------------------------------

    def snapshot(self) -> ProjectionState:
        """A detached copy of the state (HandleStates are frozen and shared)."""
        return ProjectionState(
            format=FORMAT, position=self.position, last_event_id=self.last_event_id,
            handles=dict(self.handles),
            outcomes=dict(self.outcomes), inherited=dict(self.inherited),
            work={k: Work(w.rows, w.pairs, w.publishes) for k, w in self.work.items()},
            ledger=self.ledger.state(), kv=self.kv.copy(),
        )

    def dump(self) -> bytes:
        return _encoder.encode(self.snapshot())

    @classmethod
    def load(cls, data: bytes, *, trajectory: bool = False) -> Projector | None:
        """A projector resumed from `dump()` bytes; None if they are from another
        format (the caller replays from the start instead)."""
        try:
            state = _decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if state.format != FORMAT:
            return None
        return cls(state, trajectory=trajectory)

    # -- the fold ------------------------------------------------------------------

    def apply(self, e: ev.Event) -> None:
        self.feed((e,))

    def feed(self, events: Iterable[FoldItem]) -> Projector:
        """Apply events in global order. A decode step read back whole (journal.steps'
        StepValues) is applied at once when its handle is in the plain state for it, as
        its three events otherwise; a run of them (StepRun) by replay.runs."""
        try:
            self._feed(events)
        finally:
            self.runs.flush(self)  # what the runs left in arrays, into the state
        return self

    def _feed(self, events: Iterable[FoldItem]) -> None:
        """One loop with its state in locals: this is the per-event cost of every
        replay, so nothing here is a call it does not need."""
        handles, ls, hooks, trajectory = self.handles, self.ledger, _HOOKS, self.trajectory
        runs, live = self.runs, self.runs.live  # handles whose state is in runs' arrays
        apply = APPLY  # engine.evolve.evolve's dispatch, without its call frame
        position = self.position
        applied: Any = None
        try:
            for e in events:
                pos = e.global_position
                if pos != position + 1:
                    raise KvLedgerError(
                        ErrorCode.CORRUPT_JOURNAL,
                        f"event {getattr(e, 'first_event_id', e.event_id)} is at global position {pos}, "
                        f"expected {position + 1} (run `kvledger verify`)",
                    )
                cls = e.__class__
                if cls is StepRun:
                    self._keep(position, applied)  # what this call applied so far, before the run goes in
                    runs.hold(self, e)  # type: ignore[arg-type]  # the class, checked
                    position, applied = self.position, None
                    continue
                if runs.held:  # folded before anything else: the ledger is one sequence
                    runs.settle(self)
                if live and e.stream_id in live:  # type: ignore[union-attr]  # a StepRun went on above
                    runs.flush(self)
                if cls is StepValues:
                    if trajectory is None and self._step(e):  # type: ignore[arg-type]  # the class, checked
                        position, applied = pos + 2, e
                        continue
                    self._keep(position, applied)  # what this call applied so far, before the events go in
                    self._feed(e.events())  # type: ignore[union-attr]  # the class, checked above
                    position, applied = self.position, None
                    continue
                if cls in _KV:  # an engine's block pool: its own fold, no handle, no ledger clock
                    self.kv.apply(e)  # type: ignore[arg-type]  # _KV holds exactly those classes
                    position, applied = pos, e
                    continue
                # The clock, inlined from LedgerAccumulator.advance.
                t = e.monotonic_ns  # type: ignore[union-attr]  # a StepRun went on above
                end = ls.end_ns
                if end is None:
                    ls.start_ns = ls.end_ns = ls.mark_ns = t
                elif t > end:
                    ls.end_ns = t
                sid = e.stream_id  # type: ignore[union-attr]  # as above
                old = handles.get(sid)
                try:
                    new = apply[cls](old, e)
                except Exception as exc:  # noqa: BLE001 - any fold failure means a bad journal
                    raise KvLedgerError(
                        ErrorCode.CORRUPT_JOURNAL,
                        f"event {e.event_id} at position {pos} cannot be applied to {sid}: {exc} "
                        "(run `kvledger verify`)",
                    ) from None
                handles[sid] = new
                position, applied = pos, e
                hook = hooks.get(cls)  # type: ignore[arg-type]  # a StepValues went on above
                if hook is None:
                    ls.workspace = 0  # workspace is event-local
                else:
                    hook(self, old, new, e)
                if trajectory is not None:
                    trajectory.append(LedgerPoint(pos, t, e.event_type, sid,  # type: ignore[union-attr]  # as above
                                                  ls.values()))
        finally:
            self._keep(position, applied)  # whatever was applied is applied: a failure names where it got to

    def _keep(self, position: int, applied: Any) -> None:
        """Store the loop's position and last applied event (None: it applied nothing)."""
        if applied is not None:
            self.position, self.last_event_id = position, applied.event_id

    def _step(self, x: StepValues) -> bool:
        """A decode step's three events applied at once: the state, side tables and
        ledger each event would leave, in one change (tests/test_replay_steps.py compares
        the two over whole journals; a handle's first publication owns its bytes here as
        in the publication's hook, through `resize`). False, with nothing changed: the
        handle is not in the state that step needs (unknown, no single open append with
        its txn, a verify append), and the caller applies its events one by one."""
        sid = x.stream_id
        old = self.handles.get(sid)
        ls = self.ledger
        if old is None:
            return False
        txns = old.open_txns
        if len(txns) != 1:
            return False
        txn = txns[0]
        if txn.txn_id != x.publish_txn or txn.kind == "verify":
            return False
        t = x.monotonic_ns
        ls.advance(t)  # the three events share one time
        v, c, token = x.snapshot + 1, x.committed, x.token
        outputs, output_ns = grown(old.outputs, old.output_ns, (token,), (t,))
        new = _replace(old, stream_position=x.stream_position + 2, snapshot_version=v, committed_length=c,
                       logits_ready=False, open_txns=(OpenTxn(x.start_txn, "decode", v, c, 1, (token,)),),
                       outputs=outputs, output_ns=output_ns)
        self.handles[sid] = new
        # _on_publish's work and ledger, then the emit's and the start's zero workspace
        work = self.work.get(sid)
        if work is None:
            work = self.work[sid] = Work()
        start, n = txn.interval_start, txn.interval_count
        work.rows += n
        work.pairs += n * start + n * (n + 1) // 2
        work.publishes += 1
        ls.resize(sid, new, x.global_position, x.workspace)
        ls.workspace = 0
        return True

    # -- hooks: the event types that change a side table ---------------------------

    def _on_publish(self, old: HandleState, new: HandleState, e: ev.AppendPublishEvent) -> None:
        p = e.payload
        sid = e.stream_id
        txns = old.open_txns
        txn = txns[0] if len(txns) == 1 else old.open_txn(p.txn_id)  # one open is the rule
        assert txn is not None  # the fold has just applied this publish to its open txn
        start, n = txn.interval_start, txn.interval_count
        work = self.work.get(sid)
        if work is None:
            work = self.work[sid] = Work()
        # Every staged row was computed, accepted or not; row i sees keys [0, i].
        work.rows += n
        work.pairs += n * start + n * (n + 1) // 2
        work.publishes += 1
        self.ledger.resize(sid, new, e.global_position, p.workspace_bytes)

    def _on_fork(self, old: HandleState | None, new: HandleState, e: ev.ForkEvent) -> None:
        self.inherited[e.stream_id] = len(e.payload.token_ids) - e.payload.prompt_length
        self.ledger.resize(e.stream_id, new, e.global_position)

    def _on_truncate(self, old: HandleState, new: HandleState, e: ev.TruncateEvent) -> None:
        if e.stream_id in self.ledger.owners:
            self.ledger.resize(e.stream_id, new, e.global_position)
        else:
            self.ledger.workspace = 0

    def _on_release(self, old: HandleState, new: HandleState, e: ev.ReleaseEvent) -> None:
        self.ledger.disown(e.stream_id)

    def _on_finish(self, old: HandleState, new: HandleState, e: ev.FinishEvent) -> None:
        self.outcomes[e.stream_id] = "finished"
        self.ledger.workspace = 0

    def _on_cancel(self, old: HandleState, new: HandleState, e: ev.CancelRequestEvent) -> None:
        self.outcomes[e.stream_id] = "cancelled"
        self.ledger.workspace = 0


# Keyed by the event's class: each hook takes an event of that class (Any: the dispatch
# pairs them), the handle's state before it (None only for a fork's new child) and after.
_Hook = Callable[[Projector, Any, HandleState, Any], None]
_HOOKS: dict[type[ev.Event], _Hook] = {
    ev.AppendPublishEvent: Projector._on_publish,
    ev.ForkEvent: Projector._on_fork,
    ev.TruncateEvent: Projector._on_truncate,
    ev.ReleaseEvent: Projector._on_release,
    ev.FinishEvent: Projector._on_finish,
    ev.CancelRequestEvent: Projector._on_cancel,
}


_KV = frozenset(ev.KV_EVENT_CLASSES)
