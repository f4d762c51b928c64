"""kvledger benchmarks: `python -m bench [--quick|--smoke] [--json] [--only NAME ...]`.

Every benchmark runs in this one process tree (plus the throwaway PostgreSQL it
starts), and every headline figure is a ratio against a baseline measured in the same
run, because absolute times on shared machines move. Absolute rates are reported too.

Adding a section (the hook for replay/decode):
  1. write `bench/NAME.py` with `def run(ctx: bench.Context) -> dict[str, float | int | None]`
     returning flat keys (headline keys and any absolute figures), and optionally
     `GOALS = {"key": (">=", 0.8), ...}` and `NOTES = {"key": "what limits it"}`;
  2. list it in SECTIONS below with the headline keys it promises. Until the module
     exists its keys are reported as null with status "missing" (never a crash).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Section:
    name: str
    module: str  # defines run(ctx) -> dict; optional GOALS, NOTES
    title: str
    keys: tuple[str, ...]  # headline keys the section promises


SECTIONS: list[Section] = [
    Section("journal", "bench.journal", "1. Journal append", (
        "journal_vs_raw_sqlite", "journal_vs_raw_postgres",
        "journal_vs_eventsourcing_sqlite", "journal_vs_eventsourcing_postgres",
        "postgres_batched_events_per_s",
    )),
    Section("replay", "bench.replay", "2. Replay", ("replay_events_per_s", "replay_vs_decode_only",
                                                   "replay_cost_ratio_1m_vs_100k", "replay_peak_rss_mb_1m")),
    Section("decode", "bench.decode", "3. Decode", ("decode_journal_overhead", "decode_vs_transformers")),
    Section("scale", "bench.scale", "4. Append scale", ("append_cost_ratio_10k_vs_1k_handles",)),
    Section("telemetry", "bench.telemetry", "5. Telemetry", ("telemetry_overhead",)),
    Section("tokens", "bench.tokens", "6. Journal per token", (
        "journal_tokens_per_s_sqlite", "journal_tokens_per_s_postgres", "journal_ceiling_vs_off",
        "journal_bytes_per_token_L2", "journal_bytes_per_token_L32", "replay_tokens_per_s",
    )),
    Section("kv_events", "bench.kv_events", "7. KV-event recorder", ("kv_events_record_events_per_s",)),
    Section("hf", "bench.hf", "8. Hugging Face generate", ("hf_journal_overhead",)),
    Section("bounded", "bench.bounded", "9. Bounded memory under hostile input", ()),
    Section("nats", "bench.nats", "10. NATS JetStream, three servers", ("nats_tokens_per_s", "nats_failover_pause_s")),
]

MODES = ("smoke", "quick", "full")


@dataclass
class Context:
    """What a section gets: the run mode, sizes, a temp dir, the shared PostgreSQL."""

    mode: str = "quick"  # smoke | quick | full
    log: Callable[[str], None] = field(default=None)  # type: ignore[assignment]  # None: stderr, timed
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvledger-bench-")))
    _pg: Any = None
    _pg_error: str | None = None
    _pg_scratch: Any = None
    _names: int = 0
    _t0: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if self.log is None:
            # seconds since the run began on every line: where a run's time goes
            self.log = lambda msg: print(f"[{time.perf_counter() - self._t0:6.1f} s] {msg}", file=sys.stderr,
                                         flush=True)

    @property
    def repeats(self) -> int:
        return self.size(smoke=1, quick=3, full=5)

    def size(self, *, smoke: Any, quick: Any, full: Any) -> Any:
        return {"smoke": smoke, "quick": quick, "full": full}[self.mode]

    def name(self, stem: str) -> str:
        self._names += 1
        return f"{stem}_{self._names}"

    # -- SQLite ------------------------------------------------------------------
    def sqlite_path(self, stem: str) -> Path:
        return self.tmp / f"{self.name(stem)}.db"

    def sqlite_journal_url(self, stem: str) -> str:
        """A fresh, migrated kvledger SQLite file (copied from one migrated template)."""
        template = self.tmp / "template.db"
        if not template.exists():
            from kvledger.migrations.storage import init_database

            init_database(f"sqlite:///{template}")
        path = self.sqlite_path(stem)
        shutil.copyfile(template, path)
        return f"sqlite:///{path}"

    # -- PostgreSQL ----------------------------------------------------------------
    def postgres(self) -> Any:
        """The one throwaway PostgreSQL of this run (fsync on), started on first use.
        Raises RuntimeError when it cannot start."""
        if self._pg is None and self._pg_error is None:
            from kvledger.journal.pgserver import ThrowawayPostgres

            self.log("starting a throwaway PostgreSQL (fsync=on)")
            try:
                self._pg = ThrowawayPostgres(fsync=True).start()
            except Exception as exc:  # noqa: BLE001 - whatever stops the server starting is the reason reported
                self._pg_error = f"cannot start PostgreSQL: {exc}"
        if self._pg is None:
            raise RuntimeError(self._pg_error)
        return self._pg

    def pg_conninfo(self, dbname: str) -> str:
        return f"host=127.0.0.1 port={self.postgres().port} user=postgres dbname={dbname}"

    def pg_database(self, stem: str) -> str:
        """A fresh empty database; returns its name."""
        name = self.name(stem)
        self.postgres().create_database(name)
        return name

    def pg_journal_url(self, stem: str) -> str:
        """A fresh, migrated kvledger database (from one migrated template)."""
        if self._pg_scratch is None:
            from kvledger.journal.pgserver import ScratchDatabases
            from kvledger.migrations.storage import init_database

            self._pg_scratch = ScratchDatabases(self.postgres().url(), "kvl_bench", init_database)
        return self._pg_scratch.create(self.name(stem))

    def postgres_version(self) -> str | None:
        if self._pg is None:
            return None
        import psycopg

        with psycopg.connect(self.pg_conninfo("postgres")) as conn:
            return conn.execute("SHOW server_version").fetchone()[0]

    def close(self) -> None:
        if self._pg is not None:
            self._pg.stop()
            self._pg = None
        shutil.rmtree(self.tmp, ignore_errors=True)


def at_threads(n: int, fn, *args):
    """fn(*args) with torch's CPU pool at n threads (then as it was), placed as
    kvledger.worker.serving.use_threads places a pool of that size."""
    import torch

    from kvledger.worker.serving import use_threads

    before = torch.get_num_threads()
    use_threads(n)
    try:
        return fn(*args)
    finally:
        use_threads(before)


def best_rate(samples: list[float]) -> float:
    """The best of repeated rates: noise on a shared machine only ever slows a run down."""
    return max(samples) if samples else float("nan")


def paired_ratio(a: list[float] | None, b: list[float] | None) -> float | None:
    """Median over repeats of a[i] / b[i], where a[i] and b[i] ran back to back in repeat
    i: a neighbour's burst of load slows both sides of a pair, so this is steadier than
    best(a) / best(b), which one lucky run of either side decides."""
    if not a or not b or len(a) != len(b):
        return None
    ratios = sorted(x / y for x, y in zip(a, b) if y > 0)
    if not ratios:
        return None
    mid = len(ratios) // 2
    value = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return round(value, 3)


def peak_rss_mb() -> float:
    """This process's own high-water RSS. (getrusage's ru_maxrss survives exec on Linux,
    so a child of a large parent, the bench's own process late in a run, would report the
    parent's peak.)"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def first_repeat_losers(rates: dict[Any, list[float]], rivals: list[tuple[Any, ...]],
                        margin: float = 0.5) -> set[Any]:
    """Of each group of rival set-ups (one contender at torch's whole pool and at one core
    fewer, say), those that ran at under `margin` times the fastest one's rate in the
    first repeat. Quick runs measure only the others after it: on a machine shared with
    other work a pool that loses like that runs several times slower, costs most of a
    section's time and never sets its best rate; a closer loser is kept, since one run
    cannot tell it from noise."""
    out: set[Any] = set()
    for group in rivals:
        best = max(rates[k][0] for k in group)
        out.update(k for k in group if rates[k][0] < margin * best)
    return out


@contextlib.contextmanager
def stopwatch() -> Iterator[list[float]]:
    out: list[float] = []
    t0 = time.perf_counter()
    yield out
    out.append(time.perf_counter() - t0)


__all__ = ["MODES", "SECTIONS", "Context", "Section", "best_rate", "first_repeat_losers", "paired_ratio",
           "peak_rss_mb", "stopwatch"]
