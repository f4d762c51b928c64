"""Named fault points in the journal's write path, for crash and race testing.

The write path (journal.sql) calls `fault(NAME)` at each point below, and `kvledger
crash-test` arms them (docs/guides/recover-after-crash.md). Off by default: `fault` then tests one
module-level boolean and returns, which costs no measurable time (`python -m bench
--only journal` reports it as fault_point_disarmed_ns). A point fires only when a rule
names it.

    before_update   writer lock held, receipts looked up; no head row changed yet
    after_update    every guarded head update done; no event row inserted yet
    mid_batch       in the middle of the batched commit: every head updated and every
                    event row inserted, no receipt row yet
    before_commit   events, receipts and manifests inserted; COMMIT not yet sent
                    (alias: after_insert)
    after_commit    the database commit returned; the receipt has not reached the caller
    checkpoint      a projection checkpoint row written; its transaction not committed

The PostgreSQL one-statement append (SqlJournal._append_speculative) updates heads and
inserts rows in one statement: of the points inside a transaction only before_update
exists there, so a fault armed at after_update, mid_batch or before_commit fires when
the general path runs (creates, retries, several operations on one handle).

On NATS (journal.nats) a commit is one atomic batch publish, and the points sit where
they mean the same: before_update once the heads are read, after_update once the
batch is decided in memory, before_commit with the batch built and nothing sent,
mid_batch with every message but the commit one sent to the server (flushed first),
after_commit once the server acknowledged the batch, checkpoint before a checkpoint's
publish. A `raise` there is a connection lost for good (`unreachable`): the caller
sees DATABASE_UNREACHABLE, not the journal's retry of a failover.

Rules come from the environment (read at import) or from `configure`:

    KVLEDGER_FAULTS="after_insert:exit:0.05,before_commit:sleep=0.01,mid_batch:raise@3"
    KVLEDGER_FAULTS_SEED=7            # the seed of the probabilities (default 0)
    KVLEDGER_FAULTS_LOG=/tmp/f.log    # one line per fired rule, written before it acts

A rule is `POINT:ACTION[:PROBABILITY][@NTH]`: ACTION is `raise` (FaultInjected; the
transaction rolls back and the caller sees a driver error, DATABASE_UNREACHABLE),
`exit[=CODE]` (os._exit, default code 86: no cleanup, no rollback message, like a
crash), `sleep=SECONDS`, or `count` (only counted). PROBABILITY (default 1) draws from
a generator seeded by the seed; `@NTH` fires on the NTH hit of that point only.

Crash tests also note each transaction's operation ids just before it is sent, to
check afterwards that it committed all or nothing: `KVLEDGER_INTENTS_LOG=PATH` (or
`record_intents(PATH)`) appends one JSON list per journal `append` to PATH. Off by
default (one module-level test, like `fault`).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass

from kvledger.schemas.errors import ErrorCode, KvLedgerError

POINTS = ("before_update", "after_update", "mid_batch", "before_commit", "after_commit", "checkpoint")
ALIASES = {"after_insert": "before_commit"}
EXIT_CODE = 86

ACTIVE = False  # any rule armed: the only thing `fault` reads when off
INTENTS: str | None = None  # where intend() notes transactions, see the module docstring

hits: Counter[str] = Counter()  # hits per point since configure (only while ACTIVE)
_rules: dict[str, list[Rule]] = {}
_rng = random.Random(0)
_log: str | None = None


class FaultInjected(Exception):
    """Raised at a fault point by a `raise` rule."""

    def __init__(self, point: str) -> None:
        super().__init__(f"fault injected at {point}")
        self.point = point


@dataclass
class Rule:
    point: str
    action: str  # raise | exit | sleep | count
    arg: float = 0.0  # exit code or seconds
    probability: float = 1.0
    nth: int | None = None

    def __str__(self) -> str:
        arg = f"={self.arg:g}" if self.action in ("sleep", "exit") else ""
        prob = f":{self.probability:g}" if self.probability != 1.0 else ""
        nth = f"@{self.nth}" if self.nth is not None else ""
        return f"{self.point}:{self.action}{arg}{prob}{nth}"


def fault(point: str) -> None:
    """A named point in the write path. Does nothing unless a rule is armed."""
    if ACTIVE:
        _fire(point)


def unreachable(exc: FaultInjected, where: str) -> KvLedgerError:
    """What a `raise` rule stands for on a backend whose driver errors are coded by the
    backend itself: the DATABASE_UNREACHABLE of a connection to `where` lost for good."""
    return KvLedgerError(ErrorCode.DATABASE_UNREACHABLE, f"{where}: {exc} (FaultInjected)")


def fault_unreachable(point: str, where: str) -> None:
    """`fault`, its `raise` coming out as `unreachable`."""
    if ACTIVE:
        try:
            _fire(point)
        except FaultInjected as exc:
            raise unreachable(exc, where) from None


def record_intents(path: str | None) -> None:
    """Note every transaction's operation ids in `path` from now on (None: stop)."""
    global INTENTS
    INTENTS = path


