"""verify's rules per event type: before an event is applied to its handle's state, is it
one `decide` could have produced from that state? Each rule reports what it finds
through `find` (replay.verify.Checker's, which names the event) and says whether the
event can be applied at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvledger.engine.evolve import cut
from kvledger.engine.state import HandleState
from kvledger.replay.findings import (
    B_TOKEN_MISMATCH,
    COMMITTED_LENGTH_MISMATCH,
    COUNT_MISMATCH,
    DUPLICATE_TXN,
    EVENT_AFTER_RELEASE,
    FAILURE_CHANGES_STATE,
    FAILURE_WITHOUT_START,
    GENERATION_REGRESSION,
    MANIFEST_MISSING,
    OPEN_TXN_AT_CLOSE,
    OUTPUT_INDEX_GAP,
    PUBLISH_WITHOUT_START,
    RECLAIMABLE_EXCEEDS_RESIDENT,
    RELEASE_LENGTH_MISMATCH,
    REORDER_MISMATCH,
    REQUEST_MISMATCH,
    SNAPSHOT_DISCONTINUITY,
    UNKNOWN_STREAM,
    VISIBLE_BEYOND_COMMITTED,
    WORK_AFTER_FINISH,
)
from kvledger.schemas import events as ev
from kvledger.schemas.canonical import canonical_json, sha256_hex
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.manifest import (
    b_token,
    cache_abi_sha256,
    manifest_sha256,
    prefix_identity_sha256,
    validate_manifest,
)


class EventRules:
    """The rules, over the states the checker folds (`states`, shared with it); the
    transactions started on each stream are theirs alone."""

    def __init__(self, states: dict[str, HandleState], find: Callable[[str, str], None],
                 manifest_lookup: Callable[[str], bytes | None] | None) -> None:
        self.states = states
        self.find = find  # a finding about the event being checked: its code, its message
        self._manifest_lookup = manifest_lookup
        self._txns: dict[str, set[str]] = {}

    def check(self, s: HandleState | None, e: ev.Event) -> bool:
        """Check `e` against its handle's state `s` (None only for an allocate or fork);
        False when the event must not be applied."""
        return _RULES[type(e)](self, s, e)

    def _allocate(self, s: None, e: ev.RequestAllocateEvent) -> bool:
        p, m = e.payload, e.payload.manifest
        try:
            validate_manifest(m)
        except KvLedgerError as exc:
            self.find(exc.code.value, exc.message)
        for name, want, got in (("manifest_sha256", manifest_sha256(m), p.manifest_sha256),
                                ("cache_abi_sha256", cache_abi_sha256(m), p.cache_abi_sha256),
                                ("prefix_identity_sha256", prefix_identity_sha256(m),
                                 p.prefix_identity_sha256)):
            if want != got:
                self.find("DIGEST_MISMATCH", f"{name} {got[:12]} does not match the manifest ({want[:12]})")
        if b_token(m.cache_schema) != p.b_token:
            self.find(B_TOKEN_MISMATCH, f"b_token {p.b_token}, the cache schema gives "
                                         f"{b_token(m.cache_schema)}")
        if e.request_id != m.request_identity.request_id:
            self.find(REQUEST_MISMATCH, f"request {e.request_id}, manifest names "
                                         f"{m.request_identity.request_id}")
        if self._manifest_lookup is not None:
            stored = self._manifest_lookup(p.manifest_sha256)
            if stored is None:
                self.find(MANIFEST_MISSING, f"manifest {p.manifest_sha256[:12]} is not stored")
            elif (not isinstance(stored, bytes) or sha256_hex(stored) != p.manifest_sha256
                  or stored != canonical_json(m)):
                self.find("DIGEST_MISMATCH", f"stored manifest {p.manifest_sha256[:12]} does not match "
                                              "its digest or the event's manifest")
        return True

    def _fork(self, s: None, e: ev.ForkEvent) -> bool:
        p = e.payload
        parent = self.states.get(p.parent_handle_id)
        if parent is None:
            self.find(UNKNOWN_STREAM, f"fork from unknown parent {p.parent_handle_id}")
            return True
        if parent.lifecycle == "RELEASED":
            self.find(EVENT_AFTER_RELEASE, f"fork from {p.parent_handle_id} after its release")
        if (p.parent_generation, p.parent_snapshot_version) != (parent.generation, parent.snapshot_version):
            self.find("STALE_BASE", f"fork names parent ({p.parent_generation}, "
                                     f"{p.parent_snapshot_version}), "
                                     f"parent is at ({parent.generation}, {parent.snapshot_version})")
        if p.prefix_length > parent.committed_length:
            self.find(VISIBLE_BEYOND_COMMITTED, f"fork at {p.prefix_length}, parent committed "
                                                 f"{parent.committed_length}")
        elif (p.token_ids != parent.prompt + cut(parent, p.prefix_length)["outputs"]
              or p.prompt_length != len(parent.prompt)):
            self.find("FRONTIER_MISMATCH", "fork tokens differ from the parent's at the cut")
        for name in ("manifest_sha256", "cache_abi_sha256", "prefix_identity_sha256"):
            if getattr(p, name) != getattr(parent, name):
                self.find("DIGEST_MISMATCH", f"fork {name} differs from the parent's")
        if (p.b_token, p.num_layers) != (parent.b_token, parent.num_layers):
            self.find(B_TOKEN_MISMATCH, "fork b_token or layer count differs from the parent's")
        return True

    def _start(self, s: HandleState, e: ev.AppendStartEvent) -> bool:
        p = e.payload
        t, n = p.interval_start, p.interval_count
        seen = self._txns.setdefault(e.stream_id, set())
        if p.txn_id in seen:
            self.find(DUPLICATE_TXN, f"transaction {p.txn_id} started twice on {e.stream_id}")
        seen.add(p.txn_id)
        if p.cache_abi_sha256 != s.cache_abi_sha256:
            self.find("ABI_MISMATCH", f"rows for ABI {p.cache_abi_sha256[:12]}, handle has "
                                       f"{s.cache_abi_sha256[:12]}")
        self._active(s, e, allow_finished=p.kind == "repair")
        if p.base_snapshot_version != s.snapshot_version:
            self.find("STALE_BASE", f"started at snapshot {p.base_snapshot_version}, handle is at "
                                     f"{s.snapshot_version}")
        if t > s.committed_length:
            self.find("APPEND_HOLE", f"interval starts at {t}, committed length is {s.committed_length}")
        elif t < s.committed_length:
            self.find("POSITION_MASK_MISMATCH", f"interval starts at {t}, inside committed "
                                                 f"[0, {s.committed_length})")
        if len(p.token_ids) != n or p.cache_positions != tuple(range(t, t + n)):
            self.find("POSITION_MASK_MISMATCH", f"token ids or cache positions do not cover [{t}, {t + n})")
        if p.mask_key_extent > t + n:
            self.find(VISIBLE_BEYOND_COMMITTED, f"mask key extent {p.mask_key_extent} sees past the "
                                                 f"committed rows and this call's [{t}, {t + n})")
        elif p.mask_key_extent < t + n:
            self.find("POSITION_MASK_MISMATCH", f"mask key extent {p.mask_key_extent} < {t + n}")
        if t + n > s.reserved_capacity:
            self.find("CAPACITY_EXCEEDED", f"[{t}, {t + n}) exceeds reserved capacity {s.reserved_capacity}")
        if p.kind == "verify":
            if t != s.logical_length:
                self.find("FRONTIER_MISMATCH", f"verify drafts start at {t}, the request holds "
                                                f"{s.logical_length} tokens")
        elif p.token_ids != s.logical_tokens(t, t + n) or t + n > s.logical_length:
            self.find("FRONTIER_MISMATCH", f"token ids differ from the request's tokens at [{t}, {t + n})")
        return True

    def _publish(self, s: HandleState, e: ev.AppendPublishEvent) -> bool:
        p = e.payload
        txn = s.open_txn(p.txn_id)
        if txn is None:
            if p.txn_id in s.aborted_txn_ids:
                self.find("TXN_ABORTED", f"publish of {p.txn_id} after its failure")
            else:
                self.find(PUBLISH_WITHOUT_START, f"publish of {p.txn_id}, which no append_start opened")
            return False
        self._active(s, e, allow_finished=txn.kind == "repair")
        if p.base_snapshot_version != s.snapshot_version or txn.base_snapshot_version != s.snapshot_version:
            self.find("STALE_BASE", f"publish from snapshot {p.base_snapshot_version} (started at "
                                     f"{txn.base_snapshot_version}); handle is at {s.snapshot_version}")
        if p.result_snapshot_version != p.base_snapshot_version + 1:
            self.find(SNAPSHOT_DISCONTINUITY,
                       f"snapshot {p.base_snapshot_version} -> {p.result_snapshot_version}")
        accepted = p.accepted_count
        if accepted > txn.interval_count:
            self.find("REJECTED_SUFFIX", f"accepts {accepted} of {txn.interval_count} staged rows")
        elif txn.kind != "verify" and accepted != txn.interval_count:
            self.find(COMMITTED_LENGTH_MISMATCH,
                       f"{txn.kind} commits {accepted} of {txn.interval_count} staged rows")
        if p.layers_complete != s.num_layers:
            self.find("PARTIAL_LAYER_SET", f"{p.layers_complete} layers with complete K and V over the "
                                            f"published rows != all {s.num_layers}")
        if p.committed_length != txn.interval_start + accepted:
            self.find(COMMITTED_LENGTH_MISMATCH, f"committed length {p.committed_length} != "
                                                  f"{txn.interval_start} + {accepted} accepted")
        return True

    def _failure(self, s: HandleState, e: ev.FailureEvent) -> bool:
        p = e.payload
        txn = s.open_txn(p.txn_id)
        if txn is None:
            self.find(FAILURE_WITHOUT_START, f"failure of {p.txn_id}, which is not open")
            return False
        if p.base_snapshot_version != txn.base_snapshot_version:
            self.find(FAILURE_CHANGES_STATE, f"failure claims base {p.base_snapshot_version}; "
                                              f"{p.txn_id} started at {txn.base_snapshot_version}")
        return True

    def _emit(self, s: HandleState, e: ev.OutputEmitEvent) -> bool:
        p = e.payload
        self._active(s, e)
        if p.snapshot_version > s.snapshot_version:
            self.find(VISIBLE_BEYOND_COMMITTED, f"output from snapshot {p.snapshot_version}; newest "
                                                 f"published is {s.snapshot_version}")
        elif p.snapshot_version < s.snapshot_version:
            self.find("STALE_BASE", f"output from snapshot {p.snapshot_version}, handle is at "
                                     f"{s.snapshot_version}")
        elif not s.logits_ready:
            self.find("OUTPUT_NOT_READY", "output without logits of a published call")
        if p.output_index != len(s.outputs):
            self.find(OUTPUT_INDEX_GAP, f"output index {p.output_index}, next is {len(s.outputs)}")
        return True

    def _truncate(self, s: HandleState, e: ev.TruncateEvent) -> bool:
        p = e.payload
        self._active(s, e)
        self._snapshot_step(s, p.base_snapshot_version, p.result_snapshot_version)
        if p.new_length > s.committed_length:
            self.find("TRUNCATE_GROWS", f"truncate to {p.new_length} > committed {s.committed_length}")
        elif p.output_count != len(cut(s, p.new_length)["outputs"]):
            self.find(COUNT_MISMATCH, f"truncate keeps {p.output_count} outputs")
        return True

    def _reorder(self, s: HandleState, e: ev.ReorderEvent) -> bool:
        p = e.payload
        self._active(s, e)
        n = len(p.rows)
        if sorted(p.permutation) != list(range(n)) or len(set(p.rows)) != n:
            self.find("NOT_A_PERMUTATION", f"{list(p.permutation)} over {n} rows")
        elif e.stream_id not in p.rows or p.row_index != p.permutation.index(p.rows.index(e.stream_id)):
            self.find(REORDER_MISMATCH, f"row index {p.row_index} does not follow the permutation")
        return True

    def _cancel(self, s: HandleState, e: ev.CancelRequestEvent) -> bool:
        self._active(s, e)
        self._snapshot_step(s, e.payload.base_snapshot_version, e.payload.result_snapshot_version)
        self._no_open(s)
        return True

    def _finish(self, s: HandleState, e: ev.FinishEvent) -> bool:
        p = e.payload
        self._active(s, e)
        if (p.output_count, p.committed_length) != (len(s.outputs), s.committed_length):
            self.find(COUNT_MISMATCH, f"finish records {p.output_count} outputs / "
                                       f"{p.committed_length} rows; "
                                       f"the fold has {len(s.outputs)} / {s.committed_length}")
        self._no_open(s)
        return True

    def _release(self, s: HandleState, e: ev.ReleaseEvent) -> bool:
        p = e.payload
        if s.lifecycle == "ACTIVE":
            self.find("RELEASE_BEFORE_FINISH", f"release of {e.stream_id} before finish or cancel")
        self._snapshot_step(s, p.base_snapshot_version, p.result_snapshot_version)
        if p.result_generation <= s.generation:
            self.find(GENERATION_REGRESSION,
                       f"release moves generation {s.generation} -> {p.result_generation}")
        if p.released_length > s.committed_length:
            self.find(RECLAIMABLE_EXCEEDS_RESIDENT, f"releases {p.released_length} rows; "
                                                     f"{s.committed_length} are resident")
        elif p.released_length < s.committed_length:
            self.find(RELEASE_LENGTH_MISMATCH, f"releases {p.released_length} of {s.committed_length} rows")
        self._no_open(s)
        return True

    # -- shared ----------------------------------------------------------------------

    def _active(self, s: HandleState, e: ev.Event, *, allow_finished: bool = False) -> None:
        if s.lifecycle == "CANCELLED" or (s.lifecycle == "FINISHED" and not allow_finished):
            self.find(WORK_AFTER_FINISH, f"{e.event_type} on {e.stream_id}, which is {s.lifecycle.lower()}")

    def _snapshot_step(self, s: HandleState, base: int, result: int) -> None:
        if base != s.snapshot_version:
            self.find("STALE_BASE", f"base snapshot {base}, handle is at {s.snapshot_version}")
        if result != base + 1:
            self.find(SNAPSHOT_DISCONTINUITY, f"snapshot {base} -> {result}")

    def _no_open(self, s: HandleState) -> None:
        if s.open_txns:
            self.find(OPEN_TXN_AT_CLOSE, f"transactions {[t.txn_id for t in s.open_txns]} still open: "
                                          "each must end in a publish or a failure first")


# Keyed by the event's class: each check takes an event of that class (Any: the dispatch
# pairs them) and its handle's state (None only for an allocate).
_RULES: dict[type[ev.Event], Callable[[EventRules, Any, Any], bool]] = {
    ev.RequestAllocateEvent: EventRules._allocate,
    ev.ForkEvent: EventRules._fork,
    ev.AppendStartEvent: EventRules._start,
    ev.AppendPublishEvent: EventRules._publish,
    ev.FailureEvent: EventRules._failure,
    ev.OutputEmitEvent: EventRules._emit,
    ev.TruncateEvent: EventRules._truncate,
    ev.ReorderEvent: EventRules._reorder,
    ev.CancelRequestEvent: EventRules._cancel,
    ev.FinishEvent: EventRules._finish,
    ev.ReleaseEvent: EventRules._release,
}
