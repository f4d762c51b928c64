"""The journal's port: what a storage backend must do, and all the engine and replay see of one.

The recorders are split by who needs them, as eventsourcing splits its recorder ABCs
(AggregateRecorder, ApplicationRecorder, TrackingRecorder, ProcessRecorder):

- `StreamRecorder`, the engine's side: the conditional append of operations with their
  expected heads, the stream of one handle, heads and receipts.
- `LogReader`, replay's side: the events in global order (as events, as what a
  projector folds, as the bytes stored), the last position.
- `CheckpointRecorder`: a projection's named checkpoint.
- `AuditRecorder`, verify's and import's side: one consistent snapshot of everything
  stored, the receipts in order, and loading an exported journal into an empty one.
- `Journal`: all four, the one type a backend implements and callers hold.

What an append promises, on every backend:

- One call, one transaction. `append(operations)` commits every operation whose guards
  hold, in order, and nothing of an operation whose guard fails; the results are
  positional (a Receipt or a Rejection per operation). Nothing is acknowledged before
  the commit is durable.
- The guarded head update is the linearization point: a write names the head it was
  decided against (`Guard`: generation, snapshot version, stream position; None: the
  stream must not exist yet) and takes effect only if the head is still that one
  (STALE_BASE, HANDLE_EXISTS otherwise); a `Check` guards a handle it does not write.
- Global positions are gapless and in commit order; stream positions count up per
  handle. A retry with the same operation id and fingerprint returns the original
  receipt and writes nothing; the same id with another fingerprint is CONFLICT.
- Reads return whole logical events with their envelope (schemas.events), whatever the
  backend stores; `read_raw` gives the stored JSON bodies that `export` writes.
- A call that meets a restarting server, a lost session or a busy lock raises one of
  TRANSIENT, an append's outcome then unknown; the journal connects again at the next
  call, and the same operations land once (`retried` asks again for up to RETRY_S).

Implementations, and adding one. `journal.backends.BACKENDS` is the one list of
implementations (journal.sql.SqlJournal for SQLite and PostgreSQL, journal.nats.NatsJournal
for NATS JetStream); opening a journal by its URL goes through it. A new backend is:

1. one module implementing `Journal` (and `Snapshot` for its audit);
2. one entry in `journal.backends.BACKENDS` (its name, its URL schemes, its opener);
3. the contract suite passing against it: tests/conftest.py parametrizes its `backend`
   fixture over BACKENDS (tests/test_journal_contract.py, the linearizability and
   crash tests, every test that takes `db_url`), and refuses to run while a registered
   backend has no way there to make a fresh journal for a test (SCRATCH). A test that
   edits or copies SQL tables carries `sql_storage(reason)` and runs on SQL only.

The engine and replay import this module, journal.contract's data structs and the
journal package's entry points only, never how a backend lays its records out
(tests/test_layers.py holds that).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Self, TypeVar

from kvledger.journal.contract import (
    ChainAt,
    HeadFacts,
    ImportTables,
    Integrity,
    Operation,
    Rejection,
    StoredDamage,
    StoredEvent,
    StoredReceipt,
)
from kvledger.journal.decode_run import DecodeRun, RunReceipts, RunThen
from kvledger.journal.step_values import VERSIONS as STEP_VERSIONS
from kvledger.journal.step_values import DecodeStep, FoldItem, StepColumns, StepRun, StepValues
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import Event
from kvledger.schemas.receipts import Receipt

log = logging.getLogger("kvledger.journal")
T = TypeVar("T")

# What a database restart, a dropped session or a busy lock gives; asked again for up to RETRY_S.
TRANSIENT = frozenset({ErrorCode.DATABASE_UNREACHABLE, ErrorCode.DATABASE_ERROR, ErrorCode.DATABASE_BUSY})
RETRY_S = 60.0
# The errors a retried() asked again until its time was over: an outer retried() raises them at once.
_WAITED_OUT: weakref.WeakSet[KvLedgerError] = weakref.WeakSet()


def retried(call: Callable[[], T], again: Callable[[], T] | None = None, *, what: str = "a call",
            stopped: Callable[[], bool] = lambda: False, seconds: float = RETRY_S) -> T:
    """call(), and while it raises a TRANSIENT error, `again` (or call) after a pause
    (50 ms, doubling to 2 s) for up to `seconds`; the error once that is over, or at once
    when `stopped()`. An append asked again with the same operations lands once. An error
    a retried() inside `call` waited out is raised at once: layers that each retry (the
    command service over the journal's own reads) wait once between them, not once each."""
    deadline, pause = time.monotonic() + seconds, 0.05
    while True:
        try:
            return call()
        except KvLedgerError as exc:
            if exc.code not in TRANSIENT or exc in _WAITED_OUT or stopped():
                raise
            if time.monotonic() + pause > deadline:
                _WAITED_OUT.add(exc)
                raise
            log.warning("the journal did not take %s (%s); asking again in %.2f s", what, exc, pause)
            time.sleep(pause)
            pause = min(2 * pause, 2.0)
            call = again or call


class Recorder(abc.ABC):
    """What every side of a journal has: where it is, and closing it."""

    display_url: str  # the journal's location for messages, password redacted

    @abc.abstractmethod
    def reopen_url(self) -> str:
        """The URL that opens this journal again in another process (a writer process
        does), credentials included: never log or print it."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamRecorder(Recorder):
    """The write side: the conditional append, and what a writer reads to decide."""

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

    def append_run(self, run: DecodeRun, operations: Sequence[Operation], *, defer: bool = False
                   ) -> Callable[[], Sequence[Receipt | Rejection]]:
        """append (`defer`: append_deferred) of the run's steps followed by `operations`,
        in one transaction; the function that waits for the results, positional over
        both. A backend may store the run from its columns, and answer a run written
        whole with its RunReceipts (each built when read); this default appends
        `run.operations()`, whose answers a run's must equal."""
        ops = [*run.operations(), *operations]
        if defer:
            return self.append_deferred(ops)
        results = self.append(ops)
        return lambda: results

    @abc.abstractmethod
    def read_stream(self, handle_id: str, after: int = 0) -> list[Event]:
        """Events of one handle with stream_position > after, in order."""

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
    def manifest(self, manifest_sha256: str) -> bytes | None: ...


class LogReader(Recorder):
    """The read side: every event in global order."""

    @abc.abstractmethod
    def read_all(self, after: int = 0, limit: int | None = None) -> Iterator[Event]:
        """Events with global_position > after, in global order."""

    def read_fold(self, after: int = 0) -> Iterator[FoldItem]:
        """read_all for a projector: a backend that stores decode steps as values may
        give such a step as its StepValues in place of its three events, or consecutive
        steps as one StepRun (columns a fold reads at once)."""
        return self.read_all(after)

    @abc.abstractmethod
    def read_raw(self, after: int = 0, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
        """(global_position, the event's JSON body as stored): what `export` writes."""

    @abc.abstractmethod
    def last_position(self) -> int: ...


class CheckpointRecorder(Recorder):
    """A projection's progress, by name."""

    @abc.abstractmethod
    def save_checkpoint(self, name: str, position: int, state: bytes) -> None: ...

    @abc.abstractmethod
    def load_checkpoint(self, name: str) -> tuple[int, bytes] | None: ...


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


class AuditRecorder(Recorder):
    """Audit copies: verify's snapshot, export's receipts, import's load."""

    @abc.abstractmethod
    def snapshot(self) -> contextlib.AbstractContextManager[Snapshot]:
        """One read-only snapshot of the whole journal, for verify."""

    @abc.abstractmethod
    def read_receipts(self) -> Iterator[Receipt]:
        """Every stored receipt, in order of first global position."""

    @abc.abstractmethod
    def import_events(self, events: Iterable[tuple[Event, bytes]],
                      tables: Callable[[], ImportTables]) -> None:
        """Load an exported journal into this empty one in one transaction: each stored
        body verbatim at its envelope's global position, then the head rows, receipts
        and manifests `tables()` derived from those events once they are all read.
        `events` is consumed inside the transaction (a stream need not fit in memory);
        whatever it raises rolls everything back. A journal that already has events,
        heads or receipts is refused (INVALID_ARGUMENT) before `events` is touched."""


class Journal(StreamRecorder, LogReader, CheckpointRecorder, AuditRecorder):
    """The whole port: what a backend implements (journal.backends lists them)."""


__all__ = [
    "AuditRecorder",
    "CheckpointRecorder",
    "DecodeRun",
    "DecodeStep",
    "FoldItem",
    "Journal",
    "LogReader",
    "Recorder",
    "RunReceipts",
    "RETRY_S",
    "RunThen",
    "STEP_VERSIONS",
    "Snapshot",
    "StepColumns",
    "StepRun",
    "StepValues",
    "StreamRecorder",
    "TRANSIENT",
    "retried",
]
