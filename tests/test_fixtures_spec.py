"""The spec's worked numbers, reproduced from the fixture journals by the projector the
CLI uses: from the file with no database, and from SQLite and PostgreSQL after import.

Every expected number below is the spec's own (0x02, 0x03, 0x05, 0x09) or follows
from the spec's declared policies by its stated formulas.
"""

from __future__ import annotations

import filecmp
import importlib.util
from pathlib import Path

import pytest

from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import WindowSpec, import_jsonl, replay_journal, replay_jsonl, to_json

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MS = 1_000_000
SPEC_WINDOW = WindowSpec(slo_ttft_ns=15 * MS, slo_tbt_ns=10 * MS, start_ns=0, width_ns=100 * MS)


def reports(name: str, db_url: str | None, **kw):
    """The file replay, and (with a database) the replay after import: they must agree
    to the byte, so the assertions below hold for every source."""
    path = FIXTURES / f"{name}.jsonl"
    from_file = replay_jsonl(path, SPEC_WINDOW, **kw)
    if db_url is None:
        return from_file
    with open_or_create_journal(db_url) as journal:
        import_jsonl(journal, path)
        from_db = replay_journal(journal, SPEC_WINDOW, **kw)
    assert to_json(from_db) == to_json(from_file)
    return from_db


def cuts(report) -> dict[int, object]:
    """tau (ms) -> the ledgers after the last event of that step."""
    out = {}
    for point in report.trajectory:
        out[point.t_ns // MS] = point
    return out


# 0x02 "Worked Two-Request Trajectory": (logical, materialized, reserved, physical, temporary)
TRAJECTORY = {
    0: (0, 0, 0, 0, 0),
    1: (256, 256, 512, 528, 96),
    2: (256, 256, 512, 528, 0),
    3: (384, 512, 1024, 1072, 96),
    4: (448, 576, 1024, 1072, 32),
    5: (512, 704, 1024, 1072, 32),
    6: (512, 704, 1024, 1072, 0),
    7: (192, 384, 512, 544, 0),
    8: (256, 512, 512, 544, 32),
    9: (256, 512, 512, 544, 0),
    10: (0, 0, 0, 0, 0),
}
# Declared policies: A one GPU copy of 8 slots; B GPU + host copies of 4 slots; 16 B
# allocator metadata per copy; B_token = 64. A owns state over tau 1..6, B over 3..9.
A_GPU = 8 * 64 + 16
B_COPY = 4 * 64 + 16


def expected_resident(tau: int) -> dict[str, int]:
    a = A_GPU if 1 <= tau <= 6 else 0
    b = B_COPY if 3 <= tau <= 9 else 0
    return {"gpu": a + b, "host": b}


def test_two_request_trajectory_every_ledger_at_every_tau(db_url):
    report = reports("two_request_trajectory", db_url, trajectory=True)
    points = cuts(report)
    assert sorted(points) == list(range(11))
    for tau, (logical, materialized, reserved, physical, temporary) in TRAJECTORY.items():
        led = points[tau].ledger
        assert (led.logical, led.materialized, led.reserved, led.physical, led.workspace) == (
            logical, materialized, reserved, physical, temporary), tau
        assert led.replication_overhead == materialized - logical
        assert led.reservation_slack == reserved - materialized
        assert led.allocator == physical - reserved
        assert led.instantaneous == physical + temporary
        resident = {t: v for t, v in led.resident.items() if v}
        assert resident == {t: v for t, v in expected_resident(tau).items() if v}, tau
        assert sum(led.resident.values()) == led.physical  # a partition, not an addend
    # tau = 5, reconstructed in the spec line by line
    led = points[5].ledger
    assert (led.replication_overhead, led.reservation_slack, led.allocator) == (192, 320, 48)
    assert led.resident == {"gpu": 800, "host": 272} and led.instantaneous == 1104
    # one scalar called "KV memory" cannot hold both peaks
    assert report.peaks["physical"].value == 1072
    assert report.peaks["instantaneous"].value == 1168
    peak_at = report.peaks["instantaneous"].position
    assert [p for p in report.trajectory if p.position == peak_at][0].t_ns == 3 * MS  # B's prefill


def test_arrival_and_finish_change_no_bytes():
    report = reports("two_request_trajectory", None, trajectory=True)
    for before, after in zip(report.trajectory, report.trajectory[1:]):
        if after.event_type in ("request_allocate", "finish", "output_emit", "append_start"):
            keep = ("logical", "materialized", "reserved", "physical")
            assert [getattr(after.ledger, k) for k in keep] == [getattr(before.ledger, k) for k in keep]
            assert after.ledger.workspace == 0


def test_phase_trace_metrics_window_and_byte_time(db_url):
    report = reports("phase_trace", db_url)
    a, b = report.requests
    assert (a.handle_id, b.handle_id) == ("A", "B")
    assert a.ttft_ns == 14 * MS and b.ttft_ns == 13 * MS
    assert a.tbt_ns == (7 * MS, 9 * MS, 12 * MS) and b.tbt_ns == ()
    assert a.tpot_ns * 3 == pytest.approx(28 * MS, abs=1e-6) and a.tpot_ns == 28 * MS / 3
    assert b.tpot_ns is None  # undefined for one output, never 0
    assert (a.e2e_ns, b.e2e_ns) == (42 * MS, 13 * MS)
    assert (a.release_lag_ns, b.release_lag_ns) == (8 * MS, 1 * MS)
    assert (a.slo_valid, b.slo_valid) == (False, True)  # A's 12 ms TBT fails the 10 ms gate
    w = report.window
    assert (w.completed, w.slo_valid, w.slo_valid_tokens) == (2, 1, 1)
    assert w.throughput_rps == 20.0 and w.goodput_rps == 10.0
    assert w.goodput_fraction == 0.5 and w.token_goodput_tps == 10.0
    # 13,568 byte-ms (A) + 512 byte-ms (B) = 14,080 byte-ms
    assert report.byte_time.logical_byte_ns == (13_568 + 512) * MS


def test_phase_trace_views_at_the_spec_cuts():
    path = FIXTURES / "phase_trace.jsonl"

    def view(at: int, handle: str):
        report = replay_jsonl(path, SPEC_WINDOW, at=at)
        return {h.handle_id: h for h in report.handles}[handle].view

    # event 2: A's prefill begins; pending rows are not readable state
    v = view(2, "A")
    assert v.phase == "PREFILL_IN_FLIGHT" and v.committed_tokens == 0
    # event 6: A emits a0 at t=14; the frontier waits for its decode
    v = view(6, "A")
    assert (v.phase, v.emitted_output_tokens, v.processed_generated_tokens) == ("DECODE_FRONTIER_READY", 1, 0)
    assert v.committed_tokens == 4 and v.next_ordinary_append_bytes == 64
    # event 9: B emits b0 and finishes at t=18, retaining 128 B
    v = view(9, "B")
    assert v.phase == "FINISHED_RETAINED" and v.terminal_retained_logical_payload_bytes == 128
    assert v.output_times == (18 * MS,) and v.finish_time == 18 * MS
    # the end: A released with its last output never processed (no repair needed)
    v = view(21, "A")
    assert v.phase == "RELEASED" and v.emitted_output_tokens == 4 and v.logical_payload_bytes == 0


SWEEP_B_TOKEN = {
    "sensitivity_layers_x2": 128,
    "sensitivity_kv_heads_x2": 128,
    "sensitivity_head_dim_x2": 128,
    "sensitivity_kv_bytes_1": 32,
    "sensitivity_query_heads_x2": 64,  # H_q is not in B_token
}


def at_tau5(name: str, db_url: str | None = None):
    report = reports(name, db_url, trajectory=True)
    return report, cuts(report)[5].ledger


def test_sensitivity_base(db_url):
    report, led = at_tau5("two_request_trajectory", db_url)
    assert {h.b_token for h in report.handles} == {64}
    assert (led.logical, led.materialized, led.rectangular, led.phantom) == (512, 704, 640, 128)


@pytest.mark.parametrize("name, b_token", sorted(SWEEP_B_TOKEN.items()))
def test_sensitivity_one_control_sweeps(name, b_token):
    report, led = at_tau5(name)
    assert {h.b_token for h in report.handles} == {b_token}
    scale = b_token / 64  # every payload-equivalent ledger is linear in B_token
    assert (led.logical, led.materialized, led.rectangular, led.phantom) == tuple(
        int(v * scale) for v in (512, 704, 640, 128))


def test_sensitivity_replica_capacity_workspace_and_release_delay():
    _, base = at_tau5("two_request_trajectory")
    # a replica: logical unchanged; materialized, reserved, metadata and residency grow
    _, rep = at_tau5("sensitivity_replica_a")
    assert rep.logical == base.logical and rep.materialized == base.materialized + 5 * 64
    assert rep.reserved == base.reserved + 8 * 64 and rep.allocator == base.allocator + 16
    assert rep.resident["host"] == base.resident["host"] + A_GPU
    # more reserved capacity only: logical unchanged; slack and physical grow
    _, cap = at_tau5("sensitivity_capacity_a_x2")
    assert cap.logical == base.logical and cap.materialized == base.materialized
    assert cap.reservation_slack == base.reservation_slack + 8 * 64
    assert cap.physical == base.physical + 8 * 64
    # workspace at one event: only the instantaneous cut moves
    base_report = reports("two_request_trajectory", None, trajectory=True)
    ws_report = reports("sensitivity_workspace_b_prefill_x2", None, trajectory=True)
    for p, q in zip(base_report.trajectory, ws_report.trajectory):
        assert q.ledger.physical == p.ledger.physical and q.ledger.logical == p.ledger.logical
        extra = 96 if q.t_ns == 3 * MS and q.event_type == "append_publish" else 0
        assert q.ledger.instantaneous == p.ledger.instantaneous + extra
    assert ws_report.peaks["instantaneous"].value == 1168 + 96
    # a later release: the same bytes at every event, more area under the curve
    late = reports("sensitivity_release_a_delayed", None, trajectory=True)
    assert [p.ledger for p in late.trajectory] == [p.ledger for p in base_report.trajectory]
    # A's 5 committed tokens (320 B logical, 528 B physical) are held 0.5 ms longer
    extra_logical = late.byte_time.logical_byte_ns - base_report.byte_time.logical_byte_ns
    extra_physical = late.byte_time.physical_byte_ns - base_report.byte_time.physical_byte_ns
    assert (extra_logical, extra_physical) == (5 * 64 * MS // 2, A_GPU * MS // 2)


def test_saved_work_p2048_g128(db_url):
    report = reports("saved_work_p2048_g128", db_url)
    [r] = report.requests
    s = r.saved_work
    assert (s.prompt_tokens, s.output_tokens) == (2048, 128)
    assert (s.rows_no_cache, s.rows_cache, s.rows_saved) == (270_272, 2_175, 268_097)
    assert round(s.rows_ratio, 2) == 124.26
    assert (s.pairs_no_cache, s.pairs_cache, s.pairs_saved) == (285_562_176, 2_366_400, 283_195_776)
    assert round(s.pairs_ratio, 2) == 120.67
    # what the journal proves was executed is exactly the cached path
    assert (s.executed_rows, s.executed_pairs, s.executed_appends) == (2_175, 2_366_400, 128)


def test_fixtures_regenerate_byte_identically(tmp_path):
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path)]) == 0
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    # fixtures/telemetry has a generator of its own (fixtures/telemetry/make_fixtures.py);
    # fixtures/journal_0002, journal_0003 and journal_format3 to _format7 were written by older
    # kvledgers (their READMEs say how)
    older = ("telemetry", "journal_0002", "journal_0003", "journal_format3", "journal_format5", "journal_format6",
             "journal_format7")
    checked_in = sorted(p.relative_to(FIXTURES) for p in FIXTURES.rglob("*")
                        if p.is_file() and p.suffix in (".jsonl", ".json")
                        and p.relative_to(FIXTURES).parts[0] not in older)
    assert written == checked_in
    for rel in written:
        assert filecmp.cmp(tmp_path / rel, FIXTURES / rel, shallow=False), rel
