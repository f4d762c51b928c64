"""The command port: what a worker, telemetry and recovery use of a command service.

Implemented by kvledger.engine.service.CommandService (this process),
kvledger.engine.remote.RemoteService (a writer process) and the crash test's acking
wrapper (kvledger.recovery.crash_children); mypy checks each against it where it is defined.
Attributes are read-only here so that an implementation may hold a narrower type (a
dict of states) or delegate (the acking wrapper's properties).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, Self, runtime_checkable

from kvledger.engine import commands as c
from kvledger.engine.state import HandleState
from kvledger.journal.port import Journal
from kvledger.schemas import events as ev
from kvledger.schemas.decode_batch import DecodeBatch
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.positional import Then
from kvledger.schemas.receipts import Receipt


class Results(Then[Receipt | KvLedgerError]):
    """A batch's results, positional: the receipts of a decode run the journal wrote whole
    (journal.port.RunReceipts, each built when read), for the batch's first steps, then
    one result for each other step and command. `refused()` finds the refusals without
    building a receipt: a decoding worker asks only that of most of its commits."""

    __slots__ = ()
    run: Sequence[Receipt]

    def __init__(self, rest: Sequence[Receipt | KvLedgerError], run: Sequence[Receipt] = ()) -> None:
        super().__init__(run, rest)

    def parts(self) -> tuple[Sequence[Receipt], Sequence[Receipt | KvLedgerError]]:
        """The run's receipts and the results after them, as given."""
        return self.run, self.rest

    def refused(self) -> list[tuple[int, KvLedgerError]]:
        """(index, error) of every refused step or command, in order."""
        k = len(self.run)
        return [(k + j, r) for j, r in enumerate(self.rest) if isinstance(r, KvLedgerError)]


# Called for each commit with its receipt and the events it wrote, after it is durable.
CommitHook = Callable[[Receipt, list[ev.Event]], None]
# Called for each command this call refused (nothing written), after its outcome is final.
RejectHook = Callable[[c.Command | c.Relative, KvLedgerError], None]


class Clock(Protocol):
    """The clocks events are stamped with (tests substitute a manual one)."""

    def monotonic_ns(self) -> int: ...

    def wall_ns(self) -> int: ...


@runtime_checkable
class CommandPort(Protocol):
    @property
    def journal(self) -> Journal:
        """The journal this service writes to, readable from this process."""
        ...

    @property
    def source_instance(self) -> str: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def states(self) -> Mapping[str, HandleState]:
        """The handle states this process decided (empty when a writer process decides)."""
        ...

    @property
    def on_commit(self) -> list[CommitHook]: ...

    @property
    def on_reject(self) -> list[RejectHook]: ...

    def state(self, handle_id: str, *, refresh: bool = False) -> HandleState | None: ...

    def submit_many(self, cmds: Sequence[c.Command | c.Relative], *,
                    defer: bool = True) -> Callable[[], Results]: ...

    def submit_batch(self, steps: DecodeBatch, cmds: Sequence[c.Command | c.Relative], *,
                     defer: bool = True) -> Callable[[], Results]:
        """submit_many of a decode batch's steps followed by `cmds`, one commit; results
        positional over both. No command may act on a step's handle."""
        ...

    def execute(self, cmd: c.Command | c.Relative) -> Receipt: ...

    def execute_many(self, cmds: Sequence[c.Command | c.Relative]) -> Results: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...
