"""What verify finds: each finding's code, the finding, and a run's result.

Codes reuse schemas.errors names where the invariant is the same rule the command
path enforces (STALE_BASE, APPEND_HOLE, ABI_MISMATCH, ...); the others are below.
"""

from __future__ import annotations

import msgspec

from kvledger.schemas.errors import ErrorCode

# Verify-only codes (the rest are schemas.errors.ErrorCode values).
TAMPERED = "TAMPERED"  # a stored record is not what was committed (chain, CRC, positions, lookup rows)
POSITION_GAP = "POSITION_GAP"  # global positions not 1, 2, 3, ...
STREAM_POSITION_GAP = "STREAM_POSITION_GAP"
DUPLICATE_EVENT_ID = "DUPLICATE_EVENT_ID"
OPERATION_NOT_CONTIGUOUS = "OPERATION_NOT_CONTIGUOUS"  # one commit = consecutive positions
UNKNOWN_STREAM = "UNKNOWN_STREAM"  # an event before its stream's allocate or fork
PUBLISH_WITHOUT_START = "PUBLISH_WITHOUT_START"
DUPLICATE_TXN = "DUPLICATE_TXN"
FAILURE_WITHOUT_START = "FAILURE_WITHOUT_START"
FAILURE_CHANGES_STATE = "FAILURE_CHANGES_STATE"  # a failure must leave its base visible
COMMITTED_LENGTH_MISMATCH = "COMMITTED_LENGTH_MISMATCH"
COMMITTED_EXCEEDS_LOGICAL = "COMMITTED_EXCEEDS_LOGICAL"
VISIBLE_BEYOND_COMMITTED = "VISIBLE_BEYOND_COMMITTED"
RESERVED_BELOW_COMMITTED = "RESERVED_BELOW_COMMITTED"
RECLAIMABLE_EXCEEDS_RESIDENT = "RECLAIMABLE_EXCEEDS_RESIDENT"
RELEASE_LENGTH_MISMATCH = "RELEASE_LENGTH_MISMATCH"
GENERATION_REGRESSION = "GENERATION_REGRESSION"
GENERATION_MISMATCH = "GENERATION_MISMATCH"
SNAPSHOT_DISCONTINUITY = "SNAPSHOT_DISCONTINUITY"
EVENT_AFTER_RELEASE = "EVENT_AFTER_RELEASE"
WORK_AFTER_FINISH = "WORK_AFTER_FINISH"
OPEN_TXN_AT_CLOSE = "OPEN_TXN_AT_CLOSE"
OUTPUT_INDEX_GAP = "OUTPUT_INDEX_GAP"
COUNT_MISMATCH = "COUNT_MISMATCH"  # finish/truncate counters vs the fold
REQUEST_MISMATCH = "REQUEST_MISMATCH"
REORDER_MISMATCH = "REORDER_MISMATCH"
B_TOKEN_MISMATCH = "B_TOKEN_MISMATCH"
TIME_REGRESSION = "TIME_REGRESSION"  # one source's monotonic clock ran backwards
RECEIPT_MISMATCH = "RECEIPT_MISMATCH"
RECEIPT_MISSING = "RECEIPT_MISSING"
HEAD_MISMATCH = "HEAD_MISMATCH"
MANIFEST_MISSING = "MANIFEST_MISSING"
COLUMN_MISMATCH = "COLUMN_MISMATCH"  # an indexed column disagrees with the row's body
STORED_TYPE_MISMATCH = "STORED_TYPE_MISMATCH"  # e.g. a body stored as TEXT, not bytes
MALFORMED_RECEIPT = "MALFORMED_RECEIPT"  # a receipt body that does not decode
STORAGE_CORRUPT = "STORAGE_CORRUPT"  # the database's own integrity check failed
KV_SEQ_ORDER = "KV_SEQ_ORDER"  # a KV-event stream's seqs not 0, 1, 2, ... in each epoch (gaps journaled)
KV_EPOCH_ORDER = "KV_EPOCH_ORDER"  # a KV-event stream's epoch not 0, then +1 at each restart
ANCHOR_MISMATCH = "ANCHOR_MISMATCH"  # the journal does not extend the anchor given (verify --expect)
NON_CANONICAL = ErrorCode.NON_CANONICAL_EVENT.value

KEEP = 100  # findings kept for the report; the rest are counted
STOP_AFTER = 10_000  # findings after which verify stops reading


class Finding(msgspec.Struct, frozen=True, omit_defaults=True):
    code: str
    message: str
    global_position: int | None = None
    event_id: str | None = None
    stream_id: str | None = None
    event_type: str | None = None
    line: int | None = None


class VerifyResult(msgspec.Struct, frozen=True):
    events: int
    findings: list[Finding]  # the first ones (Checker's `keep`)
    omitted: int = 0  # findings counted beyond those
    stopped: str | None = None  # why reading stopped early, if it did
    storage: str | None = None  # the database storage check that ran, or why it was skipped
    anchor: str | None = None  # with an expected anchor: what the check found

    @property
    def ok(self) -> bool:
        return not self.findings and not self.omitted and self.stopped is None
