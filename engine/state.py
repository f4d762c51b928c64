"""Handle state: what one handle's stream folds into. Frozen; evolve returns new ones."""

from __future__ import annotations

from typing import Literal

import msgspec

Lifecycle = Literal["ACTIVE", "FINISHED", "CANCELLED", "RELEASED"]


class OpenTxn(msgspec.Struct, frozen=True, gc=False):
    txn_id: str
    kind: str
    base_snapshot_version: int
    interval_start: int
    interval_count: int
    token_ids: tuple[int, ...]


class HandleState(msgspec.Struct, frozen=True, gc=False):
    handle_id: str
    request_id: str
    generation: int
    snapshot_version: int
    stream_position: int
    lifecycle: Lifecycle
    prompt: tuple[int, ...]
    outputs: tuple[int, ...]  # emitted outputs, O = len(outputs)
    committed_length: int  # K_c: rows every cache layer holds
    logits_ready: bool  # the newest publication's logits may still produce an output
    num_layers: int
    b_token: int
    reserved_capacity: int
    copy_tiers: tuple[str, ...]
    allocator_bytes_per_copy: int
    cache_abi_sha256: str
    prefix_identity_sha256: str
    manifest_sha256: str
    open_txns: tuple[OpenTxn, ...] = ()
    aborted_txn_ids: tuple[str, ...] = ()  # ended without publication: late completions
    parent_handle_id: str | None = None
    row_index: int | None = None
    arrival_ns: int = 0
    output_ns: tuple[int, ...] = ()
    finish_ns: int | None = None
    release_ns: int | None = None

    @property
    def logical_length(self) -> int:
        """Token state the request holds: prompt plus emitted outputs."""
        return len(self.prompt) + len(self.outputs)

    def logical_tokens(self, start: int, stop: int) -> tuple[int, ...]:
        return (self.prompt + self.outputs)[start:stop]

    def open_txn(self, txn_id: str) -> OpenTxn | None:
        for t in self.open_txns:
            if t.txn_id == txn_id:
                return t
        return None

    @property
    def has_frontier(self) -> bool:
        """One emitted output whose own K/V row is not committed yet."""
        return len(self.outputs) > 0 and self.logical_length == self.committed_length + 1
