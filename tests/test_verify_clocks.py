"""A source's monotonic clock is its process's: verify holds one source to it never
running backwards on a stream (TIME_REGRESSION), and never compares two sources' (spec:
monotonic timestamps of different processes cannot be compared). So a writer that comes
back after a restart or a reboot, its clock starting again, must be another source."""

from __future__ import annotations

from kvledger import Ledger
from kvledger.engine.service import ManualClock
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import verify_journal

from lifecycle_helpers import make_manifest


def _clock_findings(url: str) -> list[str]:
    with open_or_create_journal(url) as j:
        return [f.message for f in verify_journal(j).findings if f.code == "TIME_REGRESSION"]


def test_one_source_whose_clock_runs_back_on_a_stream_is_found(db_url):
    clock = ManualClock().at(5_000)
    with Ledger.open(db_url, source_instance="app", clock=clock) as led:
        led.allocate("h", make_manifest("h"), reserved_capacity=8)
        clock.at(1_000)  # the same source, earlier
        led.cancel("h", base=0)
    [message] = _clock_findings(db_url)
    assert "from app" in message


def test_two_runs_are_two_sources_whose_clocks_are_not_compared(db_url):
    """The CLI's writers (demo, generate, recover, kv-events) name each run
    (engine.ids.instance_name): the second run's clock, started again, is its own."""
    from kvledger.engine.ids import instance_name

    first, second = instance_name("kvledger-recover"), instance_name("kvledger-recover")
    assert first != second and first.startswith("kvledger-recover-")
    with Ledger.open(db_url, clock=ManualClock().at(5_000), source_instance=first) as before:
        before.allocate("h", make_manifest("h"), reserved_capacity=8)
    with Ledger.open(db_url, clock=ManualClock().at(1_000), source_instance=second) as after:  # after a reboot
        after.cancel("h", base=0)
    with open_or_create_journal(db_url) as j:
        assert [e.source_instance for e in j.read_stream("h")] == [first, second]
    assert _clock_findings(db_url) == []
