"""The fingerprint of a plain decode chain, from the three events it wrote.

A worker's decode step is one Chain command: publish the running append, emit the token,
start the append that processes it (a step of schemas.decode_batch). The service plans
such a step as values (engine.batch_plan) only when every field of it is fixed by the
events it writes (and the handle's state, which the publication's event holds too), so
its fingerprint, SHA-256 over the command's canonical JSON, can be rebuilt from those
events instead of stored: random bytes a decoded token that no compression removes.

This is that rebuild. It spells out the JSON that engine.commands' structs encode to for
the one form the service marks derived (later steps' bases left to the chain, no step
with an operation id of its own); tests/test_batch_plan.py holds it equal to
`Chain.fingerprint()` over generated chains, so a change to the command types that
this misses fails there.
"""

from __future__ import annotations

import hashlib

import msgspec

from kvledger.schemas import events as ev
from kvledger.schemas.canonical import canonical_json as _canonical
from kvledger.schemas.canonical import sha256_hex

# A decode chain's events, in the order the service stamps them (engine.batch_plan).
DECODE_CHAIN = (ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent)


def decode_chain_fingerprint(publish: ev.AppendPublishEvent, emit: ev.OutputEmitEvent,
                             start: ev.AppendStartEvent) -> str:
    """Chain(publish, emit, start).fingerprint() of the chain these events record."""
    p, o, s = publish.payload, emit.payload, start.payload
    if (s.kind != "decode" or s.interval_count != 1 or s.token_ids != (o.token_id,)
            or s.cache_positions != (s.interval_start,) or s.mask_key_extent != s.interval_start + 1):
        return _spelled_out(publish, emit, start)  # not a decode step's own form: the long way
    return chain_fingerprint(publish.stream_id, publish.handle_generation, p.base_snapshot_version, p.rows_sha256,
                             p.txn_id, p.workspace_bytes, o.output_index, o.token_id, s.cache_abi_sha256,
                             s.interval_start, s.call, s.txn_id)


_json = msgspec.json.encode
# Chain.fingerprint()'s canonical JSON of a decode step (keys sorted, as canonical_json
# sorts them), with its values put in: cheaper than the command's structs or the dict of
# _spelled_out. tests/test_batch_plan.py holds the two equal.
_STEP = (b'{"handle_id":%s,"operation_id":null,"steps":[{"accepted_count":null,"base_generation":%d,'
         b'"base_snapshot_version":%d,"handle_id":%s,"layers":null,"operation_id":null,"rows_sha256":%s,'
         b'"txn_id":%s,"type":"Publish","workspace_bytes":%s},{"base_generation":null,'
         b'"base_snapshot_version":null,"handle_id":%s,"operation_id":null,"output_index":%d,"token_id":%s,'
         b'"type":"EmitOutput"},{"base_generation":null,"base_snapshot_version":null,"cache_abi_sha256":%s,'
         b'"cache_positions":[%d],"call":%s,"handle_id":%s,"interval_count":1,"interval_start":%d,'
         b'"kind":"decode","mask_key_extent":%d,"operation_id":null,"token_ids":[%s],"txn_id":%s,'
         b'"type":"BeginAppend"}],"type":"Chain"}')


def chain_fingerprint(  # noqa: PLR0913 - the twelve values the chain's JSON spells out, unboxed: no struct a step
        handle_id: str, generation: int, snapshot_version: int, rows_sha256: str | None, txn_id: str,
        workspace_bytes: int, output_index: int, token: int, cache_abi_sha256: str, position: int,
        call: ev.ForwardCall | None, next_txn_id: str) -> str:
    """The fingerprint of the decode step with these values, decided at the base
    (generation, snapshot_version): Chain.fingerprint() of the chain it writes. A journal's
    run computes it from its columns when a receipt or a retry asks (DecodeRun.fingerprint)."""
    # The numbers a decision derives are ints (formatted as JSON formats them); the
    # token and the workspace are encoded as given (a bool would be `true`).
    h, t = _json(handle_id), _json(token)
    return hashlib.sha256(_STEP % (
        h, generation, snapshot_version, h, _json(rows_sha256), _json(txn_id), _json(workspace_bytes), h,
        output_index, t, _json(cache_abi_sha256), position, b"null" if call is None else _canonical(call), h,
        position, position + 1, t, _json(next_txn_id))).hexdigest()


def _spelled_out(publish: ev.AppendPublishEvent, emit: ev.OutputEmitEvent, start: ev.AppendStartEvent) -> str:
    h, p, o, s = publish.stream_id, publish.payload, emit.payload, start.payload
    return sha256_hex(_canonical({
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
