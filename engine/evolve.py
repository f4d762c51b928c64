"""evolve(state, event) -> state: the pure fold of one handle's stream.

Events are facts that already passed `decide` and the journal's conditional write, so
evolve does not re-validate; it only applies. Replay and the command service share it.
"""

from __future__ import annotations

from msgspec.structs import replace

from engine.state import HandleState, OpenTxn
from schemas import events as ev


def cut(state: HandleState, new_length: int) -> dict:
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
    p = event.payload
    pos = event.stream_position
    t = event.monotonic_ns
    if isinstance(event, ev.RequestAllocateEvent):
        m = p.manifest
        return HandleState(
            handle_id=event.stream_id, request_id=event.request_id,
            generation=event.handle_generation, snapshot_version=0, stream_position=pos,
            lifecycle="ACTIVE", prompt=m.input_identity.prompt_token_ids, outputs=(),
            committed_length=0, logits_ready=False, num_layers=m.cache_schema.num_cache_layers,
            b_token=p.b_token, reserved_capacity=p.reserved_capacity, copy_tiers=p.copy_tiers,
            allocator_bytes_per_copy=p.allocator_bytes_per_copy,
            cache_abi_sha256=p.cache_abi_sha256, prefix_identity_sha256=p.prefix_identity_sha256,
            manifest_sha256=p.manifest_sha256, arrival_ns=t,
        )
    if isinstance(event, ev.ForkEvent):
        return HandleState(
            handle_id=event.stream_id, request_id=event.request_id,
            generation=event.handle_generation, snapshot_version=0, stream_position=pos,
            lifecycle="ACTIVE", prompt=p.token_ids[: p.prompt_length],
            outputs=p.token_ids[p.prompt_length:], committed_length=p.prefix_length,
            logits_ready=p.logits_ready, num_layers=p.num_layers,
            b_token=p.b_token, reserved_capacity=p.reserved_capacity, copy_tiers=p.copy_tiers,
            allocator_bytes_per_copy=p.allocator_bytes_per_copy,
            cache_abi_sha256=p.cache_abi_sha256, prefix_identity_sha256=p.prefix_identity_sha256,
            manifest_sha256=p.manifest_sha256, parent_handle_id=p.parent_handle_id,
            arrival_ns=t, output_ns=(t,) * (len(p.token_ids) - p.prompt_length),
        )
    assert state is not None, f"{event.event_type} before the stream exists"
    if isinstance(event, ev.AppendStartEvent):
        txn = OpenTxn(p.txn_id, p.kind, p.base_snapshot_version, p.interval_start,
                      p.interval_count, p.token_ids)
        return replace(state, stream_position=pos, open_txns=(*state.open_txns, txn))
    if isinstance(event, ev.AppendPublishEvent):
        txn = state.open_txn(p.txn_id)
        assert txn is not None, f"publish of {p.txn_id} that is not open"
        accepted = txn.token_ids[: p.accepted_count] if txn.kind == "verify" else ()
        return replace(
            state, stream_position=pos, snapshot_version=p.result_snapshot_version,
            committed_length=p.committed_length, logits_ready=p.logits_ready,
            # verify: accepted drafts become outputs at the moment their rows commit
            outputs=state.outputs + accepted, output_ns=state.output_ns + (t,) * len(accepted),
            open_txns=tuple(x for x in state.open_txns if x.txn_id != p.txn_id),
        )
    if isinstance(event, ev.FailureEvent):
        return replace(
            state, stream_position=pos,
            open_txns=tuple(x for x in state.open_txns if x.txn_id != p.txn_id),
            aborted_txn_ids=(*state.aborted_txn_ids, p.txn_id),
        )
    if isinstance(event, ev.OutputEmitEvent):
        return replace(state, stream_position=pos, outputs=(*state.outputs, p.token_id),
                       output_ns=(*state.output_ns, t), logits_ready=False)
    if isinstance(event, ev.TruncateEvent):
        return replace(state, stream_position=pos, snapshot_version=p.result_snapshot_version,
                       **cut(state, p.new_length))
    if isinstance(event, ev.ReorderEvent):
        return replace(state, stream_position=pos, row_index=p.row_index)
    if isinstance(event, ev.CancelRequestEvent):
        return replace(state, stream_position=pos, snapshot_version=p.result_snapshot_version,
                       lifecycle="CANCELLED", finish_ns=t, logits_ready=False)
    if isinstance(event, ev.FinishEvent):
        return replace(state, stream_position=pos, lifecycle="FINISHED", finish_ns=t)
    if isinstance(event, ev.ReleaseEvent):
        return replace(state, stream_position=pos, generation=p.result_generation,
                       snapshot_version=p.result_snapshot_version, committed_length=0,
                       lifecycle="RELEASED", release_ns=t, logits_ready=False, open_txns=())
    raise AssertionError(f"unhandled event type {event.event_type}")


def fold(events: list[ev.Event], state: HandleState | None = None) -> HandleState | None:
    for e in events:
        state = evolve(state, e)
    return state
