"""Operation receipts: what a committed operation returns, and what a retry gets back."""

from __future__ import annotations

import msgspec


class HandleResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    handle_id: str
    generation: int
    snapshot_version: int
    stream_position: int
    committed_length: int


class Receipt(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Durable proof of one committed operation. A retry with the same operation id and
    fingerprint returns these exact bytes: it describes the historical commit, not the
    handle's current state."""

    operation_id: str
    fingerprint: str
    handles: tuple[HandleResult, ...]
    event_ids: tuple[str, ...]
    first_global_position: int
    last_global_position: int
    committed_wall_ns: int


receipt_encoder = msgspec.json.Encoder()
receipt_decoder = msgspec.json.Decoder(Receipt)
