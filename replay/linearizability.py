"""Linearizability of a recorded history of journal operations on handles.

A history is what concurrent clients saw: each operation invoked at a monotonic time,
then ok (with its receipt), fail (a definite rejection: nothing written) or info (its
process died or its commit acknowledgement was lost: it may or may not have happened).
A write carries the guarded steps the client sent (journal.contract.Operation): per
handle, the head it expected, (generation, snapshot_version, stream_position) or None
for "must not exist yet", and the head it writes (None for a read-only check, as a
fork checks its parent). A read carries the heads it returned.

The sequential specification of one handle is a register with compare-and-set: a step
applies only if the head equals what it expects. That is the journal's linearization
point (DESIGN.md): the conditional write.

Two independent checks:
  check_linear  linear time (plus a sort): every ok write is in the journal exactly once
                with its acknowledged events, no fail is, each info is all or nothing;
                the journal's global order respects real time between completed writes
                and is itself a legal sequential history (every committed step's guard
                held when it committed); no read misses a write acknowledged before it
                began.
  check_wgl     Wing & Gong search with memoization (Lowe), partitioned per handle: is
                there any order, consistent with real time, in which every ok operation
                (and any subset of info ones) applies with the results it returned? It
                trusts nothing the journal says about order; for short histories.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from kvledger.journal.port import Journal

Head = tuple[int, int, int]  # generation, snapshot_version, stream_position
INF = float("inf")


@dataclass(frozen=True)
class Step:
    handle: str
    expected: Head | None  # None: the handle must not exist yet (create)
    new: Head | None  # None: a check, nothing written


@dataclass
class Op:
    key: str  # the journal operation_id of a write
    process: int
    f: str
    invoke: int
    complete: int | None = None  # None: info (no completion seen)
    status: str = "info"  # ok | fail | info
    steps: tuple[Step, ...] = ()  # a write: the guarded steps of its last attempt
    receipt: dict[str, Any] | None = None  # ok write, as its client logged it: event_ids, first, last
    value: dict[str, Head | None] | None = None  # read: the heads it returned
    error: str | None = None

    @property
    def is_read(self) -> bool:
        return self.value is not None

    @property
    def handles(self) -> set[str]:
        return set(self.value) if self.value is not None else {s.handle for s in self.steps}


class ReceiptFacts(TypedDict):
    first: int
    last: int
    event_ids: list[str]


@dataclass
class Facts:
    """What the journal holds for the history's operations."""

    receipts: dict[str, ReceiptFacts] = field(default_factory=dict)  # op id -> its receipt
    events: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # op id -> (position, id)


@dataclass
class Violation:
    check: str
    message: str
    op: str | None = None
    handle: str | None = None


# -- histories ---------------------------------------------------------------------

def _head(x: Sequence[int] | None) -> Head | None:
    return None if x is None else (int(x[0]), int(x[1]), int(x[2]))


def load_history(paths: Iterable[str | Path]) -> list[Op]:
    """Records (JSON lines) of every process: invoke, attempt, ok, fail, info. An
    operation with no completion record is info (its process died mid-operation)."""
    ops: dict[str, Op] = {}
    for path in paths:
        for line in Path(path).read_bytes().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a torn last line of a killed process
            t, key = r.get("type"), r.get("op")
            if t == "invoke":
                ops[key] = Op(key, r["process"], r["f"], r["t"],
                              value={} if r["f"] == "read" else None)
                continue
            op = ops.get(key)
            if op is None:
                continue
            if t == "attempt":
                op.steps = tuple(Step(h, _head(e), _head(n)) for h, e, n in r["steps"])
            elif t in ("ok", "fail", "info"):
                op.status = t
                op.complete = r["t"] if t != "info" else None
                op.error = r.get("error")
                if t == "ok" and "receipt" in r:
                    op.receipt = r["receipt"]
                if t == "ok" and "value" in r:
                    op.value = {h: _head(v) for h, v in r["value"].items()}
    return sorted(ops.values(), key=lambda o: o.invoke)


# -- the linear-time check -----------------------------------------------------------

def check_linear(ops: list[Op], facts: Facts, initial: Mapping[str, Head | None] | None = None) -> list[Violation]:
    out: list[Violation] = []
    present: list[Op] = []
    for o in ops:
        if o.is_read:
            continue
        found = _in_journal(o, facts)
        if isinstance(found, Violation):
            out.append(found)
        elif found:
            present.append(o)
    out += _real_time(present, facts)
    out += _guards(present, facts, initial)
    out += _stale_reads(ops, present)
    return out


