"""The values a journal takes and gives, independent of any backend (journal.port says
what a backend does with them).

One operation = the events of one or more streams (handles) that commit together or
not at all. `append` takes many operations and commits them in one transaction
(group commit); each operation's guards are checked on their own, so a stale one is
rejected while the others commit. The guarded head update is the linearization point.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from kvledger.journal.step_values import DecodeStep
from kvledger.schemas.events import Event
from kvledger.schemas.receipts import Receipt


# gc=False on the write path's structs: see kvledger.engine.commands._Command.
class Guard(msgspec.Struct, frozen=True, gc=False):
    """The head a write was decided against. Stream position is part of it because
    events that do not advance the snapshot (output_emit, finish, append_start) still
    change what is legal next."""

    generation: int
    snapshot_version: int
    stream_position: int


class HeadFacts(msgspec.Struct, frozen=True, gc=False):
    """The indexed facts of a handle's head row, written with its newest event."""

    request_id: str
    generation: int
    snapshot_version: int
    stream_position: int
    committed_length: int
    lifecycle: str  # ACTIVE, FINISHED, CANCELLED or RELEASED
    prefix_identity_sha256: str
    cache_abi_sha256: str


def guard_of(facts: HeadFacts) -> Guard:
    """The guard a write decided against this head names."""
    return Guard(facts.generation, facts.snapshot_version, facts.stream_position)


class StreamWrite(msgspec.Struct, frozen=True, gc=False):
    handle_id: str
    expected: Guard | None  # None: the stream must not exist yet
    head: HeadFacts
    events: tuple[Event, ...]


class HeadMoves(NamedTuple):
    """Guarded head updates as columns: row i moves handle_ids[i] from the head it expects
    (generation, snapshot, position) to the new one, if that is the head it finds. What a
    backend's guarded update binds; a decode run gives its own without a struct a step."""

    handle_ids: Sequence[str]
    generations: Sequence[int]
    snapshots: Sequence[int]
    positions: Sequence[int]
    new_generations: Sequence[int]
    new_snapshots: Sequence[int]
    new_positions: Sequence[int]
    committed: Sequence[int]
    lifecycles: Sequence[str]


def head_moves(rows: Sequence[tuple[StreamWrite, Guard]]) -> HeadMoves:
    """The columns of guarded writes given as (write, the guard it expects) pairs."""
    if not rows:
        return HeadMoves((), (), (), (), (), (), (), (), ())
    return HeadMoves(*zip(*[(w.handle_id, g.generation, g.snapshot_version, g.stream_position, w.head.generation,
                             w.head.snapshot_version, w.head.stream_position, w.head.committed_length,
                             w.head.lifecycle) for w, g in rows]))


class Check(msgspec.Struct, frozen=True, gc=False):
    """A guard with no write: a fork reads its parent's snapshot without mutating it."""

    handle_id: str
    expected: Guard


class Operation(msgspec.Struct, frozen=True, gc=False):
    operation_id: str
    fingerprint: str
    writes: tuple[StreamWrite, ...]
    checks: tuple[Check, ...] = ()
    manifests: tuple[tuple[str, bytes], ...] = ()  # (manifest_sha256, canonical JSON)
    # The fingerprint is schemas.decode_fingerprint's of the operation's three events (a
    # decode chain's own form): a record marks it derived instead of storing it.
    derived: bool = False
    # The events are a decode step as the service plans a decided batch's step
    # (engine.batch_plan): their positions, sequence numbers, clocks and versions follow
    # from one another by construction, so a record stores them as a step row without
    # checking those relations again (journal.steps). In-process code only: nothing that
    # reads outside input builds an Operation.
    stamped: bool = False
    # The service's plan of a batch step gives a stamped, derived decode step as its facts
    # (DecodeStep, in the events' own form) instead of three event structs: the one write's
    # `events` is then empty, and `step.events()` builds them for whoever needs them; the
    # journal derives the row a record stores of it, or stores those events.
    step: DecodeStep | None = None

    def event_ids(self) -> list[str]:
        """The ids of the events the operation writes, in order."""
        if self.step is not None:
            return self.step.event_ids()
        return [e.event_id for w in self.writes for e in w.events]

    def event_count(self) -> int:
        return 3 if self.step is not None else sum(len(w.events) for w in self.writes)

    def write_events(self, w: StreamWrite) -> tuple[Event, ...]:
        """The events of one of its writes, built from `step` if it has one."""
        return self.step.events() if self.step is not None else w.events


class Rejection(msgspec.Struct, frozen=True, gc=False):
    operation_id: str
    code: str  # STALE_BASE, HANDLE_EXISTS or CONFLICT
    handle_id: str | None
    message: str


class StoredEvent(msgspec.Struct, frozen=True):
    """One row of the events table exactly as the database returned it. The columns are
    typed Any because a damaged or edited row can hold anything (SQLite keeps a TEXT body
    or a text position as given); verify compares each column with the body."""

    global_position: Any
    event_id: Any
    stream_id: Any
    stream_position: Any
    event_type: Any
    schema_version: Any
    operation_id: Any
    body: Any


class StoredDamage(msgspec.Struct, frozen=True):
    """A stored record (one commit, since revision 0003) whose bytes are not what was
    committed: `global_position` names the first event it concerns (None: the record's
    position itself is wrong). `replaces`: the event at that position could not be read
    and stands here in its place."""

    global_position: int | None
    message: str
    replaces: bool = False


class ChainAt(msgspec.Struct, frozen=True):
    """Where a journal ends and its record chain at one position (an anchor's, or its
    end): `chain` is the chain digest after the commit ending at `position` (the genesis
    digest before any record), None where no commit of this journal ends there; `named`
    is the furthest record a head row names (None: none), past `last_position` only when
    records were deleted."""

    last_position: int
    position: int
    chain: bytes | None
    named: int | None = None


class StoredReceipt(msgspec.Struct, frozen=True):
    """One row of the receipts table as stored (see StoredEvent)."""

    operation_id: Any
    fingerprint: Any
    first_global_position: Any
    last_global_position: Any
    body: Any


class Integrity(msgspec.Struct, frozen=True):
    """What the database says about its own storage: `checked` names the check that ran
    (empty when none could), `problems` what it found, `skipped` why it did not run."""

    checked: str
    problems: tuple[str, ...] = ()
    skipped: str | None = None


class ImportTables(msgspec.Struct, frozen=True):
    """What the database keeps beside imported events, derived from them."""

    heads: Mapping[str, HeadFacts]
    receipts: Sequence[Receipt]
    manifests: Sequence[tuple[str, bytes]] = ()
