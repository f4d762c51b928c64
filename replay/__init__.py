"""Read side: the projector (snapshots, byte ledgers, byte-time, service metrics),
time travel, incremental projection, audit files, and verify.

Imports schemas, journal and engine; nothing below imports replay.

    from kvledger.replay import WindowSpec, replay_jsonl
    report = replay_jsonl("fixtures/two_request_trajectory.jsonl",
                          WindowSpec(slo_ttft_ns=15_000_000, slo_tbt_ns=10_000_000),
                          at=7, trajectory=True)
    report.ledger.physical, report.peaks["instantaneous"].value
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.schemas import lazy

if TYPE_CHECKING:
    from kvledger.replay.archive import ImportSummary, derive_tables, export_jsonl, import_jsonl
    from kvledger.replay.ledger import ByteTime, LedgerPoint, LedgerValues, Peak
    from kvledger.replay.metrics import (
        RequestMetrics,
        SavedWork,
        WindowMetrics,
        WindowSpec,
        request_metrics,
        saved_work,
        window_metrics,
    )
    from kvledger.replay.projector import ProjectionState, Projector
    from kvledger.replay.report import HandleSnapshot, Report, build, snapshot_sha256, to_json
    from kvledger.replay.run import (
        CHECKPOINT,
        project,
        replay_incremental,
        replay_journal,
        replay_jsonl,
        resume,
    )
    from kvledger.replay.sources import journal_events, jsonl_bodies, jsonl_events
    from kvledger.replay.verify import Checker, Finding, VerifyResult, verify_bodies, verify_journal, verify_jsonl

# Loaded when first used: the CLI's parser and a reader of one module (replay.metrics for
# its SLO defaults) do not load the projector and numpy with them.
__getattr__ = lazy.exports(__name__, {
    "archive": ("ImportSummary", "derive_tables", "export_jsonl", "import_jsonl"),
    "ledger": ("ByteTime", "LedgerPoint", "LedgerValues", "Peak"),
    "metrics": ("RequestMetrics", "SavedWork", "WindowMetrics", "WindowSpec", "request_metrics", "saved_work",
                "window_metrics"),
    "projector": ("ProjectionState", "Projector"),
    "report": ("HandleSnapshot", "Report", "build", "snapshot_sha256", "to_json"),
    "run": ("CHECKPOINT", "project", "replay_incremental", "replay_journal", "replay_jsonl", "resume"),
    "sources": ("journal_events", "jsonl_bodies", "jsonl_events"),
    "verify": ("Checker", "Finding", "VerifyResult", "verify_bodies", "verify_journal", "verify_jsonl"),
})

__all__ = [
    "CHECKPOINT",
    "ByteTime",
    "Checker",
    "Finding",
    "HandleSnapshot",
    "ImportSummary",
    "LedgerPoint",
    "LedgerValues",
    "Peak",
    "ProjectionState",
    "Projector",
    "Report",
    "RequestMetrics",
    "SavedWork",
    "VerifyResult",
    "WindowMetrics",
    "WindowSpec",
    "build",
    "derive_tables",
    "export_jsonl",
    "import_jsonl",
    "journal_events",
    "jsonl_bodies",
    "jsonl_events",
    "project",
    "replay_incremental",
    "replay_journal",
    "replay_jsonl",
    "request_metrics",
    "resume",
    "saved_work",
    "snapshot_sha256",
    "to_json",
    "verify_bodies",
    "verify_journal",
    "verify_jsonl",
    "window_metrics",
]
