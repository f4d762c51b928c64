"""Machine tuning: every mechanism that makes kvledger faster on a machine without
changing anything it writes or returns. Each says why in one line; the figures that
justified them are in docs/decisions/cpu-placement.md and the commits that added them.

`KVLEDGER_TUNING=off` turns them all off: no thread or process is pinned to a CPU, no
wait polls before it sleeps, nothing is frozen, the collector is never paused, and
PostgreSQL's statements are not pipelined unless `KVLEDGER_PG_PIPELINE=on`.
Journals, outputs and digests are the same either way; only speed differs. The switch
is read once a process; unset, empty or `on` means on. The CLI refuses any other value
as it starts (INVALID_ARGUMENT); a library caller gets one logged warning and tuning on.

Here, in the journal's layer, because the journal is the lowest layer that tunes (its
commit thread and PostgreSQL connection); the engine, the worker, telemetry and replay
call it from above. Not here, because they change what is computed or stored: the size
of torch's thread pool (a forward call's bits depend on it and ForwardCall.threads
records it), SQLite's page size (the file's format) and msgspec's gc=False (a struct's
declaration: an immutable value is in no cycle).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import select
import time
from collections.abc import Generator, Iterator
from typing import Any, TypedDict

from kvledger.schemas.errors import ErrorCode, KvLedgerError

ENV = "KVLEDGER_TUNING"
_on: bool | None = None


def _read() -> tuple[bool, str | None]:
    """(on, why the value was not understood)."""
    raw = os.environ.get(ENV, "")
    value = raw.strip().lower()
    if value in ("", "on", "off"):
        return value != "off", None
    return True, f"{ENV}={raw[:40]!r}: expected 'on' or 'off'"


def check() -> None:
    """Refuse a KVLEDGER_TUNING that is neither on nor off, or a KVLEDGER_PG_PIPELINE
    that is not on, off or auto (the CLI, as it starts)."""
    for bad in (_read()[1], _pipeline_switch()[1]):
        if bad is not None:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, bad)
    enabled()


def enabled() -> bool:
    """Whether the mechanisms below apply in this process (KVLEDGER_TUNING, read once)."""
    global _on
    if _on is None:
        _on, bad = _read()
        if bad is not None:
            logging.getLogger("kvledger.tuning").warning("%s; tuning stays on", bad)
    return _on


# -- CPU placement -----------------------------------------------------------------------
# Why: the CPU that takes the disk's completion interrupts pays for every fsync, so when
# torch leaves a core free the journal's writers run on that CPU and the model thread off it.

# Block-device queues: virtio-blk, NVMe, AHCI/ATA, SCSI HBAs, Xen block frontends.
_BLOCK = re.compile(r"virtio\d+-req|nvme\d+q\d+|ahci|ata_|scsi|megasas|mpt\dsas|blkif|xen-blkfront")
_ALLOWED = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
_UNSET = object()
_io_cpu: object = _UNSET
_apart = False  # the model thread runs off the I/O CPU, so writers run on it


def usable_cpus() -> int:
    """CPUs this process may run on (as it started: pinning a thread does not shrink it)."""
    return len(_ALLOWED) or os.cpu_count() or 1


def io_cpu() -> int | None:
    """The CPU to run fsyncs on, or None to place nothing (tuning off, one usable CPU, no
    block-device interrupts seen). `KVLEDGER_IO_CPU` names it: a CPU number, or `none`."""
    global _io_cpu
    if not enabled():
        return None
    if _io_cpu is _UNSET:
        _io_cpu = _find()
    return _io_cpu  # type: ignore[return-value]  # _find() replaced the _UNSET sentinel


def _find() -> int | None:
    if len(_ALLOWED) < 2:
        return None
    forced = os.environ.get("KVLEDGER_IO_CPU", "").strip().lower()
    if forced:
        if forced == "none":
            return None
        cpu = int(forced) if forced.isdecimal() else -1
        if cpu not in _ALLOWED:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT,
                                f"KVLEDGER_IO_CPU={forced!r}: not one of this process's CPUs "
                                f"{sorted(_ALLOWED)} (or 'none')")
        return cpu
    try:
        with open("/proc/interrupts") as f:
            return busiest(f.read(), _ALLOWED)
    except OSError:
        return None


def busiest(table: str, allowed: frozenset[int]) -> int | None:
    """The allowed CPU with the most block-device interrupts in a /proc/interrupts text."""
    lines = table.splitlines()
    if not lines:
        return None
    cpus = [int(name[3:]) for name in lines[0].split() if name.startswith("CPU") and name[3:].isdecimal()]
    totals = dict.fromkeys(cpus, 0)
    for line in lines[1:]:
        if not _BLOCK.search(line):
            continue
        counts = line.partition(":")[2].split()[:len(cpus)]
        for cpu, n in zip(cpus, counts):
            if n.isdecimal():
                totals[cpu] += int(n)
    best = max((c for c in totals if c in allowed), key=lambda c: totals[c], default=None)
    return best if best is not None and totals[best] > 0 else None


def pin_writer(pid: int = 0) -> None:
    """Run a writer (the calling thread as it starts, or a writer process by its pid) on
    the I/O CPU, once the model has left it (pin_model): with every core in torch's pool
    it would wait there behind a spinning torch thread instead. A writer that cannot be
    moved (it already exited, the cpuset changed) runs where it is."""
    if _apart and (cpu := io_cpu()) is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, {cpu})


def pin_model(leaves_a_core: bool) -> None:
    """Run the calling (model) thread off the I/O CPU when torch's pool leaves a core for
    the writer; back on every CPU otherwise (the pool needs them all)."""
    global _apart
    cpu = io_cpu()
    if cpu is None:
        return
    _apart = False
    with contextlib.suppress(OSError):  # e.g. a cpuset shrunk since start: stay put
        os.sched_setaffinity(0, _ALLOWED - {cpu} if leaves_a_core else _ALLOWED)
        _apart = leaves_a_core


class Placement(TypedDict):
    io_cpu: int | None
    model_cpus: list[int]


def describe() -> Placement:
    """Where the calling (model) thread may run, and the CPU writers were placed on
    (None: not placed), for a run's report."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(usable_cpus())
    return {"io_cpu": io_cpu() if _apart else None, "model_cpus": sorted(cpus)}


