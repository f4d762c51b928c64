"""Commands: what a caller asks for. Each names the base it was decided against, so a
late or stale command can be fenced. A command's canonical JSON is its fingerprint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec

from engine.state import HandleState
from schemas.canonical import digest
from schemas.errors import ErrorCode, KvLedgerError
from schemas.events import AppendKind, FailureOutcome, ForwardCall, LayerRows
from schemas.manifest import Manifest


class _Command(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    operation_id: str | None = None  # idempotency key; the service makes one if absent

    def fingerprint(self) -> str:
        # The whole command minus the key itself: a retry must ask for the same thing.
        return digest(msgspec.structs.replace(self, operation_id=None))


class Allocate(_Command):
    handle_id: str
    manifest: Manifest
    reserved_capacity: int
    copy_tiers: tuple[str, ...] = ("gpu",)
    allocator_bytes_per_copy: int = 0
    generation: int = 0


class BeginAppend(_Command):
    handle_id: str
    txn_id: str
    kind: AppendKind
    base_generation: int | None  # None only as a later step of a Chain (see below)
    base_snapshot_version: int | None
    interval_start: int
    interval_count: int
    token_ids: tuple[int, ...]
    cache_positions: tuple[int, ...]
    mask_key_extent: int
    cache_abi_sha256: str
    call: ForwardCall | None = None


class Publish(_Command):
    handle_id: str
    txn_id: str
    base_generation: int | None
    base_snapshot_version: int | None
    # None: the caller asserts every cache layer staged complete K and V over the
    # interval (expanded by decide); the worker names each layer with its row digest.
    layers: tuple[LayerRows, ...] | None = None
    accepted_count: int | None = None  # verify only: rows of accepted drafts
    workspace_bytes: int = 0


class Fail(_Command):
    handle_id: str
    txn_id: str
    outcome: FailureOutcome
    code: str = "FAILED"
    detail: str = ""


class EmitOutput(_Command):
    handle_id: str
    base_generation: int | None
    snapshot_version: int | None
    output_index: int
    token_id: int


class Fork(_Command):
    parent_handle_id: str
    base_generation: int
    base_snapshot_version: int
    child_handle_ids: tuple[str, ...]
    prefix_length: int
    child_request_ids: tuple[str, ...] = ()  # default: "<parent request>.<i>"


class Truncate(_Command):
    handle_id: str
    base_generation: int
    base_snapshot_version: int
    new_length: int


class Reorder(_Command):
    """One permutation over coupled rows: new row i takes old row permutation[i]. The
    per-component permutations exist only so a split reorder can be named and refused."""

    group_id: str
    rows: tuple[str, ...]
    bases: tuple[tuple[int, int], ...]  # (generation, snapshot_version) per row
    permutation: tuple[int, ...]
    token_permutation: tuple[int, ...] | None = None
    cache_permutation: tuple[int, ...] | None = None
    position_permutation: tuple[int, ...] | None = None
    sampler_permutation: tuple[int, ...] | None = None


class CancelRequest(_Command):
    handle_id: str
    base_generation: int
    reason: str = ""


class Finish(_Command):
    handle_id: str
    base_generation: int | None
    reason: Literal["eos", "max_tokens", "stop", "client", "length"] = "max_tokens"


class Release(_Command):
    handle_id: str
    base_generation: int | None
    base_snapshot_version: int | None = None


Step = BeginAppend | Publish | EmitOutput | Finish | Release


class Chain(_Command):
    """Several commands on one handle as one operation: one decision, one guarded write,
    one receipt. The first step names its base like any command; each later step may
    leave its base as None, meaning the state the steps before it leave. That is safe
    because the chain commits whole or not at all, fenced by the first step's base: what
    a worker does for one sequence per iteration (publish, emit, start the next append)."""

    handle_id: str
    steps: tuple[Step, ...]


_RELATIVE = {
    BeginAppend: ("base_generation", "base_snapshot_version"),
    Publish: ("base_generation", "base_snapshot_version"),
    EmitOutput: ("base_generation", "snapshot_version"),
    Finish: ("base_generation",),
    Release: ("base_generation",),
}


def unnamed_base(cmd: object) -> str | None:
    """The first base field a command leaves unnamed, if any."""
    for name in _RELATIVE.get(type(cmd), ()):
        if getattr(cmd, name) is None:
            return name
    return None


def bind(step: Step, generation: int, snapshot_version: int) -> Step:
    """A chain step with its unnamed base fields set to the given state's."""
    values = {"base_generation": generation, "base_snapshot_version": snapshot_version,
              "snapshot_version": snapshot_version}
    fields = {n: values[n] for n in _RELATIVE[type(step)] if getattr(step, n) is None}
    return msgspec.structs.replace(step, **fields) if fields else step


Command = (
    Allocate | BeginAppend | Publish | Fail | EmitOutput | Fork | Truncate | Reorder
    | CancelRequest | Finish | Release | Chain
)


class Relative(msgspec.Struct, frozen=True, tag=True):
    """A command decided against its handle's state at decision time, which fills in its
    base (see bind_current); the base fields it carries are ignored. That state is the
    service's view, which the journal's guard then checks against the head row, so it is
    fenced like a command that named the same base. A worker sends these: it acts on
    what its earlier commands leave, in this batch or the last, which it does not know
    when it builds the batch. Being data, they can cross to a service in another process."""

    command: Command


def bind_current(cmd: Command, state_of: Callable[[str], HandleState | None]) -> Command:
    """`cmd` with its base taken from the current state of the handles it acts on, as
    `state_of` gives it (a fork: its parent's, forked at the committed length; an append
    start: the handle's cache ABI unless it names one; a chain: its first step's, the
    later ones follow from it; a reorder: each row's)."""
    replace = msgspec.structs.replace
    if isinstance(cmd, Reorder):
        return replace(cmd, bases=tuple((s.generation, s.snapshot_version)
                                        for s in (_existing(h, state_of) for h in cmd.rows)))
    s = _existing(handles_of(cmd)[0], state_of)
    g, v = s.generation, s.snapshot_version
    if isinstance(cmd, Chain):
        return replace(cmd, steps=(bind_current(cmd.steps[0], state_of), *cmd.steps[1:]))
    if isinstance(cmd, BeginAppend):
        return replace(cmd, base_generation=g, base_snapshot_version=v,
                       cache_abi_sha256=cmd.cache_abi_sha256 or s.cache_abi_sha256)
    if isinstance(cmd, (Publish, Truncate)):
        return replace(cmd, base_generation=g, base_snapshot_version=v)
    if isinstance(cmd, EmitOutput):
        return replace(cmd, base_generation=g, snapshot_version=v)
    if isinstance(cmd, (Finish, Release, CancelRequest)):
        return replace(cmd, base_generation=g)
    if isinstance(cmd, Fork):
        return replace(cmd, base_generation=g, base_snapshot_version=v, prefix_length=s.committed_length)
    raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{type(cmd).__name__} cannot be relative")


def _existing(h: str, state_of: Callable[[str], HandleState | None]) -> HandleState:
    s = state_of(h)
    if s is None:
        raise KvLedgerError(ErrorCode.UNKNOWN_HANDLE, f"no handle {h}")
    return s


def handles_of(cmd: Command) -> tuple[str, ...]:
    """The handles a command reads (and possibly writes)."""
    if isinstance(cmd, Fork):
        return (cmd.parent_handle_id, *cmd.child_handle_ids)
    if isinstance(cmd, Reorder):
        return cmd.rows
    return (cmd.handle_id,)
