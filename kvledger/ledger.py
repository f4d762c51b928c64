"""`kvledger.Ledger`: the public Python API over the command service and the journal.

    with Ledger.open("sqlite:///kv.db") as ledger:
        ledger.allocate("h1", manifest, reserved_capacity=64)
        s = ledger.state("h1")
        ledger.begin_append("h1", txn_id="t1", kind="prefill", base=(s.generation, s.snapshot_version),
                            start=0, token_ids=prompt)
        ...

Every mutating method returns the durable Receipt or raises KvLedgerError with a
stable code; a rejected command leaves the journal unchanged. Arguments are held to the
event schema's limits before anything is decided (CommandService.strict): a call can be
refused, never write an event that a later replay, state() or import would reject.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import cast

import msgspec

from kvledger.engine import commands as c
from kvledger.engine.decide import full_layers
from kvledger.engine.port import Clock
from kvledger.engine.service import CommandService, SystemClock
from kvledger.engine.state import HandleState
from kvledger.engine.view import ServiceStateView, view_of
from kvledger.journal import Journal
from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import AppendKind, FailureOutcome, FinishReason, LayerRows
from kvledger.schemas.manifest import Manifest
from kvledger.schemas.receipts import Receipt

Base = tuple[int, int]  # (generation, snapshot_version)


class CacheLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Where an append's rows sit in the cache, where not the defaults: the cache ABI
    (None: the handle's), each token's cache position (None: start, start + 1, ...) and
    the key extent its attention mask covers (None: start + the tokens)."""

    cache_abi_sha256: str | None = None
    cache_positions: Sequence[int] | None = None
    mask_key_extent: int | None = None