# -- polling before sleeping -------------------------------------------------------------
# Why: in a VM, a message to a process asleep on another vCPU costs its sender the wake-up;
# a reader that polls a little first takes it at once. No longer than a decode step's gap.
SPIN_S = 0.005


def poll(fd: int, events: int = select.POLLIN, spin_s: float = SPIN_S) -> None:
    """Return once `fd` has one of `events` (or an error or hang-up), or after `spin_s`
    seconds (at once with tuning off); the caller then reads, or waits, as it would have."""
    if not enabled():
        return
    ready = select.poll()  # not select.select: it takes no descriptor past 1023
    ready.register(fd, events)
    deadline = time.perf_counter() + spin_s
    while not ready.poll(0) and time.perf_counter() < deadline:
        os.sched_yield()  # a CPU shared with others' work (a loaded machine) is not held


_READ = 1  # psycopg's Wait.R (selectors.EVENT_READ) in every psycopg 3


def polled(gen: Generator[Any, Any, Any], fd: int) -> Generator[Any, Any, Any]:
    """psycopg's wait generator (what a connection waits for, on socket `fd`), with the
    socket polled before each wait to read: every statement is a round trip to the server.
    With tuning off, `gen` itself."""
    return _polled(gen, fd) if enabled() else gen


def _polled(gen: Generator[Any, Any, Any], fd: int) -> Generator[Any, Any, Any]:
    try:
        state = next(gen)
    except StopIteration as done:  # nothing to wait for
        return done.value
    while True:
        if state == _READ:
            poll(fd)
        try:
            state = gen.send((yield state))
        except StopIteration as done:
            return done.value


# -- PostgreSQL pipelining ------------------------------------------------------------------
# Why: over a network a round trip costs more than psycopg's pipeline bookkeeping; over a
# loopback or a Unix socket it costs less (decisions/postgres-storage.md).
PIPELINE_ENV = "KVLEDGER_PG_PIPELINE"
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
_warned = False


def _pipeline_switch() -> tuple[bool | None, str | None]:
    """KVLEDGER_PG_PIPELINE: True (on), False (off) or None (auto, unset), and why a value
    was not understood."""
    raw = os.environ.get(PIPELINE_ENV, "")
    value = raw.strip().lower()
    if value in ("on", "off"):
        return value == "on", None
    if value in ("", "auto"):
        return None, None
    return None, f"{PIPELINE_ENV}={raw[:40]!r}: expected 'on', 'off' or 'auto'"


def pipelined(host: str) -> bool:
    """Whether a PostgreSQL connection to `host` (a name, an address, or a Unix socket's
    directory) pipelines its statements: as KVLEDGER_PG_PIPELINE says; when auto, unless
    the host is loopback or a socket, or tuning is off. Read at each connection."""
    global _warned
    forced, bad = _pipeline_switch()
    if bad is not None and not _warned:
        _warned = True
        logging.getLogger("kvledger.tuning").warning("%s; auto", bad)
    if forced is not None:
        return forced
    return enabled() and not (host.startswith("/") or host in _LOOPBACK)


# -- the cyclic collector ------------------------------------------------------------------
_frozen = False  # by freeze_heap
_host_frozen = False  # by whoever else: seen by _heap_frozen


def freeze_heap() -> None:
    """Once a process, before serving: what start-up loaded (model, torch, libraries) goes
    out of the collector's reach (gc.freeze, as vLLM does), so a full collection no longer
    traverses it. Refcounting still frees it. No collection first: it costs every start."""
    global _frozen
    if not _frozen and enabled():
        _frozen = True
        gc.freeze()


def _heap_frozen() -> bool:
    """Whether this process's start-up heap is frozen, by freeze_heap or by its host.
    gc.get_freeze_count walks the frozen objects (~50 ms for torch's 190k), so it is asked
    only while there are none: a heap once frozen stays so."""
    global _host_frozen
    if not (_frozen or _host_frozen):
        _host_frozen = gc.get_freeze_count() > 0
    return _frozen or _host_frozen


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector paused for a replay's fold and report, which keep every handle's
    state alive and make no cycles: it would only rescan a growing projection. What they
    made then goes to the oldest generation at once (freeze, unfreeze), where a young pass
    would traverse it to free nothing; not in a process whose start-up heap is frozen
    (freeze_heap), which unfreezing would hand back to every full collection."""
    if not enabled():
        yield
        return
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if not _heap_frozen():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
