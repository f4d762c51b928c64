"""Cheap builders of valid journal operations for the benchmarks.

A publication here is what the engine writes when a decode step publishes: one
`append_publish` event (a ~280-byte JSON payload) on one handle, guarded by the head it
was decided against. Ids are made the way the engine makes them (engine.ids.new_id): a
random 64-bit prefix per writer and a counter, 32 hex characters, for event and
operation ids; handle ids are random 32-hex strings (request-derived, in no useful
order), so the head rows and the stream index see random keys, as in a serving system.
Everything else is built for real, per operation, inside the timed region.
"""

from __future__ import annotations

import itertools
import os

from kvledger.journal import Guard, HeadFacts, Operation, StreamWrite
from kvledger.schemas import events as ev
from kvledger.schemas.canonical import canonical_json
from kvledger.schemas.manifest import (
    ArtifactIdentity,
    CacheSchema,
    Manifest,
    PositionContract,
    RopeConfig,
    ScalarType,
    b_token,
    cache_abi_sha256,
    manifest_sha256,
    new_manifest,
    prefix_identity_sha256,
)

ZERO = "0" * 64
ROWS = None  # no rows digest: keeps the payload at about 200 bytes of JSON
PUBLISH_V = ev.CURRENT_VERSION["append_publish"]
ALLOCATE_V = ev.CURRENT_VERSION["request_allocate"]
AppendPublish, LayerRows = ev.AppendPublish, ev.LayerRows

def random_hex(n: int) -> list[str]:
    """n random 32-hex ids (128 random bits each, like uuid4().hex)."""
    h = os.urandom(16 * n).hex()
    return [h[i:i + 32] for i in range(0, 32 * n, 32)]


class Ids:
    """Event and operation ids as engine.ids.new_id makes them: a random 64-bit prefix
    (one per writer) and a counter."""

    def __init__(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count()

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):016x}"


def handle_ids(n: int) -> list[str]:
    return random_hex(n)


def _manifest() -> Manifest:
    prompt = (11, 22, 33, 44)
    fp16 = ScalarType("fp16", 2)
    return new_manifest(
        namespace="bench", request_id="bench", prompt=prompt,
        artifact=ArtifactIdentity(model_artifact_sha256="a" * 64, model_config_sha256="c" * 64),
        cache_schema=CacheSchema(num_cache_layers=1, kv_heads_per_rank=2, head_dim=4, key_dtype=fp16,
                                 value_dtype=fp16, num_query_heads=4),
        max_new_tokens=1 << 19, max_context_tokens=1 << 20,
        position_contract=PositionContract(rope=RopeConfig(theta=10000.0)))


MANIFEST = _manifest()
MANIFEST_SHA = manifest_sha256(MANIFEST)
MANIFEST_JSON = canonical_json(MANIFEST)
ALLOCATE_PAYLOAD = ev.RequestAllocate(
    manifest=MANIFEST, manifest_sha256=MANIFEST_SHA, cache_abi_sha256=cache_abi_sha256(MANIFEST),
    prefix_identity_sha256=prefix_identity_sha256(MANIFEST), b_token=b_token(MANIFEST.cache_schema),
    reserved_capacity=1 << 20, copy_tiers=("gpu",),
)


def allocate_op(handle: str, ids: Ids) -> Operation:
    op_id = ids()
    e = ev.RequestAllocateEvent(
        event_id=ids(), stream_id=handle, stream_position=1, schema_version=ALLOCATE_V,
        request_id=handle, handle_generation=0, operation_id=op_id, payload=ALLOCATE_PAYLOAD,
    )
    return Operation(
        operation_id=op_id, fingerprint=op_id,
        writes=(StreamWrite(handle, None, HeadFacts(handle, 0, 0, 1, 0, "DECODING", ZERO, ZERO), (e,)),),
        manifests=((MANIFEST_SHA, MANIFEST_JSON),),
    )


class Head:
    """The caller's view of one handle's head: what the next publication is decided against."""

    __slots__ = ("handle", "generation", "snapshot", "position")

    def __init__(self, handle: str) -> None:
        self.handle, self.generation, self.snapshot, self.position = handle, 0, 0, 1


def publish_op(h: Head, ids: Ids) -> Operation:
    """One publication on `h`, decided against its current head; advances `h`."""
    s, p, g, handle = h.snapshot, h.position, h.generation, h.handle
    op_id = ids()
    # positional: txn_id, base_snapshot_version, result_snapshot_version, committed_length,
    # accepted_count, layers (layer, start, count, k_complete, v_complete, rows_sha256),
    # logits_ready
    payload = AppendPublish(op_id, s, s + 1, s + 1, 1, (LayerRows(0, s, 1, True, True, ROWS),), True)
    e = ev.AppendPublishEvent(
        event_id=ids(), stream_id=handle, stream_position=p + 1, schema_version=PUBLISH_V,
        request_id=handle, handle_generation=g, operation_id=op_id, payload=payload,
    )
    h.snapshot, h.position = s + 1, p + 1
    return Operation(
        operation_id=op_id, fingerprint=op_id,
        writes=(StreamWrite(handle, Guard(g, s, p),
                            HeadFacts(handle, g, s + 1, p + 1, s + 1, "DECODING", ZERO, ZERO), (e,)),),
    )
