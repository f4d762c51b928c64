"""Decode steps folded a run at a time (journal.steps.StepRun: a record's consecutive
step rows, read back as columns), each handle's state brought up to date only when read.

`Projector._step` folds one step into a new HandleState, Work and ledger resize: much
Python a token. Here a run's steps change the ledger with array operations (the
clock, the byte-time integrals, the totals and the peaks that the publications' resizes
would leave one after the other), and each handle keeps in arrays only what its next
step is checked against (its open txn, committed length) and what its Work adds up. A
handle's HandleState, Work and ledger Owner take those results at `flush`: before any
other item of its stream is folded, and at the end of every `Projector.feed`.

Consecutive records' runs are held (`hold`, up to `_SLICE` steps: a decode loop's records
between two other items, most often) and folded as one slice at `settle`, before any
other item is folded (the ledger is one sequence): a lockstep record holds one step of
each handle, and a record at a time paid every array call once a record.

A step is taken here only where `Projector._step` would take it (one open append whose
txn the step publishes, not a verify), its handle already owns ledger bytes (a first
publication changes the physical ledger, which a run holds constant), its committed
length grows (each step checked against its handle's previous step in the slice, or
its armed state where it has none: `_checked`, for a run and for held runs alike); any
other step is folded by the projector one step at a time, after a flush of its
handle's run.
tests/test_replay_steps.py holds the result to the fold of the same journal's events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Protocol

import numpy as np
from msgspec.structs import replace

from kvledger.engine.state import HandleState, OpenTxn, grown
from kvledger.journal.port import FoldItem, StepColumns, StepRun
from kvledger.replay.ledger import LedgerAccumulator, LedgerPoint
from kvledger.replay.work import Work
from kvledger.schemas.ids import counter_of


class Folding(Protocol):
    """What a run fold reads and moves of the projector it folds for
    (replay.projector.Projector, which imports this module: named here by its shape)."""

    position: int
    last_event_id: str | None
    handles: dict[str, HandleState]
    work: dict[str, Work]
    ledger: LedgerAccumulator
    trajectory: list[LedgerPoint] | None

    def _feed(self, events: Iterable[FoldItem]) -> None: ...

# Per-handle arrays, by slot: the txn its next step must publish (prefix id, counter);
# the interval of the txn it had when armed (its first step's Work: each later step's
# txn is the one step before it started, one row at that step's committed length); its
# committed length and ledger terms.
_ARRAYS = ("exp_prefix", "exp_counter", "exp_n", "exp_start", "committed", "b_token", "tiers")


# Bounds under which a slice's int64 arithmetic is exact (the one-step fold uses Python
# ints): a token's bytes, copies, a handle's length, a slice's steps, the ledger totals.
# A slice's growth is at most _SLICE * _LENGTH * _B_TOKEN * _COPIES <= 2**61 bytes; a slice
# as long as a decode loop's records between two other items pays its array calls once,
# and a longer handle (past _LENGTH) is folded one step at a time.
_B_TOKEN, _COPIES, _LENGTH, _SLICE, _TOTAL = 1 << 24, 16, 1 << 21, 4096, 1 << 61
# The columns of held runs that a slice takes, in the order _together names them.
_HELD = ("stream", "ptxn_prefix", "stxn_prefix", "ptxn", "stxn", "committed", "mono", "workspace", "token", "position",
         "snapshot")


class _Slice(NamedTuple):
    """Steps `_checked` took, a column each: their handles' slots, the txn each starts
    (prefix id, counter), committed length after and before it, clock, workspace, token,
    stream position and snapshot version."""

    slots: np.ndarray
    stxn_prefix: np.ndarray
    stxn: np.ndarray
    committed: np.ndarray
    before: np.ndarray
    mono: np.ndarray
    workspace: np.ndarray
    token: np.ndarray
    position: np.ndarray
    snapshot: np.ndarray


class RunFold:
    __slots__ = ("slot", "sids", "armed", "live", "pending", "prefix_id", "prefixes", "table", "held", "held_steps",
                 "id_before", *_ARRAYS)
    # The arrays set by name (setattr) in __init__, declared for the type checker.
    exp_prefix: np.ndarray
    exp_counter: np.ndarray
    exp_n: np.ndarray
    exp_start: np.ndarray
    committed: np.ndarray
    b_token: np.ndarray
    tiers: np.ndarray

    def __init__(self) -> None:
        self.slot: dict[str, int] = {}
        self.sids: list[str] = []
        self.live: set[str] = set()  # handles whose state lives in the arrays: flush before reading it
        # a taken slice's slots, tokens, clocks, committed lengths, positions, snapshot versions
        self.pending: list[tuple[np.ndarray, ...]] = []
        self.prefix_id: dict[str, int] = {}
        self.prefixes: list[str] = []
        self.armed = np.zeros(0, bool)
        self.table: tuple[object, np.ndarray] = (None, self.armed)  # a streams table and its slots
        # Runs taken but not yet folded (`hold`): consecutive, at most _SLICE steps, folded
        # together at `settle`, before anything else is; the projector's last event id
        # before them (a run's own position is where it starts, less one).
        self.held: list[StepRun] = []
        self.held_steps = 0
        self.id_before: str | None = None
        for name in _ARRAYS:
            setattr(self, name, np.zeros(0, np.uint64 if name == "exp_counter" else np.int64))

    # -- a run ---------------------------------------------------------------------

    def apply(self, p: Folding, run: StepRun) -> None:
        """Fold `run`, its first step at p.position + 1."""
        c = run.columns
        if c is None or p.trajectory is not None:
            p._feed(run.values())
            return
        slots = self._slots(c)
        ids = self._ids(c.prefixes)
        ptxn_prefix, stxn_prefix = ids[c.ptxn_prefix], ids[c.stxn_prefix]
        n, i, ls = run.count, 0, p.ledger
        while i < n:
            if not (-_TOTAL < ls.logical < _TOTAL and -_TOTAL < ls.materialized < _TOTAL):  # sums past int64
                p._feed(run.values()[i:])
                return
            s = slots[i:]
            ok, before, order = self._checked(p, s, ptxn_prefix[i:], c.ptxn[i:], stxn_prefix[i:], c.stxn[i:],
                                              c.committed[i:])
            k = min(len(s) if ok.all() else int(np.argmin(ok)), _SLICE)
            if k:
                b = i + k
                taken = _Slice(s[:k], stxn_prefix[i:b], c.stxn[i:b], c.committed[i:b], before[:k], c.mono[i:b],
                               c.workspace[i:b], c.token[i:b], c.position[i:b], c.snapshot[i:b])
                self._fold(p, run.global_position + 3 * i, taken, order if k == len(s) else None)
                p.position = run.global_position + 3 * b - 1
                p.last_event_id = run.event_id if b == run.count else run.values()[b - 1].event_id
                i = b
                continue
            # Steps the projector folds one by one, up to the next one taken here (the
            # projector flushes a handle's run before it reads that handle's state).
            j = n if not ok.any() else i + int(np.argmax(ok))
            p._feed(run.values()[i:j])
            i = j

    # -- runs of several records -----------------------------------------------------
    # A record holds one step of each of many handles: folded a record at a time, a fold
    # paid its array calls per record. Consecutive runs are held and folded together, a
    # handle's later steps checked against its earlier ones in the same arrays.

    def hold(self, p: Folding, run: StepRun) -> None:
        """Take `run` (its first step at p.position + 1), to be folded with the runs held
        before it at `settle`; the projector's position moves past it now."""
        if self.held and (run.global_position != self.held[-1].last_position + 1
                          or self.held_steps + run.count > _SLICE):
            self.settle(p)
        if run.columns is None or p.trajectory is not None or run.count > _SLICE:
            self.settle(p)
            self.apply(p, run)
            return
        if not self.held:
            self.id_before = p.last_event_id
        self.held.append(run)
        self.held_steps += run.count
        p.position, p.last_event_id = run.last_position, run.event_id

    def settle(self, p: Folding) -> None:
        """Fold the held runs: together when every step of them is one `apply` would take
        (each handle's steps checked against its previous one), else the first alone and
        the rest again (a generation's first steps publish its prefill: a handle that owns
        no bytes yet is `apply`'s to fold)."""
        held = self.held
        if not held:
            return
        self.held, self.held_steps = [], 0
        last_id = self.id_before
        for i, run in enumerate(held):
            if len(held) - i > 1 and self._together(p, held[i:]):
                return
            # this run alone, from where it starts, as if never held; then the rest together
            p.position, p.last_event_id = run.global_position - 1, last_id
            self.apply(p, run)
            last_id = p.last_event_id

    def _together(self, p: Folding, held: list[StepRun]) -> bool:
        """Fold consecutive runs in one slice if `_checked` takes every step; False, having
        folded nothing, if it does not."""
        ls = p.ledger
        if not (-_TOTAL < ls.logical < _TOTAL and -_TOTAL < ls.materialized < _TOTAL):  # sums past int64
            return False
        cols = [r.columns for r in held if r.columns is not None]  # all of them: hold takes runs with columns
        if not self._armed(p, self._slots(cols[0])):
            return False  # a generation's first steps, which publish its prefill: said before the slice is built
        stream, ptxn_prefix, stxn_prefix, ptxn, stxn, committed, mono, workspace, token, position, snapshot = (
            np.concatenate([getattr(c, name) for c in cols]) for name in _HELD)
        first = cols[0]
        # A decode loop's records name the same streams and prefixes (journal.steps shares
        # a streams table read before): their indexes are looked up once, not a run at a time.
        if all(c.streams is first.streams and c.prefixes == first.prefixes for c in cols):
            slots, ids = self._table(first)[stream], self._ids(first.prefixes)
            ptxn_prefix, stxn_prefix = ids[ptxn_prefix], ids[stxn_prefix]
        else:
            slots = np.concatenate([self._slots(c) for c in cols])
            each = [self._ids(c.prefixes) for c in cols]
            ptxn_prefix = np.concatenate([i[c.ptxn_prefix] for i, c in zip(each, cols)])
            stxn_prefix = np.concatenate([i[c.stxn_prefix] for i, c in zip(each, cols)])
        ok, before, order = self._checked(p, slots, ptxn_prefix, ptxn, stxn_prefix, stxn, committed)
        if not ok.all():
            return False
        self._fold(p, held[0].global_position, _Slice(slots, stxn_prefix, stxn, committed, before, mono, workspace,
                                                      token, position, snapshot), order)
        p.position, p.last_event_id = held[-1].last_position, held[-1].event_id
        return True

    def _slots(self, c: StepColumns) -> np.ndarray:
        """The slots of a run's steps' handles."""
        slots: np.ndarray = self._table(c)[c.stream]
        return slots

    def _table(self, c: StepColumns) -> np.ndarray:
        """The slot of each stream of a run's table."""
        if c.streams is self.table[0]:  # the last run's streams (journal.steps shares a record's table)
            return self.table[1]
        get = self.slot.get
        known = [get(s[0]) for s in c.streams]
        table = np.array(known if None not in known else [self._slot_of(s[0]) for s in c.streams], np.int64)
        self.table = (c.streams, table)  # a stream's slot never changes
        return table

    def _ids(self, prefixes: list[str]) -> np.ndarray:
        return np.array([self._prefix_of(x) for x in prefixes], np.int64)

    def _checked(self, p: Folding, slots: np.ndarray, ptxn_prefix: np.ndarray, ptxn: np.ndarray,
                 stxn_prefix: np.ndarray, stxn: np.ndarray, committed: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Which steps of a slice `Projector._step` would take as `apply` folds them, each
        step's committed length before it, and the slice's steps by handle (`_fold`'s). A
        step is checked against its handle's previous step in the slice (found by a stable
        sort of the slots), or where it has none against its armed state: the txn it must
        publish, a growing length."""
        self._armed(p, slots)
        order = np.argsort(slots, kind="stable")
        same = slots[order[1:]] == slots[order[:-1]]
        prev = np.full(len(slots), -1, np.int64)
        prev[order[1:][same]] = order[:-1][same]
        has, at = prev >= 0, np.maximum(prev, 0)
        before = np.where(has, committed[at], self.committed[slots])
        ok = (self.armed[slots] & (np.where(has, stxn_prefix[at], self.exp_prefix[slots]) == ptxn_prefix)
              & (np.where(has, stxn[at], self.exp_counter[slots]) == ptxn) & (committed > before)
              & (committed < _LENGTH))
        return ok, before, order

    def _fold(self, p: Folding, first_position: int, taken: _Slice, order: np.ndarray | None = None) -> None:
        """A slice whose every step `_checked` took, the first at `first_position`: the
        ledger, and each handle's last step (what its next one is checked against); the
        rest waits for flush. `order`: the slice's steps by handle, if known."""
        slots, stxn_prefix, stxn, committed, before, mono, workspace, token, position, snapshot = taken
        p.ledger.grow(first_position, committed, before, self.b_token[slots], self.tiers[slots], mono, workspace)
        if order is None:
            order = np.argsort(slots, kind="stable")
        last = order[np.append(slots[order[1:]] != slots[order[:-1]], True)]  # each handle's last step
        s = slots[last]
        self.committed[s] = committed[last]
        self.exp_prefix[s], self.exp_counter[s] = stxn_prefix[last], stxn[last]
        self.pending.append((slots, token, mono, committed, position, snapshot))

    # -- handles -------------------------------------------------------------------

    def flush(self, p: Folding) -> None:
        """Every handle's state, Work and Owner as its steps so far leave them."""
        self.settle(p)
        if self.pending:
            slots = np.concatenate([x[0] for x in self.pending])
            order = np.argsort(slots, kind="stable")  # each handle's steps together, in order
            slots = slots[order]
            tokens, clocks, committed, positions, snapshots = (
                np.concatenate([x[i] for x in self.pending])[order] for i in range(1, 6))
            firsts = np.flatnonzero(np.append(True, slots[1:] != slots[:-1]))  # each handle's first step
            lasts = np.append(firsts[1:], len(order)) - 1
            # each handle's committed lengths before its last step, summed (exact in int64:
            # _checked takes lengths below _LENGTH, 2**24, so it would take 2**39 steps to pass)
            before = np.add.reduceat(committed, firsts) - committed[lasts]
            u = slots[firsts]
            columns = zip(u.tolist(), self.exp_prefix[u].tolist(), self.exp_counter[u].tolist(),
                          self.exp_n[u].tolist(), self.exp_start[u].tolist(), firsts.tolist(), lasts.tolist(),
                          committed[lasts].tolist(), positions[lasts].tolist(), snapshots[lasts].tolist(),
                          before.tolist())
            tokens, clocks = tokens.tolist(), clocks.tolist()
            handles, work, owners, names = p.handles, p.work, p.ledger.owners, self.prefixes
            for slot, prefix, counter, n, start, lo, last, length, position, snapshot, summed in columns:
                sid, hi = self.sids[slot], last + 1
                old = handles[sid]
                outputs, output_ns = grown(old.outputs, old.output_ns, tuple(tokens[lo:hi]), tuple(clocks[lo:hi]))
                v = snapshot + 1
                handles[sid] = replace(
                    old, stream_position=position + 2, snapshot_version=v, committed_length=length,
                    logits_ready=False, outputs=outputs, output_ns=output_ns,
                    open_txns=(OpenTxn(f"{names[prefix]}{counter:016x}", "decode", v, length, 1, (tokens[last],)),))
                w = work.get(sid)
                if w is None:
                    w = work[sid] = Work()
                # Row i of an append sees keys [0, i] (Projector._on_publish): the first step's
                # txn as armed, each later one a row at the committed length before it.
                later = hi - lo - 1
                w.rows += n + later
                w.pairs += n * start + n * (n + 1) // 2 + summed + later
                w.publishes += hi - lo
                owners[sid].committed = length
            self.pending.clear()
        self.armed[:] = False
        self.live.clear()

    def _armed(self, p: Folding, slots: np.ndarray) -> bool:
        """Arm the slots' handles not yet armed (`_arm`); whether all of them are."""
        armed = self.armed[slots]
        if armed.all():
            return True
        self._arm(p, dict.fromkeys(slots[~armed].tolist()))
        return bool(self.armed[slots].all())

    def _arm(self, p: Folding, slots: Iterable[int]) -> None:
        """The slots' handles, taken here from their folded state, each if `_step` would
        take its next step (an open append in engine.ids' form, owned, of a positive
        B_token); their arrays set a column at a time, not a value at a time."""
        handles, owners, sids = p.handles, p.ledger.owners, self.sids
        taken: list[tuple[int, int, int, int, int, int, int, int]] = []
        for u in slots:
            sid = sids[u]
            old, own = handles.get(sid), owners.get(sid)
            if (old is None or own is None or not 0 < own.b_token < _B_TOKEN or len(own.tiers) >= _COPIES
                    or len(old.open_txns) != 1):
                continue
            txn = old.open_txns[0]
            counter = counter_of(txn.txn_id)
            if txn.kind == "verify" or counter is None:
                continue
            self.live.add(sid)
            taken.append((u, self._prefix_of(txn.txn_id[:16]), counter, txn.interval_count, txn.interval_start,
                          own.committed, own.b_token, len(own.tiers)))
        if not taken:
            return
        at, prefix, counters, n, start, committed, b_token, tiers = (list(x) for x in zip(*taken))
        self.armed[at] = True
        self.exp_prefix[at], self.exp_counter[at] = prefix, np.array(counters, np.uint64)
        self.exp_n[at], self.exp_start[at] = n, start
        self.committed[at], self.b_token[at], self.tiers[at] = committed, b_token, tiers

    def _slot_of(self, sid: str) -> int:
        u = self.slot.get(sid)
        if u is None:
            u = self.slot[sid] = len(self.sids)
            self.sids.append(sid)
            if u >= len(self.armed):
                size = max(64, 2 * u)
                self.armed = np.resize(self.armed, size)
                self.armed[u:] = False
                for name in _ARRAYS:
                    setattr(self, name, np.resize(getattr(self, name), size))
        return u

    def _prefix_of(self, prefix: str) -> int:
        n = self.prefix_id.get(prefix)
        if n is None:
            n = self.prefix_id[prefix] = len(self.prefixes)
            self.prefixes.append(prefix)
        return n
