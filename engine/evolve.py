"""evolve(state, event) -> state: the pure fold of one handle's stream.

Events are facts that already passed `decide` and the journal's conditional write, so
evolve does not re-validate; it only applies. Replay and the command service share it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict

from msgspec.structs import replace

from kvledger.engine.state import HandleState, OpenTxn, grown
from kvledger.schemas import events as ev


class Cut(TypedDict):
    outputs: tuple[int, ...]
    output_ns: tuple[int, ...]
    committed_length: int
    logits_ready: bool


def cut(state: HandleState, new_length: int) -> Cut:
    """Token-state fields after cutting committed rows to `new_length` (truncate, fork).

    Output ids beyond the cut are rolled back with the rows. The output at position
    new_length, if any, stays as the frontier: it was chosen from the logits at
    new_length - 1, which are still committed. The prompt is immutable input: cutting
    into it leaves prompt rows to prefill again.
    """
    p = len(state.prompt)
    keep = max(0, min(len(state.outputs), new_length - p + 1))
    unchanged = new_length == state.committed_length and keep == len(state.outputs)
    return {
        "outputs": state.outputs[:keep],
        "output_ns": state.output_ns[:keep],
        "committed_length": new_length,
        "logits_ready": state.logits_ready and unchanged,
    }


def evolve(state: HandleState | None, event: ev.Event) -> HandleState:
    """Apply one event. A hot loop may index `APPLY` by the event's class itself."""
    # One dict lookup instead of a chain of isinstance checks: replay calls this for
    # every event in the journal.
    return APPLY[type(event)](state, event)


def _allocate(state: None, e: ev.RequestAllocateEvent) -> HandleState:
    p = e.payload
    m = p.manifest
    return HandleState(
        handle_id=e.stream_id, request_id=e.request_id, generation=e.handle_generation,
        snapshot_version=0, stream_position=e.stream_position, lifecycle="ACTIVE",
        prompt=m.input_identity.prompt_token_ids, outputs=(), committed_length=0,
        logits_ready=False, num_layers=m.cache_schema.num_cache_layers, b_token=p.b_token,
        reserved_capacity=p.reserved_capacity, copy_tiers=p.copy_tiers,
        allocator_bytes_per_copy=p.allocator_bytes_per_copy, cache_abi_sha256=p.cache_abi_sha256,
        prefix_identity_sha256=p.prefix_identity_sha256, manifest_sha256=p.manifest_sha256,
        arrival_ns=e.monotonic_ns,
    )


def _fork(state: None, e: ev.ForkEvent) -> HandleState:
    p = e.payload
    t = e.monotonic_ns
    return HandleState(
        handle_id=e.stream_id, request_id=e.request_id, generation=e.handle_generation,
        snapshot_version=0, stream_position=e.stream_position, lifecycle="ACTIVE",
        prompt=p.token_ids[: p.prompt_length], outputs=p.token_ids[p.prompt_length:],
        committed_length=p.prefix_length, logits_ready=p.logits_ready, num_layers=p.num_layers,
        b_token=p.b_token, reserved_capacity=p.reserved_capacity, copy_tiers=p.copy_tiers,
        allocator_bytes_per_copy=p.allocator_bytes_per_copy, cache_abi_sha256=p.cache_abi_sha256,
        prefix_identity_sha256=p.prefix_identity_sha256, manifest_sha256=p.manifest_sha256,
        parent_handle_id=p.parent_handle_id, arrival_ns=t,
        output_ns=(t,) * (len(p.token_ids) - p.prompt_length),
    )


def _start(state: HandleState, e: ev.AppendStartEvent) -> HandleState:
    p = e.payload
    txn = OpenTxn(p.txn_id, p.kind, p.base_snapshot_version, p.interval_start, p.interval_count,
                  p.token_ids)
    return replace(state, stream_position=e.stream_position, open_txns=state.open_txns + (txn,))


