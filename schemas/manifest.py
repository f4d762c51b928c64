"""The immutable request/cache manifest of spec 0x01 and the identities derived from it.

Two questions, two records (spec: "Immutable Request And Cache Manifest"):
which live attempt is this (request_identity, input_identity, request_policy), and
which model-state contract produced its rows (artifact_identity, cache_schema,
position_contract). The cache ABI digest covers only the second; the prefix identity
adds the exact input but never the request id, so identical prompts can share a prefix.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from kvledger.schemas.canonical import digest
from kvledger.schemas.errors import ErrorCode, KvLedgerError

_SHA256_HEX = re.compile("[0-9a-f]{64}")  # lowercase only: what reads back as the same string

MANIFEST_SCHEMA_VERSION = 1
EMPTY_SHA256 = digest(None)  # digest of "null": the declared absence of side data / salt


class RequestIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    namespace: str
    request_id: str
    attempt: int = 0
    lineage_id: str = ""
    parent_request_id: str | None = None


class ArtifactIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_artifact_sha256: str
    model_config_sha256: str
    adapter_set: tuple[str, ...] = ()
    weight_transforms: tuple[str, ...] = ()


class InputIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt_token_ids: tuple[int, ...]
    prompt_token_ids_sha256: str
    tokenizer_provenance: str = ""
    input_side_data_sha256: str = EMPTY_SHA256
    cache_isolation_salt_sha256: str = EMPTY_SHA256


class ScalarType(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    bytes_per_scalar: int


class ParallelShard(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tp_rank: int = 0
    tp_size: int = 1


class CacheSchema(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    num_cache_layers: int
    kv_heads_per_rank: int
    head_dim: int
    key_dtype: ScalarType
    value_dtype: ScalarType
    num_query_heads: int = 0  # recorded for audit; never part of B_token
    cache_family: str = "full_kv"
    positional_stage: Literal["post_rope", "pre_rope", "none"] = "post_rope"
    logical_axes: tuple[str, ...] = ("batch", "kv_head", "position", "head_dim")
    representation_schema: str = "dense"
    parallel_shard: ParallelShard = ParallelShard()


class RopeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    theta: float
    layout: Literal["rotate_half", "interleaved"] = "rotate_half"
    scaling: str | None = None


class PositionContract(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cache_position_convention: str = "absolute"
    position_origin: int = 0
    rope: RopeConfig | None = None
    visibility_policy: str = "causal_full"


class SamplingPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: Literal["greedy", "temperature"] = "greedy"
    temperature: float = 1.0
    seed: int = 0


class RequestPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_context_tokens: int
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    sampling: SamplingPolicy = SamplingPolicy()


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_identity: RequestIdentity
    artifact_identity: ArtifactIdentity
    input_identity: InputIdentity
    cache_schema: CacheSchema
    position_contract: PositionContract
    request_policy: RequestPolicy
    schema_version: int = MANIFEST_SCHEMA_VERSION


def new_manifest(
    *,
    namespace: str,
    request_id: str,
    prompt: tuple[int, ...],
    artifact: ArtifactIdentity,
    cache_schema: CacheSchema,
    policy: RequestPolicy,
    position_contract: PositionContract = PositionContract(),  # noqa: B008 - frozen Struct: a shared default is safe
) -> Manifest:
    """The manifest of a new request: its own lineage and the prompt digest computed."""
    prompt = tuple(prompt)
    return Manifest(
        request_identity=RequestIdentity(namespace=namespace, request_id=request_id, lineage_id=request_id),
        artifact_identity=artifact,
        input_identity=InputIdentity(prompt_token_ids=prompt,
                                     prompt_token_ids_sha256=prompt_token_ids_sha256(prompt)),
        cache_schema=cache_schema,
        position_contract=position_contract,
        request_policy=policy,
    )


def b_token(schema: CacheSchema) -> int:
    """Bytes per committed token on the local shard: L * H_kv,local * d_h * (b_K + b_V)."""
    return (
        schema.num_cache_layers
        * schema.kv_heads_per_rank
        * schema.head_dim
        * (schema.key_dtype.bytes_per_scalar + schema.value_dtype.bytes_per_scalar)
    )


def prompt_token_ids_sha256(prompt_token_ids: tuple[int, ...] | list[int]) -> str:
    return digest(list(prompt_token_ids))


def cache_abi_sha256(m: Manifest) -> str:
    return digest(
        {
            "artifact_identity": m.artifact_identity,
            "cache_schema": m.cache_schema,
            "position_contract": m.position_contract,
        }
    )


def prefix_identity_sha256(m: Manifest, abi: str | None = None) -> str:
    """`abi`: the manifest's cache_abi_sha256, if the caller has it already."""
    inp = m.input_identity
    return digest(
        {
            "cache_abi_sha256": abi or cache_abi_sha256(m),
            "prompt_token_ids_sha256": inp.prompt_token_ids_sha256,
            "input_side_data_sha256": inp.input_side_data_sha256,
            "cache_isolation_salt_sha256": inp.cache_isolation_salt_sha256,
        }
    )


