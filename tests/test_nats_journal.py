"""What the NATS journal adds to the contract (tests/test_nats_contract.py): writers on
several connections serialized per cell, a retry from a fresh connection answered from
the stream, init's refusal of servers that do not sync every write, credentials kept out
of messages, and the commands (demo, verify, replay) on a three-server cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from nats_cluster import fresh_cell, nats_url  # noqa: F401  # a fixture

from kvledger.journal import Guard, Rejection
from kvledger.journal.nats import NatsJournal
from kvledger.journal.nats_admin import init_cell
from kvledger.journal.nats_heads import token
from kvledger.journal.nats_server import NatsCluster
from kvledger.replay import verify_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt

from factories import allocate_op, guard_of, publish_op


def test_writers_on_two_connections_keep_positions_gapless_and_guards_exact(nats_url):  # noqa: F811
    """Two connections append at once, each to its own handles and both to a shared one
    from the head it read: every commit lands once, positions are gapless, a guard that
    lost the race is STALE_BASE, and verify finds the chain whole."""
    a, b = NatsJournal(nats_url), NatsJournal(nats_url)
    try:
        a.append([allocate_op("shared")] + [allocate_op(f"{w}{i}") for w in "ab" for i in range(3)])
        outcomes: dict[str, list[str]] = {"a": [], "b": []}

        def write(j: NatsJournal, w: str) -> None:
            for step in range(8):
                ops = [publish_op(f"{w}{i}", guard_of(j.head(f"{w}{i}")), f"{w}-{step}-{i}") for i in range(3)]
                ops.append(publish_op("shared", guard_of(j.head("shared")), f"{w}-{step}-shared"))
                results = j.append(ops)
                assert all(isinstance(r, Receipt) for r in results[:3]), results
                outcomes[w].append(type(results[3]).__name__ if isinstance(results[3], Receipt)
                                   else results[3].code)

        threads = [threading.Thread(target=write, args=(j, w)) for j, w in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        won = sum(o == "Receipt" for w in "ab" for o in outcomes[w])
        assert all(o in ("Receipt", ErrorCode.STALE_BASE) for w in "ab" for o in outcomes[w])
        positions = [p for p, _ in b.read_raw()]
        assert positions == list(range(1, 7 + 48 + won + 1))
        assert [e.stream_position for e in a.read_stream("shared")] == list(range(1, won + 2))
        assert [f for f in verify_journal(b).findings if f.code in ("TAMPERED", "STORAGE_CORRUPT")] == []
    finally:
        a.close()
        b.close()


def test_a_retry_from_a_fresh_connection_is_answered_from_the_stream(nats_url):  # noqa: F811
    """A writer whose acknowledgement was lost retries on a new connection: the commit is
    found in the stored records and its receipt returned, nothing written twice; the same
    id with another fingerprint is CONFLICT."""
    with NatsJournal(nats_url) as first:
        first.append([allocate_op("h1")])
        op = publish_op("h1", Guard(0, 0, 1), "op-1")
        [original] = first.append([op])
    with NatsJournal(nats_url) as again:
        assert again.append([op]) == [original]
        [changed] = again.append([publish_op("h1", Guard(0, 0, 1), "op-1", fingerprint="other")])
        assert isinstance(changed, Rejection) and changed.code == ErrorCode.CONFLICT
        assert again.last_position() == 2 and again.receipt("op-1") == original


def test_a_retry_whose_commit_lands_inside_its_decision_is_answered(nats_url, monkeypatch):  # noqa: F811
    """The same operation retried on a second connection while the first one's commit
    lands between the retry's read of the last record and its read of the head: the
    retry saw neither the stored operation (its ids are indexed up to that record) nor the
    old head. It is decided again and answered with the receipt, never refused STALE_BASE
    (a refusal on a head past the record it read is the journal at no moment)."""
    with NatsJournal(nats_url) as first:
        first.append([allocate_op("h1")])
        op = publish_op("h1", guard_of(first.head("h1")), "op-1")
        committed: list = []
        with NatsJournal(nats_url) as again:
            def lands_first(handles: list[str]) -> dict:
                if not committed:
                    committed.extend(first.append([op]))
                return NatsJournal._read_heads(again, handles)
            monkeypatch.setattr(again, "_read_heads", lands_first)
            assert again.append([op]) == committed and isinstance(committed[0], Receipt)
            assert again.last_position() == 2


def test_ids_that_are_no_subject_token_are_hashed_apart(nats_url):  # noqa: F811
    with NatsJournal(nats_url) as j:
        odd = ["a.b", "a b", "*", ">", "a.b.c", "~x"]
        j.append([allocate_op(h) for h in odd])
        assert set(j.heads()) == set(odd) and j.existing(odd + ["a"]) == set(odd)
        assert {token(h) for h in odd} == {token(h) for h in set(odd)} and len({token(h) for h in odd}) == 6
        assert [e.stream_id for e in j.read_stream("a.b")] == ["a.b"]


def test_init_refuses_servers_that_do_not_sync_every_write():
    lazy = NatsCluster(1, sync="2m").start()
    try:
        url = lazy.url("lazy").replace("?", "?replicas=1&")
        with pytest.raises(KvLedgerError) as exc:
            init_cell(url)
        assert exc.value.code is ErrorCode.INVALID_ARGUMENT and "sync every write" in exc.value.message
        with pytest.raises(KvLedgerError, match="monitoring ports"):
            init_cell(lazy.url("lazy", monitor=False) + "?replicas=1")
        init_cell(url, allow_lazy_fsync=True)
        with NatsJournal(url) as j:
            assert j.last_position() == 0
    finally:
        lazy.stop()


def test_credentials_stay_out_of_messages(nats_cluster):
    secret = "s3cr3t-pw"
    port = nats_cluster.client_ports[0]
    with pytest.raises(KvLedgerError) as exc:
        NatsJournal(f"nats://kv:{secret}@127.0.0.1:{port}/nope")
    assert exc.value.code is ErrorCode.NOT_MIGRATED and "kv:***@" in exc.value.message
    with pytest.raises(KvLedgerError) as exc:
        NatsJournal(f"nats://127.0.0.1:{port}/nope?creds=/nonexistent/{secret}")
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT and "creds=***" in exc.value.message
    with pytest.raises(KvLedgerError) as exc:
        NatsJournal(f"nats://kv:{secret}@127.0.0.1:1/cell?timeout=1")
    assert exc.value.code is ErrorCode.DATABASE_UNREACHABLE
    for bad in (f"nats://kv:{secret}/cell", f"nats://kv:{secret}@h@x/cell", f"nats://h/ce.ll?password={secret}"):
        with pytest.raises(KvLedgerError) as exc:
            NatsJournal(bad)
        assert exc.value.code is ErrorCode.BAD_DATABASE_URL and secret not in str(exc.value), bad


def test_demo_verify_replay_export_and_import_run_on_cells(nats_cluster, tmp_path):
    """The commands on NATS: a demo writes a cell, verify finds it clean, replay reads it,
    export writes it out and import loads that into a second cell (once: a second import
    is refused), which reads back the same bytes at the same positions, the same heads
    and receipts, and verifies clean."""
    url, copy = fresh_cell(nats_cluster, "demo"), fresh_cell(nats_cluster, "copy")
    audit = tmp_path / "demo.jsonl"

    def run(*args: str, db: str = url) -> subprocess.CompletedProcess[str]:
        json_out = ["--json"] if args[0] != "export" else []
        return subprocess.run([sys.executable, "-m", "kvledger", *args, "--db", db, *json_out],
                              capture_output=True, text=True, timeout=300)

    demo = run("demo", "--requests", "8", "--max-new-tokens", "6")
    assert demo.returncode == 0, demo.stderr[-2000:]
    verified = run("verify")
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"], verified.stdout[-2000:]
    for args in (("replay",), ("export", "--out", str(audit)), ("import", str(audit))):
        done = run(*args, db=copy if args[0] == "import" else url)
        assert done.returncode == 0, (args, done.stderr[-2000:])
    again = run("import", str(audit), db=copy)
    assert again.returncode != 0 and "not empty" in again.stderr + again.stdout
    copied = run("verify", db=copy)
    assert copied.returncode == 0 and json.loads(copied.stdout)["ok"], copied.stdout[-2000:]
    with NatsJournal(url) as j, NatsJournal(copy) as c:
        assert j.last_position() == json.loads(verified.stdout)["events"] > 100
        assert list(c.read_raw()) == list(j.read_raw())
        # (an import derives its receipts from the events: fingerprint and clock are its own)
        def kept(journal: NatsJournal) -> list[tuple]:
            return [(r.operation_id, r.handles, r.event_ids, r.first_global_position, r.last_global_position)
                    for r in journal.read_receipts()]

        assert kept(c) == kept(j) and c.heads() == j.heads()


def test_killing_the_stream_leader_loses_no_acknowledged_commit():
    """SIGKILL the stream's leader while a writer commits: appends pause while the others
    elect a new leader, then go on; every acknowledged commit is stored once, positions
    stay gapless, and verify is clean once the killed server is back."""
    cluster = NatsCluster(3).start()
    try:
        # an election under a loaded CI machine took over the default 10 s a request waits
        url = fresh_cell(cluster, "failover") + "&timeout=60"
        with NatsJournal(url) as j:
            handles = [f"h{i}" for i in range(4)]
            j.append([allocate_op(h) for h in handles])
            acked: list[Receipt] = []
            killed = None
            for step in range(40):
                if step == 10:
                    killed = cluster.index(j.client.api(f"STREAM.INFO.{j.stream}")["cluster"]["leader"])
                    cluster.kill(killed)
                results = j.append([publish_op(h, guard_of(j.head(h)), f"s{step}-{h}") for h in handles])
                assert all(isinstance(r, Receipt) for r in results), results
                acked += results
            assert killed is not None
            cluster.restart(killed)
            assert [p for p, _ in j.read_raw()] == list(range(1, 4 + 40 * 4 + 1))
            assert all(j.receipt(r.operation_id) == r for r in acked)
            assert [f for f in verify_journal(j).findings if f.code in ("TAMPERED", "STORAGE_CORRUPT")] == []
    finally:
        cluster.stop()


def test_a_direct_get_no_server_answers_is_asked_again_then_unreachable(nats_url):  # noqa: F811
    """A 503 (no responder) comes while a cluster still spreads a stream's direct-get
    interest: the client asks again until its timeout, as it asks a request nobody
    answers, then DATABASE_UNREACHABLE. A stream that does not exist is never answered."""
    import time

    timeout = 1.0
    with NatsJournal(f"{nats_url}&timeout={timeout}") as j:
        j.append([allocate_op("h1")])
        asked = []
        once = j.client._get_many_once

        async def counted(stream, request):
            asked.append(stream)
            return await once(stream, request)

        j.client._get_many_once = counted
        assert [m.seq for m in j.client.get_many(j.stream, {"seq": 1, "batch": 8})] != [] and len(asked) == 1
        t0 = time.monotonic()
        with pytest.raises(KvLedgerError) as gone:
            j.client.get_many(j.stream + "_NONE", {"seq": 1, "batch": 8})
        assert gone.value.code == ErrorCode.DATABASE_UNREACHABLE and "no JetStream responder" in gone.value.message
        assert len(asked) - 1 >= 3 and time.monotonic() - t0 >= timeout - 0.5  # the last wait is 0.5 s at most
