"""The replay report: what `kvledger replay` prints, built from a projector on demand.

The JSON form is one object with the keys position, handles, ledger, peaks, byte_time,
requests, window (and trajectory, only when it was recorded; forks and fork_window, only
when the journal holds forks; kv_blocks, only when it holds KV-event streams:
replay.kv_blocks). `requests` and `window` are the requests' (the roots of fork trees);
`forks` and `fork_window` the forks' (beams, n > 1 samples), each naming its request
(replay.metrics). Field order and handle
order (first appearance in the journal) are deterministic, so two replays of the same
events print byte-identical JSON.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from kvledger.engine.state import HandleState
from kvledger.engine.view import ServiceStateView, view_of
from kvledger.journal.tuning import collector_paused
from kvledger.replay.kv_blocks import StreamReport
from kvledger.replay.kv_blocks import report as kv_report
from kvledger.replay.ledger import ByteTime, LedgerPoint, LedgerValues, Peak
from kvledger.replay.metrics import (
    RequestMetrics,
    WindowMetrics,
    WindowSpec,
    fork_roots,
    request_metrics,
    saved_work,
    window_metrics,
)
from kvledger.replay.projector import Projector
from kvledger.schemas.canonical import digest


# gc=False: immutable values only, so never in a cycle; a report holds one a request,
# which the collector would otherwise scan after every replay.
class HandleSnapshot(msgspec.Struct, frozen=True, gc=False):
    handle_id: str
    request_id: str
    generation: int
    snapshot_version: int
    stream_position: int
    lifecycle: str
    committed_length: int
    logical_length: int
    prompt_length: int
    output_count: int
    open_txns: int
    owns_cache: bool  # counted in the byte ledgers right now
    b_token: int
    reserved_capacity: int
    copy_tiers: tuple[str, ...]
    allocator_bytes_per_copy: int
    parent_handle_id: str | None
    cache_abi_sha256: str
    snapshot_sha256: str
    view: ServiceStateView


class Report(msgspec.Struct, frozen=True, omit_defaults=True):
    position: int
    handles: list[HandleSnapshot]
    ledger: LedgerValues
    peaks: dict[str, Peak]
    byte_time: ByteTime
    requests: list[RequestMetrics]
    window: WindowMetrics
    trajectory: list[LedgerPoint] | None = None
    # the forks' own figures (beams, n > 1 samples); absent when the journal has none
    forks: list[RequestMetrics] | None = None
    fork_window: WindowMetrics | None = None
    # KV-event streams' block pools (replay.kv_blocks); absent when the journal has none
    kv_blocks: list[StreamReport] | None = None


def snapshot_sha256(s: HandleState) -> str:
    """Identity of one committed snapshot: SHA-256 of the canonical JSON of

        {"handle_id", "generation", "snapshot_version", "committed_length",
         "cache_abi_sha256", "committed_token_ids"}

    where committed_token_ids are the tokens whose K/V rows are committed, i.e. the
    first committed_length of prompt + outputs (an unprocessed frontier output is not
    part of it). Two handles, or two points in one handle's life, have the same digest
    exactly when a reader would see the same rows under the same ABI and fence.
    """
    return digest({
        "handle_id": s.handle_id,
        "generation": s.generation,
        "snapshot_version": s.snapshot_version,
        "committed_length": s.committed_length,
        "cache_abi_sha256": s.cache_abi_sha256,
        "committed_token_ids": list(s.logical_tokens(0, s.committed_length)),
    })


def handle_snapshot(s: HandleState, owns_cache: bool) -> HandleSnapshot:
    return HandleSnapshot(
        handle_id=s.handle_id, request_id=s.request_id, generation=s.generation,
        snapshot_version=s.snapshot_version, stream_position=s.stream_position,
        lifecycle=s.lifecycle, committed_length=s.committed_length,
        logical_length=s.logical_length, prompt_length=len(s.prompt),
        output_count=len(s.outputs), open_txns=len(s.open_txns), owns_cache=owns_cache,
        b_token=s.b_token, reserved_capacity=s.reserved_capacity, copy_tiers=s.copy_tiers,
        allocator_bytes_per_copy=s.allocator_bytes_per_copy, parent_handle_id=s.parent_handle_id,
        cache_abi_sha256=s.cache_abi_sha256, snapshot_sha256=snapshot_sha256(s), view=view_of(s),
    )


def build(projector: Projector, window: WindowSpec, *, block_bytes: int | None = None) -> Report:
    with collector_paused():
        return _build(projector, window, block_bytes)


def _build(projector: Projector, window: WindowSpec, block_bytes: int | None = None) -> Report:
    led = projector.ledger
    owners = led.owners
    handles = []
    roots = fork_roots(projector.handles)
    per_root = Counter(roots.values())
    requests: list[tuple[RequestMetrics, int | None]] = []
    forks: list[tuple[RequestMetrics, int | None]] = []
    for hid, s in projector.handles.items():
        handles.append(handle_snapshot(s, hid in owners))
        w = projector.work.get(hid)
        executed = (w.rows, w.pairs, w.publishes) if w else (0, 0, 0)
        inherited = projector.inherited.get(hid)
        own = len(s.outputs) - min(inherited or 0, len(s.outputs))
        work = saved_work(len(s.prompt), own, *executed, from_prefill=inherited is None)
        root = roots.get(hid)
        r = request_metrics(s, projector.outcomes.get(hid), window, work, inherited or 0, fork_of=root,
                            forks=per_root.get(hid, 0))
        (requests if root is None else forks).append((r, s.finish_ns))
    return Report(
        position=projector.position, handles=handles, ledger=led.values(),
        peaks=led.peak_values(), byte_time=led.byte_time(), requests=[r for r, _ in requests],
        window=window_metrics(requests, window, led.start_ns, led.end_ns),
        forks=[r for r, _ in forks] if forks else None,
        fork_window=window_metrics(forks, window, led.start_ns, led.end_ns) if forks else None,
        trajectory=projector.trajectory,
        kv_blocks=kv_report(projector.kv.state, block_bytes) if projector.kv.state.streams else None,
    )


_json = msgspec.json.Encoder()


def to_json(report: Report) -> bytes:
    return _json.encode(report)
