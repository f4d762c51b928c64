"""msgspec types for events, manifests and receipts; canonical JSON and digests.

The leftmost layer: imports nothing of kvledger's own.
"""

from kvledger.schemas.canonical import canonical_json, digest, sha256_hex
from kvledger.schemas.codec import decode_event, encode_event
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import CURRENT_VERSION, EVENT_CLASSES, PAYLOAD_CLASSES, Event
from kvledger.schemas.manifest import (
    Manifest,
    b_token,
    cache_abi_sha256,
    manifest_sha256,
    prefix_identity_sha256,
    prompt_token_ids_sha256,
    validate_manifest,
)

__all__ = [
    "CURRENT_VERSION",
    "EVENT_CLASSES",
    "PAYLOAD_CLASSES",
    "ErrorCode",
    "Event",
    "KvLedgerError",
    "Manifest",
    "b_token",
    "cache_abi_sha256",
    "canonical_json",
    "decode_event",
    "digest",
    "encode_event",
    "manifest_sha256",
    "prefix_identity_sha256",
    "prompt_token_ids_sha256",
    "sha256_hex",
    "validate_manifest",
]
