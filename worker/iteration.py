"""Building one iteration of the serving worker: from what the last calls produced, the
clients' requests and new arrivals, the commands of the next commit and the forward
calls it starts (serving.Worker sends the one and runs the others)."""

from __future__ import annotations

from typing import Literal

import msgspec
import torch
from torch import Tensor

from kvledger.engine import commands as c
from kvledger.engine.ids import new_id
from kvledger.engine.state import HandleState
from kvledger.schemas.events import ForwardCall
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
from kvledger.worker.kvstore import KVStore
from kvledger.worker.loading import DTYPE_NAMES
from kvledger.worker.model import ModelConfig
from kvledger.worker.requests import Chain, Entry, Live, Ok, Planned, Ran, RequestSpec, call_shape, new_txn


class IterationBuilder:
    """The build half of serving.Worker, which sets these attributes."""

    cfg: ModelConfig
    artifact: ArtifactIdentity
    dtype: torch.dtype
    itemsize: int
    store: KVStore
    max_running: int
    prefill_chunk: int
    prefill_tokens: int
    pending: list[RequestSpec]
    live: dict[str, Live]
    order: list[str]  # FCFS
    ran: list[Ran]
    failed: list[tuple[Planned, str]]
    retries: int
    step_no: int
    errors: list[str]
    _cancels: dict[str, str]
    _truncates: dict[str, int]
    _reorders: list[tuple[tuple[str, ...], tuple[int, ...]]]
    _repairs: set[str]
    _structural: bool
    _adopted: list[tuple[Live, HandleState]]
    _chains: dict[str, Chain]

    def _build(self) -> tuple[list[Entry | Chain], list[tuple[str, list[Planned]]]]:
        batch: list[Entry | Chain] = []
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
            shape = call_shape(members)
            for i, p in enumerate(members):
                entry = self._start(p, ForwardCall(call_id=call_id, index=i, size=shape.size,
                                                   new_pad=shape.new_pad, key_extent=shape.key_extent,
                                                   threads=threads))
                if entry is not None:
                    batch.append(entry)
        return batch, calls

    # -- what the last calls produced ----------------------------------------------
    def _publish(self, ran: Ran, batch: list[Entry | Chain], nxt: list[Planned]) -> None:
        p, lv = ran.planned, self.live[ran.planned.handle]
        end = p.past + ran.accepted
        accepted = ran.accepted if p.kind == "verify" else None

        publish = c.Publish(handle_id=p.handle, txn_id=p.txn, base_generation=None, base_snapshot_version=None,
                            rows_sha256=ran.rows_sha256, accepted_count=accepted, workspace_bytes=self._workspace(p))

        def failed(exc: Exception, h: str = p.handle) -> None:
            self.store.discard(h)
            self.errors.append(str(exc))
            self.live[h].done = self.live[h].done or "failed"

        chain = Chain(p.handle, publish, lambda: self.store.commit(p.handle, end), failed)
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

    def _on_ready(self, lv: Live, batch: list[Entry | Chain], nxt: list[Planned]) -> None:
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
                nxt.append(Planned(lv.handle, new_txn(), "verify", len(spec.prompt) + len(lv.outputs), drafts))
                return
        self._emit(lv, self._sample(lv), batch, nxt)

    def _emit(self, lv: Live, token: int, batch: list[Entry | Chain], nxt: list[Planned]) -> None:
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
                nxt.append(Planned(lv.handle, new_txn(), "repair", self._length(lv), (token,)))
            else:
                batch.append(self._release(lv))
        else:
            nxt.append(Planned(lv.handle, new_txn(), "decode", self._length(lv), (token,)))

    # -- new work ------------------------------------------------------------------
    def _arrive(self, spec: RequestSpec, batch: list[Entry | Chain]) -> None:
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
            nxt.append(Planned(h, new_txn(), "prefill" if done == 0 else "chunk", done,
                               lv.spec.prompt[done:done + n]))

    def _group(self, planned: list[Planned]) -> list[tuple[str, list[Planned]]]:
        groups: dict[str, list[Planned]] = {"prefill": [], "decode": [], "verify": []}
        for p in planned:
            groups["decode" if p.kind in ("decode", "repair") else
                   "prefill" if p.kind in ("prefill", "chunk") else "verify"].append(p)
        return [(new_id(), g) for g in groups.values() if g]

    def _fail(self, p: Planned, why: str, batch: list[Entry | Chain], nxt: list[Planned]) -> None:
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
                nxt.append(Planned(p.handle, new_txn(), p.kind, p.past, p.tokens))
            return
        # Not served: an error of the run, like a rejected command.
        self.errors.append(f"{lv.handle}: forward call failed {lv.failures} times, last: {why}")
        if lv.done is None:
            lv.done = "cancelled"
            batch.append(self._simple(lv, c.CancelRequest(handle_id=lv.handle, base_generation=0,
                                                          reason="forward call failed")))
        batch.append(self._release(lv))

    def _interrupt(self, batch: list[Entry | Chain], nxt: list[Planned]) -> None:
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

    def _cut(self, lv: Live, new_len: int, batch: list[Entry | Chain], nxt: list[Planned]) -> None:
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
                                  ok=lambda: self.store.truncate(h, new_len)))
        if lv.outputs and new_len >= len(lv.spec.prompt):
            nxt.append(Planned(h, new_txn(), "decode", new_len, (lv.outputs[-1],)))

    def _reorder_rows(self, batch: list[Entry | Chain]) -> None:
        """The reorders asked for since the last build. The journal commits each
        permutation; the store's rows follow it once it has."""
        for rows, perm in self._reorders:
            if any(h not in self.live or self.live[h].done is not None for h in rows):
                continue  # a row finished first: nothing left to reorder
            for h in rows:
                self._chains.pop(h, None)  # the reorder comes after their chains
            self._structural = True

            def reordered(rows: tuple[str, ...] = rows, perm: tuple[int, ...] = perm) -> None:
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

    def _resume(self, lv: Live, state: HandleState, batch: list[Entry | Chain], nxt: list[Planned]) -> None:
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
            nxt.append(Planned(h, new_txn(), "decode", state.committed_length, (lv.outputs[-1],)))
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
                            ok=lambda: self.store.release(lv.handle))

    def _fork(self, lv: Live, kids: list[str]) -> Entry:
        def ok(parent: str = lv.handle) -> None:
            for k in kids:
                self.store.fork(parent, k, self.store.pending[parent])

        return self._simple(lv, c.Fork(parent_handle_id=lv.handle, base_generation=0, base_snapshot_version=0,
                                       child_handle_ids=tuple(kids), prefix_length=None,
                                       child_request_ids=tuple(kids)), ok=ok)

    def _drop(self, h: str, exc: Exception) -> None:
        self.errors.append(str(exc))
        self.live[h].done = "failed"

