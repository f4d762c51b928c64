"""A decided decode batch as the engine hands it to the journal: one value, as columns.

The command service decides a batch of decode steps (engine.decide_batch) and gives the
plain steps on handles the batch touches first as one `DecodeRun`: n steps on n
distinct existing handles, decided at one clock reading, their ids one contiguous
block. Step i is the operation f"{prefix}{first_counter + 4 * i:016x}", whose three
events (publish, emit, start) have the three counters after it, as engine.batch_plan
draws a single step's; its events start at local sequence `local_sequence + 3 * i` and
at the stream position after its guard's. Everything else a step's three events and
receipt hold is in its columns or follows from them (journal.step_values.DecodeStep).

A backend may write a run as it is, one block of columns (journal.run_writer); the
port's default appends `operations()`, the same steps as Operations, which is also the
general path a backend falls back to when a run's conditions do not hold (a guard
failed, an id is stored already). tests/test_decode_run.py holds the two to the same
journal and the same answers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec

from kvledger.journal.contract import Guard, HeadFacts, HeadMoves, Operation, Rejection, StreamWrite
from kvledger.journal.step_values import DecodeStep
from kvledger.schemas.decode_fingerprint import chain_fingerprint
from kvledger.schemas.events import ForwardCall
from kvledger.schemas.positional import Positional, Then
from kvledger.schemas.receipts import HandleResult, Receipt

GAPS = (1, 1, 1)  # an operation's three event ids follow its own
ACTIVE = "ACTIVE"  # the lifecycle a plain step finds and leaves


class DecodeRun(msgspec.Struct, frozen=True, gc=False):
    source_instance: str
    monotonic_ns: int
    observed_wall_time: int
    prefix: str  # of the run's operation and event ids
    first_counter: int  # the first step's operation id's counter
    local_sequence: int  # the first step's first event's
    handle_ids: tuple[str, ...]
    request_ids: tuple[str, ...]
    cache_abis: tuple[str, ...]
    # the head each step was decided on (its guard); it leaves the snapshot after it and
    # the stream three events on, its committed length `committed`, ACTIVE (a plain step's)
    generations: tuple[int, ...]
    snapshots: tuple[int, ...]
    positions: tuple[int, ...]
    prefix_identities: tuple[str, ...]  # the head row's
    publish_txns: tuple[str, ...]
    start_txns: tuple[str, ...]
    committed: tuple[int, ...]  # the committed length after the publication: where the start's row goes
    accepted: tuple[int, ...]
    layers: tuple[int, ...]
    workspace: tuple[int, ...]
    rows_sha256: tuple[str | None, ...]
    outputs: tuple[int, ...]  # the output index emitted
    tokens: tuple[int, ...]
    calls: tuple[ForwardCall | None, ...]

    def __len__(self) -> int:
        return len(self.handle_ids)

    def operation_id(self, i: int) -> str:
        return f"{self.prefix}{self.first_counter + 4 * i:016x}"

    def first_event_id(self, i: int) -> str:
        return f"{self.prefix}{self.first_counter + 4 * i + 1:016x}"

    def operation_ids(self) -> list[str]:
        return [self.operation_id(i) for i in range(len(self))]

    def step(self, i: int) -> DecodeStep:
        return DecodeStep(
            0, self.handle_ids[i], self.request_ids[i], self.generations[i], self.source_instance,
            self.cache_abis[i], self.positions[i] + 1, self.local_sequence + 3 * i, self.monotonic_ns,
            self.observed_wall_time, self.prefix, self.first_counter + 4 * i, GAPS, self.publish_txns[i],
            self.start_txns[i], self.snapshots[i], self.committed[i], self.accepted[i], self.layers[i],
            self.workspace[i], self.rows_sha256[i], self.outputs[i], self.tokens[i], self.calls[i])

    def event_ids(self, i: int) -> tuple[str, str, str]:
        n = self.first_counter + 4 * i
        return f"{self.prefix}{n + 1:016x}", f"{self.prefix}{n + 2:016x}", f"{self.prefix}{n + 3:016x}"

    def guard(self, i: int) -> Guard:
        return Guard(self.generations[i], self.snapshots[i], self.positions[i])

    def head(self, i: int) -> HeadFacts:
        """The head step i leaves."""
        return HeadFacts(self.request_ids[i], self.generations[i], self.snapshots[i] + 1, self.positions[i] + 3,
                         self.committed[i], ACTIVE, self.prefix_identities[i], self.cache_abis[i])

    def moves(self) -> HeadMoves:
        """Every step's guarded head update, as columns."""
        n = len(self)
        return HeadMoves(self.handle_ids, self.generations, self.snapshots, self.positions, self.generations,
                         [v + 1 for v in self.snapshots], [p + 3 for p in self.positions], self.committed,
                         (ACTIVE,) * n)

    def operation(self, i: int) -> Operation:
        """Step i as the Operation a single planned step is (engine.batch_plan)."""
        return Operation(self.operation_id(i), self.fingerprint(i),
                         (StreamWrite(self.handle_ids[i], self.guard(i), self.head(i), ()),),
                         derived=True, stamped=True, step=self.step(i))

    def operations(self) -> list[Operation]:
        return [self.operation(i) for i in range(len(self))]

    def fingerprint(self, i: int) -> str:
        """Step i's fingerprint: its chain command's, from the values its events hold."""
        return chain_fingerprint(self.handle_ids[i], self.generations[i], self.snapshots[i], self.rows_sha256[i],
                                 self.publish_txns[i], self.workspace[i], self.outputs[i], self.tokens[i],
                                 self.cache_abis[i], self.committed[i], self.calls[i], self.start_txns[i])


class RunReceipts(Positional[Receipt]):
    """The receipts of a run written whole, its events from global position `first` on
    (three a step), committed at `now`. Each is built when read: a step's fingerprint
    is a SHA-256 that only a retry, a hook or an acknowledgement log reads, and a run
    is most of a decoding service's commits."""

    __slots__ = ("run", "first", "now", "_built")

    def __init__(self, run: DecodeRun, first: int, now: int) -> None:
        self.run, self.first, self.now = run, first, now
        self._built: list[Receipt | None] = [None] * len(run)  # a hook and a reader may both ask

    def __len__(self) -> int:
        return len(self.run)

    def _at(self, i: int) -> Receipt:
        built = self._built[i]
        if built is None:
            run, first, x = self.run, self.first + 3 * i, self.run.head(i)
            built = self._built[i] = Receipt(
                run.operation_id(i), run.fingerprint(i),
                (HandleResult(run.handle_ids[i], x.generation, x.snapshot_version, x.stream_position,
                              x.committed_length),),
                run.event_ids(i), first, first + 2, self.now)
        return built

    def __iter__(self) -> Iterator[Receipt]:
        return map(self._at, range(len(self.run)))

    def event_ids(self) -> list[str]:
        """Every event id of the run, in order (what reading each receipt's would give)."""
        return [e for i in range(len(self.run)) for e in self.run.event_ids(i)]


class RunThen(Then[Receipt | Rejection]):
    """The answer to a run written whole followed by other operations in its commit: the
    run's receipts (built when read), then the others' results, positional over both."""

    __slots__ = ()
    run: RunReceipts

    def __init__(self, run: RunReceipts, rest: Sequence[Receipt | Rejection]) -> None:
        super().__init__(run, rest)
