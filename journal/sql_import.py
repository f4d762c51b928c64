"""Loading an exported journal into an empty SQL journal (SqlJournal.import_events), in
the caller's transaction."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from kvledger.journal.contract import ImportTables, StreamWrite
from kvledger.journal.manifests import pack_manifest
from kvledger.journal.statements import EventRow, Statements
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import Event
from kvledger.schemas.receipts import receipt_encoder

IMPORT_PAGE_ROWS = 5000  # an import inserts events, heads and receipts in pages of this many rows
IMPORT_PAGE_BYTES = 16 << 20  # an import inserts events in pages of at most this many body bytes


def load_import(sql: Statements, events: Iterable[tuple[Event, bytes]], tables: Callable[[], ImportTables],
                display_url: str, cur: Any) -> None:
    """Each stored body verbatim at its envelope's global position, then the head rows,
    receipts and manifests `tables()` derives; INVALID_ARGUMENT if the journal is not empty."""
    if sql.has_rows(cur):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{display_url} is not empty: "
                            "import loads an exported journal into an empty one")
    page: list[EventRow] = []
    size = 0
    for e, body in events:
        # The schema_version column describes the stored body, which an upcast
        # event no longer does: read it from the body itself.
        page.append((e.global_position, e.event_id, e.stream_id, e.stream_position,
                     e.event_type, _stored_version.decode(body).schema_version,
                     e.operation_id, body))
        size += len(body)
        if len(page) == IMPORT_PAGE_ROWS or size >= IMPORT_PAGE_BYTES:
            sql.insert_events(cur, page)
            page, size = [], 0
    if page:
        sql.insert_events(cur, page)
    derived = tables()
    head_rows = [StreamWrite(h, None, facts, ()) for h, facts in derived.heads.items()]
    receipt_rows = [(r.operation_id, r.fingerprint, r.first_global_position,
                     r.last_global_position, receipt_encoder.encode(r)) for r in derived.receipts]
    for i in range(0, len(head_rows), IMPORT_PAGE_ROWS):
        sql.create_heads(cur, head_rows[i:i + IMPORT_PAGE_ROWS])
    for i in range(0, len(receipt_rows), IMPORT_PAGE_ROWS):
        sql.insert_receipts(cur, receipt_rows[i:i + IMPORT_PAGE_ROWS])
    if derived.manifests:
        sql.insert_manifests(cur, [(sha, pack_manifest(m)) for sha, m in derived.manifests])


class _StoredVersion(msgspec.Struct):
    schema_version: int


_stored_version = msgspec.json.Decoder(_StoredVersion)
