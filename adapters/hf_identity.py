"""What a Hugging Face model says about the rows it caches: the manifest of a request.

The cache schema and the artifact identity are read from the model itself (its config,
its parameters, its dtype), never from a table of known models. The weights digest
costs a pass over every parameter, so it is computed once per model and reused while
no parameter has been changed in place (torch's version counters say so).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import Any

import torch

from kvledger.schemas.canonical import digest
from kvledger.schemas.manifest import (
    ArtifactIdentity,
    CacheSchema,
    Manifest,
    PositionContract,
    RequestPolicy,
    RopeConfig,
    SamplingPolicy,
    ScalarType,
    new_manifest,
)
from kvledger.worker.loading import DTYPE_NAMES

NAMESPACE = "kvledger.hf"
_ARTIFACTS: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], ArtifactIdentity]] = weakref.WeakKeyDictionary()


def text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def config_sha256(model: Any) -> str:
    return digest(json.loads(model.config.to_json_string(use_diff=False)))


def weights_sha256(model: Any) -> str:
    """SHA-256 over every parameter and buffer of the state dict, in name order: the
    name, dtype and shape, then the bytes as stored."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def artifact_identity(model: Any) -> ArtifactIdentity:
    # the version counters move on every in-place write: a changed weight is hashed again
    versions = tuple(p._version for p in model.parameters())
    cached = _ARTIFACTS.get(model)
    if cached is not None and cached[0] == versions:
        return cached[1]
    artifact = ArtifactIdentity(model_artifact_sha256=weights_sha256(model),
                                model_config_sha256=config_sha256(model),
                                adapter_set=(f"transformers:{type(model).__name__}",))
    _ARTIFACTS[model] = (versions, artifact)
    return artifact


def cache_schema(model: Any) -> CacheSchema:
    cfg = text_config(model)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = next(model.parameters()).dtype
    width = torch.tensor([], dtype=dtype).element_size()
    st = ScalarType(DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")), width)
    return CacheSchema(num_cache_layers=cfg.num_hidden_layers, kv_heads_per_rank=kv, head_dim=head_dim,
                       key_dtype=st, value_dtype=st, num_query_heads=heads)


def position_contract(model: Any) -> PositionContract:
    cfg = text_config(model)
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta if theta is not None else getattr(cfg, "rope_theta", None)
    if theta is None:
        return PositionContract()
    kind = rope.get("rope_type") if isinstance(rope, dict) else None
    return PositionContract(rope=RopeConfig(theta=float(theta),
                                            scaling=None if kind in (None, "default") else str(kind)))


def manifest(model: Any, *, request_id: str, prompt: tuple[int, ...], max_new_tokens: int,
             max_context_tokens: int, stop_token_ids: tuple[int, ...], sampling: SamplingPolicy) -> Manifest:
    return new_manifest(namespace=NAMESPACE, request_id=request_id, prompt=prompt,
                        artifact=artifact_identity(model), cache_schema=cache_schema(model),
                        policy=RequestPolicy(max_new_tokens=max_new_tokens, max_context_tokens=max_context_tokens,
                                             stop_token_ids=stop_token_ids, sampling=sampling),
                        position_contract=position_contract(model))
