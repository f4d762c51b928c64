"""The byte ledgers of spec 0x02, kept incrementally: one event changes one handle, so
one event changes each ledger by that handle's delta. Nothing here re-sums over the
live handles, which keeps a replay O(1) per event however many requests are live.

Ownership (the set A_KV of the spec) runs from a handle's first append_publish, or its
fork event (a fork child holds the committed prefix), to its release. An arrival alone
owns nothing: tau=0 and tau=2 of the worked trajectory show 0 B for the new request.
Per owning handle i with T_i committed tokens, r_i = len(copy_tiers) copies, C_i
reserved token slots per copy and a declared allocator charge a_i per copy:

    logical       += T_i * B_token
    materialized  += r_i * T_i * B_token
    reserved      += r_i * C_i * B_token
    allocator     += r_i * a_i
    resident[tier] += C_i * B_token + a_i      for each copy's tier

physical = reserved + allocator, and the resident tiers partition it exactly. The
temporary workspace is event-local (an append_publish's `workspace_bytes`, 0 at every
other event); instantaneous = physical + workspace.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import msgspec

from kvledger.engine.state import HandleState

if TYPE_CHECKING:
    import numpy as np

PEAK_NAMES = ("logical", "materialized", "reserved", "allocator", "physical", "workspace",
              "instantaneous")


class LedgerValues(msgspec.Struct, frozen=True):
    """Every ledger at one cut. `rectangular` and `phantom` are the 0x09 padding
    ledgers: N owners padded to the largest owner's logical payload (with one B_token
    this is B_token * N * max T_i)."""

    logical: int
    materialized: int
    replication_overhead: int
    reserved: int
    reservation_slack: int
    allocator: int
    physical: int
    resident: dict[str, int]
    workspace: int
    instantaneous: int
    rectangular: int
    phantom: int
    owners: int


class LedgerPoint(msgspec.Struct, frozen=True):
    """The ledgers right after one event: a trajectory sample."""

    position: int
    t_ns: int
    event_type: str
    stream_id: str
    ledger: LedgerValues


class Peak(msgspec.Struct, frozen=True):
    value: int
    position: int  # the first event at which the peak was reached (0: never above 0)


class ByteTime(msgspec.Struct, frozen=True):
    """Integrals of the logical and physical ledgers over monotonic time, piecewise
    constant between events, in byte-nanoseconds."""

    logical_byte_ns: int
    physical_byte_ns: int
    start_ns: int | None
    end_ns: int | None


class Owner(msgspec.Struct, array_like=True):
    """What one owning handle contributes; kept so release can subtract it exactly."""

    committed: int
    b_token: int
    capacity_bytes: int  # C_i * B_token: one copy's reservation
    allocator: int  # a_i: one copy's declared allocator metadata
    tiers: tuple[str, ...]  # one entry per materialized copy


class LedgerState(msgspec.Struct, kw_only=True):
    """The accumulator's serializable state (part of a projection checkpoint)."""

    logical: int = 0
    materialized: int = 0
    reserved: int = 0
    allocator: int = 0
    workspace: int = 0
    resident: dict[str, int] = {}
    owners: dict[str, Owner] = {}
    peaks: dict[str, tuple[int, int]] = {}
    logical_byte_ns: int = 0  # integrated up to mark_ns
    physical_byte_ns: int = 0
    mark_ns: int = 0
    start_ns: int | None = None
    end_ns: int | None = None


_SCALARS = ("logical", "materialized", "reserved", "allocator", "workspace", "logical_byte_ns",
            "physical_byte_ns", "mark_ns", "start_ns", "end_ns")


