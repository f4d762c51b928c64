"""What the figures were measured on."""

from __future__ import annotations

import os
import platform
import sqlite3
from importlib import metadata
from pathlib import Path
from typing import Any

from kvledger.journal import tuning


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _filesystem(path: Path) -> str | None:
    """Filesystem type of the mount holding `path` (fsync cost depends on it)."""
    try:
        best, fstype = "", None
        target = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, kind, *_ = line.split()
            if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, fstype = mount, kind
        return fstype
    except OSError:
        return None


def machine_info(ctx: Any) -> dict[str, Any]:
    try:
        pg = ctx.postgres_version()
    except Exception:  # noqa: BLE001 - no server, no version: the report says null
        pg = None
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": tuning.usable_cpus(),  # as the process started, before any pinning
        "io_cpu": tuning.io_cpu(),  # takes the disk's interrupts: writers run there (kvledger.journal.tuning)
        "tuning": tuning.enabled(),  # KVLEDGER_TUNING
        "memory_gb": _memory_gb(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "sqlite": sqlite3.sqlite_version,
        "postgres": pg,
        "psycopg": _version("psycopg"),
        "sqlalchemy": _version("sqlalchemy"),
        "msgspec": _version("msgspec"),
        "eventsourcing": _version("eventsourcing"),
        "tmp_filesystem": _filesystem(ctx.tmp),
    }
