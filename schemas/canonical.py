"""Canonical JSON and SHA-256 digests.

Canonical JSON here means: object keys sorted, no insignificant whitespace, UTF-8
(non-ASCII kept as is), msgspec's shortest round-trip float form. Every digest in the
spec is SHA-256 over this encoding, so two processes that agree on the value agree on
the digest.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder(order="sorted")


def canonical_json(value: Any) -> bytes:
    return _encoder.encode(value)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest(value: Any) -> str:
    """SHA-256 of the canonical JSON of `value`, hex encoded."""
    return sha256_hex(canonical_json(value))