class Ledger:
    def __init__(self, journal: Journal, *, source_instance: str = "kvledger",
                 clock: Clock | None = None) -> None:
        self.journal = journal
        c.check_id(source_instance, "source instance")
        self.service = CommandService(journal, source_instance=source_instance, strict=True,
                                      clock=SystemClock() if clock is None else clock)

    @classmethod
    def open(cls, url: str | None = None, *, source_instance: str = "kvledger",
             clock: Clock | None = None) -> Ledger:
        return cls(open_or_create_journal(url), source_instance=source_instance, clock=clock)

    def close(self) -> None:
        self.journal.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads -------------------------------------------------------------------
    def state(self, handle_id: str, *, refresh: bool = True) -> HandleState:
        s = self.service.state(c.check_id(handle_id), refresh=refresh)
        if s is None:
            raise KvLedgerError(ErrorCode.UNKNOWN_HANDLE, f"no handle {handle_id}")
        return s

    def view(self, handle_id: str) -> ServiceStateView:
        return view_of(self.state(handle_id))

    def prefix_owners(self, prefix_identity_sha256: str) -> tuple[str, ...]:
        """Live handles holding a prefix identity. Empty means eviction-eligible; which
        physical bytes that frees is the allocator's business, not the ledger's."""
        heads = self.journal.heads(prefix_identity_sha256=c.check_id(prefix_identity_sha256, "prefix identity"))
        return tuple(sorted(h for h, f in heads.items() if f.lifecycle != "RELEASED"))

    def require_evictable(self, prefix_identity_sha256: str) -> None:
        owners = self.prefix_owners(prefix_identity_sha256)
        if owners:
            raise KvLedgerError(ErrorCode.PREFIX_STILL_OWNED,
                                f"prefix {prefix_identity_sha256[:12]} is owned by {', '.join(owners)}")

    # -- commands ----------------------------------------------------------------
    def execute(self, cmd: c.Command) -> Receipt:
        return self.service.execute(cmd)

    def execute_many(self, cmds: Sequence[c.Command]) -> list[Receipt | KvLedgerError]:
        """Many commands (e.g. one iteration's publications) in one journal commit."""
        with _arguments():
            cmds = list(cmds)
        return list(self.service.execute_many(cmds))

    def allocate(self, handle_id: str, manifest: Manifest, *, reserved_capacity: int,
                 copy_tiers: tuple[str, ...] = ("gpu",), allocator_bytes_per_copy: int = 0,
                 generation: int = 0, operation_id: str | None = None) -> Receipt:
        with _arguments():
            cmd = c.Allocate(
                handle_id=handle_id, manifest=manifest, reserved_capacity=reserved_capacity,
                copy_tiers=copy_tiers, allocator_bytes_per_copy=allocator_bytes_per_copy,
                generation=generation, operation_id=operation_id)
        return self.execute(cmd)

    def begin_append(self, handle_id: str, *, txn_id: str, kind: AppendKind, base: Base, start: int,
                     token_ids: Sequence[int], layout: CacheLayout | None = None,
                     operation_id: str | None = None) -> Receipt:
        """Open an append of `token_ids` at `start`; `layout` where its rows sit in the
        cache when not the defaults (CacheLayout)."""
        layout = layout or CacheLayout()
        abi = layout.cache_abi_sha256 or self.state(handle_id, refresh=False).cache_abi_sha256
        with _arguments():
            n = len(token_ids)
            cmd = c.BeginAppend(
                handle_id=handle_id, txn_id=txn_id, kind=kind, base_generation=base[0],
                base_snapshot_version=base[1], interval_start=start, interval_count=n,
                token_ids=tuple(token_ids),
                cache_positions=tuple(layout.cache_positions) if layout.cache_positions is not None
                else tuple(range(start, start + n)),
                mask_key_extent=start + n if layout.mask_key_extent is None else layout.mask_key_extent,
                cache_abi_sha256=abi, operation_id=operation_id)
        return self.execute(cmd)

    def publish(self, handle_id: str, *, txn_id: str, base: Base,
                layers: tuple[LayerRows, ...] | None = None, accepted_count: int | None = None,
                workspace_bytes: int = 0, rows_sha256: str | None = None,
                operation_id: str | None = None) -> Receipt:
        """Publish an open append. `layers=None` asserts every layer staged complete K
        and V (with `rows_sha256`, schemas.canonical.layers_sha256 of their row digests,
        if known); name the layers (with row digests) to have each one checked."""
        with _arguments():
            cmd = c.Publish(
                handle_id=handle_id, txn_id=txn_id, base_generation=base[0], base_snapshot_version=base[1],
                layers=layers, accepted_count=accepted_count, workspace_bytes=workspace_bytes,
                rows_sha256=rows_sha256, operation_id=operation_id)
        return self.execute(cmd)

    def fail(self, handle_id: str, *, txn_id: str, outcome: FailureOutcome = "failed", code: str = "FAILED",
             detail: str = "", operation_id: str | None = None) -> Receipt:
        return self.execute(c.Fail(handle_id=handle_id, txn_id=txn_id, outcome=outcome, code=code,
                                   detail=detail, operation_id=operation_id))

    def emit(self, handle_id: str, *, base: Base, output_index: int, token_id: int,
             operation_id: str | None = None) -> Receipt:
        with _arguments():
            cmd = c.EmitOutput(
                handle_id=handle_id, base_generation=base[0], base_snapshot_version=base[1],
                output_index=output_index, token_id=token_id, operation_id=operation_id)
        return self.execute(cmd)

    def fork(self, parent_handle_id: str, *, base: Base, child_handle_ids: Sequence[str],
             prefix_length: int, child_request_ids: Sequence[str] = (),
             operation_id: str | None = None) -> Receipt:
        with _arguments():
            cmd = c.Fork(
                parent_handle_id=parent_handle_id, base_generation=base[0], base_snapshot_version=base[1],
                child_handle_ids=tuple(child_handle_ids), prefix_length=prefix_length,
                child_request_ids=tuple(child_request_ids), operation_id=operation_id)
        return self.execute(cmd)

    def truncate(self, handle_id: str, *, base: Base, new_length: int,
                 operation_id: str | None = None) -> Receipt:
        with _arguments():
            cmd = c.Truncate(handle_id=handle_id, base_generation=base[0], base_snapshot_version=base[1],
                             new_length=new_length, operation_id=operation_id)
        return self.execute(cmd)

    def reorder(self, group_id: str, *, rows: Sequence[str], permutation: Sequence[int],
                bases: Sequence[Base] | None = None, operation_id: str | None = None,
                **parts: Sequence[int]) -> Receipt:
        with _arguments():
            rows = tuple(rows)
        if bases is None:
            bases = [(s.generation, s.snapshot_version) for s in map(self.state, rows)]
        with _arguments():
            cmd = c.Reorder(
                # cast: a caller's list becomes a tuple; strict validation holds it to two numbers
                group_id=group_id, rows=rows, bases=tuple(cast(Base, tuple(b)) for b in bases),
                permutation=tuple(permutation), operation_id=operation_id,
                **{k: tuple(v) for k, v in parts.items()})
        return self.execute(cmd)

    def cancel(self, handle_id: str, *, base: int, reason: str = "",
               operation_id: str | None = None) -> Receipt:
        return self.execute(c.CancelRequest(handle_id=handle_id, base_generation=base,
                                            reason=reason, operation_id=operation_id))

    def finish(self, handle_id: str, *, base: int, reason: FinishReason = "max_tokens",
               operation_id: str | None = None) -> Receipt:
        return self.execute(c.Finish(handle_id=handle_id, base_generation=base, reason=reason,
                                     operation_id=operation_id))

    def release(self, handle_id: str, *, base: int | Base, operation_id: str | None = None) -> Receipt:
        """`base` is the generation, or (generation, snapshot_version) to fence on the snapshot too."""
        with _arguments():
            generation, snapshot_version = (base, None) if isinstance(base, int) else base
        return self.execute(c.Release(handle_id=handle_id, base_generation=generation,
                                      base_snapshot_version=snapshot_version, operation_id=operation_id))


@contextlib.contextmanager
def _arguments() -> Iterator[None]:
    """Building a command from the caller's arguments (len(), tuple(), base[0], an unknown
    keyword): a wrong type or shape there is the caller's INVALID_ARGUMENT, not a traceback.
    Only the building runs in here; deciding and writing do not."""
    try:
        yield
    except (TypeError, ValueError, IndexError, KeyError, OverflowError) as exc:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"bad argument: {exc}") from None


__all__ = ["Ledger", "full_layers"]