def _without(txns: tuple[OpenTxn, ...], txn_id: str) -> tuple[tuple[OpenTxn, ...], OpenTxn | None]:
    if len(txns) == 1:  # the usual case: one append in flight
        return ((), txns[0]) if txns[0].txn_id == txn_id else (txns, None)
    found = None
    rest = []
    for x in txns:
        if x.txn_id == txn_id:
            found = x
        else:
            rest.append(x)
    return tuple(rest), found


def _publish(state: HandleState, e: ev.AppendPublishEvent) -> HandleState:
    p = e.payload
    rest, txn = _without(state.open_txns, p.txn_id)
    assert txn is not None, f"publish of {p.txn_id} that is not open"
    if txn.kind == "verify":  # accepted drafts become outputs as their rows commit
        accepted = txn.token_ids[: p.accepted_count]
        outputs, output_ns = grown(state.outputs, state.output_ns, accepted, (e.monotonic_ns,) * len(accepted))
        return replace(
            state, stream_position=e.stream_position, snapshot_version=p.result_snapshot_version,
            committed_length=p.committed_length, logits_ready=p.logits_ready, open_txns=rest,
            outputs=outputs, output_ns=output_ns,
        )
    return replace(
        state, stream_position=e.stream_position, snapshot_version=p.result_snapshot_version,
        committed_length=p.committed_length, logits_ready=p.logits_ready, open_txns=rest,
    )


def _failure(state: HandleState, e: ev.FailureEvent) -> HandleState:
    rest, _ = _without(state.open_txns, e.payload.txn_id)
    return replace(state, stream_position=e.stream_position, open_txns=rest,
                   aborted_txn_ids=state.aborted_txn_ids + (e.payload.txn_id,))


def _emit(state: HandleState, e: ev.OutputEmitEvent) -> HandleState:
    outputs, output_ns = grown(state.outputs, state.output_ns, (e.payload.token_id,), (e.monotonic_ns,))
    return replace(state, stream_position=e.stream_position, outputs=outputs, output_ns=output_ns,
                   logits_ready=False)


def _truncate(state: HandleState, e: ev.TruncateEvent) -> HandleState:
    return replace(state, stream_position=e.stream_position,
                   snapshot_version=e.payload.result_snapshot_version, **cut(state, e.payload.new_length))


def _reorder(state: HandleState, e: ev.ReorderEvent) -> HandleState:
    return replace(state, stream_position=e.stream_position, row_index=e.payload.row_index)


def _cancel(state: HandleState, e: ev.CancelRequestEvent) -> HandleState:
    return replace(state, stream_position=e.stream_position,
                   snapshot_version=e.payload.result_snapshot_version, lifecycle="CANCELLED",
                   finish_ns=e.monotonic_ns, logits_ready=False)


def _finish(state: HandleState, e: ev.FinishEvent) -> HandleState:
    return replace(state, stream_position=e.stream_position, lifecycle="FINISHED", finish_ns=e.monotonic_ns)


def _release(state: HandleState, e: ev.ReleaseEvent) -> HandleState:
    p = e.payload
    return replace(state, stream_position=e.stream_position, generation=p.result_generation,
                   snapshot_version=p.result_snapshot_version, committed_length=0,
                   lifecycle="RELEASED", release_ns=e.monotonic_ns, logits_ready=False, open_txns=())


# Keyed by the event's class; each function takes that class (and the state before it,
# None for an allocation or a fork), a pairing a dict's type cannot state.
APPLY: dict[type, Callable[[Any, Any], HandleState]] = {
    ev.RequestAllocateEvent: _allocate, ev.ForkEvent: _fork, ev.AppendStartEvent: _start,
    ev.AppendPublishEvent: _publish, ev.FailureEvent: _failure, ev.OutputEmitEvent: _emit,
    ev.TruncateEvent: _truncate, ev.ReorderEvent: _reorder, ev.CancelRequestEvent: _cancel,
    ev.FinishEvent: _finish, ev.ReleaseEvent: _release,
}


def fold(events: list[ev.Event], state: HandleState | None = None) -> HandleState | None:
    for e in events:
        state = evolve(state, e)
    return state
