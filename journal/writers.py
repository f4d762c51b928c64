"""Where the journal's writers run: the commit thread (SqlJournal.append_deferred), the
writer process (kvledger.engine.remote) and the telemetry exporter's thread call `place`
as they start. Which CPU that should be is the worker's decision (beside the disk's
interrupts, off the model's CPUs: kvledger.worker.placement), installed here when that
module is imported; without it, writers run wherever the OS puts them. The layers below
the worker so ask for placement without importing it."""

from __future__ import annotations

from collections.abc import Callable

_pin: Callable[[int], None] | None = None


def place(pid: int = 0) -> None:
    """Run a writer where the installed placement says: the calling thread (pid 0) or
    the process `pid`."""
    if _pin is not None:
        _pin(pid)


def install(pin: Callable[[int], None] | None) -> None:
    global _pin
    _pin = pin
