"""Stable error codes.

Every rejection anywhere in kvledger carries one of these codes. The codes are part of
the public contract (scripts match on them), so members are only ever added, never
renamed. The first group maps the nine failure classes of spec 0x09.
"""

from __future__ import annotations

import unicodedata
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
    # The database under the journal (journal/driver_errors.py maps driver errors to these;
    # DATABASE_UNREACHABLE stays reserved for a database that cannot be reached at all).
    DATABASE_NOT_FOUND = "DATABASE_NOT_FOUND"  # no SQLite file (read side), no such PG database
    DATABASE_AUTH_FAILED = "DATABASE_AUTH_FAILED"  # the server refused the credentials
    NOT_A_DATABASE = "NOT_A_DATABASE"  # a directory, a non-SQLite or corrupt file
    DATABASE_READ_ONLY = "DATABASE_READ_ONLY"  # read-only file, directory or transaction
    PERMISSION_DENIED = "PERMISSION_DENIED"  # the OS or the server denies this access
    DATABASE_BUSY = "DATABASE_BUSY"  # locked beyond the timeout, serialization failure
    DATABASE_FULL = "DATABASE_FULL"  # disk full
    CONSTRAINT_VIOLATION = "CONSTRAINT_VIOLATION"  # a unique/not-null/check constraint refused a row
    TABLE_MISSING = "TABLE_MISSING"  # a journal table was dropped after migration
    SCHEMA_MISMATCH = "SCHEMA_MISMATCH"  # tables that are not the ones the revision says
    DATABASE_TOO_NEW = "DATABASE_TOO_NEW"  # written by a newer kvledger (unknown revision)
    DATABASE_ERROR = "DATABASE_ERROR"  # any other driver error
    INTERNAL_ERROR = "INTERNAL_ERROR"  # a bug: an exception kvledger did not expect
    UNWRITABLE_OUTPUT = "UNWRITABLE_OUTPUT"  # an output path is a directory, read-only, or the disk is full
    OUTPUT_IS_INPUT = "OUTPUT_IS_INPUT"  # an output would overwrite the journal or another input
    CONTEXT_TOO_LONG = "CONTEXT_TOO_LONG"  # prompt + generation beyond the model's positions
    NON_CANONICAL_EVENT = "NON_CANONICAL_EVENT"  # a body that does not re-encode to itself


class KvLedgerError(Exception):
    """An error with a stable code. `str()` is the one-line message the CLI prints:
    control characters in it are escaped (see `one_line`); `message` keeps the raw text
    for JSON."""

    def __init__(self, code: ErrorCode, message: str, **details: object) -> None:
        super().__init__(f"{code.value}: {one_line(message)}")
        self.code = code
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code.value, "message": self.message, **self.details}


# Characters that could end the line or change how it reads: C0/C1 controls, format
# characters (bidi overrides, zero-width), line/paragraph separators, and lone surrogates
# (undecodable bytes of a path), which would also make printing fail.
_ESCAPED = {"Cc", "Cf", "Cs", "Zl", "Zp"}
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line(text: str) -> str:
    """`text` with every character that could break or disguise a one-line message
    escaped, so an id or path holding a newline cannot inject a second, fake line (e.g.
    one that starts with `STALE_BASE:`)."""
    if text.isprintable():  # the common case: nothing to escape (fast path)
        return text
    out = []
    for ch in text:
        if unicodedata.category(ch) in _ESCAPED:
            n = ord(ch)
            out.append(_SHORT.get(ch) or (f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000
                                          else f"\\U{n:08x}"))
        else:
            out.append(ch)
    return "".join(out)
