"""Manifest digests, B_token, canonical JSON, event decoding and bad input."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.schemas import events as ev
from kvledger.schemas.canonical import canonical_json, digest, layers_sha256
from kvledger.schemas.codec import decode_event, encode_event
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.manifest import (
    CacheSchema,
    ScalarType,
    b_token,
    cache_abi_sha256,
    manifest_sha256,
    prefix_identity_sha256,
    prompt_token_ids_sha256,
    validate_manifest,
)
from kvledger.schemas.positional import Positional

from factories import allocate_op, make_manifest

FP16, INT8 = ScalarType("fp16", 2), ScalarType("int8", 1)


def test_canonical_json_sorts_keys_and_drops_whitespace():
    assert canonical_json({"b": 1, "a": [1, 2], "é": "ü"}) == '{"a":[1,2],"b":1,"é":"ü"}'.encode()
    assert digest([11, 22]) == prompt_token_ids_sha256((11, 22))


def test_adapter_changes_cache_abi():
    a, b = make_manifest(), make_manifest(adapters=("lora-x",))
    assert cache_abi_sha256(a) != cache_abi_sha256(b)
    assert prefix_identity_sha256(a) != prefix_identity_sha256(b)


def test_request_id_does_not_change_prefix_identity():
    a, b = make_manifest(request_id="r1"), make_manifest(request_id="r2")
    assert prefix_identity_sha256(a) == prefix_identity_sha256(b)
    assert cache_abi_sha256(a) == cache_abi_sha256(b)
    assert manifest_sha256(a) != manifest_sha256(b)


def test_one_prompt_token_changes_prompt_and_prefix_but_not_abi():
    a, b = make_manifest(prompt=(11, 22, 33, 44)), make_manifest(prompt=(11, 22, 33, 45))
    ia, ib = a.input_identity, b.input_identity
    assert ia.prompt_token_ids_sha256 != ib.prompt_token_ids_sha256
    assert prefix_identity_sha256(a) != prefix_identity_sha256(b)
    assert cache_abi_sha256(a) == cache_abi_sha256(b)


def test_digest_definitions_follow_the_spec_formulas():
    import hashlib
    import json

    m = make_manifest()
    projection = {
        "artifact_identity": msgspec.to_builtins(m.artifact_identity),
        "cache_schema": msgspec.to_builtins(m.cache_schema),
        "position_contract": msgspec.to_builtins(m.position_contract),
    }
    text = json.dumps(projection, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert cache_abi_sha256(m) == hashlib.sha256(text.encode()).hexdigest()
    tokens = json.dumps([11, 22, 33, 44], separators=(",", ":"))
    assert m.input_identity.prompt_token_ids_sha256 == hashlib.sha256(tokens.encode()).hexdigest()


def schema(layers, kv_heads, head_dim, k=FP16, v=FP16, q=0):
    return CacheSchema(num_cache_layers=layers, kv_heads_per_rank=kv_heads, head_dim=head_dim,
                       key_dtype=k, value_dtype=v, num_query_heads=q)


def test_b_token_reproduces_the_spec():
    assert b_token(schema(2, 2, 4)) == 64
    big = b_token(schema(32, 8, 128))
    assert big == 131_072 and 4096 * big == 536_870_912
    assert 4096 * b_token(schema(32, 32, 128)) == 2 * 1024**3
    assert b_token(schema(2, 2, 4, INT8, INT8)) == 32
    assert b_token(schema(2, 2, 4, q=4)) == b_token(schema(2, 2, 4, q=8)) == 64


def test_validate_manifest_catches_drift():
    m = make_manifest()
    validate_manifest(m)
    drift = msgspec.structs.replace(
        m, input_identity=msgspec.structs.replace(m.input_identity, prompt_token_ids=(1, 2, 3, 4))
    )
    with pytest.raises(KvLedgerError) as e:
        validate_manifest(drift)
    assert e.value.code is ErrorCode.DIGEST_MISMATCH
    zero = msgspec.structs.replace(m, cache_schema=schema(0, 2, 4))
    with pytest.raises(KvLedgerError) as e:
        validate_manifest(zero)
    assert e.value.code is ErrorCode.INVALID_MANIFEST


def _allocate_event_dict():
    e = allocate_op("h1").writes[0].events[0]
    return msgspec.to_builtins(e)


def test_append_start_v2_reads_as_v3_with_no_thread_count():
    """v2's ForwardCall had no thread count: it reads back as 0 (not recorded)."""
    body = {
        "event_type": "append_start", "event_id": "e1", "stream_id": "h1", "stream_position": 2,
        "schema_version": 2, "request_id": "h1", "handle_generation": 0, "global_position": 2,
        "payload": {"txn_id": "t1", "kind": "decode", "base_snapshot_version": 1, "interval_start": 4,
                    "interval_count": 1, "token_ids": [7], "cache_positions": [4], "mask_key_extent": 5,
                    "cache_abi_sha256": "0" * 64,
                    "call": {"call_id": "c1", "index": 0, "size": 2, "new_pad": 1, "key_extent": 8}},
    }
    e = decode_event(msgspec.json.encode(body))
    assert e.schema_version == 3 and e.payload.call.threads == 0 and e.payload.call.key_extent == 8
    body["schema_version"] = 3
    body["payload"]["call"]["threads"] = -1
    with pytest.raises(KvLedgerError) as info:
        decode_event(msgspec.json.encode(body))
    assert info.value.code is ErrorCode.MALFORMED_EVENT