def _in_journal(o: Op, facts: Facts) -> bool | Violation:
    """Whether write `o` is in the journal, whole; a Violation where what the journal
    holds contradicts its outcome (an ok one lost or partial, a fail one present, an
    info one half visible)."""
    r, evs = facts.receipts.get(o.key), facts.events.get(o.key, [])
    whole = r is not None and evs == list(zip(range(r["first"], r["last"] + 1), r["event_ids"]))
    if o.status == "ok":
        return _acknowledged(o, r, evs, whole)
    if o.status == "fail":
        if r is not None or evs:
            return Violation("fail_present", f"{o.f} {o.key} was refused ({o.error}) but "
                             "the journal holds it", o.key)
        return False
    # info: all or nothing
    if r is None and not evs:
        return False
    return True if whole else Violation("partial", f"info {o.key}: half visible: events {evs}", o.key)


def _acknowledged(o: Op, r: ReceiptFacts | None, evs: list[tuple[int, str]], whole: bool) -> bool | Violation:
    """An ok write is in the journal, whole, with the receipt its client was given."""
    ack = o.receipt or {}
    if r is None:
        return Violation("lost", f"acknowledged {o.f} {o.key} is not in the journal", o.key)
    if not whole:
        return Violation("partial", f"{o.key}: events {evs} != receipt "
                         f"[{r['first']}, {r['last']}] {r['event_ids']}", o.key)
    if (list(ack.get("event_ids", ())), ack.get("first"), ack.get("last")) != \
            (list(r["event_ids"]), r["first"], r["last"]):
        return Violation("lost", f"{o.key}: the journal's receipt differs from the "
                         "acknowledged one", o.key)
    return True


def _real_time(present: list[Op], facts: Facts) -> list[Violation]:
    """The real-time order of completed writes is kept in global_position."""
    out: list[Violation] = []
    # an ok operation has its completion time
    done = sorted(((o.complete, o) for o in present if o.status == "ok" and o.complete is not None),
                  key=lambda d: d[0])
    completes = [c for c, _ in done]
    best: list[tuple[int, str]] = []  # prefix max of last positions
    for _, o in done:
        last = facts.receipts[o.key]["last"]
        best.append(max(best[-1], (last, o.key)) if best else (last, o.key))
    for o in present:
        i = bisect.bisect_left(completes, o.invoke)
        if i and best[i - 1][0] >= facts.receipts[o.key]["first"]:
            out.append(Violation("real_time", f"{o.key} began after {best[i - 1][1]} was acknowledged "
                                 f"but committed before it (position {facts.receipts[o.key]['first']} "
                                 f"<= {best[i - 1][0]})", o.key))
    return out


def _guards(present: list[Op], facts: Facts, initial: Mapping[str, Head | None] | None) -> list[Violation]:
    """The journal order is a legal sequential history of guarded steps."""
    out: list[Violation] = []
    heads: dict[str, Head | None] = dict(initial or {})
    for o in sorted(present, key=lambda o: facts.receipts[o.key]["first"]):
        for s in o.steps:
            cur = heads.get(s.handle)
            if cur != s.expected:
                out.append(Violation("guard", f"{o.f} {o.key} committed at position "
                                     f"{facts.receipts[o.key]['first']} expecting {s.handle} at {s.expected}, "
                                     f"but the head was {cur}", o.key, s.handle))
            if s.new is not None:
                heads[s.handle] = s.new
    return out


def _stale_reads(ops: list[Op], present: list[Op]) -> list[Violation]:
    """No read misses a write acknowledged before the read began."""
    out: list[Violation] = []
    index = _newest_acknowledged(present)
    for o in ops:
        if o.value is None or o.status != "ok":  # o.value: o.is_read
            continue
        for h, v in o.value.items():
            if h not in index:
                continue
            times, acc = index[h]
            i = bisect.bisect_left(times, o.invoke)
            if i and (v is None or v[2] < acc[i - 1][0]):
                out.append(Violation("stale_read", f"read {o.key} of {h} returned {v} after "
                                     f"{acc[i - 1][1]} (stream position {acc[i - 1][0]}) was acknowledged",
                                     o.key, h))
    return out


def _newest_acknowledged(present: list[Op]) -> dict[str, tuple[list[int], list[tuple[int, str]]]]:
    """Per handle: the completion times of its ok writes, sorted, and beside each the
    newest stream position (and its op) acknowledged by then."""
    newest: dict[str, list[tuple[int, int, str]]] = {}  # handle -> (complete, stream position, op)
    for o in present:
        if o.status == "ok" and o.complete is not None:
            for s in o.steps:
                if s.new is not None:
                    newest.setdefault(s.handle, []).append((o.complete, s.new[2], o.key))
    index: dict[str, tuple[list[int], list[tuple[int, str]]]] = {}
    for h, rows in newest.items():
        rows.sort()
        acc: list[tuple[int, str]] = []
        for _, p, k in rows:
            acc.append(max(acc[-1], (p, k)) if acc else (p, k))
        index[h] = ([c for c, _, _ in rows], acc)
    return index


