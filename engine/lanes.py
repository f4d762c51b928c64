"""Handles mid-decode as columns: a batch of plain decode steps decided, planned and
settled a column at a time.

A handle whose state admits a plain decode step (engine.decide_batch.plain_after: active,
one open append at its base that is neither a verify nor a repair, ending at the last
token) is held in a slot of these columns while its steps stay plain. A batch whose steps
are all plain, on distinct such handles, is then checked with a few array comparisons
(each step's txn, position, output index, cache ABI and capacity against its slot's),
gives its run's columns by gathering slots, and settles by assignment: no HandleState is
built a step. The state a handle's plain steps leave follows from the one it came in with
(`take` builds it, as plain_after would step by step); anything that reads a handle's
state takes it out of the lanes (`States`), and it comes back in at its next batch.
tests/test_decide_batch.py holds batches decided here to their chains.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from itertools import chain
from typing import TYPE_CHECKING

from msgspec.structs import replace

from kvledger.engine.decide_batch import admits
from kvledger.engine.state import HandleState, OpenTxn, grown
from kvledger.schemas.decode_batch import DecodeBatch

if TYPE_CHECKING:
    import numpy as np

# Below this many steps a batch is decided step by step: the columns' fixed cost of array
# calls is more than what they save (and a small batch follows a model call that evicted numpy's code).
FEW = 4

# the rows of Lanes._ints, one a column: generation, snapshot, stream position, where the open
# append ends, outputs, reserved capacity, the open append's rows, layers, any aborted txn
G, V, P, END, NOUT, CAP, COUNT, LAYERS, ABORTED = range(9)
INTS = 9
# the rows of Lanes._objs: the open append's txn, the cache ABI, the request, the prefix identity
TXN, ABI, REQUEST, PREFIX = range(4)
OBJS = 4


class Lanes:
    """The columns, one slot a handle (see the module's doc)."""

    def __init__(self) -> None:
        self.slot: dict[str, int] = {}
        self._free: list[int] = []
        self._came: list[HandleState | None] = []  # by slot: the state the handle came in with
        self._tokens: list[list[int]] = []  # by slot: the outputs emitted since, and when
        self._ns: list[list[int]] = []
        self._ints: np.ndarray | None = None  # INTS x slots, int64
        self._objs: np.ndarray | None = None  # OBJS x slots, str

    def __len__(self) -> int:
        return len(self.slot)

    def __contains__(self, handle_id: object) -> bool:
        return handle_id in self.slot

    def admit(self, states: Sequence[HandleState]) -> bool:
        """Hold each of `states` (each admits(), on distinct handles not held) in a slot of
        its own, in one assignment; False, none held, if a count of one is past int64."""
        import numpy as np  # only once a batch is decided as columns: the API imports no numpy

        n = len(states)
        opens = [s.open_txns[0] for s in states]
        try:
            ints = np.array([(s.generation, s.snapshot_version, s.stream_position, t.interval_start + t.interval_count,
                              len(s.outputs), s.reserved_capacity, t.interval_count, s.num_layers,
                              bool(s.aborted_txn_ids)) for s, t in zip(states, opens)], np.int64)
        except OverflowError:
            return False
        if len(self._free) < n:
            self._grow(n)
        assert self._ints is not None and self._objs is not None  # grown
        slots = self._free[-n:]
        del self._free[-n:]
        self._ints[:, slots] = ints.T
        self._objs[:, slots] = np.array([(t.txn_id, s.cache_abi_sha256, s.request_id, s.prefix_identity_sha256)
                                         for s, t in zip(states, opens)], object).T
        for k, s in zip(slots, states):
            self._came[k] = s
            self.slot[s.handle_id] = k
        return True

    def _grow(self, n: int) -> None:
        """Room for n more handles (doubling: handles come and go)."""
        import numpy as np

        old = len(self._came)
        grow = max(64, old, n - len(self._free))
        ints, objs = np.zeros((INTS, grow), np.int64), np.full((OBJS, grow), "", object)
        self._ints = ints if self._ints is None else np.concatenate([self._ints, ints], 1)
        self._objs = objs if self._objs is None else np.concatenate([self._objs, objs], 1)
        self._came += [None] * grow
        self._tokens += [[] for _ in range(grow)]
        self._ns += [[] for _ in range(grow)]
        self._free = list(range(old + grow - 1, old - 1, -1)) + self._free

    def take(self, handle_id: str) -> HandleState:
        """The handle's state, out of the lanes: the state it came in with, as the plain
        steps since leave it (each as plain_after leaves it). KeyError if not held."""
        k = self.slot.pop(handle_id)
        s, tokens, times = self._came[k], self._tokens[k], self._ns[k]
        assert s is not None and self._ints is not None and self._objs is not None  # a held slot
        self._came[k] = None
        self._free.append(k)
        if not tokens:
            return s
        self._tokens[k], self._ns[k] = [], []
        v, t = int(self._ints[V, k]), int(self._ints[END, k]) - 1
        outputs, output_ns = grown(s.outputs, s.output_ns, tuple(tokens), tuple(times))
        return replace(s, stream_position=int(self._ints[P, k]), snapshot_version=v, committed_length=t,
                       logits_ready=False, outputs=outputs, output_ns=output_ns,
                       open_txns=(OpenTxn(str(self._objs[TXN, k]), "decode", v, t, 1, (tokens[-1],)),))

    def drop(self, handle_id: str) -> None:
        """Forget the handle (its state was set anew elsewhere)."""
        k = self.slot.pop(handle_id, None)
        if k is not None:
            self._came[k] = None
            self._tokens[k], self._ns[k] = [], []
            self._free.append(k)

    def decide(self, batch: DecodeBatch) -> Columns | None:
        """The held handles' columns at the batch's steps if every step is plain on its
        handle (plain_after gives a state for it: see admits), the handles distinct and
        all held; else None."""
        import numpy as np

        handles = batch.handle_ids
        n = len(handles)
        slot = self.slot
        try:
            slots = np.fromiter(map(slot.__getitem__, handles), np.intp, n)
        except KeyError:
            return None
        if len(set(handles)) != n:
            return None
        assert self._ints is not None and self._objs is not None  # a handle is held
        ints, objs = self._ints[:, slots], self._objs[:, slots]
        end = ints[END]
        given = np.array((batch.positions, batch.output_indexes))
        if given.dtype != np.int64:  # a value past int64, or not an int: the general path's to judge
            return None
        named = np.array((batch.txn_ids, batch.cache_abi_sha256), object)
        held = ((end == given[0]) & (ints[NOUT] == given[1]) & (end < ints[CAP]) & (objs[TXN] == named[0])
                & (objs[ABI] == named[1]))
        if not held.all():
            return None
        if ints[ABORTED].any() and any(nxt in self._aborted(k) for k, nxt in zip(slots.tolist(), batch.next_txn_ids)):
            return None
        if batch.bases is not None and any(b is not None and b != (g, v) for b, g, v in
                                           zip(batch.bases, ints[G].tolist(), ints[V].tolist())):
            return None
        return Columns(slots, ints, objs)

    def _aborted(self, k: int) -> tuple[str, ...]:
        s = self._came[k]
        assert s is not None  # a held slot
        return s.aborted_txn_ids  # plain steps leave it as it came in

    def settle(self, columns: Columns, batch: DecodeBatch, monotonic_ns: int) -> None:
        """Step the handles at `columns` as the batch's plain steps, decided at
        `monotonic_ns`, leave them (plain_after)."""
        assert self._ints is not None and self._objs is not None  # decide found them held
        ints = columns.ints
        ints[V] += 1
        ints[P] += 3
        ints[END] += 1
        ints[NOUT] += 1
        ints[COUNT] = 1
        self._ints[:, columns.slots] = ints
        self._objs[TXN, columns.slots] = batch.next_txn_ids
        tokens, times = self._tokens, self._ns
        for k, token in zip(columns.slots.tolist(), batch.tokens):
            tokens[k].append(token)
            times[k].append(monotonic_ns)


class Columns:
    """A decided batch's handles' columns as decide found them: `slots`, and the int and
    str columns at them (Lanes' rows)."""

    __slots__ = ("slots", "ints", "objs")

    def __init__(self, slots: np.ndarray, ints: np.ndarray, objs: np.ndarray) -> None:
        self.slots, self.ints, self.objs = slots, ints, objs

    def ints_of(self, row: int) -> tuple[int, ...]:
        return tuple(self.ints[row].tolist())

    def objs_of(self, row: int) -> tuple[str, ...]:
        return tuple(self.objs[row].tolist())


class States(MutableMapping[str, HandleState]):
    """A command service's handle states: a dict, and the lanes. A handle is in one or
    the other; reading one in the lanes takes it out (Lanes.take)."""

    def __init__(self, states: dict[str, HandleState] | None = None) -> None:
        self._states: dict[str, HandleState] = {} if states is None else dict(states)
        self.lanes = Lanes()

    def __getitem__(self, handle_id: str) -> HandleState:
        found = self._states.get(handle_id)
        if found is None:
            found = self._states[handle_id] = self.lanes.take(handle_id)  # KeyError: neither
        return found

    def get(self, handle_id: str, default: HandleState | None = None) -> HandleState | None:  # type: ignore[override]  # Mapping.get's overloads, one signature
        found = self._states.get(handle_id)
        if found is None and handle_id in self.lanes.slot:
            found = self._states[handle_id] = self.lanes.take(handle_id)
        return default if found is None else found

    def __setitem__(self, handle_id: str, s: HandleState) -> None:
        self._states[handle_id] = s
        if self.lanes.slot:
            self.lanes.drop(handle_id)

    def __delitem__(self, handle_id: str) -> None:
        if handle_id in self.lanes.slot:
            self.lanes.drop(handle_id)
        else:
            del self._states[handle_id]

    def __contains__(self, handle_id: object) -> bool:
        return handle_id in self._states or handle_id in self.lanes.slot

    def __iter__(self) -> Iterator[str]:
        return chain(self._states, list(self.lanes.slot))

    def __len__(self) -> int:
        return len(self._states) + len(self.lanes)

    def decide(self, batch: DecodeBatch, load: Callable[[str], HandleState | None]) -> Columns | None:
        """Lanes.decide, after taking into the lanes each step's handle that is not there
        and admits a plain step (`load` reads one this service has not cached)."""
        slot, states = self.lanes.slot, self._states
        coming: dict[str, HandleState] = {}
        for h in batch.handle_ids:
            if h not in slot and h not in coming:
                s = states.get(h) or load(h)  # load caches what it reads in `states`
                if s is None or not admits(s):
                    return None
                coming[h] = s
        if coming:
            if not self.lanes.admit(list(coming.values())):
                return None
            for h in coming:
                states.pop(h, None)
        return self.lanes.decide(batch)