def _publish_v1(layers: list[dict]) -> bytes:
    return msgspec.json.encode({
        "event_type": "append_publish", "event_id": "e1", "stream_id": "h1", "stream_position": 3,
        "schema_version": 1, "request_id": "h1", "handle_generation": 0, "global_position": 3,
        "payload": {"txn_id": "t1", "base_snapshot_version": 1, "result_snapshot_version": 2,
                    "committed_length": 6, "accepted_count": 2, "layers": layers, "logits_ready": True}})


def _layer(i: int, start: int = 4, count: int = 2, digest: str | None = None, complete: bool = True) -> dict:
    return {"layer": i, "start": start, "count": count, "k_complete": complete, "v_complete": True,
            "rows_sha256": digest}


def test_append_publish_v1_reads_as_one_digest_over_its_layers():
    digests = [f"{i:x}" * 64 for i in range(3)]
    e = decode_event(_publish_v1([_layer(i, digest=d) for i, d in enumerate(digests)]))
    assert e.schema_version == 2 and e.payload.layers_complete == 3
    assert e.payload.rows_sha256 == layers_sha256(digests) != layers_sha256(digests[::-1])
    # layer order is what counts, not the order the records were listed in
    listed = [_layer(i, digest=d) for i, d in enumerate(digests)][::-1]
    assert decode_event(_publish_v1(listed)).payload.rows_sha256 == layers_sha256(digests)
    assert decode_event(_publish_v1([_layer(0), _layer(1)])).payload.rows_sha256 is None


@pytest.mark.parametrize("layers, complete", [
    ([_layer(0), _layer(1, count=1)], 1),  # v1's unequal layer lengths
    ([_layer(0), _layer(1, start=3)], 1),  # rows other than those committed
    ([_layer(0), _layer(2)], 1),  # a layer skipped
    ([_layer(0, complete=False), _layer(1)], 0),  # incomplete K
    ([_layer(0), _layer(0), _layer(1)], 0),  # a layer twice
])
def test_append_publish_v1_that_was_no_full_layer_set_counts_fewer_layers(layers, complete):
    """verify then reports the publish as a partial layer set (a v2 publish cannot say more)."""
    assert decode_event(_publish_v1(layers)).payload.layers_complete == complete


def test_append_publish_v1_with_a_bad_digest_is_malformed():
    with pytest.raises(KvLedgerError) as e:
        decode_event(_publish_v1([_layer(0, digest="zz")]))
    assert e.value.code is ErrorCode.MALFORMED_EVENT


def test_encode_decode_round_trip():
    e = allocate_op("h1").writes[0].events[0]
    assert decode_event(encode_event(e)) == e


@pytest.mark.parametrize(
    "mutate, code",
    [
        (lambda d: d.update(event_type="teleport"), ErrorCode.UNKNOWN_EVENT_TYPE),
        (lambda d: d.update(schema_version=2), ErrorCode.UNKNOWN_SCHEMA_VERSION),
        (lambda d: d.update(schema_version="one"), ErrorCode.MALFORMED_EVENT),
        (lambda d: d.update(stream_position="x"), ErrorCode.MALFORMED_EVENT),
        (lambda d: d.update(stream_position=-1), ErrorCode.MALFORMED_EVENT),
        (lambda d: d["payload"].update(b_token="64"), ErrorCode.MALFORMED_EVENT),
        (lambda d: d["payload"].update(unexpected=1), ErrorCode.MALFORMED_EVENT),
        (lambda d: d["payload"].pop("manifest"), ErrorCode.MALFORMED_EVENT),
        (lambda d: d.update(request_id="r" * 10_000), ErrorCode.FIELD_TOO_LARGE),
        (lambda d: d["payload"].update(cache_abi_sha256="XYZ"), ErrorCode.MALFORMED_EVENT),
        # 64 characters, but not lowercase hex: the alphabet is checked, not only the length.
        (lambda d: d["payload"].update(cache_abi_sha256="A" * 64), ErrorCode.MALFORMED_EVENT),
        (lambda d: d["payload"].update(manifest_sha256="g" * 64), ErrorCode.MALFORMED_EVENT),
        (lambda d: d["payload"].update(prefix_identity_sha256="0" * 63 + " "), ErrorCode.MALFORMED_EVENT),
    ],
)
def test_bad_events_get_stable_codes(mutate, code):
    d = _allocate_event_dict()
    mutate(d)
    with pytest.raises(KvLedgerError) as e:
        decode_event(msgspec.json.encode(d))
    assert e.value.code is code


