"""Manifests as kvl_manifests stores them: compressed on their own, or a reference to the
allocation event that holds one (its record compresses it with its neighbours)."""

from __future__ import annotations

import msgspec
import zstandard

from kvledger.journal import inflate
from kvledger.journal.inflate import compress, decompressor
from kvledger.schemas.canonical import canonical_json
from kvledger.schemas.manifest import Manifest

MAX_MANIFEST = 1 << 24


def pack_manifest(body: bytes) -> bytes:
    """A manifest kvl_manifests stores itself (one from `import`): zstd-compressed.
    Canonical JSON starts with `{`, never with zstd's magic or MANIFEST_REF, so every
    stored form reads back unambiguously."""
    return compress(body)


# An appended allocation's event already holds its manifest, in its record, compressed
# with its neighbours' (far smaller than alone): kvl_manifests then keeps
# only where that event is, as b"@<global position>".
MANIFEST_REF = b"@"


def manifest_ref(position: int) -> bytes:
    return b"@%d" % position


def manifest_ref_position(stored: bytes) -> int | None:
    """The event position a stored manifest refers to (None: not a reference)."""
    if not stored.startswith(MANIFEST_REF) or not stored[1:].isdigit() or len(stored) > 21:
        return None
    return int(stored[1:])


class _Manifested(msgspec.Struct):
    manifest: Manifest


class _AllocationBody(msgspec.Struct):
    payload: _Manifested


def allocation_manifest(event: bytes) -> bytes | None:
    """The canonical JSON of the manifest a request_allocate event holds, which is what
    kvl_manifests stored before (None: no manifest). An event body keeps its fields in
    declaration order, so the manifest is decoded and encoded again, not cut out."""
    try:
        return canonical_json(msgspec.json.decode(event, type=_AllocationBody).payload.manifest)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def unpack_manifest(stored: bytes) -> bytes:
    """The canonical JSON of a stored manifest, either form. A damaged compressed one
    comes back as stored: its digest no longer matches, which is what verify reports."""
    if not stored.startswith(inflate.ZSTD_MAGIC):
        return stored
    try:
        size = zstandard.frame_content_size(stored)
    except zstandard.ZstdError:
        return stored
    out, problem = inflate.at_once(2, stored, size, decompressor()) if 0 <= size <= MAX_MANIFEST else (b"", "too long")
    return stored if problem else out
