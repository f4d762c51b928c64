"""Process bodies for the race tests (imported by spawned children, so top level)."""

from __future__ import annotations

import time

from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt

from factories import guard_of, publish_op


def publisher(url: str, handle: str, worker: int, attempts: int, out) -> None:
    """Publish on one handle from whatever base this process last read. An attempt the
    journal gave up on (DATABASE_BUSY: NATS's bounded retries, on a loaded machine) is a
    loss with that code and its operation id, which must have written nothing."""
    results: list = []
    try:
        with open_or_create_journal(url) as j:
            for n in range(attempts):
                base, op_id = guard_of(j.head(handle)), f"w{worker}-{n}"
                try:
                    [r] = j.append([publish_op(handle, base, op_id)])
                except KvLedgerError as exc:
                    if exc.code is not ErrorCode.DATABASE_BUSY:
                        raise
                    results.append((base.snapshot_version, False, exc.code.value, op_id))
                    continue
                results.append((base.snapshot_version, isinstance(r, Receipt), getattr(r, "code", None), op_id))
    except BaseException as exc:  # said at once: the test waits on this queue
        out.put((worker, repr(exc)))
        raise
    out.put((worker, results))


def tailer(url: str, stop, out) -> None:
    """Follow global_position; record every event seen, in the order seen."""
    seen: list[tuple[int, str]] = []
    last = 0
    with open_or_create_journal(url) as j:
        while True:
            stopping = stop.is_set()
            for e in j.read_all(after=last):
                seen.append((e.global_position, e.event_id))
                last = e.global_position
            if stopping:
                break
            time.sleep(0.001)
    out.put(seen)
