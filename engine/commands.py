"""Commands: what a caller asks for. Each names the base it was decided against, so a
late or stale command can be fenced. A command's canonical JSON is its fingerprint.

Fields that flow into events carry the events' own constrained types (schemas.events:
Id, Count, TokenIds, Text), so a command decoded from data (kvledger.engine.remote's frames), or
checked by `validate`, is refused for exactly what the event decoder would refuse later:
the limits cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvledger.engine.state import HandleState
from kvledger.schemas.canonical import digest
from kvledger.schemas.decode_batch import Abi, DecodeBatch
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import (
    AppendKind,
    Count,
    Digest,
    FailureOutcome,
    ForwardCall,
    Id,
    LayerRows,
    Text,
    TokenIds,
)
from kvledger.schemas.ids import id_problem
from kvledger.schemas.manifest import Manifest

# The events' Count: bounded by the journal's BIGINT columns too (generations, versions
# and lengths are stored in head rows as well as in bodies).
N = Count
Ids = Annotated[tuple[Id, ...], Meta(max_length=4096)]  # the events' bound on a row list
Perm = Annotated[tuple[N, ...], Meta(max_length=4096)]


# gc=False (here and on the journal's Operation, StreamWrite, Guard, HeadFacts and on
# Receipt): a frozen struct of immutable values cannot be part of a reference cycle, so the
# cyclic collector need not track it: tracked, they ran it often and its full passes stalled the write path.
class _Command(msgspec.Struct, frozen=True, kw_only=True, tag=True, gc=False):
    operation_id: Id | None = None  # idempotency key; the service makes one if absent

    def fingerprint(self) -> str:
        # The whole command minus the key itself: a retry must ask for the same thing.
        return digest(self if self.operation_id is None else msgspec.structs.replace(self, operation_id=None))


class Allocate(_Command, frozen=True):
    handle_id: Id
    manifest: Manifest
    reserved_capacity: N
    copy_tiers: Annotated[tuple[Id, ...], Meta(max_length=64)] = ("gpu",)  # decide: at least one
    allocator_bytes_per_copy: N = 0
    generation: N = 0


class BeginAppend(_Command, frozen=True):
    handle_id: Id
    txn_id: Id
    kind: AppendKind
    base_generation: N | None  # None only as a later step of a Chain (see below)
    base_snapshot_version: N | None
    interval_start: N
    interval_count: N  # >= 1, checked by decide (POSITION_MASK_MISMATCH)
    token_ids: TokenIds
    cache_positions: TokenIds
    mask_key_extent: N
    cache_abi_sha256: Abi
    call: ForwardCall | None = None


class Publish(_Command, frozen=True):
    handle_id: Id
    txn_id: Id
    base_generation: N | None
    base_snapshot_version: N | None
    # None: the caller asserts every cache layer staged complete K and V over the
    # interval (expanded by decide); or name each layer, with its row digest, to have
    # each one checked.
    layers: Annotated[tuple[LayerRows, ...], Meta(max_length=4096)] | None = None
    accepted_count: N | None = None  # verify only: rows of accepted drafts
    workspace_bytes: N = 0
    # With layers=None: schemas.canonical.layers_sha256 of every layer's row digest, in
    # layer order, which is what the publication stores. The worker's form: one field
    # where 32 layer records would cost a decode step more than everything else.
    rows_sha256: Digest | None = None


class Fail(_Command, frozen=True):
    handle_id: Id
    txn_id: Id
    outcome: FailureOutcome
    code: Id = "FAILED"
    detail: Text = ""


class EmitOutput(_Command, frozen=True):
    handle_id: Id
    base_generation: N | None
    base_snapshot_version: N | None
    output_index: N
    token_id: N


class Fork(_Command, frozen=True):
    parent_handle_id: Id
    base_generation: N
    base_snapshot_version: N
    child_handle_ids: Ids
    prefix_length: N | None  # None, in a Relative fork only: the parent's committed length
    child_request_ids: Ids = ()  # default: "<parent request>.<i>"


class Truncate(_Command, frozen=True):
    handle_id: Id
    base_generation: N
    base_snapshot_version: N
    new_length: N


class Reorder(_Command, frozen=True):
    """One permutation over coupled rows: new row i takes old row permutation[i]. The
    per-component permutations exist only so a split reorder can be named and refused."""

    group_id: Id
    rows: Ids
    bases: Annotated[tuple[tuple[N, N], ...], Meta(max_length=4096)]  # (generation, snapshot_version) per row
    permutation: Perm
    token_permutation: Perm | None = None
    cache_permutation: Perm | None = None
    position_permutation: Perm | None = None
    sampler_permutation: Perm | None = None


class CancelRequest(_Command, frozen=True):
    handle_id: Id
    base_generation: N
    reason: Text = ""


class Finish(_Command, frozen=True):
    handle_id: Id
    base_generation: N | None
    reason: Literal["eos", "max_tokens", "stop", "client", "length"] = "max_tokens"


class Release(_Command, frozen=True):
    handle_id: Id
    base_generation: N | None
    base_snapshot_version: N | None = None


Step = BeginAppend | Publish | EmitOutput | Finish | Release


class Chain(_Command, frozen=True):
    """Several commands on one handle as one operation: one decision, one guarded write,
    one receipt. The first step names its base like any command; each later step may
    leave its base as None, meaning the state the steps before it leave. That is safe
    because the chain commits whole or not at all, fenced by the first step's base: what
    a worker does for one sequence per iteration (publish, emit, start the next append)."""

    handle_id: Id
    steps: Annotated[tuple[Step, ...], Meta(max_length=4096)]


_RELATIVE: dict[type, tuple[str, ...]] = {
    BeginAppend: ("base_generation", "base_snapshot_version"),
    Publish: ("base_generation", "base_snapshot_version"),
    EmitOutput: ("base_generation", "base_snapshot_version"),
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
    values = {"base_generation": generation, "base_snapshot_version": snapshot_version}
    fields = {n: values[n] for n in _RELATIVE[type(step)] if getattr(step, n) is None}
    return msgspec.structs.replace(step, **fields) if fields else step


Command = (
    Allocate | BeginAppend | Publish | Fail | EmitOutput | Fork | Truncate | Reorder
    | CancelRequest | Finish | Release | Chain
)


class Relative(msgspec.Struct, frozen=True, tag=True, gc=False):
    """A command decided against its handle's state at decision time, which fills in its
    base (see bind_current); the base fields it carries are ignored. That state is the
    service's view, which the journal's guard then checks against the head row, so it is
    fenced like a command that named the same base. A worker sends these: it acts on
    what its earlier commands leave, in this batch or the last, which it does not know
    when it builds the batch. Being data, they can cross to a service in another process."""

    command: Command


def batch_chain(batch: DecodeBatch, i: int) -> Chain:
    """Step i of a decode batch as the chain it stands for: publish the running append
    (at the step's base, or unnamed: the handle's current), emit the token, start the
    append that processes it. The general path (decide, evolve) defines what it does."""
    h, token, at = batch.handle_ids[i], batch.tokens[i], batch.positions[i]
    base = batch.base(i)
    g, v = (None, None) if base is None else base
    return Chain(handle_id=h, steps=(
        Publish(handle_id=h, txn_id=batch.txn_ids[i], base_generation=g, base_snapshot_version=v,
                rows_sha256=batch.rows_sha256[i], workspace_bytes=batch.workspace(i)),
        EmitOutput(handle_id=h, base_generation=None, base_snapshot_version=None,
                   output_index=batch.output_indexes[i], token_id=token),
        BeginAppend(handle_id=h, txn_id=batch.next_txn_ids[i], kind="decode", base_generation=None,
                    base_snapshot_version=None, interval_start=at, interval_count=1, token_ids=(token,),
                    cache_positions=(at,), mask_key_extent=at + 1, cache_abi_sha256=batch.cache_abi_sha256[i],
                    call=batch.call(i))))


def batch_step(batch: DecodeBatch, i: int) -> Command | Relative:
    """Step i as a command: its chain, Relative when it leaves its base to the handle."""
    chain = batch_chain(batch, i)
    return chain if batch.base(i) is not None else Relative(chain)


def bind_current(cmd: Command, state_of: Callable[[str], HandleState | None]) -> Command:
    """`cmd` with its base taken from the current state of the handles it acts on, as
    `state_of` gives it (a fork: its parent's, forked at the prefix it names, else at the
    committed length; an append start: the handle's cache ABI unless it names one; a
    chain: its first step's, the later ones follow from it; a reorder: each row's)."""
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
        return replace(cmd, base_generation=g, base_snapshot_version=v)
    if isinstance(cmd, (Finish, Release, CancelRequest)):
        return replace(cmd, base_generation=g)
    if isinstance(cmd, Fork):
        prefix = s.committed_length if cmd.prefix_length is None else cmd.prefix_length
        return replace(cmd, base_generation=g, base_snapshot_version=v, prefix_length=prefix)
    raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{type(cmd).__name__} cannot be relative")


def _existing(h: str, state_of: Callable[[str], HandleState | None]) -> HandleState:
    s = state_of(h)
    if s is None:
        raise KvLedgerError(ErrorCode.UNKNOWN_HANDLE, f"no handle {h}")
    return s


def handles_of(cmd: Command | Relative) -> tuple[str, ...]:
    """The handles a command (a Relative one: its command) reads, and possibly writes."""
    if isinstance(cmd, Relative):
        cmd = cmd.command
    if isinstance(cmd, Fork):
        return (cmd.parent_handle_id, *cmd.child_handle_ids)
    if isinstance(cmd, Reorder):
        return cmd.rows
    return (cmd.handle_id,)


# -- validation at the public boundary ---------------------------------------------------
# A command built in Python is not checked by msgspec (only decoding checks), so one from a
# caller is round-tripped through the wire format its declared types decode: the same
# check kvledger.engine.remote's writer applies to every frame. The worker's own commands skip it.

_wire_encode = msgspec.msgpack.Encoder().encode
_wire_decode: Callable[[bytes], Command | Relative] = msgspec.msgpack.Decoder(Command | Relative).decode
_json_encode = msgspec.json.Encoder().encode
# PostgreSQL text cannot hold NUL and a journal must move between backends (export, then
# import elsewhere), so no string of a command may contain one.
_NUL = b"\\u0000"


def validate(cmd: object) -> Command | Relative:
    """`cmd` as its declared types decode it, or INVALID_ARGUMENT naming the first field
    outside them (a wrong type, an id of 0 or 257 characters, a negative count, ...)."""
    if not isinstance(cmd, (_Command, Relative)):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"not a command: {type(cmd).__name__}")
    name = type(cmd).__name__
    try:
        checked = _wire_decode(_wire_encode(cmd))
        if _NUL in _json_encode(checked):
            raise ValueError("a string contains NUL")
    except (msgspec.ValidationError, msgspec.EncodeError, TypeError, ValueError, OverflowError) as exc:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{name}: {exc}") from None
    return checked


def check_id(value: object, what: str = "handle id") -> str:
    """An id given to a read, held to the events' Id (1 to 256 characters), NUL-free and
    encodable as UTF-8."""
    if type(value) is not str:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"bad {what}: expected str, got {type(value).__name__}")
    problem = id_problem(value)
    if problem is not None:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"bad {what}: it {problem}")
    return value
