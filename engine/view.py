"""ServiceStateView (spec 0x05): the facts a scheduler may read about one handle.

Phase is a projection of the handle state, not a second truth. No decision fields
(admit, priority, batch, preempt): those belong to the scheduler.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvledger.engine.state import HandleState

Phase = Literal["WAITING_PREFILL", "PREFILL_IN_FLIGHT", "OUTPUT_READY", "DECODE_FRONTIER_READY",
                "FINISHED_RETAINED", "RELEASED"]
EligibleWork = Literal["PREFILL_ROWS_AVAILABLE", "DECODE_FRONTIER_AVAILABLE", "NONE"]


# gc=False: immutable values only, so never in a cycle; a report holds one a request,
# which the collector would otherwise scan after every replay.
class ServiceStateView(msgspec.Struct, frozen=True, gc=False):
    request_id: str
    handle_id: str
    handle_generation: int
    snapshot_version: int
    phase: Phase
    eligible_work: EligibleWork
    prompt_rows_remaining: int
    emitted_output_tokens: int
    processed_generated_tokens: int
    committed_tokens: int
    output_frontier_count: int
    logical_payload_bytes: int
    next_ordinary_append_bytes: int
    terminal_retained_logical_payload_bytes: int
    arrival_time: int
    output_times: tuple[int, ...]
    finish_time: int | None
    release_time: int | None


def phase_of(s: HandleState) -> Phase:
    if s.lifecycle == "RELEASED":
        return "RELEASED"
    if s.lifecycle in ("FINISHED", "CANCELLED"):
        return "FINISHED_RETAINED"
    if s.committed_length < len(s.prompt):
        return "PREFILL_IN_FLIGHT" if s.open_txns else "WAITING_PREFILL"
    if s.logits_ready:
        return "OUTPUT_READY"
    if s.has_frontier:
        return "DECODE_FRONTIER_READY"
    return "WAITING_PREFILL"  # no frontier and no logits: rows must be recomputed


def view_of(s: HandleState) -> ServiceStateView:
    phase = phase_of(s)
    released = phase == "RELEASED"
    logical = 0 if released else s.committed_length * s.b_token
    processed = max(0, s.committed_length - len(s.prompt))
    return ServiceStateView(
        request_id=s.request_id, handle_id=s.handle_id, handle_generation=s.generation,
        snapshot_version=s.snapshot_version, phase=phase,
        eligible_work=("PREFILL_ROWS_AVAILABLE" if phase == "WAITING_PREFILL"
                       else "DECODE_FRONTIER_AVAILABLE" if phase == "DECODE_FRONTIER_READY"
                       else "NONE"),
        prompt_rows_remaining=max(0, len(s.prompt) - s.committed_length),
        emitted_output_tokens=len(s.outputs), processed_generated_tokens=processed,
        committed_tokens=0 if released else s.committed_length,
        output_frontier_count=len(s.outputs) - processed if not released else 0,
        logical_payload_bytes=logical,
        next_ordinary_append_bytes=s.b_token if phase == "DECODE_FRONTIER_READY" else 0,
        terminal_retained_logical_payload_bytes=logical if phase == "FINISHED_RETAINED" else 0,
        arrival_time=s.arrival_ns, output_times=tuple(s.output_ns), finish_time=s.finish_ns,
        release_time=s.release_ns,
    )
