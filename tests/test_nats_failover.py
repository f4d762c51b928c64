"""Issue 46's failover acceptance: SIGKILL the stream's leader while `kvledger demo`
writes to a three-server cluster, restart it, run `kvledger recover` and `verify`:
nothing the demo was acknowledged is lost, verify is clean, and every request's outputs
equal those of an uninterrupted run of the same demo (on SQLite: same seed, same tokens)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nats_cluster import fresh_cell

from kvledger.engine.evolve import fold
from kvledger.journal import Journal
from kvledger.journal.nats import NatsJournal
from kvledger.journal.nats_server import NatsCluster
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


def test_killing_the_leader_under_a_demo_loses_nothing_acknowledged(tmp_path: Path):
    baseline = kvledger(*DEMO, db=f"sqlite:///{tmp_path / 'baseline.db'}")
    assert baseline.returncode == 0, baseline.stderr[-2000:]
    with open_existing_journal(f"sqlite:///{tmp_path / 'baseline.db'}") as b:
        want = outputs(b)
    assert len(want) == 9 and sum(map(len, want.values())) == json.loads(baseline.stdout)["tokens"]

    cluster = NatsCluster(3).start()
    try:
        url = fresh_cell(cluster, "failover")
        acks = tmp_path / "acks.jsonl"
        demo = subprocess.Popen([sys.executable, "-c", ACKING_DEMO, str(acks), *DEMO, "--db", url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with NatsJournal(url) as watch:
            deadline = time.monotonic() + 60
            while watch.last_position() < 40 and demo.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            killed_at = watch.last_position()
        assert demo.poll() is None, "the demo ended before the kill: nothing was tested"
        killed = int(stream_cluster(url)["leader"].removeprefix("n"))
        cluster.kill(killed)
        out, err = demo.communicate(timeout=120)
        if demo.returncode != 0:  # gave up during the election: a coded error, then recovery finishes it
            assert demo.returncode == 2 and err.strip().splitlines()[-1].split(":")[0] in ErrorCode.__members__, err
        cluster.restart(killed)
        group = caught_up(url)  # the restarted server holds the whole stream again
        assert sorted([group["leader"], *(r["name"] for r in group["replicas"])]) == ["n0", "n1", "n2"] and all(
            r.get("current") and not r.get("lag") for r in group["replicas"]), group

        recovered = kvledger("recover", "--json", db=url)
        report = json.loads(recovered.stdout)
        assert recovered.returncode == 0 and report["ok"], (recovered.stdout[-2000:], recovered.stderr[-2000:])
        verified = kvledger("verify", "--json", db=url)
        assert verified.returncode == 0 and json.loads(verified.stdout)["ok"], verified.stdout[-2000:]

        with NatsJournal(url) as j:
            stored = {r.operation_id: r for r in j.read_receipts()}
            positions = {e.event_id: e.global_position for e in j.read_all()}
            acked = [json.loads(line) for line in acks.read_text().splitlines()]
            assert acked[-1][3] > killed_at  # the demo committed after the kill
            for op, events, first, last in acked:
                r = stored.get(op)
                assert r is not None and (list(r.event_ids), r.first_global_position, r.last_global_position) \
                    == (events, first, last), op
                assert [positions.get(e) for e in events] == list(range(first, last + 1)), op
            assert sorted(positions.values()) == list(range(1, j.last_position() + 1))
            assert outputs(j) == want
        if demo.returncode == 0:
            assert json.loads(out)["errors"] == [] and report["events_written"] == 0
    finally:
        cluster.stop()
