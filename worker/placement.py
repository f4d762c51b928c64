"""Which CPU the journal's fsyncs should run on, and which the model should stay off.

The CPU that takes the disk's completion interrupts pays for every fsync, whoever
issued it: on the 2-vCPU VM these figures come from, a loop of fdatasyncs from either
CPU doubled a batch-1 decode step running on the interrupt CPU and left one on the
other CPU untouched. So when torch leaves a core for the journal's writer (a writer
process, or the commit thread), the core it leaves is that one: the writer runs there,
the model thread on the others (kvledger.worker.serving.use_threads). Importing
this module installs pin_writer as the journal's writer placement (journal.writers).

The interrupt CPU is read from /proc/interrupts (the CPU with the most block-device
queue interrupts among those this process may use). `KVLEDGER_IO_CPU` overrides it:
a CPU number, or `none` to place nothing. Off Linux, or with one usable CPU, nothing
is placed.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import TypedDict

from kvledger.journal import writers
from kvledger.schemas.errors import ErrorCode, KvLedgerError

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
    """The CPU to run fsyncs on, or None to place nothing."""
    global _io_cpu
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
        cpu = int(forced) if forced.isdigit() else -1
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
    cpus = [int(name[3:]) for name in lines[0].split() if name.startswith("CPU")]
    totals = dict.fromkeys(cpus, 0)
    for line in lines[1:]:
        if not _BLOCK.search(line):
            continue
        counts = line.split(":", 1)[1].split()[:len(cpus)]
        for cpu, n in zip(cpus, counts):
            if n.isdigit():
                totals[cpu] += int(n)
    best = max((c for c in totals if c in allowed), key=lambda c: totals[c], default=None)
    return best if best is not None and totals[best] > 0 else None


def pin_writer(pid: int = 0) -> None:
    """Run a writer on the I/O CPU, if the model has left it (pin_model): the calling
    thread (a commit thread as it starts), or a writer process by its pid. With every
    core in torch's pool, a writer pinned there would wait behind a spinning torch thread
    instead. Placement is only about speed: a writer that cannot be moved (it already
    exited, the cpuset changed) runs where it is."""
    if _apart and (cpu := io_cpu()) is not None:  # apart only once a CPU was found (pin_model)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, {cpu})


def pin_model(leaves_a_core: bool) -> None:
    """Run the calling thread off the I/O CPU when torch's pool leaves a core for the
    writer; back on every CPU otherwise (the pool needs them all)."""
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


writers.install(pin_writer)
