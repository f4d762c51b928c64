"""Where the journal's writers run: the commit thread (SqlJournal.append_deferred), the
writer process (kvledger.engine.remote) and the telemetry exporter's thread call `place`
as they start. Which CPU that should be is the worker's decision (beside the disk's
interrupts, off the model's CPUs: kvledger.worker.placement), installed here when that
module is imported; without it, writers run wherever the OS puts them. The layers below
the worker so ask for placement without importing it. `poll` is how a writer waits for
the other side's next message without sleeping at once (below)."""

from __future__ import annotations

import os
import select
import time
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


# How long a writer polls for the other side's next message before it sleeps in poll(2)
# or read(2): the writer process for the worker's next frame and the worker for its reply
# (engine.remote), a PostgreSQL connection for the server's reply (journal.postgres). In
# this VM, waking a process asleep on another vCPU costs the sender an IPI and the sleeper
# the vCPU's wake-up: a 60-byte os.write to a pipe whose reader slept took 14 us (p90 27;
# 49 in place in a batch-1 worker) against 1.8 to one whose reader polled, a round trip
# 128 us against 41 (docs/PERFORMANCE.md, step 26). No longer than a decode step's gap.
SPIN_S = 0.005


def poll(fd: int, events: int = select.POLLIN, spin_s: float = SPIN_S) -> None:
    """Return once `fd` has one of `events` (or an error or hang-up), or after `spin_s`
    seconds; the caller then reads, or waits, as it would have."""
    ready = select.poll()  # not select.select: it takes no descriptor past 1023
    ready.register(fd, events)
    deadline = time.perf_counter() + spin_s
    while not ready.poll(0) and time.perf_counter() < deadline:
        os.sched_yield()  # a CPU shared with others' work (a loaded machine) is not held
