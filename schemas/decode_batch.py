"""A batch of decode steps: one value, as columns, from the worker to the engine.

A decode step publishes a handle's running append `txn_ids[i]` (its K/V rows digested as
`rows_sha256[i]`), emits the token that publication's logits chose (`tokens[i]`, output
`output_indexes[i]`) and starts the append `next_txn_ids[i]` that processes it, one row at
position `positions[i]` (the committed length after the publication). It is what a worker
sends for each running sequence each iteration, and most of what a serving journal
records. Its base is the handle's (generation, snapshot_version) the step expects, or
None for "the handle's current" (a worker does not know what its last batch left).

Columns are tuples: at 64 and 256 steps a batch built, sent as msgpack and read value by
value costs less as tuples than as numpy arrays (which msgpack carries only as bytes).
Nothing here knows how a journal stores a step: the engine decides a batch, the journal
alone turns what was decided into its records.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import Count, Digest, ForwardCall, Id

MAX_STEPS = 4096  # the events' bound on a row list
Abi = Annotated[str, Meta(max_length=64)]  # an append's cache ABI; "" means the handle's
Ids = Annotated[tuple[Id, ...], Meta(max_length=MAX_STEPS)]
Counts = Annotated[tuple[Count, ...], Meta(max_length=MAX_STEPS)]
Base = tuple[Count, Count]  # (generation, snapshot_version)


class DecodeBatch(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """n decode steps, column by column (see the module's doc); a handle named twice has
    its steps applied in order.

    A column that is None holds its default for every step: workspace 0, each handle's
    current base, no recorded model call. The model call of step i, when `call_ids[i]`
    is set, is ForwardCall(call_ids[i], call_indexes[i], call_sizes[i], call_new_pads[i],
    call_key_extents[i], call_threads[i])."""

    handle_ids: Ids
    txn_ids: Ids
    positions: Counts  # where each next append starts
    output_indexes: Counts
    tokens: Counts
    next_txn_ids: Ids
    rows_sha256: Annotated[tuple[Digest | None, ...], Meta(max_length=MAX_STEPS)]
    cache_abi_sha256: Annotated[tuple[Abi, ...], Meta(max_length=MAX_STEPS)]
    workspace_bytes: Counts | None = None
    bases: Annotated[tuple[Base | None, ...], Meta(max_length=MAX_STEPS)] | None = None
    call_ids: Annotated[tuple[Id | None, ...], Meta(max_length=MAX_STEPS)] | None = None
    call_indexes: Counts | None = None
    call_sizes: Counts | None = None
    call_new_pads: Counts | None = None
    call_key_extents: Counts | None = None
    call_threads: Counts | None = None

    def __len__(self) -> int:
        return len(self.handle_ids)

    def workspace(self, i: int) -> int:
        return 0 if self.workspace_bytes is None else self.workspace_bytes[i]

    def base(self, i: int) -> Base | None:
        return None if self.bases is None else self.bases[i]

    def call(self, i: int) -> ForwardCall | None:
        call_id = None if self.call_ids is None else self.call_ids[i]
        if call_id is None:
            return None
        assert (self.call_indexes is not None and self.call_sizes is not None and self.call_new_pads is not None
                and self.call_key_extents is not None and self.call_threads is not None)  # check()
        return ForwardCall(call_id, self.call_indexes[i], self.call_sizes[i], self.call_new_pads[i],
                           self.call_key_extents[i], self.call_threads[i])

    def check(self) -> None:
        """INVALID_ARGUMENT unless the columns line up: every column as long as the
        handles, the call columns all given or all absent, a recorded call's sizes
        positive (ForwardCall's bounds). Types and bounds of single values are the
        decoder's (see `validate`)."""
        n = len(self.handle_ids)
        for name in _COLUMNS:
            col = getattr(self, name)
            if col is not None and len(col) != n:
                raise _bad(f"column {name} has {len(col)} values for {n} steps")
        given = [getattr(self, name) is not None for name in _CALL_COLUMNS]
        if any(given) and not all(given):
            raise _bad("the call columns are given together or not at all")
        if self.call_ids:
            assert self.call_sizes is not None and self.call_new_pads is not None and self.call_key_extents is not None
            sizes = (self.call_sizes, self.call_new_pads, self.call_key_extents)
            if None not in self.call_ids and min(map(min, sizes)) > 0:  # a worker's batch: one call, every step
                return
            for i, (call_id, size, pad, extent) in enumerate(zip(self.call_ids, *sizes)):
                if call_id is not None and min(size, pad, extent) <= 0:
                    raise _bad(f"step {i} of call {call_id}: a model call's size, padding and key extent "
                               "are positive")


_COLUMNS = tuple(f.name for f in msgspec.structs.fields(DecodeBatch))
_CALL_COLUMNS = tuple(name for name in _COLUMNS if name.startswith("call_"))
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(DecodeBatch).decode


def _bad(message: str) -> KvLedgerError:
    return KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"decode batch: {message}")


def decode(data: bytes) -> DecodeBatch:
    """A batch from its msgpack bytes (a frame from another process), checked whole;
    INVALID_ARGUMENT naming the first thing outside its types or its columns' rules."""
    try:
        batch = _decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _bad(str(exc)) from None
    batch.check()
    return batch


def encode(batch: DecodeBatch) -> bytes:
    return _encode(batch)


def validate(value: object) -> DecodeBatch:
    """A batch built by a caller outside (msgspec checks only what it decodes), held to
    its declared types and bounds and to `check`, or INVALID_ARGUMENT."""
    if not isinstance(value, DecodeBatch):
        raise _bad(f"not a DecodeBatch: {type(value).__name__}")
    try:
        data = _encode(value)
    except (msgspec.EncodeError, TypeError, OverflowError) as exc:
        raise _bad(str(exc)) from None
    return decode(data)


class BatchBuilder:
    """Collects a batch step by step: what a producer (the worker, an adapter, a
    benchmark) fills during its iteration."""

    def __init__(self) -> None:
        self.handle_ids: list[str] = []
        self._txns: list[str] = []
        self._positions: list[int] = []
        self._outputs: list[int] = []
        self._tokens: list[int] = []
        self._next: list[str] = []
        self._rows: list[str | None] = []
        self._abis: list[str] = []
        self._workspace: list[int] = []
        self._bases: list[Base | None] = []
        self._calls: list[ForwardCall | None] = []

    def __len__(self) -> int:
        return len(self.handle_ids)

    def add(self, handle_id: str, txn_id: str, position: int, output_index: int, token: int, next_txn_id: str,
            rows_sha256: str | None, cache_abi_sha256: str) -> int:
        """Add one step (its optional columns at their defaults: see `detail`); its index
        in the batch."""
        self.handle_ids.append(handle_id)
        self._txns.append(txn_id)
        self._positions.append(position)
        self._outputs.append(output_index)
        self._tokens.append(token)
        self._next.append(next_txn_id)
        self._rows.append(rows_sha256)
        self._abis.append(cache_abi_sha256)
        self._workspace.append(0)
        self._bases.append(None)
        self._calls.append(None)
        return len(self.handle_ids) - 1

    def detail(self, i: int, *, workspace_bytes: int = 0, base: Base | None = None,
               call: ForwardCall | None = None) -> None:
        """Set step i's optional columns: its workspace, the base it expects (None: the
        handle's current) and the model call that computed it."""
        self._workspace[i], self._bases[i], self._calls[i] = workspace_bytes, base, call

    def build(self) -> DecodeBatch:
        calls: tuple[tuple[Any, ...] | None, ...] = (None,) * 6  # the call columns: none given
        if any(x is not None for x in self._calls):
            calls = tuple(zip(*[_NO_CALL if x is None else (x.call_id, x.index, x.size, x.new_pad, x.key_extent,
                                                              x.threads) for x in self._calls]))
        return DecodeBatch(
            tuple(self.handle_ids), tuple(self._txns), tuple(self._positions), tuple(self._outputs),
            tuple(self._tokens), tuple(self._next), tuple(self._rows), tuple(self._abis),
            tuple(self._workspace) if any(self._workspace) else None,
            tuple(self._bases) if any(b is not None for b in self._bases) else None, *calls)


_NO_CALL = (None, 0, 0, 0, 0, 0)  # a step without a model call, in a batch with some
