"""What the SQL journal decides of a batch before and around its statements: each
operation checked (`validate`), operations grouped into chains and rounds on disjoint
handles, the phantom heads a refused operation leaves, and a retry's answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

from kvledger.journal.contract import Guard, HeadFacts, Operation, Rejection, StreamWrite, guard_of
from kvledger.journal.keys import counted_keys, id_keys, id_runs
from kvledger.journal.record_rows import Known
from kvledger.journal.step_values import VERSIONS as STEP_VERSIONS
from kvledger.schemas.decode_fingerprint import DECODE_CHAIN
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import CURRENT_VERSION, Event
from kvledger.schemas.ids import MAX_ID, id_problem
from kvledger.schemas.receipts import Receipt, receipt_decoder


class GuardStatements(Protocol):
    """What a batch's rounds run its guards on (`cur`: the transaction's cursor): SQL
    statements (journal.statements), or heads held in memory (journal.nats_heads.HeadView).
    Each returns the handles whose guard held and changes only those."""

    def guarded_update(self, cur: Any, rows: list[tuple[StreamWrite, Guard]],
                       last_record: int | None = None) -> set[str]: ...

    def create_heads(self, cur: Any, writes: list[StreamWrite], last_record: int | None = None) -> set[str]: ...

    def check_heads(self, cur: Any, rows: list[tuple[str, Guard]]) -> set[str]: ...

    def savepoint(self, cur: Any) -> None: ...

    def rollback_to_savepoint(self, cur: Any) -> None: ...

    def release_savepoint(self, cur: Any) -> None: ...


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
    guarded update instead of one per operation is what makes them cheap. A chain may
    start with the handle's creation (an arrival: its allocation and first append), one
    insert of the head the chain leaves."""
    units: list[list[int]] = []
    tail: dict[str, tuple[list[int], HeadFacts]] = {}  # handle -> (open chain, head it leaves)
    for i in indexes:
        op = ops[i]
        if len(op.writes) == 1 and not op.checks:
            w = op.writes[0]
            chain = tail.get(w.handle_id)
            if chain is not None and w.expected is not None and guard_of(chain[1]) == w.expected:
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


class RoundGuards(NamedTuple):
    """What the set-based statements of a round check: guarded updates, creates, checks."""

    updates: list[tuple[StreamWrite, Guard]]
    creates: list[StreamWrite]
    checks: list[tuple[str, Guard]]
    spans: bool  # an operation touches several handles: a refusal may need a savepoint's undo


def round_guards(ops: Sequence[Operation], units: list[list[int]]) -> RoundGuards:
    """The guards of `units`, gathered once for the round's statements (and again for
    the units left after a rollback): a chain is one update from its first base to its
    last head."""
    spans = False
    updates: list[tuple[StreamWrite, Guard]] = []
    creates: list[StreamWrite] = []
    checks: list[tuple[str, Guard]] = []
    for unit in units:
        op = ops[unit[0]]
        if len(unit) > 1:  # a chain: first base (or none: a create), last head
            first, last = op.writes[0], ops[unit[-1]].writes[0]
            whole = StreamWrite(first.handle_id, first.expected, last.head, ())
            if first.expected is None:
                creates.append(whole)
            else:
                updates.append((whole, first.expected))
            continue
        spans = spans or len(op.writes) + len(op.checks) > 1
        for w in op.writes:
            if w.expected is None:
                creates.append(w)
            else:
                updates.append((w, w.expected))
        checks.extend((c.handle_id, c.expected) for c in op.checks)
    return RoundGuards(updates, creates, checks, spans)


def refusal(op: Operation, ok: set[str], checked: set[str]) -> Rejection | None:
    """Why `op` is refused once its round's statements ran (`ok`: the handles whose
    update or create held, `checked`: whose check held): its first failed write, else
    its first failed check; None when every guard of it held. Named apart so the round's
    retry loop reads as the retry alone."""
    failed = [w for w in op.writes if w.handle_id not in ok]
    if failed:
        w = failed[0]
        code = ErrorCode.STALE_BASE if w.expected else ErrorCode.HANDLE_EXISTS
        handle = w.handle_id
    else:
        failed_checks = [c for c in op.checks if c.handle_id not in checked]
        if not failed_checks:
            return None
        code, handle = ErrorCode.STALE_BASE, failed_checks[0].handle_id
    return Rejection(
        operation_id=op.operation_id,
        code=code.value,
        handle_id=handle,
        message=(f"handle {handle} already exists" if code is ErrorCode.HANDLE_EXISTS
                 else f"head of {handle} moved past the expected base"),
    )


