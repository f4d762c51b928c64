"""The fingerprint of a plain decode chain, from the three events it wrote.

A worker's decode step is one Chain command: publish the running append, emit the token,
start the append that processes it. engine/decode_step.py accepts such a chain only when
every field of it is fixed by the events it writes (and the handle's state, which the
publication's event holds too), so its fingerprint, SHA-256 over the command's canonical
JSON, can be rebuilt from those events instead of stored: 32 random bytes a decoded token
that no compression removes (docs/COMPACT.md, step 10).

This is that rebuild. It spells out the JSON that engine.commands' structs encode to for
the one form the service marks derived (later steps' bases left to the chain, no step
with an operation id of its own); tests/test_decode_step.py holds it equal to
`Chain.fingerprint()` over generated chains, so a change to the command types that
this misses fails there.
"""

from __future__ import annotations

from kvledger.schemas import events as ev
from kvledger.schemas.canonical import canonical_json, sha256_hex

# A decode chain's events, in the order the service's decode lane stamps them.
DECODE_CHAIN = (ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent)


def decode_chain_fingerprint(publish: ev.AppendPublishEvent, emit: ev.OutputEmitEvent,
                             start: ev.AppendStartEvent) -> str:
    """Chain(publish, emit, start).fingerprint() of the chain these events record."""
    h, p, o, s = publish.stream_id, publish.payload, emit.payload, start.payload
    return sha256_hex(canonical_json({
        "type": "Chain", "handle_id": h, "operation_id": None, "steps": [
            {"type": "Publish", "handle_id": h, "txn_id": p.txn_id, "base_generation": publish.handle_generation,
             "base_snapshot_version": p.base_snapshot_version, "layers": None, "accepted_count": None,
             "workspace_bytes": p.workspace_bytes, "rows_sha256": p.rows_sha256, "operation_id": None},
            {"type": "EmitOutput", "handle_id": h, "base_generation": None, "base_snapshot_version": None,
             "output_index": o.output_index, "token_id": o.token_id, "operation_id": None},
            {"type": "BeginAppend", "handle_id": h, "txn_id": s.txn_id, "kind": s.kind, "base_generation": None,
             "base_snapshot_version": None, "interval_start": s.interval_start,
             "interval_count": s.interval_count, "token_ids": s.token_ids, "cache_positions": s.cache_positions,
             "mask_key_extent": s.mask_key_extent, "cache_abi_sha256": s.cache_abi_sha256, "call": s.call,
             "operation_id": None},
        ]}))


def chain_events(events: list[ev.Event]) -> tuple[ev.AppendPublishEvent, ev.OutputEmitEvent,
                                                  ev.AppendStartEvent] | None:
    """The events of one operation as a decode chain's (publish, emit, start on one
    stream), or None."""
    if tuple(map(type, events)) != DECODE_CHAIN:
        return None
    p, o, s = events
    if not p.stream_id == o.stream_id == s.stream_id:
        return None
    return p, o, s  # type: ignore[return-value]  # DECODE_CHAIN's types, checked above
