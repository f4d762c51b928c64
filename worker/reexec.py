"""Re-execute a journal's appends to rebuild K/V and prove it matches what was published.

Appends run call by call, with the shapes and CPU thread counts their append_start
recorded (ForwardCall), so on the same model, device and dtype every row comes out bit
for bit and its digest must equal the one in its append_publish. Used by determinism
tests and by recovery.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvledger.schemas import events as ev
from kvledger.schemas.canonical import layers_sha256
from kvledger.worker.executor import CallShape, Member, run_call
from kvledger.worker.kvstore import KVStore
from kvledger.worker.model import Transformer

SCRATCH = "__scratch__"


@dataclass
class Mismatch:
    """A re-executed append whose rows over all layers do not hash to what its publish recorded."""

    handle_id: str
    txn_id: str
    global_position: int
    recorded: str | None
    recomputed: str


@dataclass
class Reexecution:
    store: KVStore
    logits: dict[str, Tensor] = field(default_factory=dict)  # newest next-token logits per handle
    verified_rows: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    skipped: set[str] = field(default_factory=set)  # appends with no recorded call


def reexecute(model: Transformer, events: Iterable[ev.Event], *, slots: int = 64,
              capacity: int = 1024) -> Reexecution:
    threads = torch.get_num_threads()
    try:
        return _reexecute(model, events, slots, capacity)
    finally:
        torch.set_num_threads(threads)


def _reexecute(model: Transformer, events: Iterable[ev.Event], slots: int, capacity: int) -> Reexecution:
    replay = _Replay(model, slots, capacity)
    for e in events:
        replay.feed(e)
    return replay.out


class _Replay:
    """The store and the appends in flight while a journal is re-executed, event by event."""

    def __init__(self, model: Transformer, slots: int, capacity: int) -> None:
        self.model = model
        dtype = next(model.parameters()).dtype
        self.store = KVStore(model.cfg, slots=slots + 1, capacity=capacity, dtype=dtype,
                             device=next(model.parameters()).device)
        self.store.open(SCRATCH, capacity)
        self.out = Reexecution(self.store)
        self.starts: dict[tuple[str, str], ev.AppendStartEvent] = {}  # (handle, txn)
        self.calls: dict[str, list[ev.AppendStartEvent]] = {}
        self.ran: set[str] = set()

    def feed(self, e: ev.Event) -> None:
        h, store, logits = e.stream_id, self.store, self.out.logits
        if isinstance(e, ev.RequestAllocateEvent):
            store.open(h, e.payload.reserved_capacity)
        elif isinstance(e, ev.ForkEvent):
            store.fork(e.payload.parent_handle_id, h, e.payload.prefix_length)
            if e.payload.parent_handle_id in logits and e.payload.logits_ready:
                logits[h] = logits[e.payload.parent_handle_id]
        elif isinstance(e, ev.AppendStartEvent):
            self.start(e)
        elif isinstance(e, (ev.AppendPublishEvent, ev.FailureEvent)):
            self.end(e)
        elif isinstance(e, ev.OutputEmitEvent):
            logits.pop(h, None)
        elif isinstance(e, ev.TruncateEvent):
            store.truncate(h, e.payload.new_length)
            logits.pop(h, None)
        elif isinstance(e, ev.ReleaseEvent):
            store.release(h)
            logits.pop(h, None)

    def start(self, e: ev.AppendStartEvent) -> None:
        self.starts[(e.stream_id, e.payload.txn_id)] = e
        if e.payload.call is None:
            self.out.skipped.add(e.stream_id)
        else:
            self.calls.setdefault(e.payload.call.call_id, []).append(e)

    def end(self, e: ev.AppendPublishEvent | ev.FailureEvent) -> None:
        """An append's end: its call runs (once, at the first end of its members), then
        a failure discards the rows and a publication is checked against them."""
        h = e.stream_id
        start = self.starts.pop((h, e.payload.txn_id), None)
        if start is None or start.payload.call is None:
            return
        if start.payload.call.call_id not in self.ran:
            self.run(start.payload.call.call_id)
        if isinstance(e, ev.FailureEvent):
            self.store.discard(h)
            return
        self.publish(start, e)

    def publish(self, start: ev.AppendStartEvent, e: ev.AppendPublishEvent) -> None:
        h, p, store, out = e.stream_id, e.payload, self.store, self.out
        t = start.payload.interval_start
        got = (layers_sha256(store.rows_sha256(h, t, p.accepted_count))
               if p.committed_length - p.accepted_count == t else "interval differs from the start")
        if got != p.rows_sha256:
            out.mismatches.append(Mismatch(h, p.txn_id, e.global_position, p.rows_sha256, got))
        out.verified_rows += p.accepted_count
        store.staged(h, p.committed_length)
        store.commit(h, p.committed_length)
        if start.payload.kind == "verify" or not p.logits_ready:
            out.logits.pop(h, None)

    def run(self, call_id: str) -> None:
        members_ev = self.calls.pop(call_id)
        call = members_ev[0].payload.call
        assert call is not None  # calls holds only starts that name their call (start)
        by_index = {e.payload.call.index: e for e in members_ev if e.payload.call is not None}
        members = []
        for i in range(call.size):
            e = by_index.get(i)
            if e is None:  # refused at the time: a placeholder row keeps the shape
                members.append(Member(SCRATCH, 0, (0,)))
            else:
                members.append(Member(e.stream_id, e.payload.interval_start, e.payload.token_ids))
        verify = any(e.payload.kind == "verify" for e in members_ev)
        if call.threads and call.threads != torch.get_num_threads():
            torch.set_num_threads(call.threads)
        logits = run_call(self.model, self.store, members, CallShape(call.size, call.new_pad, call.key_extent),
                          all_rows=verify)
        if not verify:
            for b in range(len(members)):
                e = by_index.get(b)
                if e is not None:
                    self.out.logits[e.stream_id] = logits[b, -1]
        self.ran.add(call_id)
