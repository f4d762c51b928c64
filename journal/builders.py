"""Builders of valid manifests, events and journal operations, for code that writes a
journal without the engine: the journal's contract tests, the benchmarks and the spec
fixtures (the engine builds these for real; the journal contract must not depend on it).
"""

from __future__ import annotations

import uuid
from typing import Protocol, TypeVar

from kvledger.journal.contract import Guard, HeadFacts, Operation, StreamWrite, guard_of  # noqa: F401 - guard_of re-exported for the tests
from kvledger.schemas import events as ev
from kvledger.schemas.canonical import canonical_json
from kvledger.schemas.manifest import (
    ArtifactIdentity,
    CacheSchema,
    Manifest,
    PositionContract,
    RequestPolicy,
    RopeConfig,
    ScalarType,
    b_token,
    cache_abi_sha256,
    manifest_sha256,
    new_manifest,
    prefix_identity_sha256,
)

FP16 = ScalarType("fp16", 2)
ZERO = "0" * 64
ACTIVE = "ACTIVE"  # the lifecycle the service writes while a request runs
P = TypeVar("P", contravariant=True)
E = TypeVar("E", covariant=True)


class EventClass(Protocol[P, E]):
    """An event class: its tag, and a constructor taking its own payload type."""

    @property
    def event_type(self) -> str: ...

    def __call__(self, *, event_id: str, stream_id: str, stream_position: int, schema_version: int,
                 request_id: str, handle_generation: int, operation_id: str | None, payload: P) -> E: ...


def cache_schema(layers: int = 2, kv_heads: int = 2, head_dim: int = 4, query_heads: int = 4,
                 key_dtype: ScalarType = FP16, value_dtype: ScalarType = FP16) -> CacheSchema:
    """The Loop 2 cache ABI by default: B_token = 2 * 2 * 4 * (2 + 2) = 64 B."""
    return CacheSchema(num_cache_layers=layers, kv_heads_per_rank=kv_heads, head_dim=head_dim,
                       key_dtype=key_dtype, value_dtype=value_dtype, num_query_heads=query_heads)


def make_manifest(request_id: str = "req-1", prompt: tuple[int, ...] = (11, 22, 33, 44), *,
                  schema: CacheSchema | None = None, adapters: tuple[str, ...] = (),
                  namespace: str = "test", max_new_tokens: int = 8,
                  max_context_tokens: int | None = None) -> Manifest:
    """A manifest of fixed artifact digests; its context limit is the prompt plus 64
    tokens unless given."""
    return new_manifest(
        namespace=namespace, request_id=request_id, prompt=prompt,
        artifact=ArtifactIdentity(model_artifact_sha256="a" * 64, model_config_sha256="c" * 64,
                                  adapter_set=adapters),
        cache_schema=schema or cache_schema(),
        policy=RequestPolicy(max_new_tokens=max_new_tokens, max_context_tokens=len(prompt) + 64
                             if max_context_tokens is None else max_context_tokens),
        position_contract=PositionContract(rope=RopeConfig(theta=10000.0)))


def envelope(cls: EventClass[P, E], handle: str, position: int, payload: P, generation: int = 0,
             op: str | None = None, event_id: str | None = None) -> E:
    """An event of `cls` on stream `handle` (its own request), a fresh id unless given."""
    return cls(
        event_id=event_id or uuid.uuid4().hex, stream_id=handle, stream_position=position,
        schema_version=ev.CURRENT_VERSION[cls.event_type], request_id=handle,
        handle_generation=generation, operation_id=op, payload=payload,
    )


def allocate_payload(m: Manifest, reserved_capacity: int = 8) -> ev.RequestAllocate:
    return ev.RequestAllocate(
        manifest=m, manifest_sha256=manifest_sha256(m), cache_abi_sha256=cache_abi_sha256(m),
        prefix_identity_sha256=prefix_identity_sha256(m), b_token=b_token(m.cache_schema),
        reserved_capacity=reserved_capacity, copy_tiers=("gpu",),
    )


def head(handle: str, generation: int, snapshot: int, position: int, committed: int,
         lifecycle: str = ACTIVE) -> HeadFacts:
    return HeadFacts(handle, generation, snapshot, position, committed, lifecycle, ZERO, ZERO)


def allocate_op(handle: str, op_id: str | None = None, *, payload: ev.RequestAllocate | None = None,
                event_id: str | None = None) -> Operation:
    """Allocates `handle` (a test manifest unless `payload` is given)."""
    payload = payload or allocate_payload(make_manifest(request_id=handle))
    op_id = op_id or f"alloc-{handle}"
    e = envelope(ev.RequestAllocateEvent, handle, 1, payload, op=op_id, event_id=event_id)
    return Operation(
        operation_id=op_id, fingerprint=f"fp-{op_id}",
        writes=(StreamWrite(handle, None, head(handle, 0, 0, 1, 0), (e,)),),
        manifests=((payload.manifest_sha256, canonical_json(payload.manifest)),),
    )


def publish_op(handle: str, base: Guard, op_id: str, fingerprint: str | None = None, n: int = 1, *,
               layers: int = 2, event_id: str | None = None) -> Operation:
    """A publish-shaped event advancing the snapshot by one (journal-level only)."""
    s = base.snapshot_version
    payload = ev.AppendPublish(
        txn_id=op_id, base_snapshot_version=s, result_snapshot_version=s + 1,
        committed_length=s + n, accepted_count=n,
        layers_complete=layers,
        logits_ready=True,
    )
    e = envelope(ev.AppendPublishEvent, handle, base.stream_position + 1, payload, base.generation, op_id,
                 event_id)
    return Operation(
        operation_id=op_id, fingerprint=fingerprint or f"fp-{op_id}",
        writes=(StreamWrite(handle, base, head(handle, base.generation, s + 1, base.stream_position + 1, s + n),
                            (e,)),),
    )

