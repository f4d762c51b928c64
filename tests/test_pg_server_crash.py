"""A PostgreSQL server that crashes (pg_ctl stop -m immediate: no shutdown checkpoint, WAL
recovery at the next start) while a writer commits: every operation the journal
acknowledged is in it after the restart, with gapless positions. Also on a database whose
default is synchronous_commit = off, where the server acknowledges a commit before it is
durable: the journal's sessions commit durably whatever the database's default."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from kvledger.journal.pgserver import ThrowawayPostgres, conninfo, find_bin
from kvledger.migrations.storage import init_database, open_or_create_journal

pytestmark = pytest.mark.skipif(find_bin() is None, reason="no PostgreSQL server binaries")

TESTS = Path(__file__).resolve().parent
# The writer: 8 handles, a publication on each a commit, every acknowledged operation id
# written down (flushed) as its receipt returns, until the server goes away.
WRITER = """
import sys
sys.path.insert(0, sys.argv[3])
from factories import allocate_op, guard_of, publish_op
from kvledger.migrations.storage import open_or_create_journal
with open_or_create_journal(sys.argv[1]) as j, open(sys.argv[2], "w") as acks:
    handles = [f"h{i}" for i in range(8)]
    j.append([allocate_op(h) for h in handles])
    for k in range(10 ** 6):
        results = j.append([publish_op(h, guard_of(j.head(h)), f"p{k}-{h}") for h in handles])
        acks.write(" ".join(r.operation_id for r in results) + "\\n")
        acks.flush()
"""


@pytest.fixture(scope="module")
def server():
    pg = ThrowawayPostgres(fsync=True).start()  # fsync on: a crash is survived only by what reached the disk
    yield pg
    pg.stop()


def _crash_and_restart(pg: ThrowawayPostgres) -> None:
    assert pg.bin is not None and pg.dir is not None
    data = str(pg.dir / "data")
    pg._run(str(pg.bin / "pg_ctl"), "-D", data, "-m", "immediate", "stop")
    pg._run(str(pg.bin / "pg_ctl"), "-D", data, "-l", str(pg.dir / "log"), "-w", "-t", "60", "-o",
            f"-c listen_addresses=127.0.0.1 -c port={pg.port} -c unix_socket_directories={pg.dir / 'sock'}",
            "start")


@pytest.mark.parametrize("default", ["on", "off"], ids=["synchronous_commit_on", "synchronous_commit_off"])
def test_acknowledged_writes_survive_a_server_crash(server, tmp_path, default):
    name = f"crash_sync_{default}"  # names built here, not input
    url = server.create_database(name)
    init_database(url)
    with psycopg.connect(conninfo(url), autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {name} SET synchronous_commit = {default}")
    acks = tmp_path / "acks.txt"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, url, str(acks), str(TESTS)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not acks.exists() or acks.read_text().count("\n") < 100:  # well into its commits
            assert writer.poll() is None, writer.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the writer made no progress"
            time.sleep(0.01)
        _crash_and_restart(server)
        _, err = writer.communicate(timeout=120)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert "DATABASE_UNREACHABLE" in err or "DATABASE_ERROR" in err, err[-2000:]  # it lost its server
    acked = acks.read_text().split()
    with open_or_create_journal(url) as j:
        assert [op for op in acked if j.receipt(op) is None] == []
        positions = [p for p, _ in j.read_raw()]
        assert positions == list(range(1, len(positions) + 1)) and len(positions) >= 8 + len(acked)


def test_the_kv_events_recorder_rides_out_a_server_crash(server):
    """`kvledger kv-events record` into PostgreSQL while the server crashes and restarts:
    the group being appended is asked again until the server is back (its operation ids
    land it once), the receiving loop waits meanwhile, and every batch the publisher sent
    is journaled exactly once."""
    pytest.importorskip("zmq")
    from kv_publisher import Publisher, Workload
    from kv_recording import check_exactly_once, publish_batches, record_cli, stream_events, wait_for

    url = server.create_database("recorder")
    init_database(url)
    pub = Publisher("vllm")
    published: dict[tuple[int, int], list] = {}
    w = Workload(3)
    try:
        recorder = record_cli(url, pub, "--idle-exit", "2")
        time.sleep(1.5)  # the CLI starts and connects
        publish_batches(pub, w, 200, published, pace=50)
        wait_for(url, 150)
        _crash_and_restart(server)
        publish_batches(pub, w, 200, published, pace=50)
        _, err = recorder.communicate(timeout=120)
    finally:
        pub.close()
    assert recorder.returncode == 0, err.decode()[-2000:]
    assert b"the journal did not take a group" in err  # it met the crash
    check_exactly_once(stream_events(url), published)
