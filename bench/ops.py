"""Cheap builders of valid journal operations for the benchmarks.

A publication here is what the engine writes when a decode step publishes: one
`append_publish` event (a ~280-byte JSON payload) on one handle, guarded by the head it
was decided against. Event and operation ids are the engine's (engine.ids.new_id: a
random 64-bit prefix per process and a counter, 32 hex characters); handle ids are
random 32-hex strings (request-derived, in no useful order), so the head rows and the
stream index see random keys, as in a serving system.
Everything else is built for real (kvledger.journal.builders), per operation, inside the
timed region.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from kvledger.journal import Guard, Operation, builders

ALLOCATE_PAYLOAD = builders.allocate_payload(builders.make_manifest(
    "bench", namespace="bench", schema=builders.cache_schema(layers=1), max_new_tokens=1 << 19,
    max_context_tokens=1 << 20), reserved_capacity=1 << 20)


def random_hex(n: int) -> list[str]:
    """n random 32-hex ids (128 random bits each, like uuid4().hex)."""
    h = os.urandom(16 * n).hex()
    return [h[i:i + 32] for i in range(0, 32 * n, 32)]


def handle_ids(n: int) -> list[str]:
    return random_hex(n)


def allocate_op(handle: str, ids: Callable[[], str]) -> Operation:
    return builders.allocate_op(handle, ids(), payload=ALLOCATE_PAYLOAD, event_id=ids())


class Head:
    """The caller's view of one handle's head: what the next publication is decided against."""

    __slots__ = ("handle", "generation", "snapshot", "position")

    def __init__(self, handle: str) -> None:
        self.handle, self.generation, self.snapshot, self.position = handle, 0, 0, 1


def publish_op(h: Head, ids: Callable[[], str]) -> Operation:
    """One publication on `h`, decided against its current head; advances `h`."""
    op_id = ids()
    op = builders.publish_op(h.handle, Guard(h.generation, h.snapshot, h.position), op_id, op_id,
                             layers=1, event_id=ids())
    h.snapshot, h.position = h.snapshot + 1, h.position + 1
    return op
