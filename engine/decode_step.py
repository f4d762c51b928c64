"""A decode step decided in one function: the fast path of the worker's hot chain.

A worker's decode iteration is one Chain per sequence: publish the running append, emit
the token its logits chose, start the append that processes that token. Deciding it
step by step (`decide`, `bind`, `evolve`, three times) costs about 45 Python calls, the
largest part of what a decoded token costs the write path. This function decides the
same chain at once when it is the plain case: one open append that is not a verify or a
repair, every base either the handle's or left to the chain, an active handle, a
decode start of exactly the emitted token. Anything else returns None and the general
path decides it, so every rejection keeps its exact code and message. The events and
the state it gives are the general path's, field for field: tests/test_decode_step.py
checks that over generated chains, including every way one can be off.
"""

from __future__ import annotations

from msgspec.structs import replace

from kvledger.engine import commands as c
from kvledger.engine.state import HandleState, OpenTxn, grown
from kvledger.schemas import events as ev

Payloads = tuple[ev.AppendPublish, ev.OutputEmit, ev.AppendStart]


def _base_is(step: c.Publish | c.EmitOutput | c.BeginAppend, generation: int, snapshot: int) -> bool:
    """The step's base is the given one, named or left to the chain."""
    g, v = step.base_generation, step.base_snapshot_version
    return (g is None or g == generation) and (v is None or v == snapshot)


def decode_step(s: HandleState, chain: c.Chain, monotonic_ns: int) -> tuple[Payloads, HandleState] | None:
    """The payloads of the chain's three events and the state they leave (its stream
    position three further), or None when the general path must decide."""
    after = decode_after(s, chain, monotonic_ns)
    return None if after is None else (decode_payloads(s, chain, after), after)


def decode_payloads(s: HandleState, chain: c.Chain, after: HandleState) -> Payloads:
    """The payloads of the three events of a chain decode_after accepted, leaving `after`."""
    publish, emit, start = chain.steps
    assert type(publish) is c.Publish and type(emit) is c.EmitOutput and type(start) is c.BeginAppend
    txn = s.open_txns[0]
    v, t, token = s.snapshot_version, after.committed_length, emit.token_id
    return (
        ev.AppendPublish(txn_id=txn.txn_id, base_snapshot_version=v, result_snapshot_version=v + 1,
                         committed_length=t, accepted_count=txn.interval_count,
                         layers_complete=s.num_layers, logits_ready=True,
                         workspace_bytes=publish.workspace_bytes, rows_sha256=publish.rows_sha256),
        ev.OutputEmit(output_index=len(s.outputs), token_id=token, snapshot_version=v + 1),
        ev.AppendStart(txn_id=start.txn_id, kind="decode", base_snapshot_version=v + 1, interval_start=t,
                       interval_count=1, token_ids=start.token_ids, cache_positions=start.cache_positions,
                       mask_key_extent=t + 1, cache_abi_sha256=start.cache_abi_sha256, call=start.call),
    )


def decode_after(s: HandleState, chain: c.Chain, monotonic_ns: int) -> HandleState | None:
    """The state the chain leaves when it is the plain case, or None (decode_step's
    decision without its events: the service's lane builds a step's values instead)."""
    steps = decode_shape(chain)
    if steps is None:
        return None
    publish, emit, start = steps
    g, v = s.generation, s.snapshot_version
    # The first step names its base (the service binds a Relative chain before this);
    # a later one may leave it to the chain, which is then the state after the publish.
    if (publish.base_generation != g or publish.base_snapshot_version != v
            or not _base_is(emit, g, v + 1) or not _base_is(start, g, v + 1)):
        return None
    return plain_after(s, publish.txn_id, emit.output_index, emit.token_id, start.txn_id, start.interval_start,
                       start.cache_abi_sha256, monotonic_ns)


def decode_shape(chain: c.Chain) -> tuple[c.Publish, c.EmitOutput, c.BeginAppend] | None:
    """The chain's steps when it is a decode step whatever its bases: publish (no layers
    named, not a verify's), emit a token, start one row that processes that token, all
    on the chain's handle; else None."""
    steps = chain.steps
    if len(steps) != 3:
        return None
    publish, emit, start = steps
    if type(publish) is not c.Publish or type(emit) is not c.EmitOutput or type(start) is not c.BeginAppend:
        return None
    at = start.interval_start
    if (publish.layers is not None or publish.accepted_count is not None or start.kind != "decode"
            or start.interval_count != 1 or start.token_ids != (emit.token_id,) or start.cache_positions != (at,)
            or start.mask_key_extent != at + 1
            or not publish.handle_id == emit.handle_id == start.handle_id == chain.handle_id):
        return None
    return publish, emit, start


def plain_after(s: HandleState, txn_id: str, output_index: int, token: int, next_txn_id: str, at: int,
                cache_abi_sha256: str, monotonic_ns: int) -> HandleState | None:
    """The state a plain decode step leaves, or None: publish the running append `txn_id`,
    emit `token` as output `output_index`, start `next_txn_id` at position `at` (a
    chain's own fields checked, what decode_after and the service's column lane share)."""
    if s.lifecycle != "ACTIVE" or len(s.open_txns) != 1:
        return None
    txn = s.open_txns[0]
    v = s.snapshot_version
    t = txn.interval_start + txn.interval_count
    if (txn_id != txn.txn_id or txn.kind == "verify" or txn.kind == "repair" or txn.base_snapshot_version != v
            # the publication leaves logits ready only when its rows reach the last token
            or t != len(s.prompt) + len(s.outputs) or output_index != len(s.outputs) or at != t
            or cache_abi_sha256 != s.cache_abi_sha256 or t + 1 > s.reserved_capacity
            or next_txn_id in s.aborted_txn_ids):
        return None
    outputs, output_ns = grown(s.outputs, s.output_ns, (token,), (monotonic_ns,))
    return replace(
        s, stream_position=s.stream_position + 3, snapshot_version=v + 1, committed_length=t,
        logits_ready=False, outputs=outputs, output_ns=output_ns,
        open_txns=(OpenTxn(next_txn_id, "decode", v + 1, t, 1, (token,)),),
    )
