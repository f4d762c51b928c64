"""The builders of valid manifests, events and operations for journal-level tests live in
kvledger.journal.builders (the benchmarks and the fixtures use them too)."""

from __future__ import annotations

from kvledger.journal.builders import (  # noqa: F401 - re-exported for the tests
    allocate_op,
    envelope,
    guard_of,
    head,
    make_manifest,
    publish_op,
)
