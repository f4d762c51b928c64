"""decide(states, command) -> drafts: the pure validation of one command.

Checks follow the spec's ordered chain (0x09): ABI, then position/mask, then the layer
set, then generation/snapshot, then frontier, then ownership. A rejection raises
KvLedgerError with a stable code; nothing has been written at that point. The drafts
are events without envelope stamps (ids, clocks, positions): the service adds those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from kvledger.engine import commands as c
from kvledger.engine.evolve import cut
from kvledger.engine.state import HandleState
from kvledger.schemas import events as ev
from kvledger.schemas.canonical import layers_sha256
from kvledger.schemas.errors import ErrorCode as E
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.manifest import (
    b_token,
    cache_abi_sha256,
    manifest_sha256,
    prefix_identity_sha256,
    validate_manifest,
)

Payload = (
    ev.RequestAllocate | ev.AppendStart | ev.AppendPublish | ev.Failure | ev.OutputEmit | ev.Fork
    | ev.Truncate | ev.Reorder | ev.CancelRequest | ev.Finish | ev.Release
)
States = Mapping[str, HandleState | None]


class Draft(NamedTuple):
    handle_id: str
    event_cls: type[ev.Event]
    payload: Payload  # the one event_cls carries


def reject(code: E, message: str) -> KvLedgerError:
    return KvLedgerError(code, message)


def decide(states: States, cmd: c.Command) -> list[Draft]:
    missing = c.unnamed_base(cmd)
    if missing is not None:
        raise reject(E.INVALID_ARGUMENT, f"{type(cmd).__name__}.{missing} must be named: only a "
                                         "later step of a chain may leave its base to the chain")
    handler = _HANDLERS.get(type(cmd))
    if handler is None:  # a Chain is decided step by step by the command service
        raise reject(E.INVALID_ARGUMENT, f"{type(cmd).__name__} is not decided on its own")
    return handler(states, cmd)


# -- shared checks ------------------------------------------------------------------

def _existing(states: States, handle_id: str) -> HandleState:
    s = states.get(handle_id)
    if s is None:
        raise reject(E.UNKNOWN_HANDLE, f"no handle {handle_id}")
    return s


def _fence(s: HandleState, generation: int | None, snapshot: int | None = None) -> None:
    """Generation and snapshot fence: a stale base is refused even if a recycled
    slot or handle name looks the same (the ABA case). A command's base fields are
    optional (a chain's later steps), but decide refuses an unnamed one before this."""
    if generation != s.generation or (snapshot is not None and snapshot != s.snapshot_version):
        want = f"generation {generation}" + ("" if snapshot is None else f", snapshot {snapshot}")
        raise reject(E.STALE_BASE, f"{s.handle_id} is at generation {s.generation}, snapshot "
                                   f"{s.snapshot_version}; the command names {want}")


def _owned(s: HandleState, *, allow_finished: bool = False) -> None:
    if s.lifecycle == "RELEASED":
        raise reject(E.HANDLE_RELEASED, f"{s.handle_id} is released")
    if s.lifecycle == "CANCELLED" or (s.lifecycle == "FINISHED" and not allow_finished):
        raise reject(E.HANDLE_TERMINAL, f"{s.handle_id} is {s.lifecycle.lower()}: no new work")


def _abort_open(s: HandleState, reason: str) -> list[Draft]:
    return [
        Draft(s.handle_id, ev.FailureEvent, ev.Failure(
            txn_id=t.txn_id, outcome="aborted", code=E.TXN_ABORTED.value,
            base_snapshot_version=t.base_snapshot_version, detail=reason))
        for t in s.open_txns
    ]


# -- commands -----------------------------------------------------------------------

def _allocate(states: States, cmd: c.Allocate) -> list[Draft]:
    if states.get(cmd.handle_id) is not None:
        raise reject(E.HANDLE_EXISTS, f"handle {cmd.handle_id} already exists")
    m = cmd.manifest
    validate_manifest(m)
    if cmd.reserved_capacity < 0 or not cmd.copy_tiers or cmd.allocator_bytes_per_copy < 0:
        raise reject(E.INVALID_ARGUMENT, "reserved_capacity, copy_tiers and allocator bytes must be declared")
    abi = cache_abi_sha256(m)
    return [Draft(cmd.handle_id, ev.RequestAllocateEvent, ev.RequestAllocate(
        manifest=m, manifest_sha256=manifest_sha256(m), cache_abi_sha256=abi,
        prefix_identity_sha256=prefix_identity_sha256(m, abi), b_token=b_token(m.cache_schema),
        reserved_capacity=cmd.reserved_capacity, copy_tiers=cmd.copy_tiers,
        allocator_bytes_per_copy=cmd.allocator_bytes_per_copy))]


def _begin_append(states: States, cmd: c.BeginAppend) -> list[Draft]:
    s = _existing(states, cmd.handle_id)
    if cmd.cache_abi_sha256 != s.cache_abi_sha256:
        raise reject(E.ABI_MISMATCH, f"rows for ABI {cmd.cache_abi_sha256[:12]}, handle has "
                                     f"{s.cache_abi_sha256[:12]}")
    t, n = cmd.interval_start, cmd.interval_count
    if n < 1 or len(cmd.token_ids) != n:
        raise reject(E.POSITION_MASK_MISMATCH, f"{len(cmd.token_ids)} token ids for an interval of {n}")
    if cmd.cache_positions != tuple(range(t, t + n)):
        raise reject(E.POSITION_MASK_MISMATCH, f"cache positions do not cover [{t}, {t + n})")
    if cmd.mask_key_extent != t + n:
        raise reject(E.POSITION_MASK_MISMATCH, f"mask key extent {cmd.mask_key_extent} != {t + n}")
    _fence(s, cmd.base_generation, cmd.base_snapshot_version)
    _owned(s, allow_finished=cmd.kind == "repair")
    k = s.committed_length
    if t < k:
        raise reject(E.POSITION_MASK_MISMATCH, f"interval starts at {t}, inside committed [0, {k})")
    if t > k:
        raise reject(E.APPEND_HOLE, f"interval starts at {t}, committed length is {k}")
    if s.open_txn(cmd.txn_id) is not None or cmd.txn_id in s.aborted_txn_ids:
        raise reject(E.CONFLICT, f"transaction {cmd.txn_id} already exists on {s.handle_id}")
    if t + n > s.reserved_capacity:
        raise reject(E.CAPACITY_EXCEEDED, f"[{t}, {t + n}) exceeds reserved capacity {s.reserved_capacity}")
    _check_frontier(s, cmd)
    return [Draft(s.handle_id, ev.AppendStartEvent, ev.AppendStart(
        txn_id=cmd.txn_id, kind=cmd.kind, base_snapshot_version=s.snapshot_version,  # the command's, fenced
        interval_start=t, interval_count=n, token_ids=cmd.token_ids,
        cache_positions=cmd.cache_positions, mask_key_extent=cmd.mask_key_extent,
        cache_abi_sha256=cmd.cache_abi_sha256, call=cmd.call))]


def _check_frontier(s: HandleState, cmd: c.BeginAppend) -> None:
    """Every row must be computed for the exact token at its position."""
    t, n, p = cmd.interval_start, cmd.interval_count, len(s.prompt)
    if cmd.kind == "verify":
        # Drafts are proposals for outputs: only from a snapshot whose logits are ready.
        if not s.logits_ready or s.logical_length != t:
            raise reject(E.OUTPUT_NOT_READY, "verify needs a published snapshot with ready logits")
        return
    if cmd.kind == "prefill" and t != 0:
        raise reject(E.POSITION_MASK_MISMATCH, "prefill starts at position 0; use chunk")
    if cmd.kind == "chunk" and t == 0:
        raise reject(E.POSITION_MASK_MISMATCH, "a chunk continues committed rows; use prefill")
    if cmd.kind in ("decode", "repair"):
        if n != 1 or not s.has_frontier:
            raise reject(E.FRONTIER_MISMATCH, f"{cmd.kind} processes exactly the one emitted, "
                                              "unprocessed output")
        if cmd.kind == "repair" and s.lifecycle != "FINISHED":
            raise reject(E.FRONTIER_MISMATCH, "repair closes the frontier of a finished request; "
                                              "an active one decodes it")
    if t + n > s.logical_length:
        raise reject(E.FRONTIER_MISMATCH, f"[{t}, {t + n}) runs past the {s.logical_length} "
                                          "tokens the request holds")
    expected = s.logical_tokens(t, t + n)
    if cmd.token_ids != expected:
        raise reject(E.FRONTIER_MISMATCH, f"token ids differ from the request's tokens at [{t}, {t + n})")
    if cmd.kind == "prefill" and t + n > p:
        raise reject(E.POSITION_MASK_MISMATCH, "prefill covers prompt rows only")


def _publish(states: States, cmd: c.Publish) -> list[Draft]:
    s = _existing(states, cmd.handle_id)
    txn = s.open_txn(cmd.txn_id)
    # Set when the transaction is open, the one case that publishes (refused below otherwise).
    accepted = 0
    rows_sha256 = None
    if txn is not None:
        staged = txn.interval_count
        accepted = cmd.accepted_count if cmd.accepted_count is not None else staged
        if cmd.layers is None:  # every layer complete, asserted by the caller
            _check_accepted(accepted, txn.kind, staged)
            rows_sha256 = cmd.rows_sha256
        elif cmd.rows_sha256 is not None:
            raise reject(E.INVALID_ARGUMENT, "a publish names its layers or gives their combined "
                                             "rows_sha256, not both")
        else:
            _check_layer_set(s, cmd.layers, txn.interval_start, accepted, txn.kind, staged)
            rows_sha256 = _rows_sha256(cmd.layers)
    _fence(s, cmd.base_generation, cmd.base_snapshot_version)
    if txn is None:
        if cmd.txn_id in s.aborted_txn_ids:
            raise reject(E.TXN_ABORTED, f"{cmd.txn_id} was aborted: a late completion publishes nothing")
        raise reject(E.TXN_NOT_OPEN, f"no open transaction {cmd.txn_id} on {s.handle_id}")
    if txn.base_snapshot_version != s.snapshot_version:
        raise reject(E.STALE_BASE, f"{cmd.txn_id} started at snapshot {txn.base_snapshot_version}, "
                                   f"handle is at {s.snapshot_version}")
    _owned(s, allow_finished=txn.kind == "repair")
    committed = txn.interval_start + accepted
    return [Draft(s.handle_id, ev.AppendPublishEvent, ev.AppendPublish(
        txn_id=txn.txn_id, base_snapshot_version=s.snapshot_version,
        result_snapshot_version=s.snapshot_version + 1, committed_length=committed,
        accepted_count=accepted, layers_complete=s.num_layers, rows_sha256=rows_sha256,
        # Repair logits are discarded; a partial prefill has no next-token logits yet.
        logits_ready=txn.kind != "repair" and committed == s.logical_length + (
            accepted if txn.kind == "verify" else 0),
        workspace_bytes=cmd.workspace_bytes))]


def full_layers(num_layers: int, start: int, count: int) -> tuple[ev.LayerRows, ...]:
    """Layer records of a complete all-layer staging of [start, start+count)."""
    return tuple(ev.LayerRows(layer=i, start=start, count=count, k_complete=True, v_complete=True)
                 for i in range(num_layers))


def _rows_sha256(layers: tuple[ev.LayerRows, ...]) -> str | None:
    """The publish's one digest over its layers' row digests: all layers digested, or none."""
    digests = [r.rows_sha256 for r in sorted(layers, key=lambda r: r.layer) if r.rows_sha256 is not None]
    if not digests:
        return None
    if len(digests) < len(layers):
        missing = [r.layer for r in layers if r.rows_sha256 is None]
        raise reject(E.INVALID_ARGUMENT, f"row digests for some layers but not for layers {sorted(missing)}")
    return layers_sha256(digests)


def _check_layer_set(s: HandleState, layers: tuple[ev.LayerRows, ...], start: int, accepted: int,
                     kind: str, staged: int) -> None:
    """prepared(X): every cache layer, exactly once, with complete K and V over the same
    interval. Anything less publishes nothing (no best-effort shorter state)."""
    _check_accepted(accepted, kind, staged)
    named = sorted(r.layer for r in layers)
    if named != list(range(s.num_layers)):
        raise reject(E.PARTIAL_LAYER_SET, f"layers {named} != all {s.num_layers} cache layers")
    for r in layers:
        if not (r.k_complete and r.v_complete):
            raise reject(E.PARTIAL_LAYER_SET, f"layer {r.layer} has incomplete K or V")
        if r.start != start:
            raise reject(E.PARTIAL_LAYER_SET, f"layer {r.layer} interval starts at {r.start}, not {start}")
        if r.count > accepted and kind == "verify":
            raise reject(E.REJECTED_SUFFIX, f"layer {r.layer} commits {r.count} rows, only "
                                            f"{accepted} drafts were accepted")
        if r.count != accepted:
            raise reject(E.PARTIAL_LAYER_SET, f"layer {r.layer} has {r.count} rows, expected {accepted}")


def _check_accepted(accepted: int, kind: str, staged: int) -> None:
    if kind != "verify" and accepted != staged:
        raise reject(E.PARTIAL_LAYER_SET, f"{kind} must publish all {staged} staged rows")
    if not 0 <= accepted <= staged:
        raise reject(E.REJECTED_SUFFIX, f"accepted {accepted} of {staged} staged rows")


def _fail(states: States, cmd: c.Fail) -> list[Draft]:
    s = _existing(states, cmd.handle_id)
    txn = s.open_txn(cmd.txn_id)
    if txn is None:
        raise reject(E.TXN_NOT_OPEN, f"no open transaction {cmd.txn_id} on {s.handle_id}")
    return [Draft(s.handle_id, ev.FailureEvent, ev.Failure(
        txn_id=txn.txn_id, outcome=cmd.outcome, code=cmd.code,
        base_snapshot_version=txn.base_snapshot_version, detail=cmd.detail))]


def _emit(states: States, cmd: c.EmitOutput) -> list[Draft]:
    s = _existing(states, cmd.handle_id)
    _fence(s, cmd.base_generation, cmd.base_snapshot_version)
    _owned(s)
    if not s.logits_ready:
        raise reject(E.OUTPUT_NOT_READY, f"{s.handle_id} has no published logits to choose from")
    if cmd.output_index != len(s.outputs):
        raise reject(E.FRONTIER_MISMATCH, f"output index {cmd.output_index}, next is {len(s.outputs)}")
    return [Draft(s.handle_id, ev.OutputEmitEvent, ev.OutputEmit(
        output_index=cmd.output_index, token_id=cmd.token_id, snapshot_version=s.snapshot_version))]


def _fork(states: States, cmd: c.Fork) -> list[Draft]:
    if cmd.prefix_length is None:
        raise reject(E.INVALID_ARGUMENT, "Fork.prefix_length must be named: only a Relative fork leaves it "
                                         "to the parent's committed length")
    s = _existing(states, cmd.parent_handle_id)
    _fence(s, cmd.base_generation, cmd.base_snapshot_version)
    _owned(s, allow_finished=True)
    if cmd.prefix_length > s.committed_length or cmd.prefix_length < 0:
        raise reject(E.FORK_BEYOND_COMMITTED,
                     f"fork at {cmd.prefix_length}, committed prefix is [0, {s.committed_length})")
    kids = cmd.child_handle_ids
    if not kids or len(set(kids)) != len(kids) or s.handle_id in kids:
        raise reject(E.INVALID_ARGUMENT, "fork needs distinct new child handle ids")
    if cmd.child_request_ids and len(cmd.child_request_ids) != len(kids):
        raise reject(E.INVALID_ARGUMENT, "one request id per child")
    for k in kids:
        if states.get(k) is not None:
            raise reject(E.HANDLE_EXISTS, f"handle {k} already exists")
    inherited = cut(s, cmd.prefix_length)
    tokens = s.prompt + inherited["outputs"]
    return [
        Draft(k, ev.ForkEvent, ev.Fork(
            parent_handle_id=s.handle_id, parent_generation=s.generation,
            parent_snapshot_version=s.snapshot_version, prefix_length=cmd.prefix_length,
            child_index=i, token_ids=tokens, prompt_length=len(s.prompt),
            logits_ready=inherited["logits_ready"], manifest_sha256=s.manifest_sha256,
            cache_abi_sha256=s.cache_abi_sha256, prefix_identity_sha256=s.prefix_identity_sha256,
            num_layers=s.num_layers, b_token=s.b_token, reserved_capacity=s.reserved_capacity,
            copy_tiers=s.copy_tiers, allocator_bytes_per_copy=s.allocator_bytes_per_copy))
        for i, k in enumerate(kids)
    ]


def _truncate(states: States, cmd: c.Truncate) -> list[Draft]:
    s = _existing(states, cmd.handle_id)
    _fence(s, cmd.base_generation, cmd.base_snapshot_version)
    _owned(s)
    if cmd.new_length > s.committed_length:
        raise reject(E.TRUNCATE_GROWS, f"truncate to {cmd.new_length} > committed {s.committed_length}")
    if cmd.new_length < 0:
        raise reject(E.INVALID_ARGUMENT, "negative length")
    return [Draft(s.handle_id, ev.TruncateEvent, ev.Truncate(
        base_snapshot_version=s.snapshot_version, result_snapshot_version=s.snapshot_version + 1,
        new_length=cmd.new_length, output_count=len(cut(s, cmd.new_length)["outputs"])))]


def _reorder(states: States, cmd: c.Reorder) -> list[Draft]:
    n, perm = len(cmd.rows), cmd.permutation
    if sorted(perm) != list(range(n)) or len(set(cmd.rows)) != n:
        raise reject(E.NOT_A_PERMUTATION, f"{list(perm)} is not a bijection over {n} distinct rows; "
                                          "selection with repeats is select + fork")
    for part in (cmd.token_permutation, cmd.cache_permutation, cmd.position_permutation,
                 cmd.sampler_permutation):
        if part is not None and tuple(part) != tuple(perm):
            raise reject(E.SPLIT_REORDER, "token, cache, position and sampler state must move "
                                          "under one permutation")
    if len(cmd.bases) != n:
        raise reject(E.INVALID_ARGUMENT, "one base per row")
    drafts: list[Draft] = []
    new_index = {old: new for new, old in enumerate(perm)}
    for i, h in enumerate(cmd.rows):
        s = _existing(states, h)
        _fence(s, *cmd.bases[i])
        _owned(s)
        drafts.append(Draft(h, ev.ReorderEvent, ev.Reorder(
            group_id=cmd.group_id, rows=cmd.rows, permutation=perm, row_index=new_index[i])))
    return drafts


def _cancel(states: States, cmd: c.CancelRequest) -> list[Draft]:
    s = _existing(states, cmd.handle_id)
    _fence(s, cmd.base_generation)
    _owned(s)
    return [*_abort_open(s, "request cancelled"), Draft(s.handle_id, ev.CancelRequestEvent, ev.CancelRequest(
        base_snapshot_version=s.snapshot_version, result_snapshot_version=s.snapshot_version + 1,
        aborted_txn_ids=tuple(t.txn_id for t in s.open_txns), reason=cmd.reason))]


def _finish(states: States, cmd: c.Finish) -> list[Draft]:
    s = _existing(states, cmd.handle_id)
    _fence(s, cmd.base_generation)
    _owned(s)
    return [*_abort_open(s, "request finished"), Draft(s.handle_id, ev.FinishEvent, ev.Finish(
        reason=cmd.reason, output_count=len(s.outputs), committed_length=s.committed_length))]


def _release(states: States, cmd: c.Release) -> list[Draft]:
    s = _existing(states, cmd.handle_id)
    _fence(s, cmd.base_generation, cmd.base_snapshot_version)
    if s.lifecycle == "RELEASED":
        raise reject(E.HANDLE_RELEASED, f"{s.handle_id} is already released")
    if s.lifecycle == "ACTIVE":
        raise reject(E.RELEASE_BEFORE_FINISH, f"{s.handle_id} must finish or be cancelled before release")
    return [*_abort_open(s, "handle released"), Draft(s.handle_id, ev.ReleaseEvent, ev.Release(
        base_snapshot_version=s.snapshot_version, result_generation=s.generation + 1,
        result_snapshot_version=s.snapshot_version + 1, released_length=s.committed_length))]


# Keyed by the command's class; each handler takes that class, a pairing a dict's type
# cannot state, hence Any for the command.
_HANDLERS: dict[type, Callable[[States, Any], list[Draft]]] = {
    c.Allocate: _allocate, c.BeginAppend: _begin_append, c.Publish: _publish, c.Fail: _fail,
    c.EmitOutput: _emit, c.Fork: _fork, c.Truncate: _truncate, c.Reorder: _reorder,
    c.CancelRequest: _cancel, c.Finish: _finish, c.Release: _release,
}