# -- Wing & Gong with memoization ------------------------------------------------------

@dataclass
class _Entry:
    op: Op
    invoke: int
    complete: float
    required: bool
    steps: tuple[tuple[Head | None, Head | None], ...]  # (expected, new) on this handle
    read: Head | None | bool = False  # False: not a read


def _apply(state: Head | None, e: _Entry) -> tuple[bool, Head | None]:
    if e.read is not False:
        return state == e.read, state
    for expected, new in e.steps:
        if state != expected:
            return False, state
        if new is not None:
            state = new
    return True, state


def check_wgl(ops: list[Op], initial: Mapping[str, Head | None] | None = None, *,
              max_ops: int = 30, budget: int = 2_000_000) -> tuple[list[Violation], dict[str, int]]:
    """Search each handle's subhistory for a linearization. ok operations must apply
    inside their interval with the results they returned; info ones may apply (after
    their invocation) or not at all; fail ones never happened. Returns violations and
    stats: handles checked, skipped (more than max_ops operations), states explored."""
    per: dict[str, list[_Entry]] = {}
    for o in ops:
        if o.status == "fail":
            continue
        if o.value is not None:  # o.is_read
            if o.status != "ok" or o.complete is None:  # an ok one has its completion time
                continue
            for h, v in o.value.items():
                per.setdefault(h, []).append(_Entry(o, o.invoke, o.complete, True, (), v))
            continue
        by_handle: dict[str, list[tuple[Head | None, Head | None]]] = {}
        for s in o.steps:
            by_handle.setdefault(s.handle, []).append((s.expected, s.new))
        for h, steps in by_handle.items():
            done = o.status == "ok"
            complete = o.complete if done and o.complete is not None else INF
            per.setdefault(h, []).append(_Entry(o, o.invoke, complete, done, tuple(steps)))
    violations: list[Violation] = []
    stats = {"handles": 0, "skipped": 0, "states": 0, "ops": 0}
    for h, entries in sorted(per.items()):
        if len(entries) > max_ops:
            stats["skipped"] += 1
            continue
        stats["handles"] += 1
        stats["ops"] += len(entries)
        ok, explored, detail = _search(entries, (initial or {}).get(h), budget)
        stats["states"] += explored
        if ok is None:
            stats["skipped"] += 1
        elif not ok:
            violations.append(Violation("wgl", f"no linearization of {len(entries)} operations on {h}: "
                                        f"{detail}", handle=h))
    return violations, stats


def _search(entries: list[_Entry], start: Head | None, budget: int) -> tuple[bool | None, int, str]:
    entries = sorted(entries, key=lambda e: e.invoke)
    n = len(entries)
    need = sum(1 << i for i, e in enumerate(entries) if e.required)
    seen: set[tuple[int, Head | None]] = set()
    stack: list[tuple[int, Head | None]] = [(0, start)]
    deepest, deepest_mask = -1, 0
    explored = 0
    while stack:
        mask, state = stack.pop()
        if mask & need == need:
            return True, explored, ""
        if (mask, state) in seen:
            continue
        seen.add((mask, state))
        explored += 1
        if explored > budget:
            return None, explored, "search budget exhausted"
        depth = bin(mask).count("1")
        if depth > deepest:
            deepest, deepest_mask = depth, mask
        # the earliest completion among required operations not yet linearized bounds
        # which operations may go next: none invoked after it
        horizon = min((entries[i].complete for i in range(n) if not mask >> i & 1 and entries[i].required),
                      default=INF)
        for i in range(n):
            if mask >> i & 1:
                continue
            e = entries[i]
            if e.invoke > horizon:
                break  # sorted by invocation: the rest began later still
            ok, nxt = _apply(state, e)
            if ok:
                stack.append((mask | 1 << i, nxt))
    stuck = [entries[i].op.key for i in range(n) if not deepest_mask >> i & 1 and entries[i].required]
    return False, explored, f"at most {deepest} linearize; cannot place {stuck[:5]}"


def facts_from_journal(journal: Journal, handles: Iterable[str], op_ids: Iterable[str]) -> Facts:
    """Receipts and events of `op_ids`, read from the streams of `handles`."""
    facts = Facts()
    for h in handles:
        for e in journal.read_stream(h):
            if e.operation_id is not None:
                facts.events.setdefault(e.operation_id, []).append((e.global_position, e.event_id))
    for v in facts.events.values():
        v.sort()
    for k in op_ids:
        r = journal.receipt(k)
        if r is not None:
            facts.receipts[k] = {"first": r.first_global_position, "last": r.last_global_position,
                                 "event_ids": list(r.event_ids)}
    return facts


__all__ = ["Facts", "Op", "Step", "Violation", "check_linear", "check_wgl", "facts_from_journal",
           "load_history"]