def manifest_sha256(m: Manifest) -> str:
    return digest(m)


def validate_manifest(m: Manifest) -> None:
    """Reject a manifest whose declared facts contradict each other (spec 0x01 validation)."""
    if m.schema_version != MANIFEST_SCHEMA_VERSION:
        raise KvLedgerError(
            ErrorCode.UNKNOWN_SCHEMA_VERSION, f"manifest schema_version {m.schema_version}"
        )
    _check_prompt(m.input_identity)
    _check_cache_schema(m.cache_schema)
    _check_policy(len(m.input_identity.prompt_token_ids), m.request_policy)
    _check_digests(m)


def _bad(msg: str) -> KvLedgerError:
    return KvLedgerError(ErrorCode.INVALID_MANIFEST, msg)


def _check_prompt(inp: InputIdentity) -> None:
    if prompt_token_ids_sha256(inp.prompt_token_ids) != inp.prompt_token_ids_sha256:
        raise KvLedgerError(ErrorCode.DIGEST_MISMATCH, "prompt_token_ids_sha256 does not match the prompt")
    if not inp.prompt_token_ids:
        raise _bad("empty prompt")
    if min(inp.prompt_token_ids) < 0:
        raise _bad("negative token id in prompt")


def _check_cache_schema(cs: CacheSchema) -> None:
    for name in ("num_cache_layers", "kv_heads_per_rank", "head_dim"):
        if getattr(cs, name) <= 0:
            raise _bad(f"cache_schema.{name} must be positive")
    for name in ("key_dtype", "value_dtype"):
        if getattr(cs, name).bytes_per_scalar <= 0:
            raise _bad(f"cache_schema.{name}.bytes_per_scalar must be positive")
    if cs.num_query_heads and cs.num_query_heads % cs.kv_heads_per_rank:
        raise _bad("num_query_heads must be a multiple of kv_heads_per_rank")
    shard = cs.parallel_shard
    if not 0 <= shard.tp_rank < shard.tp_size:
        raise _bad("parallel_shard.tp_rank outside [0, tp_size)")


def _check_policy(prompt_len: int, pol: RequestPolicy) -> None:
    if pol.max_new_tokens < 0 or pol.max_context_tokens <= 0:
        raise _bad("request_policy limits must be positive")
    if prompt_len + pol.max_new_tokens > pol.max_context_tokens:
        raise _bad("prompt + max_new_tokens exceeds max_context_tokens")


def _check_digests(m: Manifest) -> None:
    inp = m.input_identity
    for h in (
        m.artifact_identity.model_artifact_sha256,
        m.artifact_identity.model_config_sha256,
        inp.input_side_data_sha256,
        inp.cache_isolation_salt_sha256,
    ):
        if _SHA256_HEX.fullmatch(h) is None:
            raise _bad(f"not a lowercase SHA-256 hex digest: {h!r}")
