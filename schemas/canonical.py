"""Canonical JSON and SHA-256 digests.

Canonical JSON here means: object keys sorted, no insignificant whitespace, UTF-8
(non-ASCII kept as is), msgspec's shortest round-trip float form. Every digest in the
spec is SHA-256 over this encoding, so two processes that agree on the value agree on
the digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder(order="sorted")


def canonical_json(value: Any) -> bytes:
    return _encoder.encode(value)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def layers_sha256(per_layer: Sequence[str]) -> str:
    """One digest for an append's rows over all layers: SHA-256 over the layers' own row
    digests (raw bytes, in layer order). A publish stores this one (32 bytes, not one
    per layer); recovery recomputes each layer's digest from the rows it re-executes
    and combines them the same way, so the proof is still bit for bit."""
    return hashlib.sha256(bytes.fromhex("".join(per_layer))).hexdigest()  # one fromhex: same bytes


def digest(value: Any) -> str:
    """SHA-256 of the canonical JSON of `value`, hex encoded."""
    return sha256_hex(canonical_json(value))
