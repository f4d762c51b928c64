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
from typing import TypedDict, Unpack

import torch
from torch import Tensor

from kvledger.engine import commands as c
from kvledger.engine.port import CommandPort
from kvledger.engine.state import HandleState
from kvledger.journal import tuning
from kvledger.schemas.canonical import layers_sha256
from kvledger.schemas.decode_batch import BatchBuilder
from kvledger.schemas.manifest import ArtifactIdentity
from kvledger.schemas.receipts import Receipt
from kvledger.worker.executor import Member, run_call
from kvledger.worker.iteration import IterationBuilder
from kvledger.worker.kvstore import KVStore
from kvledger.worker.loading import require_context
from kvledger.worker.model import Transformer
from kvledger.worker.requests import (
    Chain,
    Entry,
    Err,
    Inflight,
    Live,
    Ok,
    Planned,
    Ran,
    RequestSpec,
    accepted_drafts,
    call_shape,
    command_of,
)
from kvledger.worker.threads import leave_a_core, leaves_a_core, use_threads

__all__ = ["RequestSpec", "Worker", "leave_a_core", "use_threads"]

log = logging.getLogger("kvledger.worker")


class Options(TypedDict, total=False):
    """How a Worker serves (each optional; Worker.__init__ gives the defaults)."""

    max_running: int  # requests holding a K/V slot at once (16)
    prefill_chunk: int  # prompt rows per request per call (64)
    prefill_tokens: int  # prompt rows per iteration, all requests (256)
    capacity: int  # K/V rows a slot holds (512)
    device: str  # torch device of the K/V store ("cpu")
    pipeline: bool | None  # overlap the commit with the model call (None: where a core is free)
    retries: int  # runs again of an append whose call raised (1)
    lookahead: bool | None  # build while the last commit is in flight (None: as pipeline)


class Worker(IterationBuilder):
    def __init__(self, model: Transformer, *, service: CommandPort | None, artifact: ArtifactIdentity,
                 **options: Unpack[Options]) -> None:
        max_running, capacity = options.get("max_running", 16), options.get("capacity", 512)
        prefill_chunk, prefill_tokens = options.get("prefill_chunk", 64), options.get("prefill_tokens", 256)
        device, retries = options.get("device", "cpu"), options.get("retries", 1)
        pipeline, lookahead = options.get("pipeline"), options.get("lookahead")
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
        # fsync it hides, so the default commits first there.
        self.pipeline = pipeline if pipeline is not None else (
            str(device).startswith("cuda") or leaves_a_core(torch.get_num_threads()))
        self._structural = False  # a fork or truncate this iteration: commit before running
        # Called with each receipt once its store effects are applied (telemetry observers).
        self.on_applied: Callable[[Receipt], None] | None = None
        self._adopted: list[tuple[Live, HandleState]] = []  # taken over after a crash (adopt)
        self._chains: dict[str, Chain] = {}  # open chains of this iteration, by handle
        # run() builds each iteration's batch while the last one's commit is still in
        # flight (see _iterate); `lookahead` False waits for it first. Only an overlapped
        # commit is ever in flight, so the default follows `pipeline`.
        self.lookahead = self.pipeline if lookahead is None else lookahead
        self._inflight: Inflight | None = None

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
        self._inflight = Inflight(done, ran)
        if not (overlap and lookahead):
            self._settle()


    def _hold(self) -> dict[str, tuple[list[int], int]]:
        """What a build may change of each running request that a refusal of the
        in-flight commit would have kept: its outputs (the list, which a build appends
        to or replaces, and its length)."""
        return {h: (lv.outputs, len(lv.outputs)) for h, lv in self.live.items() if lv.done is None}

    def _settle(self, held: dict[str, tuple[list[int], int]] | None = None,
                batch: list[Entry | Chain] | None = None,
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
            cmd = command_of(e)
            if isinstance(cmd, c.Fork) and cmd.parent_handle_id in hit:
                for k in cmd.child_handle_ids:
                    self.live[k].done, self.live[k].outputs = "failed", []
                    gone.add(k)
        batch[:] = [e for e in batch if gone.isdisjoint(c.handles_of(command_of(e)))]
        for _, members in calls:
            for p in members:
                if p.handle in gone:
                    p.txn = ""

    def _submit(self, batch: list[Entry | Chain], overlap: bool) -> Callable[[], set[str]]:
        """Decide and write the iteration's commands now (and commit them, unless
        `overlap`). The returned function waits until their commit is durable, then
        applies each result (store effects, errors) once, and returns the handles of
        the refused commands."""
        # The plain decode steps go as one DecodeBatch, built here from the chains; the rest
        # as commands, after them in the same commit. A step's handle is no command's.
        others = {h for e in batch if not isinstance(e, Chain) for h in c.handles_of(command_of(e))}
        steps, stepped, entries = BatchBuilder(), [], []
        for e in batch:
            if isinstance(e, Chain) and e.handle not in others and e.add_to(steps):
                stepped.append(e)
            else:
                entries.append(e.entry() if isinstance(e, Chain) else e)
        # results in this order: the steps', then the commands'
        outcomes: list[tuple[tuple[str, ...], Ok | None, Err | None]] = [((e.handle,), *e.callbacks()) for e in stepped]
        outcomes += [(c.handles_of(command_of(e)), e[1], e[2]) for e in entries]
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
            results = None if wait is None else wait()
            # Most commits refuse nothing: their receipts are read only for on_applied.
            refused = {} if results is None else dict(results.refused())
            applied = self.on_applied
            for i, (handles, ok, err) in enumerate(outcomes):
                if (exc := refused.get(i)) is not None:
                    hit.update(handles)
                    if err:
                        err(exc)
                    else:
                        self.errors.append(str(exc))
                        log.warning("command rejected: %s", exc)
                else:
                    if ok:
                        ok()
                    if applied is not None and results is not None:
                        receipt = results[i]
                        assert isinstance(receipt, Receipt)  # not refused
                        applied(receipt)
            return hit
        return done

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
        shape = call_shape(planned)
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
                    prev = self._logits(self.live[p.handle])
                    accepted[b] = accepted_drafts(prev, logits[b, :len(p.tokens)], p.tokens)
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