def _failed_guards(sql: GuardStatements, cur: Any, guards: RoundGuards, last_record: int | None
                   ) -> tuple[set[str], set[str]] | None:
    """One try of a round's statements: None when every guard held (handles are distinct
    within a round), else the handles whose update or create held and those whose check did."""
    ok = sql.guarded_update(cur, guards.updates, last_record)
    if guards.creates:
        ok |= sql.create_heads(cur, guards.creates, last_record)
    checked = sql.check_heads(cur, guards.checks) if guards.checks else set()
    if len(ok) == len(guards.updates) + len(guards.creates) and len(checked) == len(guards.checks):
        return None
    return ok, checked


def _refused_units(ops: Sequence[Operation], live: list[list[int]], ok: set[str], checked: set[str]
                   ) -> tuple[dict[int, Rejection], bool]:
    """The operations of `live` a failed try refuses (a chain's rest after its first,
    STALE_BASE: only guarded writes chain), and whether one of them changed some of its
    rows, which the round must then undo and retry without them."""
    rejected: dict[int, Rejection] = {}
    partial = False
    for unit in live:
        op = ops[unit[0]]
        refused = refusal(op, ok, checked)
        if refused is None:
            continue
        partial = partial or any(w.handle_id in ok for w in op.writes)
        rejected[unit[0]] = refused
        handle = refused.handle_id
        assert handle is not None  # refusal names the handle whose guard failed
        rejected.update((i, refused_after(ops[i], handle)) for i in unit[1:])
    return rejected, partial


def batch_ids(ops: Sequence[Operation]) -> tuple[list[str], list[str], Known]:
    """The batch's distinct operation ids, its event ids, and their keys, computed once
    for the receipt lookup and the record: a decode step's from its counters, not its
    text (this runs once a batch, not once an event)."""
    op_ids = list({op.operation_id: None for op in ops})
    event_ids: list[str] = []
    keys: dict[str, int] = {}
    owned = [op.event_ids() for op in ops]  # each operation's ids, for the record's rows too
    for op, own in zip(ops, owned):
        event_ids += own
        if (x := op.step) is not None:
            keys.update(zip((op.operation_id, *own), counted_keys(x.prefix, x.counters())))
    rest = [i for i in op_ids + event_ids if i not in keys] if keys else op_ids + event_ids
    keys.update(zip(rest, id_keys(rest)))
    return op_ids, event_ids, Known(keys, owned, id_runs(keys.values()))  # runs: the lookup's and the record's


def answer_stored(ops: Sequence[Operation], stored: dict[str, tuple[str, bytes]],
                  results: list[Receipt | Rejection | None], phantoms: dict[str, Guard]
                  ) -> tuple[dict[str, int], list[int]]:
    """Fill `results` for the operations whose receipt is stored (a retry; a changed one
    is CONFLICT and leaves phantoms); return each other id's first index in the batch and
    those indexes, the operations to apply. A repeat inside the batch is resolved
    against its first after the rounds (resolve_repeats)."""
    first_in_batch: dict[str, int] = {}
    pending: list[int] = []
    for i, op in enumerate(ops):
        op_id = op.operation_id
        if op_id in stored:
            fingerprint, body = stored[op_id]
            results[i] = stored_receipt(op, fingerprint, body)
            if isinstance(results[i], Rejection):
                leaves_phantoms(op, phantoms)
        elif op_id not in first_in_batch:
            first_in_batch[op_id] = i
            pending.append(i)
    return first_in_batch, pending


def _phantom_refusals(ops: Sequence[Operation], round_: list[list[int]], phantoms: dict[str, Guard]
                      ) -> tuple[list[list[int]], dict[int, Rejection]]:
    """The units of a round to apply, and the operations refused unapplied because their
    base is a head a refused operation would have left (see phantom_base)."""
    if not phantoms:
        return round_, {}
    live: list[list[int]] = []
    rejected: dict[int, Rejection] = {}
    for unit in round_:
        if (handle := phantom_base(ops[unit[0]], phantoms)) is None:
            live.append(unit)
        else:
            rejected.update((i, refused_after(ops[i], handle)) for i in unit)
    return live, rejected


def apply_rounds(sql: GuardStatements, cur: Any, ops: Sequence[Operation], pending: list[int],
                 results: list[Receipt | Rejection | None], phantoms: dict[str, Guard], predicted: int) -> None:
    """The guarded updates of the `pending` operations, round by round on disjoint
    handles (`predicted`: the record's last position if none is refused); each refusal
    goes into `results` and leaves its phantoms for the rounds after it."""
    for round_ in rounds(ops, chains(ops, pending)):
        live, rejected = _phantom_refusals(ops, round_, phantoms)
        if live:
            rejected.update(apply_round(sql, cur, ops, live, predicted))
        for i, rejection in rejected.items():
            results[i] = rejection
            leaves_phantoms(ops[i], phantoms)