def intend(operation_ids: list[str]) -> None:
    """One transaction's operation ids, about to be sent. No fsync: the page cache
    outlives a killed process, and only a process is killed."""
    if INTENTS:
        fd = os.open(INTENTS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, json.dumps(operation_ids).encode() + b"\n")
        finally:
            os.close(fd)


def _fire(point: str) -> None:
    hits[point] += 1
    for rule in _rules.get(point, ()):
        if rule.nth is not None and hits[point] != rule.nth:
            continue
        if rule.probability < 1.0 and _rng.random() >= rule.probability:
            continue
        if _log:
            fd = os.open(_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, f"{point} {rule.action} {hits[point]} {os.getpid()}\n".encode())
            finally:
                os.close(fd)
        if rule.action == "exit":
            os._exit(int(rule.arg))
        if rule.action == "raise":
            raise FaultInjected(point)
        if rule.action == "sleep":
            time.sleep(rule.arg)


def parse(spec: str) -> list[Rule]:
    """Rules from `POINT:ACTION[:PROBABILITY][@NTH],...`; ValueError names a bad one."""
    rules = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        text, nth = item, None
        if "@" in text:
            text, n = text.rsplit("@", 1)
            nth = int(n)
            if nth < 1:
                raise ValueError(f"{item}: @NTH counts from 1")
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"{item}: expected POINT:ACTION[:PROBABILITY][@NTH]")
        point = ALIASES.get(parts[0], parts[0])
        if point not in POINTS:
            raise ValueError(f"{item}: unknown fault point {parts[0]!r} (one of {', '.join(POINTS)}, "
                             f"{', '.join(ALIASES)})")
        action, _, arg = parts[1].partition("=")
        if action not in ("raise", "exit", "sleep", "count"):
            raise ValueError(f"{item}: unknown action {action!r} (raise, exit[=CODE], sleep=S, count)")
        if action == "sleep" and not arg:
            raise ValueError(f"{item}: sleep needs seconds, e.g. sleep=0.01")
        value = float(arg) if arg else (EXIT_CODE if action == "exit" else 0.0)
        probability = float(parts[2]) if len(parts) == 3 else 1.0
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"{item}: probability must be in [0, 1]")
        rules.append(Rule(point, action, value, probability, nth))
    return rules


def configure(spec: str | list[Rule] | None, *, seed: int = 0, log: str | None = None) -> None:
    """Arm `spec` (a rule string or Rules), replacing any armed rules; None disarms.
    Hit counts restart from zero."""
    global ACTIVE, _rng, _log
    rules = parse(spec) if isinstance(spec, str) else list(spec or [])
    _rules.clear()
    for r in rules:
        _rules.setdefault(r.point, []).append(r)
    hits.clear()
    _rng = random.Random(seed)
    _log = log
    ACTIVE = bool(rules)


def armed() -> list[Rule]:
    return [r for rules in _rules.values() for r in rules]


def _from_env() -> None:
    record_intents(os.environ.get("KVLEDGER_INTENTS_LOG") or None)
    spec = os.environ.get("KVLEDGER_FAULTS")
    if spec:
        configure(spec, seed=int(os.environ.get("KVLEDGER_FAULTS_SEED", "0")),
                  log=os.environ.get("KVLEDGER_FAULTS_LOG") or None)


_from_env()
