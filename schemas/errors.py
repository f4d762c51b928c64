"""Stable error codes.

Every rejection anywhere in kvledger carries one of these codes. The codes are part of
the public contract (scripts match on them), so members are only ever added, never
renamed. The first group maps the nine failure classes of spec 0x09.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    # 0x09 failure classes and the lifecycle rules around them.
    POSITION_MASK_MISMATCH = "POSITION_MASK_MISMATCH"  # interval/positions/mask disagree
    ABI_MISMATCH = "ABI_MISMATCH"  # rows from another cache ABI
    PARTIAL_LAYER_SET = "PARTIAL_LAYER_SET"  # publish without every layer's K and V
    SPLIT_REORDER = "SPLIT_REORDER"  # token/cache/position/sampler permuted apart
    NOT_A_PERMUTATION = "NOT_A_PERMUTATION"
    STALE_BASE = "STALE_BASE"  # generation/snapshot fence failed
    TXN_ABORTED = "TXN_ABORTED"  # late completion of an aborted transaction
    FRONTIER_MISMATCH = "FRONTIER_MISMATCH"  # a row for a token that is not the frontier
    PREFIX_STILL_OWNED = "PREFIX_STILL_OWNED"  # eviction of a prefix with live owners
    REJECTED_SUFFIX = "REJECTED_SUFFIX"  # committing rows of rejected draft tokens
    # Lifecycle.
    APPEND_HOLE = "APPEND_HOLE"  # interval does not start at the committed length
    FORK_BEYOND_COMMITTED = "FORK_BEYOND_COMMITTED"
    TRUNCATE_GROWS = "TRUNCATE_GROWS"
    RELEASE_BEFORE_FINISH = "RELEASE_BEFORE_FINISH"
    HANDLE_TERMINAL = "HANDLE_TERMINAL"  # new work after finish or cancel
    HANDLE_RELEASED = "HANDLE_RELEASED"  # read or mutation after release
    UNKNOWN_HANDLE = "UNKNOWN_HANDLE"
    HANDLE_EXISTS = "HANDLE_EXISTS"
    TXN_NOT_OPEN = "TXN_NOT_OPEN"
    OUTPUT_NOT_READY = "OUTPUT_NOT_READY"  # emit without logits of a published call
    CAPACITY_EXCEEDED = "CAPACITY_EXCEEDED"
    CONFLICT = "CONFLICT"  # same operation id, different fingerprint
    # Input and storage.
    INVALID_MANIFEST = "INVALID_MANIFEST"
    DIGEST_MISMATCH = "DIGEST_MISMATCH"
    MALFORMED_EVENT = "MALFORMED_EVENT"
    UNKNOWN_EVENT_TYPE = "UNKNOWN_EVENT_TYPE"
    UNKNOWN_SCHEMA_VERSION = "UNKNOWN_SCHEMA_VERSION"
    FIELD_TOO_LARGE = "FIELD_TOO_LARGE"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    CORRUPT_JOURNAL = "CORRUPT_JOURNAL"
    BAD_DATABASE_URL = "BAD_DATABASE_URL"
    DATABASE_UNREACHABLE = "DATABASE_UNREACHABLE"
    NOT_MIGRATED = "NOT_MIGRATED"
    NOT_BUILT = "NOT_BUILT"
    NON_CANONICAL_EVENT = "NON_CANONICAL_EVENT"  # a body that does not re-encode to itself


class KvLedgerError(Exception):
    """An error with a stable code. `str()` is the one-line message the CLI prints."""

    def __init__(self, code: ErrorCode, message: str, **details: object) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code.value, "message": self.message, **self.details}
