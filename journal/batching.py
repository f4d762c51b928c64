"""What the SQL journal decides of a batch before and around its statements: each
operation checked (`validate`), operations grouped into chains and rounds on disjoint
handles, the phantom heads a refused operation leaves, and a retry's answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvledger.journal.contract import Guard, HeadFacts, Operation, Rejection, StreamWrite, guard_of
from kvledger.journal.statements import Statements
from kvledger.journal.step_values import VERSIONS as STEP_VERSIONS
from kvledger.schemas.decode_fingerprint import DECODE_CHAIN
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import CURRENT_VERSION
from kvledger.schemas.receipts import Receipt, receipt_decoder


def leaves_phantoms(op: Operation, phantoms: dict[str, Guard]) -> None:
    """`op` is not applied: the heads it would have left are phantoms (see SqlJournal._append)."""
    phantoms.update((w.handle_id, guard_of(w.head)) for w in op.writes)


def phantom_base(op: Operation, phantoms: dict[str, Guard]) -> str | None:
    """The handle whose base `op` names is a head that a refused operation of its batch
    would have left, if any."""
    for w in op.writes:
        if w.expected is not None and phantoms.get(w.handle_id) == w.expected:
            return w.handle_id
    for c in op.checks:
        if phantoms.get(c.handle_id) == c.expected:
            return c.handle_id
    return None


def refused_after(op: Operation, handle: str) -> Rejection:
    return Rejection(operation_id=op.operation_id, code=ErrorCode.STALE_BASE.value, handle_id=handle,
                     message=f"an earlier operation on {handle} in this batch was refused")


def chains(ops: Sequence[Operation], indexes: list[int]) -> list[list[int]]:
    """Group operations into units. Consecutive single-handle operations on a handle
    where each names as its base exactly the head the previous one writes (what the
    command service builds when one batch publishes, emits and starts on a handle)
    become one chain: sequentially they succeed or fail together anyway, and one
    guarded update instead of one per operation is what makes them cheap."""
    units: list[list[int]] = []
    tail: dict[str, tuple[list[int], HeadFacts]] = {}  # handle -> (open chain, head it leaves)
    for i in indexes:
        op = ops[i]
        if len(op.writes) == 1 and not op.checks and op.writes[0].expected is not None:
            w = op.writes[0]
            chain = tail.get(w.handle_id)
            if chain is not None and guard_of(chain[1]) == w.expected:
                unit = chain[0]
                unit.append(i)
            else:
                unit = [i]
                units.append(unit)
            tail[w.handle_id] = (unit, w.head)
            continue
        units.append([i])
        for handle in [w.handle_id for w in op.writes] + [c.handle_id for c in op.checks]:
            tail.pop(handle, None)  # anything else on a handle ends its chain
    return units


def rounds(ops: Sequence[Operation], units: list[list[int]]) -> Iterator[list[list[int]]]:
    """Split units, in order, into rounds that touch disjoint handles, so one
    set-based statement per round has sequential semantics."""
    current: list[list[int]] = []
    touched: set[str] = set()
    for unit in units:
        op = ops[unit[0]]
        if len(op.writes) == 1 and not op.checks:  # the common shape: one handle
            handle = op.writes[0].handle_id
            if handle in touched:
                yield current
                current, touched = [], set()
            current.append(unit)
            touched.add(handle)
            continue
        handles = {w.handle_id for w in op.writes} | {c.handle_id for c in op.checks}
        if handles & touched:
            yield current
            current, touched = [], set()
        current.append(unit)
        touched |= handles
    if current:
        yield current


def apply_round(sql: Statements, cur: Any, ops: Sequence[Operation], units: list[list[int]],
                last_record: int | None = None) -> dict[int, Rejection]:
    """Apply the guards of the units of one round (disjoint handles). A unit is one
    operation, or a chain of single-handle operations each starting from the head the
    previous one leaves: one guarded update from the chain's first base to its last
    head decides all of them. Returns the rejected operations; a rejected one leaves
    no row changed."""
    spans = False
    updates: list[tuple[StreamWrite, Guard]] = []
    creates: list[StreamWrite] = []
    checks: list[tuple[str, Guard]] = []

    def collect(unit: list[int]) -> None:
        nonlocal spans
        op = ops[unit[0]]
        if len(unit) > 1:  # a chain: first base, last head
            first, last = op.writes[0], ops[unit[-1]].writes[0]
            assert first.expected is not None  # chains joins only guarded writes
            updates.append((StreamWrite(first.handle_id, first.expected, last.head, ()), first.expected))
            return
        spans = spans or len(op.writes) + len(op.checks) > 1
        for w in op.writes:
            if w.expected is None:
                creates.append(w)
            else:
                updates.append((w, w.expected))
        if op.checks:
            checks.extend((c.handle_id, c.expected) for c in op.checks)

    for unit in units:
        collect(unit)
    if spans:
        sql.savepoint(cur)
    rejected: dict[int, Rejection] = {}
    live = units
    while True:
        ok = sql.guarded_update(cur, updates, last_record)
        if creates:
            ok |= sql.create_heads(cur, creates)
        checked = sql.check_heads(cur, checks) if checks else set()
        if len(ok) == len(updates) + len(creates) and len(checked) == len(checks):
            break  # every guard held (handles are distinct within a round)
        partial = False
        for unit in live:
            op = ops[unit[0]]
            failed = [w for w in op.writes if w.handle_id not in ok]
            failed_checks = [c for c in op.checks if c.handle_id not in checked]
            if not failed and not failed_checks:
                continue
            if len(failed) < len(op.writes):
                partial = True  # some rows of this operation changed: undo the round
            if failed:
                w = failed[0]
                code = ErrorCode.STALE_BASE if w.expected else ErrorCode.HANDLE_EXISTS
                handle = w.handle_id
            else:
                code, handle = ErrorCode.STALE_BASE, failed_checks[0].handle_id
            rejected[unit[0]] = Rejection(
                operation_id=op.operation_id,
                code=code.value,
                handle_id=handle,
                message=(f"handle {handle} already exists" if code is ErrorCode.HANDLE_EXISTS
                         else f"head of {handle} moved past the expected base"),
            )
            # the rest of a chain (only guarded writes chain: STALE_BASE after its first)
            rejected.update((i, refused_after(ops[i], handle)) for i in unit[1:])
        if not partial:
            break
        sql.rollback_to_savepoint(cur)
        live = [u for u in live if u[0] not in rejected]
        updates, creates, checks = [], [], []
        for unit in live:
            collect(unit)
    if spans:
        sql.release_savepoint(cur)
    return rejected


# Operation.step rebuilds its events at steps.VERSIONS: the current versions, or no step.
_STEP_VERSIONS_CURRENT = tuple(CURRENT_VERSION[cls.event_type] for cls in DECODE_CHAIN) == STEP_VERSIONS


def _invalid(op: Operation, msg: str) -> KvLedgerError:
    return KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"operation {op.operation_id}: {msg}")


def validate(op: Operation) -> None:
    if not op.writes:
        raise _invalid(op, "writes nothing")
    seen: set[str] = set()
    for w in op.writes:
        handle = w.handle_id
        if handle in seen:
            raise _invalid(op, f"writes {handle} twice")
        seen.add(handle)
        position = w.expected.stream_position if w.expected else 0
        if op.step is not None:  # the decode lane's values: three events at its versions
            x = op.step
            if len(op.writes) != 1 or w.events or not _STEP_VERSIONS_CURRENT:
                raise _invalid(op, "a decode step's values are its one write's events")
            if x.stream_id != handle or x.stream_position != position + 1:
                raise _invalid(op, f"its decode step is not at {handle}:{position + 1}")
            if x.global_position != 0:
                raise _invalid(op, "global_position is assigned by the journal")
            if w.head.stream_position != position + 3:
                raise _invalid(op, f"head of {handle} does not end at its last event")
            continue
        if not w.events:
            raise _invalid(op, f"write to {handle} has no events")
        for ev in w.events:
            position += 1
            if ev.stream_id != handle or ev.stream_position != position:
                raise _invalid(op, f"event {ev.event_id} is not at {handle}:{position}")
            if ev.global_position != 0:
                raise _invalid(op, "global_position is assigned by the journal")
            if ev.schema_version != CURRENT_VERSION[ev.event_type]:
                raise _invalid(op, f"{ev.event_type} must be written at schema_version "
                          f"{CURRENT_VERSION[ev.event_type]}")
        if w.head.stream_position != position:
            raise _invalid(op, f"head of {handle} does not end at its last event")


def stored_receipt(op: Operation, fingerprint: str, body: bytes) -> Receipt | Rejection:
    """A retry's answer: the receipt stored under its operation id, or CONFLICT when the
    retry's fingerprint differs from the committed operation's."""
    if fingerprint != op.fingerprint:
        return conflict(op)
    return receipt_decoder.decode(body)


def conflict(op: Operation) -> Rejection:
    return Rejection(
        operation_id=op.operation_id,
        code=ErrorCode.CONFLICT.value,
        handle_id=op.writes[0].handle_id,
        message=f"operation {op.operation_id} was committed with another fingerprint",
    )
