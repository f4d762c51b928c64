"""The KV-event recorder on a NATS cell (issue 46 item 2): a vLLM-form publisher's batches
recorded exactly once, a range evicted past its replay buffer journaled as one gap, a
publisher restart journaled; the cell then verifies clean. (`kv-events serve` from a cell:
tests/test_nats_kv_events_serve.py.)"""

from __future__ import annotations

from typing import Any

from nats_cluster import nats_cluster, nats_url  # noqa: F401 - fixtures

from kvledger.schemas import events as ev

from kv_publisher import Workload
from kv_recording import check_exactly_once, publish_batches, recording, verify_clean, wait_for

N = 300


def test_a_stream_recorded_on_a_cell_is_exactly_once_with_its_gap_and_restart(nats_url):  # noqa: F811
    published: dict[tuple[int, int], list[Any]] = {}
    lost = set(range(100, 200))  # not sent live; the ring keeps only the last 50
    with recording(nats_url, "vllm", buffer_steps=50) as (pub, _):
        publish_batches(pub, Workload(46), N, published, drop=lost, pace=N)
        wait_for(nats_url, 0, timeout=60, last=(0, N - 1))
        replays = list(pub.replays)
        pub.restart()
        publish_batches(pub, Workload(47), 20, published)
        got = wait_for(nats_url, 0, timeout=60, last=(1, 19))
    served = [first for start, first in replays if start == 100]
    assert served and served[0] is not None
    # The gap ends where the replay's first batch or the first live one after the drop
    # (200, when the ring had evicted it before the replay was asked) begins.
    end = min(served[0], max(lost) + 1)
    (gap,) = [e.payload for e in got if isinstance(e, ev.KvEventsGapEvent)]
    assert (gap.epoch, gap.first_seq, gap.last_seq) == (0, 100, end - 1)
    (restart,) = [e.payload for e in got if isinstance(e, ev.KvEventsRestartEvent)]
    assert (restart.epoch, restart.previous_seq) == (1, N - 1)
    check_exactly_once(got, published, missing={(0, s) for s in range(100, end)})
    verify_clean(nats_url)
