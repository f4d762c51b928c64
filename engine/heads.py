"""What the journal's guards and head rows hold of a handle's state."""

from __future__ import annotations

from typing import overload

from kvledger.engine.state import HandleState
from kvledger.journal.contract import Guard, HeadFacts


@overload
def guard(s: HandleState) -> Guard: ...
@overload
def guard(s: HandleState | None) -> Guard | None: ...
def guard(s: HandleState | None) -> Guard | None:
    """The base a write decided against `s` expects (None: the stream must not exist)."""
    return None if s is None else Guard(s.generation, s.snapshot_version, s.stream_position)


def head(s: HandleState) -> HeadFacts:
    return HeadFacts(s.request_id, s.generation, s.snapshot_version, s.stream_position,
                     s.committed_length, s.lifecycle, s.prefix_identity_sha256, s.cache_abi_sha256)
