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
    dtype = next(model.parameters()).dtype
    store = KVStore(model.cfg, slots=slots + 1, capacity=capacity, dtype=dtype,
                    device=next(model.parameters()).device)
    store.open(SCRATCH, capacity)
    out = Reexecution(store)
    starts: dict[tuple[str, str], ev.AppendStartEvent] = {}  # (handle, txn)
    calls: dict[str, list[ev.AppendStartEvent]] = {}
    ran: set[str] = set()

    def run(call_id: str) -> None:
        members_ev = calls.pop(call_id)
        call = members_ev[0].payload.call
        assert call is not None  # calls holds only starts that name their call (below)
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
        logits = run_call(model, store, members, CallShape(call.size, call.new_pad, call.key_extent),
                          all_rows=verify)
        for b in range(len(members)):
            e = by_index.get(b)
            if e is None:
                continue
            if not verify:
                out.logits[e.stream_id] = logits[b, -1]
        ran.add(call_id)

    for e in events:
        h = e.stream_id
        if isinstance(e, ev.RequestAllocateEvent):
            store.open(h, e.payload.reserved_capacity)
        elif isinstance(e, ev.ForkEvent):
            store.fork(e.payload.parent_handle_id, h, e.payload.prefix_length)
            if e.payload.parent_handle_id in out.logits and e.payload.logits_ready:
                out.logits[h] = out.logits[e.payload.parent_handle_id]
        elif isinstance(e, ev.AppendStartEvent):
            starts[(h, e.payload.txn_id)] = e
            if e.payload.call is None:
                out.skipped.add(h)
            else:
                calls.setdefault(e.payload.call.call_id, []).append(e)
        elif isinstance(e, (ev.AppendPublishEvent, ev.FailureEvent)):
            start = starts.pop((h, e.payload.txn_id), None)
            if start is None or start.payload.call is None:
                continue
            if start.payload.call.call_id not in ran:
                run(start.payload.call.call_id)
            if isinstance(e, ev.FailureEvent):
                store.discard(h)
                continue
            p = e.payload
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
        elif isinstance(e, ev.OutputEmitEvent):
            out.logits.pop(h, None)
        elif isinstance(e, ev.TruncateEvent):
            store.truncate(h, e.payload.new_length)
            out.logits.pop(h, None)
        elif isinstance(e, ev.ReleaseEvent):
            store.release(h)
            out.logits.pop(h, None)
    return out