class LedgerAccumulator:
    """Mutable, O(1)-per-event ledger state. Plain slots rather than a Struct: these
    few integers change at every publish, and a slot is the cheapest place for them.
    Peak values live in slots too (`peak_<name>`); the position that reached each one
    is written only when a peak moves."""

    __slots__ = (*_SCALARS, *(f"peak_{n}" for n in PEAK_NAMES), "peak_at", "resident", "owners",
                 "_max", "_max_stale")
    # The slots set by name (setattr) in __init__, declared for the type checker.
    logical: int
    materialized: int
    reserved: int
    allocator: int
    workspace: int
    logical_byte_ns: int
    physical_byte_ns: int
    mark_ns: int
    start_ns: int | None
    end_ns: int | None
    peak_logical: int
    peak_materialized: int
    peak_reserved: int
    peak_allocator: int
    peak_physical: int
    peak_workspace: int
    peak_instantaneous: int

    def __init__(self, state: LedgerState | None = None) -> None:
        state = state if state is not None else LedgerState()
        for name in _SCALARS:
            setattr(self, name, getattr(state, name))
        self.resident = dict(state.resident)
        self.owners = {k: msgspec.structs.replace(o) for k, o in state.owners.items()}
        self.peak_at: dict[str, int] = {}
        for name in PEAK_NAMES:
            value, position = state.peaks.get(name, (0, 0))
            setattr(self, f"peak_{name}", value)
            self.peak_at[name] = position
        # The largest owner payload (rectangular ledger). Growth keeps it exact; when
        # its holder shrinks or leaves it goes stale and is recomputed when read.
        self._max = 0
        self._max_stale = bool(self.owners)

    def state(self) -> LedgerState:
        return LedgerState(
            **{name: getattr(self, name) for name in _SCALARS},
            resident=dict(self.resident),
            owners={k: msgspec.structs.replace(o) for k, o in self.owners.items()},
            peaks={name: (getattr(self, f"peak_{name}"), self.peak_at[name]) for name in PEAK_NAMES},
        )

    # -- time ----------------------------------------------------------------------

    def advance(self, t_ns: int) -> None:
        """Move the clock to t_ns. A clock that steps backwards (events from another
        source's monotonic clock) does not move it: no negative area. The integral
        itself is only brought up to date where the ledgers change (`_integrate`):
        between changes the bytes are constant, so the area is one product."""
        end = self.end_ns
        if end is None:
            self.start_ns = self.end_ns = self.mark_ns = t_ns
        elif t_ns > end:
            self.end_ns = t_ns

    def _integrate(self) -> None:
        """Bring the byte-time integrals up to the clock, before the ledgers change."""
        assert self.end_ns is not None  # an owner exists: advance() has run
        dt = self.end_ns - self.mark_ns
        if dt:
            self.logical_byte_ns += self.logical * dt
            self.physical_byte_ns += (self.reserved + self.allocator) * dt
            self.mark_ns = self.end_ns

    # -- ownership -----------------------------------------------------------------

    def resize(self, handle_id: str, h: HandleState, position: int, workspace: int = 0) -> None:
        """The handle owns state with h.committed_length tokens from now on (first
        ownership included). Sets the event's workspace and updates the peaks. Only the
        ledgers this call can raise are compared with their peaks: this runs at every
        publish, the hottest path of a replay."""
        end = self.end_ns
        assert end is not None  # advance() runs before every event's change
        dt = end - self.mark_ns  # _integrate, inlined
        if dt:
            self.logical_byte_ns += self.logical * dt
            self.physical_byte_ns += (self.reserved + self.allocator) * dt
            self.mark_ns = end
        own = self.owners.get(handle_id)
        first = own is None
        if own is None:
            own = self._own(handle_id, h, position)
        committed = h.committed_length
        before = own.committed
        if committed != before:
            b_token = own.b_token
            delta = (committed - before) * b_token
            self.logical += delta
            self.materialized += delta * len(own.tiers)
            own.committed = committed
            if delta > 0:
                if committed * b_token > self._max:
                    self._max = committed * b_token
                # _raised, inlined: a growing decode raises both at nearly every publish
                if self.logical > self.peak_logical:
                    self.peak_logical = self.logical
                    self.peak_at["logical"] = position
                if self.materialized > self.peak_materialized:
                    self.peak_materialized = self.materialized
                    self.peak_at["materialized"] = position
            elif before * b_token == self._max:
                self._max_stale = True
        self.workspace = workspace
        # With no workspace, instantaneous is physical, which only a new owner raises.
        if workspace or first:
            if workspace > self.peak_workspace:
                self._raised("workspace", workspace, position)
            instantaneous = self.reserved + self.allocator + workspace
            if instantaneous > self.peak_instantaneous:
                self._raised("instantaneous", instantaneous, position)

    def grow(self, first: int, committed: np.ndarray, before: np.ndarray, b_token: np.ndarray,
             copies: np.ndarray, clocks: np.ndarray, workspace: np.ndarray) -> None:
        """`resize` of owned handles, one a step, each growing (committed > before), at
        positions first, first + 3, ...: the clock advanced to each step's, its ledgers,
        integrals and peaks as the calls one after the other would leave them, then no
        workspace (replay.runs: a record's decode steps as columns, int64 sums kept in
        range by its bounds). The handles' Owners are the caller's to update."""
        import numpy as np

        end, mark = self.end_ns, self.mark_ns
        assert end is not None  # its handles are owned: advance() has run
        d = (committed - before) * b_token  # each resize's logical change
        # The clock and the integrals: every resize integrates up to its step's clock.
        ends = np.maximum.accumulate(clocks)
        np.maximum(ends, end, out=ends)
        dts = np.empty_like(ends)
        dts[0] = ends[0] - mark
        np.subtract(ends[1:], ends[:-1], out=dts[1:])
        logical = np.cumsum(d)
        logical += self.logical
        moved = np.flatnonzero(dts)
        if moved.size:
            held = (logical - d)[moved].tolist()  # the ledger each interval held: Python ints, no overflow
            self.logical_byte_ns += sum(map(operator.mul, held, dts[moved].tolist()))
            end = int(ends[-1])
            self.physical_byte_ns += (self.reserved + self.allocator) * (end - mark)
            self.end_ns = self.mark_ns = end
        # Totals and peaks: logical only grows here, so its last value is its peak.
        self.logical = int(logical[-1])
        if self.logical > self.peak_logical:
            self.peak_logical = self.logical
            self.peak_at["logical"] = first + 3 * (len(d) - 1)
        materialized = np.cumsum(d * copies)
        materialized += self.materialized
        self.materialized = int(materialized[-1])
        if self.materialized > self.peak_materialized:
            self.peak_materialized = self.materialized
            self.peak_at["materialized"] = first + 3 * int(np.argmax(materialized == materialized[-1]))
        self._max = max(self._max, int((committed * b_token).max()))
        peak_w = int(workspace.max())
        if peak_w:  # a publication's workspace: its own peak, and the instantaneous ledger's
            at = first + 3 * int(np.argmax(workspace))
            if peak_w > self.peak_workspace:
                self.peak_workspace, self.peak_at["workspace"] = peak_w, at
            instantaneous = self.reserved + self.allocator + peak_w
            if instantaneous > self.peak_instantaneous:
                self.peak_instantaneous, self.peak_at["instantaneous"] = instantaneous, at
        self.workspace = 0  # the emit's and the start's

    def _own(self, handle_id: str, h: HandleState, position: int) -> Owner:
        b_token = h.b_token
        own = Owner(0, b_token, h.reserved_capacity * b_token, h.allocator_bytes_per_copy, h.copy_tiers)
        self.owners[handle_id] = own
        self._copies(own, 1)
        self._raised("reserved", self.reserved, position)
        self._raised("allocator", self.allocator, position)
        self._raised("physical", self.reserved + self.allocator, position)
        return own

    def disown(self, handle_id: str) -> None:
        """Release: the handle's every byte leaves every ledger (no peak can rise)."""
        self.workspace = 0
        own = self.owners.pop(handle_id, None)
        if own is None:
            return
        self._integrate()
        payload = own.committed * own.b_token
        self.logical -= payload
        self.materialized -= payload * len(own.tiers)
        self._copies(own, -1)
        if payload == self._max:
            self._max_stale = True

    # -- reading -------------------------------------------------------------------

    def values(self) -> LedgerValues:
        physical = self.reserved + self.allocator
        n = len(self.owners)
        if self._max_stale:
            self._max = max((o.committed * o.b_token for o in self.owners.values()), default=0)
            self._max_stale = False
        rectangular = n * self._max
        return LedgerValues(
            logical=self.logical, materialized=self.materialized,
            replication_overhead=self.materialized - self.logical, reserved=self.reserved,
            reservation_slack=self.reserved - self.materialized, allocator=self.allocator,
            physical=physical, resident=dict(sorted(self.resident.items())),
            workspace=self.workspace, instantaneous=physical + self.workspace,
            rectangular=rectangular, phantom=rectangular - self.logical, owners=n,
        )

    def peak_values(self) -> dict[str, Peak]:
        return {name: Peak(getattr(self, f"peak_{name}"), self.peak_at[name]) for name in PEAK_NAMES}

    def byte_time(self) -> ByteTime:
        tail = (self.end_ns or 0) - self.mark_ns  # constant bytes since the last change
        return ByteTime(self.logical_byte_ns + self.logical * tail,
                        self.physical_byte_ns + (self.reserved + self.allocator) * tail,
                        self.start_ns, self.end_ns)

    # -- internals -----------------------------------------------------------------

    def _raised(self, name: str, value: int, position: int) -> None:
        if value > getattr(self, f"peak_{name}"):
            setattr(self, f"peak_{name}", value)
            self.peak_at[name] = position

    def _copies(self, own: Owner, sign: int) -> None:
        copies = len(own.tiers)
        self.reserved += sign * copies * own.capacity_bytes
        self.allocator += sign * copies * own.allocator
        per_copy = sign * (own.capacity_bytes + own.allocator)
        resident = self.resident
        for tier in own.tiers:
            resident[tier] = resident.get(tier, 0) + per_copy
