"""Payloads of the KV-event streams a serving engine publishes (vLLM, SGLang,
TensorRT-LLM): physical prefix-cache residency, owned by the engine.

Spec 0x08 calls such facts "foreign owner": they are recorded as what the engine said,
on streams of their own (one per endpoint, topic and data-parallel rank), and are never
turned into handle events. A batch keeps the engine's field names; a hash that was
bytes on the wire is lowercase hex here, an int hash stays an int, so the two kinds
never collide.

`ts` is the engine's own float timestamp (seconds), kept as published: it is the
engine's fact, not one of kvledger's clocks (those are integer nanoseconds in the
envelope).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

# An int hash (msgspec holds int64 or uint64) or a bytes hash as hex.
KV_LIFECYCLE = "KV_EVENTS"  # the lifecycle column of a KV-event stream's head row: no handle's applies

Hash = int | Annotated[str, Meta(max_length=512)]
Hashes = Annotated[tuple[Hash, ...], Meta(max_length=1 << 20)]
Seq = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Name = Annotated[str, Meta(max_length=256)]


class _KvEvent(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True,
               tag_field="type", gc=False):
    pass


class BlockStored(_KvEvent, frozen=True, tag="BlockStored"):
    block_hashes: Hashes
    parent_block_hash: Hash | None = None
    token_ids: Annotated[tuple[int, ...], Meta(max_length=1 << 22)] = ()
    block_size: Annotated[int, Meta(ge=0)] = 0
    lora_id: int | None = None
    medium: Name | None = None
    lora_name: Name | None = None
    extra_keys: Any = None  # the engine's per-block hash inputs, as sent
    group_idx: int | None = None
    kv_cache_spec_kind: Name | None = None
    kv_cache_spec_sliding_window: int | None = None
    unknown_fields: dict[str, Any] | None = None  # fields a newer engine sent, kept as sent


class BlockRemoved(_KvEvent, frozen=True, tag="BlockRemoved"):
    block_hashes: Hashes
    medium: Name | None = None
    group_idx: int | None = None
    unknown_fields: dict[str, Any] | None = None


class AllBlocksCleared(_KvEvent, frozen=True, tag="AllBlocksCleared"):
    medium: Name | None = None  # not sent by vLLM today: None clears every medium
    unknown_fields: dict[str, Any] | None = None


class BlockUpdated(_KvEvent, frozen=True, tag="BlockUpdated"):
    """TensorRT-LLM's `updated`: one block moved between cache levels (tiers)."""

    block_hash: Hash
    medium: Name | None = None  # where it was
    new_medium: Name | None = None  # where it is now (None: the tier did not change)
    priority: int | None = None
    group_idx: int | None = None


class PoolCreated(_KvEvent, frozen=True, tag="PoolCreated"):
    """TensorRT-LLM's `created`: a new, empty block pool (its blocks per cache level)."""

    num_blocks_per_cache_level: tuple[int, ...] = ()


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared, BlockUpdated, PoolCreated]  # noqa: UP007 - a tagged union's members, one per line in the JSON schema


class KvEventsBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One published batch. `epoch` counts publisher restarts seen on this stream
    (seq starts again at 0 in each)."""

    epoch: Seq
    seq: Seq
    ts: float
    events: Annotated[tuple[KvEvent, ...], Meta(max_length=1 << 20)]
    data_parallel_rank: int | None = None
    replayed: bool = False  # received from the replay socket, not live


class KvEventsGap(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """seqs [first_seq, last_seq] of `epoch` that were published and never journaled: the
    state after this is uncertain until a clear. Schema v2 adds `code` and `size_bytes`:
    a batch received and refused (FIELD_TOO_LARGE: its events' JSON, `size_bytes` of it,
    is over what the journal reads back) is a gap of its one seq with the refusal's code;
    a batch never received has neither."""

    epoch: Seq
    first_seq: Seq
    last_seq: Seq
    reason: Annotated[str, Meta(max_length=4096)]
    code: Annotated[str, Meta(max_length=64)] | None = None
    size_bytes: Annotated[int, Meta(ge=0)] | None = None


class KvEventsRestart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """seq went backwards: the publisher restarted. Its block state is gone."""

    epoch: Seq  # the new epoch
    previous_seq: int  # the last seq recorded in the old epoch (-1: none)
    first_seq: Seq  # the seq that showed the restart
    reason: Annotated[str, Meta(max_length=4096)] = ""