def resolve_repeats(ops: Sequence[Operation], results: list[Receipt | Rejection | None],
                    first_in_batch: dict[str, int]) -> None:
    """A repeat of an operation id inside one batch is a retry of the first: its receipt,
    or CONFLICT when the fingerprints differ (or the first was refused)."""
    for i, op in enumerate(ops):
        if results[i] is None:
            original = results[first_in_batch[op.operation_id]]
            results[i] = (
                original
                if isinstance(original, Receipt) and original.fingerprint == op.fingerprint
                else conflict(op)
            )


def apply_round(sql: GuardStatements, cur: Any, ops: Sequence[Operation], units: list[list[int]],
                last_record: int | None = None) -> dict[int, Rejection]:
    """Apply the guards of the units of one round (disjoint handles). A unit is one
    operation, or a chain of single-handle operations each starting from the head the
    previous one leaves: one guarded update from the chain's first base to its last
    head decides all of them. Returns the rejected operations; a rejected one leaves
    no row changed."""
    guards = round_guards(ops, units)
    spans = guards.spans  # a retry's units are a subset: they span no more
    if spans:
        sql.savepoint(cur)
    rejected: dict[int, Rejection] = {}
    live = units
    while (failed := _failed_guards(sql, cur, guards, last_record)) is not None:
        refused, partial = _refused_units(ops, live, *failed)
        rejected.update(refused)
        if not partial:
            break
        sql.rollback_to_savepoint(cur)  # some rows of a refused operation changed: undo the round
        live = [u for u in live if u[0] not in rejected]
        guards = round_guards(ops, live)
    if spans:
        sql.release_savepoint(cur)
    return rejected


# Operation.step rebuilds its events at steps.VERSIONS: the current versions, or no step.
_STEP_VERSIONS_CURRENT = tuple(CURRENT_VERSION[cls.event_type] for cls in DECODE_CHAIN) == STEP_VERSIONS


def _invalid(op: Operation, msg: str) -> KvLedgerError:
    return KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"operation {op.operation_id[:64]}: {msg}")


def _bad_id(op: Operation, what: str, value: str, problem: str) -> KvLedgerError:
    """INVALID_ARGUMENT, or FIELD_TOO_LARGE for an id over its length (the reader's code,
    and PostgreSQL's for its column)."""
    code = ErrorCode.FIELD_TOO_LARGE if len(value) > MAX_ID else ErrorCode.INVALID_ARGUMENT
    return KvLedgerError(code, f"operation {op.operation_id[:64]}: {what} {value[:64]!r} {problem}")


def validate(op: Operation) -> None:
    if not op.writes:
        raise _invalid(op, "writes nothing")
    _check_ids(op)
    seen: set[str] = set()
    for w in op.writes:
        handle = w.handle_id
        if handle in seen:
            raise _invalid(op, f"writes {handle} twice")
        seen.add(handle)
        position = w.expected.stream_position if w.expected else 0
        if op.step is not None:  # a planned step's values: three events at its versions
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


def _check_ids(op: Operation) -> None:
    """Refuse an id the reader would refuse (or PostgreSQL's columns would): acknowledged,
    it would fail every later read of the journal, on any backend."""
    if (problem := id_problem(op.operation_id)) is not None:
        raise _bad_id(op, "its operation id", op.operation_id, problem)
    for check in op.checks:
        if (problem := id_problem(check.handle_id)) is not None:
            raise _bad_id(op, "the handle id it checks", check.handle_id, problem)
    for w in op.writes:
        if (problem := id_problem(w.handle_id)) is not None:
            raise _bad_id(op, "handle id", w.handle_id, problem)
        if (problem := id_problem(w.head.request_id)) is not None:
            raise _bad_id(op, "its head's request id", w.head.request_id, problem)
        for ev in w.events:
            if (id_problem(ev.event_id) or id_problem(ev.request_id) or id_problem(ev.source_instance)
                    or (ev.operation_id is not None and id_problem(ev.operation_id))):
                raise _envelope_problem(op, ev)


def _envelope_problem(op: Operation, ev: Event) -> KvLedgerError:
    for name in ("event_id", "request_id", "source_instance", "operation_id"):
        value = getattr(ev, name)
        if value is not None and (problem := id_problem(value)) is not None:
            return _bad_id(op, f"event {ev.event_id[:64]!r}: its {name}", value, problem)
    raise AssertionError("called for an event with a bad id")


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