@pytest.mark.parametrize("digest, ok", [("0123456789abcdef" * 4, True), ("0123456789ABCDEF" * 4, False),
                                        ("z" * 64, False), ("a" * 63, False)])
def test_row_digests_must_be_lowercase_hex(digest, ok):
    d = {"txn_id": "t", "base_snapshot_version": 0, "result_snapshot_version": 1, "committed_length": 1,
         "accepted_count": 1, "layers_complete": 2, "rows_sha256": digest, "logits_ready": True}
    raw = msgspec.json.encode(d)
    if ok:
        assert msgspec.json.decode(raw, type=ev.AppendPublish).rows_sha256 == digest
    else:
        with pytest.raises(msgspec.ValidationError, match="rows_sha256|sha256"):
            msgspec.json.decode(raw, type=ev.AppendPublish)


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1,2]", b'"x"', b"{"])
def test_non_objects_are_malformed(raw):
    with pytest.raises(KvLedgerError) as e:
        decode_event(raw)
    assert e.value.code is ErrorCode.MALFORMED_EVENT


def test_newer_version_of_upcast_type_is_refused():
    newer = ev.CURRENT_VERSION["append_start"] + 1
    d = {"event_type": "append_start", "schema_version": newer, "payload": {}}
    with pytest.raises(KvLedgerError) as e:
        decode_event(msgspec.json.encode(d))
    assert e.value.code is ErrorCode.UNKNOWN_SCHEMA_VERSION


def test_v1_append_start_that_is_not_valid_v1_is_malformed():
    d = {"event_type": "append_start", "schema_version": 1, "event_id": "e", "stream_id": "h",
         "stream_position": 1, "request_id": "h", "handle_generation": 0, "payload": {"kind": "prefill"}}
    with pytest.raises(KvLedgerError) as e:
        decode_event(msgspec.json.encode(d))
    assert e.value.code is ErrorCode.MALFORMED_EVENT


def test_an_older_event_that_makes_no_current_one_is_refused():
    """An older version's body is upcast, then held to the current event: a payload that
    is no object, or an envelope the current event refuses, is MALFORMED_EVENT; a body
    past MAX_EVENT_BYTES is FIELD_TOO_LARGE before it is parsed."""
    from kvledger.journal.builders import envelope
    from kvledger.schemas.codec import MAX_EVENT_BYTES, encode_event

    start = ev.AppendStart(txn_id="t", kind="prefill", base_snapshot_version=0, interval_start=0, interval_count=1,
                           token_ids=(1,), cache_positions=(0,), mask_key_extent=1, cache_abi_sha256="a" * 64)
    d = msgspec.json.decode(encode_event(envelope(ev.AppendStartEvent, "h", 1, start)))
    older = {**d, "schema_version": 2}
    assert decode_event(msgspec.json.encode(older)).schema_version == 3  # upcast
    for bad, why in (({**older, "payload": "x"}, "payload must be a JSON object"),
                     ({**older, "stream_position": -1}, "stream_position")):
        with pytest.raises(KvLedgerError) as e:
            decode_event(msgspec.json.encode(bad))
        assert e.value.code is ErrorCode.MALFORMED_EVENT and why in e.value.message
    with pytest.raises(KvLedgerError) as e:
        decode_event(b" " * (MAX_EVENT_BYTES + 1))
    assert e.value.code is ErrorCode.FIELD_TOO_LARGE


def test_every_event_type_has_a_payload_and_a_schema_entry():
    s = msgspec.json.schema(ev.Event)
    assert set(s["discriminator"]["mapping"]) == set(ev.EVENT_CLASSES) == {
        "request_allocate", "append_start", "append_publish", "failure", "output_emit", "fork",
        "truncate", "reorder", "cancel_request", "finish", "release",
        "kv_events_batch", "kv_events_gap", "kv_events_restart",
    }


class _Squares(Positional[int]):
    __slots__ = ("n", "made")

    def __init__(self, n: int) -> None:
        self.n, self.made = n, []

    def __len__(self) -> int:
        return self.n

    def _at(self, i: int) -> int:
        self.made.append(i)
        return i * i


@given(st.integers(0, 6), st.integers(-9, 9), st.one_of(st.none(), st.integers(-9, 9)),
       st.one_of(st.none(), st.integers(-9, 9)), st.sampled_from([None, 1, 2, -1, -3]))
def test_a_positional_sequence_indexes_and_slices_as_a_list(n, i, start, stop, step):
    """Results and RunReceipts (schemas.positional): items made when read, indexed as a list."""
    seq, want = _Squares(n), [k * k for k in range(n)]
    if -n <= i < n:
        assert seq[i] == want[i] and seq.made == [i % n]
    else:
        with pytest.raises(IndexError):
            seq[i]
        assert seq.made == []
    assert seq[start:stop:step] == want[start:stop:step]
    assert list(seq) == want and list(reversed(seq)) == want[::-1]
    assert ((n - 1) ** 2 in seq) == (n > 0)
