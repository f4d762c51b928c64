"""The serving worker: an iteration-level loop (first come, first served) whose every
state change goes through the journal.

One iteration = one journal commit + the model calls it authorizes:
  commit:  publications of the calls that just ran, the outputs sampled from them,
           failures of the appends whose call raised, forks, truncates, reorders,
           cancels, finishes, releases, new arrivals, and the append_start of every
           append the next calls will run;
  calls:   one prefill call (ragged chunks), one decode call (one row per request),
           one verify call (speculative drafts), each staged into the K/V store.
K/V rows become visible only when the commit that publishes them returns; an output
is emitted in the same commit as the publication whose logits chose it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import torch
from torch import Tensor

from kvledger.engine import commands as c
from kvledger.engine.gather import add_step
from kvledger.engine.ids import new_id
from kvledger.engine.port import CommandPort
from kvledger.engine.state import HandleState
from kvledger.journal import tuning
from kvledger.schemas.canonical import layers_sha256
from kvledger.schemas.decode_batch import BatchBuilder
from kvledger.schemas.events import AppendKind, ForwardCall
from kvledger.schemas.manifest import (
    ArtifactIdentity,
    CacheSchema,
    Manifest,
    PositionContract,
    RequestPolicy,
    RopeConfig,
    SamplingPolicy,
    ScalarType,
    cache_abi_sha256,
    new_manifest,
)
from kvledger.schemas.receipts import Receipt
from kvledger.worker.executor import CallShape, Member, run_call
from kvledger.worker.kvstore import KVStore
from kvledger.worker.loading import DTYPE_NAMES, require_context
from kvledger.worker.model import Transformer

log = logging.getLogger("kvledger.worker")


class RequestSpec(msgspec.Struct, frozen=True):
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    arrival_step: int = 0
    n: int = 1  # parallel samples: n - 1 forks at the prompt
    speculate: int = 0  # drafts per verify (prompt lookup); greedy only


@dataclass
class Live:
    handle: str
    spec: RequestSpec
    seed: int  # sampling seed; each draw is seeded by (seed, output index): no hidden RNG state
    outputs: list[int] = field(default_factory=list)
    logits: Tensor | None = None  # next-token logits of the newest publication
    greedy: int | None = None  # their argmax, when the call computed it
    forked: bool = False
    done: str | None = None  # finish reason, "cancelled", or None while running
    abi: str = ""  # cache ABI digest of the handle (chain steps name it without reading state)
    failures: int = 0  # appends of this handle that ended in a failure event


@dataclass
class Planned:
    handle: str
    txn: str
    kind: AppendKind
    past: int
    tokens: tuple[int, ...]


@dataclass
class Ran:
    planned: Planned
    logits: Tensor  # [R, V]: last row, or every row for verify
    accepted: int
    rows_sha256: str  # schemas.canonical.layers_sha256 of the accepted rows' per-layer digests
    correction: int | None = None  # verify: the token chosen after the accepted drafts
    greedy: int | None = None  # argmax of the last row, computed for the whole call at once


Ok = Callable[[Receipt | None], None]  # a command's receipt (None: journaling off)
Err = Callable[[Exception], None]  # why it was refused
Entry = tuple[c.Command | c.Relative, Ok | None, Err | None]


@dataclass
class _Inflight:
    done: Callable[[], set[str]]  # Worker._submit's: waits, applies, names the refused handles
    ran: list[Ran]  # the calls it started


def _command(e: Entry | _Chain) -> c.Command:
    cmd = e.first if isinstance(e, _Chain) else e[0]
    return cmd.command if isinstance(cmd, c.Relative) else cmd


class _Chain:
    """A handle's publication and what follows it in the same iteration (the output it
    chose, the next append's start), submitted as one engine Chain: one decision, one
    guarded write, one receipt. The publication names the real base; the later steps
    leave theirs to the chain. Any other command on the handle ends the chain."""

    def __init__(self, handle: str, first: c.Publish, ok: Ok | None, err: Err | None) -> None:
        self.handle, self.first = handle, first
        self.steps: list[c.Step] = []
        self.oks, self.errs = [ok], [err]

    def add(self, step: c.Step, err: Err | None = None) -> None:
        self.steps.append(step)
        self.errs.append(err)

    def entry(self) -> Entry:
        if not self.steps:
            return (c.Relative(self.first), self.oks[0], self.errs[0])
        return (c.Relative(c.Chain(handle_id=self.handle, steps=(self.first, *self.steps))), *self.callbacks())

    def callbacks(self) -> tuple[Ok, Err]:
        def ok(r: Receipt | None) -> None:
            for f in self.oks:
                if f:
                    f(r)

        def err(exc: Exception) -> None:
            for f in self.errs:
                if f:
                    f(exc)

        return ok, err

    def add_to(self, steps: BatchBuilder) -> bool:
        """Add this chain to `steps` if it is a decode step (engine.gather.decode_shape);
        else False."""
        return add_step(steps, (self.first, *self.steps))


class Worker:
    def __init__(self, model: Transformer, *, service: CommandPort | None, artifact: ArtifactIdentity,
                 max_running: int = 16, prefill_chunk: int = 64, prefill_tokens: int = 256,
                 capacity: int = 512, device: str = "cpu", pipeline: bool | None = None,
                 retries: int = 1, lookahead: bool | None = None) -> None:
        tuning.freeze_heap()  # the process's first worker: what start-up loaded, before serving
        self.model, self.service, self.artifact = model, service, artifact
        self.cfg = model.cfg
        require_context(self.cfg, capacity)  # before the store's preallocation
        self.dtype = next(model.parameters()).dtype
        self.itemsize = torch.tensor([], dtype=self.dtype).element_size()
        self.max_running, self.prefill_chunk, self.prefill_tokens = max_running, prefill_chunk, prefill_tokens
        # one scratch slot stands in for a member whose start was refused, so a call
        # still runs with the shape its journal record names
        self.store = KVStore(self.cfg, slots=max_running * 2 + 1, capacity=capacity, dtype=self.dtype,
                             device=device)
        self.scratch = "__scratch__"
        self.store.open(self.scratch, capacity)
        self.capacity = capacity
        self.pending: list[RequestSpec] = []
        self.live: dict[str, Live] = {}
        self.order: list[str] = []  # FCFS
        self.ran: list[Ran] = []
        # Appends whose forward call raised, with why: each ends in a failure event at the
        # next commit and runs again, up to `retries` times per request; then the request
        # is cancelled.
        self.failed: list[tuple[Planned, str]] = []
        self.retries = retries
        # What clients asked for (cancel, truncate, reorder, repair): applied at the next build.
        self._cancels: dict[str, str] = {}  # handle -> reason
        self._truncates: dict[str, int] = {}  # handle -> new length
        self._reorders: list[tuple[tuple[str, ...], tuple[int, ...]]] = []  # (rows, permutation)
        self._repairs: set[str] = set()  # handles whose final output is processed before release
        self.step_no = 0
        self.errors: list[str] = []
        self.calls = 0
        # Overlap each commit's fsync with the next model call: the journal commits on its
        # own thread (deciding and writing stay on this one, where the GIL puts them
        # anyway). That thread needs a core the model is not using: on a GPU, or when
        # torch's CPU threads leave one free. With every core in torch's thread pool the
        # commit preempts a spinning OpenMP worker and the forward slows by more than the
        # fsync it hides (measured on 2 cores: 10% faster with 1 torch thread, 0-7% slower
        # with 2), so the default commits first there.
        self.pipeline = pipeline if pipeline is not None else (
            str(device).startswith("cuda") or _leaves_a_core(torch.get_num_threads()))
        self._structural = False  # a fork or truncate this iteration: commit before running
        # Called with each receipt once its store effects are applied (telemetry observers).
        self.on_applied: Callable[[Receipt], None] | None = None
        self._adopted: list[tuple[Live, HandleState]] = []  # taken over after a crash (adopt)
        self._chains: dict[str, _Chain] = {}  # open chains of this iteration, by handle
        # run() builds each iteration's batch while the last one's commit is still in
        # flight (see _iterate); `lookahead` False waits for it first. Only an overlapped
        # commit is ever in flight, so the default follows `pipeline`.
        self.lookahead = self.pipeline if lookahead is None else lookahead
        self._inflight: _Inflight | None = None

    # -- public --------------------------------------------------------------------
    def submit(self, spec: RequestSpec) -> None:
        self.pending.append(spec)

    # What a client asks of a request between iterations; each takes effect at the next one.
    def cancel(self, handle: str, reason: str = "client cancelled") -> None:
        """Cancel a request (or one row of a fork group): a call it has running is
        aborted (its rows are dropped; the journal's cancel aborts its append), then its
        handle is released. A request not arrived yet is dropped; one done stays so."""
        waiting = len(self.pending)
        self.pending = [s for s in self.pending if s.request_id != handle]
        if len(self.pending) == waiting:
            self._cancels[handle] = reason

    def truncate(self, handle: str, new_length: int) -> None:
        """Roll a running request back to its first `new_length` cache rows: a call it
        has running is aborted, the outputs past the cut are dropped, the output at
        `new_length` stays as the frontier and decoding goes on from it. The cut keeps
        the prompt and falls at or before the newest output (ValueError otherwise)."""
        lv = self.live.get(handle)
        if lv is None or lv.done is not None:
            raise ValueError(f"{handle} is not running")
        p, n = len(lv.spec.prompt), len(lv.outputs)
        if not p <= new_length < p + n:
            raise ValueError(f"{handle}: truncate to {new_length} rows must keep its {p} prompt rows and "
                             f"its first output (at most {p + n - 1} rows: {n} outputs)")
        self._truncates[handle] = new_length

    def reorder(self, rows: Sequence[str], permutation: Sequence[int]) -> None:
        """Permute a fork group's rows (new row i <- old row permutation[i]), as a beam
        search's beam_idx does; the group is named by its first row. The journal commits
        the permutation, then each handle's K/V rows move with it. Dropped if a row is
        done by then."""
        if sorted(permutation) != list(range(len(rows))) or len(set(rows)) != len(rows):
            raise ValueError(f"{list(permutation)} is not a permutation of {len(rows)} distinct rows")
        self._reorders.append((tuple(rows), tuple(permutation)))

    def repair(self, handle: str) -> None:
        """Close the request's output frontier before its release: once it finishes, a
        repair append processes its final output (one K/V row per layer, logits
        discarded), so its last snapshot holds every output. Ask before it finishes."""
        self._repairs.add(handle)

    def run(self, on_step: Callable[[Worker], None] | None = None, max_steps: int = 100_000) -> dict[str, list[int]]:
        """Iterate until every request is done. With `lookahead`, an iteration's commit
        may still be in flight when on_step sees the worker; it is settled before run
        returns."""
        try:
            while (self.pending or self.ran or self._adopted or self.failed
                   or any(lv.done is None for lv in self.live.values())) \
                    and self.step_no < max_steps:
                self._iterate(self.lookahead)
                if on_step:
                    on_step(self)
        finally:
            self._settle()
        return {h: lv.outputs for h, lv in self.live.items()}

    # -- one iteration -------------------------------------------------------------
    def step(self) -> None:
        """One whole iteration: its commit is durable and applied when this returns."""
        self._iterate(lookahead=False)

    def _iterate(self, lookahead: bool) -> None:
        """Build the batch from what the last calls produced, commit it and run the calls
        it starts. An in-flight commit (the last iteration's, with `lookahead`) is
        settled after the build and before the send: the build overlaps the writer's
        work instead of following it, and nothing is sent on an unsettled result."""
        held = self._hold() if self._inflight is not None else None
        batch, calls = self._build()
        if held is not None:
            self._settle(held, batch, calls)
        # Pipelined: this iteration's calls run while the commit that starts them (and
        # publishes the previous ones) becomes durable. Nothing they stage is published
        # before a later commit, which is only sent after this one returned; a refused
        # start's rows are dropped once it is settled. A fork or truncate commits before
        # running.
        overlap = self.pipeline and not self._structural
        done = self._submit(batch, overlap)
        if not overlap:
            done()
        try:
            ran = self._run_calls(calls)
        except BaseException:
            if overlap:
                done()  # even if the model call failed: the commit is waited for, never left open
            raise
        for p, _ in self.failed:
            if p.txn:
                self.store.discard(p.handle)  # what the failed call staged is never published
        self._structural = False
        self.step_no += 1
        self.ran = ran
        self._inflight = _Inflight(done, ran)
        if not (overlap and lookahead):
            self._settle()

    def _build(self) -> tuple[list[Entry | _Chain], list[tuple[str, list[Planned]]]]:
        batch: list[Entry | _Chain] = []
        nxt: list[Planned] = []
        self._chains = {}
        self._interrupt(batch, nxt)
        for prev in self.ran:
            self._publish(prev, batch, nxt)
        self.ran = []
        for p, why in self.failed:
            self._fail(p, why, batch, nxt)
        self.failed = []
        self._reorder_rows(batch)
        for lv, state in self._adopted:
            self._resume(lv, state, batch, nxt)
        self._adopted = []
        for spec in [s for s in self.pending if s.arrival_step <= self.step_no]:
            self.pending.remove(spec)
            self._arrive(spec, batch)
        self._plan_prefill(nxt)
        calls = self._group(nxt)
        threads = torch.get_num_threads()  # part of what fixes the call's bits: see ForwardCall
        for call_id, members in calls:
            shape = _shape(members)
            for i, p in enumerate(members):
                entry = self._start(p, ForwardCall(call_id=call_id, index=i, size=shape.size,
                                                   new_pad=shape.new_pad, key_extent=shape.key_extent,
                                                   threads=threads))
                if entry is not None:
                    batch.append(entry)
        return batch, calls

    def _hold(self) -> dict[str, tuple[list[int], int]]:
        """What a build may change of each running request that a refusal of the
        in-flight commit would have kept: its outputs (the list, which a build appends
        to or replaces, and its length)."""
        return {h: (lv.outputs, len(lv.outputs)) for h, lv in self.live.items() if lv.done is None}

    def _settle(self, held: dict[str, tuple[list[int], int]] | None = None,
                batch: list[Entry | _Chain] | None = None,
                calls: Sequence[tuple[str, list[Planned]]] = ()) -> None:
        """Wait for the in-flight commit and apply it. A refused command fails its
        handle: its start's rows are discarded and it runs no more. A batch built
        meanwhile (`batch`, from `held`) then loses every entry on that handle (and on
        a fork's children built from it), its planned appends run as placeholders, and
        its outputs are what they were before that build and it ends "failed": what
        the worker would have done had it waited."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        hit = inflight.done()
        for r in inflight.ran:
            if not r.planned.txn:
                self.store.discard(r.planned.handle)
        if batch is None:
            self.ran = [r for r in self.ran if r.planned.txn]
            return
        if not hit:
            return
        assert held is not None
        for h in hit.intersection(held):
            outputs, n = held[h]
            del outputs[n:]
            self.live[h].outputs, self.live[h].done = outputs, "failed"
        gone = set(hit)
        for e in batch:
            cmd = _command(e)
            if isinstance(cmd, c.Fork) and cmd.parent_handle_id in hit:
                for k in cmd.child_handle_ids:
                    self.live[k].done, self.live[k].outputs = "failed", []
                    gone.add(k)
        batch[:] = [e for e in batch if gone.isdisjoint(c.handles_of(_command(e)))]
        for _, members in calls:
            for p in members:
                if p.handle in gone:
                    p.txn = ""

    def _submit(self, batch: list[Entry | _Chain], overlap: bool) -> Callable[[], set[str]]:
        """Decide and write the iteration's commands now (and commit them, unless
        `overlap`). The returned function waits until their commit is durable, then
        applies each result (store effects, errors) once, and returns the handles of
        the refused commands."""
        # The plain decode steps go as one DecodeBatch, built here from the chains; the rest
        # as commands, after them in the same commit. A step's handle is no command's.
        others = {h for e in batch if not isinstance(e, _Chain) for h in c.handles_of(_command(e))}
        steps, stepped, entries = BatchBuilder(), [], []
        for e in batch:
            if isinstance(e, _Chain) and e.handle not in others and e.add_to(steps):
                stepped.append(e)
            else:
                entries.append(e.entry() if isinstance(e, _Chain) else e)
        # results in this order: the steps', then the commands'
        outcomes: list[tuple[tuple[str, ...], Ok | None, Err | None]] = [((e.handle,), *e.callbacks()) for e in stepped]
        outcomes += [(c.handles_of(_command(e)), e[1], e[2]) for e in entries]
        wait = None
        if self.service is not None:  # journaling off: the same loop, nothing durable, every command as if committed
            cmds = [e[0] for e in entries]
            wait = (self.service.submit_batch(steps.build(), cmds, defer=overlap) if len(steps)
                    else self.service.submit_many(cmds, defer=overlap))
        hit: set[str] | None = None

        def done() -> set[str]:
            nonlocal hit
            if hit is not None:
                return hit
            hit = set()
            results: Sequence[Receipt | Exception | None] = [None] * len(outcomes) if wait is None else wait()
            for (handles, ok, err), r in zip(outcomes, results):
                if isinstance(r, Exception):
                    hit.update(handles)
                    if err:
                        err(r)
                    else:
                        self.errors.append(str(r))
                        log.warning("command rejected: %s", r)
                else:
                    if ok:
                        ok(r)
                    if r is not None and self.on_applied is not None:
                        self.on_applied(r)
            return hit
        return done

    # -- what the last calls produced ----------------------------------------------
    def _publish(self, ran: Ran, batch: list[Entry | _Chain], nxt: list[Planned]) -> None:
        p, lv = ran.planned, self.live[ran.planned.handle]
        end = p.past + ran.accepted
        accepted = ran.accepted if p.kind == "verify" else None

        publish = c.Publish(handle_id=p.handle, txn_id=p.txn, base_generation=None, base_snapshot_version=None,
                            rows_sha256=ran.rows_sha256, accepted_count=accepted, workspace_bytes=self._workspace(p))

        def failed(exc: Exception, h: str = p.handle) -> None:
            self.store.discard(h)
            self.errors.append(str(exc))
            self.live[h].done = self.live[h].done or "failed"

        chain = _Chain(p.handle, publish, lambda r: self.store.commit(p.handle, end), failed)
        batch.append(chain)
        self._chains[p.handle] = chain
        if p.kind == "repair":
            batch.append(self._release(lv))
            return
        if p.kind == "verify":
            drafts = p.tokens[: ran.accepted]
            lv.outputs.extend(drafts)
            assert ran.correction is not None  # a verify call always chooses one (_run)
            self._emit(lv, ran.correction, batch, nxt)
            return
        if end < len(lv.spec.prompt):
            return  # more prompt chunks: planned with the other prefills
        lv.logits = ran.logits[-1]
        lv.greedy = ran.greedy
        self._on_ready(lv, batch, nxt)

    def _on_ready(self, lv: Live, batch: list[Entry | _Chain], nxt: list[Planned]) -> None:
        """Logits of a publication are ready: fork, speculate or emit."""
        spec = lv.spec
        if spec.n > 1 and not lv.forked and not lv.outputs:
            lv.forked = True
            kids = [f"{lv.handle}.{i}" for i in range(1, spec.n)]
            batch.append(self._fork(lv, kids))
            self._structural = True
            for i, k in enumerate(kids, 1):
                kid = Live(k, msgspec.structs.replace(spec, n=1, seed=spec.seed + i), spec.seed + i)
                kid.logits, kid.abi = lv.logits, lv.abi
                self.live[k] = kid
                self.order.append(k)
                self._on_ready(kid, batch, nxt)
        remaining = spec.max_new_tokens - len(lv.outputs)
        if spec.speculate and spec.temperature == 0 and remaining > 1 and self._free_rows(lv) > 1:
            drafts = self._draft(lv, min(spec.speculate, remaining - 1, self._free_rows(lv) - 1))
            if drafts:
                nxt.append(Planned(lv.handle, _txn(), "verify", len(spec.prompt) + len(lv.outputs), drafts))
                return
        self._emit(lv, self._sample(lv), batch, nxt)

    def _emit(self, lv: Live, token: int, batch: list[Entry | _Chain], nxt: list[Planned]) -> None:
        spec = lv.spec
        index = len(lv.outputs)

        emit = c.EmitOutput(handle_id=lv.handle, base_generation=None, base_snapshot_version=None,
                            output_index=index, token_id=token)
        chain = self._chains.get(lv.handle)
        if chain is not None:
            chain.add(emit)
        else:
            batch.append((c.Relative(emit), None, None))
        lv.outputs.append(token)
        lv.logits, lv.greedy = None, None
        eos = self.cfg.eos_token_id
        if (eos is not None and token == eos) or len(lv.outputs) >= spec.max_new_tokens:
            reason: Literal["eos", "max_tokens"] = "eos" if token == eos else "max_tokens"
            lv.done = reason
            finish = c.Finish(handle_id=lv.handle, base_generation=None, reason=reason)
            if chain is not None:  # ends the chain: one operation fewer, the same events
                chain.add(finish)
                self._chains.pop(lv.handle)
            else:
                batch.append(self._simple(lv, finish))
            if lv.handle in self._repairs:
                nxt.append(Planned(lv.handle, _txn(), "repair", self._length(lv), (token,)))
            else:
                batch.append(self._release(lv))
        else:
            nxt.append(Planned(lv.handle, _txn(), "decode", self._length(lv), (token,)))

    # -- new work ------------------------------------------------------------------
    def _arrive(self, spec: RequestSpec, batch: list[Entry | _Chain]) -> None:
        h = spec.request_id
        manifest = self.manifest(spec)
        self.live[h] = Live(h, spec, spec.seed, abi=cache_abi_sha256(manifest))
        self.order.append(h)
        reserved = len(spec.prompt) + spec.max_new_tokens + 1  # +1: room to repair the frontier
        batch.append((c.Allocate(handle_id=h, manifest=manifest, reserved_capacity=reserved),
                      None, lambda exc: self._drop(h, exc)))

    def _plan_prefill(self, nxt: list[Planned]) -> None:
        budget = self.prefill_tokens
        busy = {p.handle for p in nxt}
        running = sum(1 for h, lv in self.live.items() if h in self.store.slot and lv.done is None)
        for h in self.order:
            lv = self.live[h]
            if lv.done is not None or h in busy or lv.outputs or lv.logits is not None:
                continue
            done = self.store.pending.get(h, 0)
            rest = len(lv.spec.prompt) - done
            if rest <= 0 or budget <= 0:
                continue
            if h not in self.store.slot:
                if running >= self.max_running or self.store.free_slots < lv.spec.n:
                    continue  # FCFS: wait for a slot
                self.store.open(h, len(lv.spec.prompt) + lv.spec.max_new_tokens + 1)
                running += 1
            n = min(rest, self.prefill_chunk, budget)
            budget -= n
            nxt.append(Planned(h, _txn(), "prefill" if done == 0 else "chunk", done,
                               lv.spec.prompt[done:done + n]))

    def _group(self, planned: list[Planned]) -> list[tuple[str, list[Planned]]]:
        groups: dict[str, list[Planned]] = {"prefill": [], "decode": [], "verify": []}
        for p in planned:
            groups["decode" if p.kind in ("decode", "repair") else
                   "prefill" if p.kind in ("prefill", "chunk") else "verify"].append(p)
        return [(new_id(), g) for g in groups.values() if g]

    def _fail(self, p: Planned, why: str, batch: list[Entry | _Chain], nxt: list[Planned]) -> None:
        """End an append whose forward call raised with a failure event, then run it
        again, or, past the retries, cancel the request."""
        if not p.txn:
            return  # its start was refused: nothing is open
        lv = self.live[p.handle]
        lv.failures += 1
        self._chains.pop(lv.handle, None)
        batch.append((c.Fail(handle_id=lv.handle, txn_id=p.txn, outcome="failed", code="FORWARD_FAILED",
                             detail=why[:200]), None, None))
        if lv.failures <= self.retries:
            if p.kind not in ("prefill", "chunk"):  # _plan_prefill plans the prompt's rest again
                nxt.append(Planned(p.handle, _txn(), p.kind, p.past, p.tokens))
            return
        # Not served: an error of the run, like a rejected command.
        self.errors.append(f"{lv.handle}: forward call failed {lv.failures} times, last: {why}")
        if lv.done is None:
            lv.done = "cancelled"
            batch.append(self._simple(lv, c.CancelRequest(handle_id=lv.handle, base_generation=0,
                                                          reason="forward call failed")))
        batch.append(self._release(lv))

    def _interrupt(self, batch: list[Entry | _Chain], nxt: list[Planned]) -> None:
        """The cancels and truncates asked for since the last build. A call the handle
        has running is aborted first: its staged rows are dropped, and nothing it
        computed is published or sampled from."""
        for h in [*self._cancels, *(h for h in self._truncates if h not in self._cancels)]:
            lv = self.live.get(h)
            if lv is None or lv.done is not None:
                continue
            running = [r.planned for r in self.ran if r.planned.handle == h] + \
                [p for p, _ in self.failed if p.handle == h]
            if running:
                self.ran = [r for r in self.ran if r.planned.handle != h]
                self.failed = [f for f in self.failed if f[0].handle != h]
                self.store.discard(h)
            if h in self._cancels:
                lv.done = "cancelled"  # the journal's cancel aborts the open append
                batch.append(self._simple(lv, c.CancelRequest(handle_id=h, base_generation=0,
                                                              reason=self._cancels[h])))
                batch.append(self._release(lv))
                continue
            batch += [(c.Fail(handle_id=h, txn_id=p.txn, outcome="aborted", code="TXN_ABORTED",
                              detail="truncated by the client"), None, None) for p in running if p.txn]
            self._cut(lv, self._truncates[h], batch, nxt)
        self._cancels, self._truncates = {}, {}

    def _cut(self, lv: Live, new_len: int, batch: list[Entry | _Chain], nxt: list[Planned]) -> None:
        """Truncate the handle to `new_len` rows and decode on from the output there, the
        frontier (as engine.evolve.cut: outputs past it go; a cut into the prompt
        leaves the rest of the prompt to prefill)."""
        keep = max(0, new_len - len(lv.spec.prompt) + 1)
        lv.outputs = lv.outputs[:keep]  # a new list: Worker._hold keeps the old one
        lv.logits, lv.greedy = None, None
        self._structural = True
        h = lv.handle
        batch.append(self._simple(lv, c.Truncate(handle_id=h, base_generation=0, base_snapshot_version=0,
                                                 new_length=new_len),
                                  ok=lambda r: self.store.truncate(h, new_len)))
        if lv.outputs and new_len >= len(lv.spec.prompt):
            nxt.append(Planned(h, _txn(), "decode", new_len, (lv.outputs[-1],)))

    def _reorder_rows(self, batch: list[Entry | _Chain]) -> None:
        """The reorders asked for since the last build. The journal commits each
        permutation; the store's rows follow it once it has."""
        for rows, perm in self._reorders:
            if any(h not in self.live or self.live[h].done is not None for h in rows):
                continue  # a row finished first: nothing left to reorder
            for h in rows:
                self._chains.pop(h, None)  # the reorder comes after their chains
            self._structural = True

            def reordered(r: Receipt | None, rows: tuple[str, ...] = rows, perm: tuple[int, ...] = perm) -> None:
                self.store.reorder(rows, perm)

            batch.append((c.Relative(c.Reorder(group_id=rows[0], rows=rows, bases=(), permutation=perm)),
                          reordered, None))
        self._reorders = []

    def _start(self, p: Planned, call: ForwardCall) -> Entry | None:
        """The append_start of a planned append: a step of its handle's open chain (None
        is returned), or an entry of its own."""
        n = len(p.tokens)

        start = c.BeginAppend(
            handle_id=p.handle, txn_id=p.txn, kind=p.kind, base_generation=None, base_snapshot_version=None,
            interval_start=p.past, interval_count=n, token_ids=p.tokens,
            cache_positions=tuple(range(p.past, p.past + n)), mask_key_extent=p.past + n,
            cache_abi_sha256=self.live[p.handle].abi, call=call)

        def refused(exc: Exception) -> None:
            p.txn = ""  # runs as a placeholder row only
            self.errors.append(str(exc))
            self.live[p.handle].done = self.live[p.handle].done or "failed"

        chain = self._chains.get(p.handle)
        if chain is not None and start.cache_abi_sha256:
            chain.add(start, err=refused)
            return None
        return (c.Relative(start), None, refused)

    def _run_calls(self, calls: list[tuple[str, list[Planned]]]) -> list[Ran]:
        ran: list[Ran] = []
        for call_id, members in calls:
            try:
                ran += self._run(call_id, members)
            except RuntimeError as exc:  # a device error, out of memory, an injected fault
                log.warning("forward call %s failed (%d members): %s", call_id, len(members), exc)
                self.failed += [(p, f"{type(exc).__name__}: {exc}") for p in members]
        return ran

    def _run(self, call_id: str, planned: list[Planned]) -> list[Ran]:
        shape = _shape(planned)
        real = [bool(p.txn) for p in planned]  # a start refused by the commit runs as a placeholder
        members = [Member(p.handle, p.past, p.tokens) if ok else Member(self.scratch, 0, p.tokens)
                   for p, ok in zip(planned, real)]
        verify = planned[0].kind == "verify"
        logits = run_call(self.model, self.store, members, shape, all_rows=verify)
        self.calls += 1
        accepted = {}
        for b, p in enumerate(planned):
            if real[b]:
                accepted[b] = len(p.tokens)
                if verify:
                    accepted[b] = _accepted(self._logits(self.live[p.handle]), logits[b, :len(p.tokens)], p.tokens)
                    self.store.staged(p.handle, p.past + accepted[b])  # rejected drafts' rows are dropped
        greedy = logits[:, -1].argmax(-1).tolist() if not verify else None  # one op for the batch
        digests = dict(zip(accepted, self.store.rows_sha256_many(
            [(planned[b].handle, planned[b].past, n) for b, n in accepted.items()])))
        ran = []
        for b, p in enumerate(planned):
            if not real[b]:
                continue
            # every layer ran and wrote its rows: the publish gives their combined digest
            rows_sha256 = layers_sha256(digests[b])
            correction = None
            if verify:  # the target's own choice after the accepted drafts
                after = self._logits(self.live[p.handle]) if accepted[b] == 0 else logits[b, accepted[b] - 1]
                correction = int(after.argmax())
            ran.append(Ran(p, logits[b], accepted[b], rows_sha256, correction,
                           greedy[b] if greedy is not None else None))
        return ran

    # -- recovery: continue handles rebuilt from the journal --------------------------
    def adopt(self, state: HandleState, spec: RequestSpec, k: Tensor, v: Tensor,
              logits: Tensor | None = None) -> None:
        """Take over a live handle after a crash. `state` is its journal fold (no open
        appends: recovery aborted them), `k`/`v` its committed rows [L, H_kv, committed,
        d_h] rebuilt by re-execution, `logits` the next-token logits of its newest
        publication when they are ready. The next step continues it like any request:
        prefill the rest of the prompt, decode the emitted frontier, sample from the
        ready logits, finish at max_new_tokens, release a finished or cancelled handle.
        What its client asked before the crash (truncate, reorder, cancel, repair) is not
        replayed, nor are its forks and speculation."""
        h, n = state.handle_id, state.committed_length
        lv = Live(h, spec, spec.seed, outputs=list(state.outputs), forked=True,
                  logits=logits if state.logits_ready else None, abi=state.cache_abi_sha256)
        if state.lifecycle != "ACTIVE":
            lv.done = state.lifecycle.lower()
        self.live[h] = lv
        self.order.append(h)
        self.store.open(h, state.reserved_capacity)
        slot = self.store.slot[h]
        self.store.k[:, slot, :, :n] = k
        self.store.v[:, slot, :, :n] = v
        self.store.committed[h] = self.store.pending[h] = n
        self._adopted.append((lv, state))

    def _resume(self, lv: Live, state: HandleState, batch: list[Entry | _Chain], nxt: list[Planned]) -> None:
        spec, h = lv.spec, lv.handle
        if state.lifecycle in ("FINISHED", "CANCELLED"):
            batch.append(self._release(lv))  # all that was left to do
            return
        eos = self.cfg.eos_token_id
        if len(lv.outputs) >= spec.max_new_tokens or (eos is not None and lv.outputs and lv.outputs[-1] == eos):
            reason: Literal["eos", "max_tokens"] = \
                "eos" if eos is not None and lv.outputs and lv.outputs[-1] == eos else "max_tokens"
            lv.done = reason
            batch.append(self._simple(lv, c.Finish(handle_id=h, base_generation=None, reason=reason)))
            batch.append(self._release(lv))
        elif lv.logits is not None:
            self._on_ready(lv, batch, nxt)
        elif state.has_frontier:
            nxt.append(Planned(h, _txn(), "decode", state.committed_length, (lv.outputs[-1],)))
        elif state.committed_length < len(spec.prompt) and not lv.outputs:
            pass  # _plan_prefill continues the prompt from the committed rows
        else:
            self._cut(lv, state.committed_length - 1, batch, nxt)  # no logits to choose from: redo the last row

    # -- helpers -------------------------------------------------------------------
    def manifest(self, spec: RequestSpec) -> Manifest:
        cfg, width = self.cfg, self.itemsize
        dt = ScalarType(DTYPE_NAMES.get(self.dtype, str(self.dtype)), width)
        return new_manifest(
            namespace="kvledger", request_id=spec.request_id, prompt=spec.prompt, artifact=self.artifact,
            cache_schema=CacheSchema(num_cache_layers=cfg.num_layers, kv_heads_per_rank=cfg.num_kv_heads,
                                     head_dim=cfg.head_dim, key_dtype=dt, value_dtype=dt,
                                     num_query_heads=cfg.num_heads),
            policy=RequestPolicy(
                max_new_tokens=spec.max_new_tokens,
                max_context_tokens=len(spec.prompt) + spec.max_new_tokens + 1,  # +1: room for a repair
                stop_token_ids=() if cfg.eos_token_id is None else (cfg.eos_token_id,),
                sampling=SamplingPolicy(kind="greedy" if spec.temperature == 0 else "temperature",
                                        temperature=spec.temperature or 1.0, seed=spec.seed)),
            position_contract=PositionContract(rope=RopeConfig(theta=cfg.rope_theta)))

    def _length(self, lv: Live) -> int:
        """Rows the handle will hold once the appends already planned commit."""
        return len(lv.spec.prompt) + len(lv.outputs) - (1 if lv.outputs else 0)

    def _free_rows(self, lv: Live) -> int:
        return self.store.reserved.get(lv.handle, 0) - len(lv.spec.prompt) - len(lv.outputs)

    def _workspace(self, p: Planned) -> int:
        # The append's own K/V rows are the temporary workspace until publication.
        return len(p.tokens) * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim * 2 * self.itemsize

    def _logits(self, lv: Live) -> Tensor:
        """The ready logits a sample, a draft or a verify starts from (_on_ready's)."""
        assert lv.logits is not None, f"{lv.handle}: no ready logits"
        return lv.logits

    def _sample(self, lv: Live) -> int:
        logits = self._logits(lv)
        if lv.spec.temperature == 0:
            return lv.greedy if lv.greedy is not None else int(logits.argmax())
        probs = torch.softmax(logits.float() / lv.spec.temperature, dim=-1)
        # Seeded per draw, so a run recovered from its journal samples what it would have.
        gen = torch.Generator().manual_seed(lv.seed * 1_000_003 + len(lv.outputs))
        return int(torch.multinomial(probs, 1, generator=gen))

    def _draft(self, lv: Live, k: int) -> tuple[int, ...]:
        """Prompt-lookup drafts: what followed the last occurrence of the newest token."""
        seq = list(lv.spec.prompt) + lv.outputs
        nxt = int(self._logits(lv).argmax())  # the target's own next token anchors the lookup
        for i in range(len(seq) - 1, -1, -1):
            if seq[i] == nxt and i + 1 < len(seq):
                return (nxt, *seq[i + 1:i + k])[:k]
        return (nxt,)[:k]

    def _simple(self, lv: Live, cmd: c.Command, ok: Ok | None = None) -> Entry:
        """A command of its own, on the state the handle's earlier commands leave."""
        self._chains.pop(lv.handle, None)  # a command of its own ends the handle's chain
        return (c.Relative(cmd), ok, None)

    def _release(self, lv: Live) -> Entry:
        self._repairs.discard(lv.handle)
        return self._simple(lv, c.Release(handle_id=lv.handle, base_generation=None),
                            ok=lambda r: self.store.release(lv.handle))

    def _fork(self, lv: Live, kids: list[str]) -> Entry:
        def ok(r: Receipt | None, parent: str = lv.handle) -> None:
            for k in kids:
                self.store.fork(parent, k, self.store.pending[parent])

        return self._simple(lv, c.Fork(parent_handle_id=lv.handle, base_generation=0, base_snapshot_version=0,
                                       child_handle_ids=tuple(kids), prefix_length=None,
                                       child_request_ids=tuple(kids)), ok=ok)

    def _drop(self, h: str, exc: Exception) -> None:
        self.errors.append(str(exc))
        self.live[h].done = "failed"


def use_threads(n: int) -> int:
    """Set torch's CPU thread pool to n threads. When that leaves a core for a journal
    writer, the calling (model) thread moves off the CPU that takes the disk's interrupts,
    so the core left is that one (kvledger.journal.tuning.pin_model); with every core in the pool it may
    run anywhere again. Returns n."""
    torch.set_num_threads(n)
    tuning.pin_model(_leaves_a_core(n))
    return n


def _leaves_a_core(threads: int) -> bool:
    """A torch pool of this size leaves a CPU free for the journal's writer."""
    return threads < tuning.usable_cpus()


def leave_a_core() -> int:
    """Shrink torch's CPU thread pool by one core (never below 1) for a journal writer
    process (kvledger.engine.remote) to run on; returns the thread count now set. The writer's
    commit then overlaps the model call instead of preempting it. What the model gives
    up (2 cores, default model): nothing at batch 1, 10-25% of its rate at batch 16."""
    return use_threads(max(1, min(torch.get_num_threads(), tuning.usable_cpus() - 1)))


def _accepted(prev_logits: Tensor, rows: Tensor, drafts: tuple[int, ...]) -> int:
    """Greedy acceptance: draft j stands if it is what the target would have chosen."""
    predictions = [int(prev_logits.argmax())] + [int(r.argmax()) for r in rows[:-1]]
    a = 0
    while a < len(drafts) and drafts[a] == predictions[a]:
        a += 1
    return a


def _shape(members: list[Planned]) -> CallShape:
    return CallShape(len(members), max(len(p.tokens) for p in members),
                     max(p.past + len(p.tokens) for p in members))


def _txn() -> str:
    return new_id()

