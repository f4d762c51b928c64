"""`kvledger crash-test` on NATS: trials on cells of the three-server loopback cluster
(each trial a cell of its own), every fault point of the NATS commit path hit by a
writer killed there, zero lost acknowledged writes, zero partial commits, zero digest
or output mismatches, and a second recover that writes nothing. Fewer trials than on
SQL (tests/test_crash_cli.py) for CI's time; `kvledger crash-test --trials 200` runs
more by hand. Also: a batch a writer left half sent on the server never shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from nats_cluster import nats_url  # noqa: F401  # a fixture

from kvledger.journal import faults
from kvledger.journal.nats import NatsJournal
from kvledger.journal.nats_client import NatsClient
from kvledger.journal.url import parse_url
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt

from factories import allocate_op, guard_of, publish_op

TRIALS = 8  # two SIGKILLs and an os._exit at each of the six points


def test_crash_test_trials_on_nats_cells(nats_cluster):
    url = nats_cluster.url(f"crash{os.getpid()}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_FAULTS")}
    p = subprocess.run([sys.executable, "-m", "kvledger", "crash-test", "--db", url, "--trials", str(TRIALS),
                        "--seed", "3", "--json"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    r = json.loads(p.stdout)
    print(f"\ncrash-test nats: {json.dumps({k: v for k, v in r.items() if k not in ('moments', 'workload')})}")
    assert r["ok"] and r["backend"] == "nats" and r["trials"] == TRIALS and r["violations"] == []
    assert (r["lost"], r["partial"], r["digest_mismatches"], r["output_mismatches"]) == (0, 0, 0, 0)
    assert (r["verify_findings"], r["unfinished"], r["second_recover_writes"], r["checkpoint_mismatches"],
            r["recovery_errors"], r["child_failures"]) == (0, 0, 0, 0, 0, 0)
    assert r["fault_points_missed"] == [] and r["fault_not_reached"] == 0
    assert r["crash_moments"]["crashed"] == TRIALS and r["crash_moments"]["by_mode"] == {"sigkill": 2, "exit": 6}
    assert r["acknowledged_writes_checked"] > 20 * TRIALS and r["transactions_checked"] > 0
    assert r["unacknowledged_commits"] > 0 and r["aborted_appends"] > 0 and r["rows_reexecuted"] > 0
    # every trial's cell is gone again: only the cells of other tests are on the cluster
    client = NatsClient(parse_url(url))
    try:
        names = client.api("STREAM.NAMES").get("streams") or []
    finally:
        client.close()
    assert not [n for n in names if n.startswith(f"KVL_crash{os.getpid()}-")]
    assert r["workdir"] is None  # and the trials' logs are gone


def test_a_batch_left_open_on_the_server_never_shows_and_its_retry_commits_once(nats_url):  # noqa: F811
    """A `raise` at mid_batch: the record and one head are on the server, the commit
    message never sent. The caller sees DATABASE_UNREACHABLE, the stream stores none of
    the open batch, and the same operations again (the same Nats-Msg-Id) commit once."""
    j = NatsJournal(nats_url)
    try:
        first = j.append([allocate_op("a"), allocate_op("b")])
        ops = [publish_op("a", guard_of(j.head("a")), "pa"), publish_op("b", guard_of(j.head("b")), "pb")]
        stored = _messages(j)
        faults.configure("mid_batch:raise@1")
        try:
            with pytest.raises(KvLedgerError) as info:
                j.append(ops)
            assert faults.hits["mid_batch"] == 1
        finally:
            faults.configure(None)
        assert info.value.code is ErrorCode.DATABASE_UNREACHABLE and "mid_batch" in str(info.value)
        assert _messages(j) == stored and j.receipt("pa") is None
        got = j.append(ops)
        assert all(isinstance(r, Receipt) for r in got)
        last = first[-1].last_global_position
        assert [r.last_global_position for r in got] == [last + 1, last + 2]
        assert _messages(j) == stored + 3  # the record and the two heads, once
        other = NatsJournal(nats_url)  # a fresh reader, nothing remembered
        try:
            assert [e.operation_id for e in other.read_all(after=last)] == ["pa", "pb"]
            assert [other.receipt(op.operation_id) for op in ops] == got
        finally:
            other.close()
    finally:
        j.close()


def _messages(j: NatsJournal) -> int:
    return int(j.client.api(f"STREAM.INFO.{j.stream}")["state"]["messages"])
