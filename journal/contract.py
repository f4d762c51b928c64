"""The journal contract: what every backend must do, independent of SQL.

One operation = the events of one or more streams (handles) that commit together or
not at all. `append` takes many operations and commits them in one transaction
(group commit); each operation's guards are checked on their own, so a stale one is
rejected while the others commit. The guarded head update is the linearization point.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

import msgspec

from kvledger.schemas.events import Event
from kvledger.schemas.receipts import Receipt

if TYPE_CHECKING:
    from kvledger.journal.steps import FoldItem, StepValues  # it imports this module


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
    # The events are a decode step as the service's decode lane stamps them
    # (engine.decode_step): their positions, sequence numbers, clocks and versions follow
    # from one another by construction, so a record stores them as a step row without
    # checking those relations again (journal.steps). In-process code only: nothing that
    # reads outside input builds an Operation.
    stamped: bool = False
    # The service's decode lane gives a stamped, derived decode step as its values (what a
    # record stores of it) instead of three event structs: the one write's `events` is
    # then empty, and `step.events()` builds them for whoever needs them.
    step: StepValues | None = None

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


class Snapshot(abc.ABC):
    """Every read of one audit, in one database snapshot: a writer committing meanwhile
    is either wholly visible or not at all, so events, receipts and heads agree."""

    @abc.abstractmethod
    def events(self) -> Iterator[StoredEvent | StoredDamage]:
        """Event rows in global_position order, fetched in pages; what a stored record's
        audit finds wrong (its chain, CRCs, positions, lookup rows) where it finds it."""

    @abc.abstractmethod
    def receipts(self) -> Iterator[StoredReceipt]: ...

    @abc.abstractmethod
    def heads(self) -> dict[str, HeadFacts]: ...

    @abc.abstractmethod
    def manifest(self, manifest_sha256: str) -> Any:
        """The stored manifest body (bytes unless damaged), or None."""

    @abc.abstractmethod
    def integrity(self) -> Integrity:
        """The database's own storage check (SQLite quick_check, PostgreSQL amcheck)."""

    @abc.abstractmethod
    def chain_at(self, position: int | None = None) -> ChainAt:
        """The record chain at `position` (None: at the journal's end): what an anchor
        (`kvledger head`) records and `verify --expect` compares."""


class Journal(abc.ABC):
    """Abstract recorder. Implementations: journal.sql.SqlJournal (SQLite, PostgreSQL)."""

    display_url: str  # the journal's location for messages, password redacted

    @abc.abstractmethod
    def append(self, operations: Sequence[Operation]) -> list[Receipt | Rejection]:
        """Commit every operation whose guards hold, in one transaction, in order.
        Results are positional. Nothing is acknowledged before the commit returns."""

    def append_deferred(self, operations: Sequence[Operation]) -> Callable[[], list[Receipt | Rejection]]:
        """`append` in two halves: the transaction's statements run now, and the returned
        function waits until the commit is durable and returns append's results. In
        between the caller may compute (a worker runs its next model call while the fsync
        happens), but must call it, from the same thread, before using this journal again.
        Nothing is acknowledged before it returns. This default commits at once."""
        results = self.append(operations)
        return lambda: results

    @abc.abstractmethod
    def read_stream(self, handle_id: str, after: int = 0) -> list[Event]:
        """Events of one handle with stream_position > after, in order."""

    @abc.abstractmethod
    def read_all(self, after: int = 0, limit: int | None = None) -> Iterator[Event]:
        """Events with global_position > after, in global order."""

    def read_fold(self, after: int = 0) -> Iterator[FoldItem]:
        """read_all for a projector: a backend that stores decode steps as rows (record
        format 6) may give such a step as its StepValues in place of its three events,
        or consecutive steps of a record as one StepRun."""
        return self.read_all(after)

    @abc.abstractmethod
    def read_raw(self, after: int = 0, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
        """(global_position, stored bytes), exactly as written: for export and audit."""

    @abc.abstractmethod
    def head(self, handle_id: str) -> HeadFacts | None: ...

    @abc.abstractmethod
    def heads(self, *, prefix_identity_sha256: str | None = None) -> dict[str, HeadFacts]: ...

    def existing(self, handle_ids: Sequence[str]) -> set[str]:
        """Which of `handle_ids` have a stream (every stream has a head). A backend may
        answer in one read; the command service asks before it allocates handles it has
        not seen, rather than reading each one's stream."""
        return {h for h in handle_ids if self.head(h) is not None}

    @abc.abstractmethod
    def receipt(self, operation_id: str) -> Receipt | None: ...

    @abc.abstractmethod
    def last_position(self) -> int: ...

    @abc.abstractmethod
    def manifest(self, manifest_sha256: str) -> bytes | None: ...

    @abc.abstractmethod
    def save_checkpoint(self, name: str, position: int, state: bytes) -> None: ...

    @abc.abstractmethod
    def load_checkpoint(self, name: str) -> tuple[int, bytes] | None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- audit copies (replay/import, verify) --------------------------------------

    @abc.abstractmethod
    def import_events(self, events: Iterable[tuple[Event, bytes]],
                      tables: Callable[[], ImportTables]) -> None:
        """Load an exported journal into this empty one in one transaction: each stored
        body verbatim at its envelope's global position, then the head rows, receipts
        and manifests `tables()` derived from those events once they are all read.
        `events` is consumed inside the transaction (a stream need not fit in memory);
        whatever it raises rolls everything back. A journal that already has events,
        heads or receipts is refused (INVALID_ARGUMENT) before `events` is touched."""

    @abc.abstractmethod
    def snapshot(self) -> contextlib.AbstractContextManager[Snapshot]:
        """One read-only snapshot of the whole journal, for verify."""

    @abc.abstractmethod
    def read_receipts(self) -> Iterator[Receipt]:
        """Every stored receipt, in order of first global position."""
