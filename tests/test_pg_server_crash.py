"""A PostgreSQL server that crashes (pg_ctl stop -m immediate: no shutdown checkpoint, WAL
recovery at the next start) while a writer commits: every operation the journal
acknowledged is in it after the restart, with gapless positions. Also on a database whose
default is synchronous_commit = off, where the server acknowledges a commit before it is
durable: the journal's sessions commit durably whatever the database's default."""

from __future__ import annotations

import contextlib
import functools
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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


def _crash(pg: ThrowawayPostgres) -> None:
    assert pg.bin is not None and pg.dir is not None
    pg._run(str(pg.bin / "pg_ctl"), "-D", str(pg.dir / "data"), "-m", "immediate", "stop")


def _start(pg: ThrowawayPostgres) -> None:
    """The crashed server started again on its data, with the options it first had."""
    assert pg.bin is not None and pg.dir is not None
    pg._run(str(pg.bin / "pg_ctl"), "-D", str(pg.dir / "data"), "-l", str(pg.dir / "log"), "-o", pg.options,
            "-w", "-t", "60", "start")


def _crash_and_restart(pg: ThrowawayPostgres) -> None:
    _crash(pg)
    _start(pg)


def _crash_once(pg: ThrowawayPostgres, proc: subprocess.Popen, progressed: Callable[[], bool]) -> None:
    """Crash the server and start it again once `progressed()`, `proc` still running."""
    deadline = time.monotonic() + 120
    while not progressed():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the writer made no progress"
        time.sleep(0.01)
    _crash_and_restart(pg)


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
        _crash_once(server, writer, lambda: acks.exists() and acks.read_text().count("\n") >= 100)  # well in
        try:  # it dies of the commit the crash cut, or, met in a read, rides it out (read again) and goes on
            _, err = writer.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            writer.kill()
            _, err = writer.communicate()
    finally:
        if writer.poll() is None:
            writer.kill()
    assert "DATABASE_UNREACHABLE" in err or "DATABASE_ERROR" in err, err[-2000:]  # it lost its server
    acked = acks.read_text().split()
    with open_or_create_journal(url) as j:
        assert [op for op in acked if j.receipt(op) is None] == []
        positions = [p for p, _ in j.read_raw()]
        assert positions == list(range(1, len(positions) + 1)) and len(positions) >= 8 + len(acked)


@contextlib.contextmanager
def _recording(server: ThrowawayPostgres, name: str, *args: str) -> Iterator[tuple[str, Callable[[int], None],
                                                                                 subprocess.Popen[bytes], dict]]:
    """A recorder (`kvledger kv-events record *args`) on a reference publisher into a new
    PostgreSQL journal `name`, 100 batches in: (its URL, publish(n), the recorder, what was
    published). The publisher closes as the block ends."""
    pytest.importorskip("zmq")
    from kv_publisher import Publisher, Workload
    from kv_recording import publish_batches, record_cli, wait_for

    url = server.create_database(name)
    init_database(url)
    pub, w = Publisher("vllm"), Workload(3)
    published: dict[tuple[int, int], list] = {}

    def publish(n: int) -> None:
        publish_batches(pub, w, n, published, pace=50)

    try:
        recorder = record_cli(url, pub, *args)
        time.sleep(1.5)  # the CLI starts and connects
        publish(100)
        wait_for(url, 80)
        yield url, publish, recorder, published
    finally:
        pub.close()


def test_the_kv_events_recorder_rides_out_a_server_crash(server):
    """`kvledger kv-events record` into PostgreSQL while the server crashes and restarts:
    the group being appended is asked again until the server is back (its operation ids
    land it once), the receiving loop waits meanwhile, and every batch the publisher sent
    is journaled exactly once."""
    from kv_recording import check_exactly_once, stream_events

    with _recording(server, "recorder", "--idle-exit", "2") as (url, publish, recorder, published):
        _crash_and_restart(server)
        publish(200)
        _, err = recorder.communicate(timeout=120)
    assert recorder.returncode == 0, err.decode()[-2000:]
    assert b"the journal did not take a group" in err  # it met the crash
    check_exactly_once(stream_events(url), published)


def test_a_recorder_told_to_stop_while_the_database_is_down_stops(server):
    """SIGTERM while the server is down: the recorder stops asking the journal again and
    ends at once with the database's coded error, not after its retry window."""
    try:
        with _recording(server, "stopping") as (_, publish, recorder, _):
            _crash(server)
            publish(100)
            time.sleep(1.0)  # it meets the outage and asks again
            asked = time.monotonic()
            recorder.send_signal(signal.SIGTERM)
            _, err = recorder.communicate(timeout=120)
            took = time.monotonic() - asked
    finally:
        _start(server)
    assert recorder.returncode == 2 and b"DATABASE_UNREACHABLE" in err, err.decode()[-2000:]
    assert took < 15, took  # the retry window is 60 s


def _heads_at_least(conn: psycopg.Connection, n: int) -> bool:
    return conn.execute("SELECT count(*) FROM kvl_heads").fetchone()[0] >= n


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_demo_rides_out_a_server_crash(server, tmp_path, writer):
    """`kvledger demo` while the server crashes and restarts: the commit in flight, its
    outcome unknown, is sent again with the same operation ids once the server is back
    (each lands once), reads are read again; the run finishes, journals what the same run
    journals undisturbed, and verifies."""
    import json

    from demo_runs import assert_journaled_as_undisturbed, demo_argv, demo_env

    url = server.create_database(f"demo_{writer}")  # names built here, not input
    init_database(url)
    proc = subprocess.Popen(demo_argv(writer, url), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=demo_env())
    try:
        with psycopg.connect(conninfo(url), autocommit=True) as watch:
            _crash_once(server, proc, functools.partial(_heads_at_least, watch, 30))  # well into the run
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "the journal did not take" in err  # it met the crash
    assert_journaled_as_undisturbed(json.loads(out))
    check = subprocess.run([sys.executable, "-m", "kvledger", "verify", "--db", url], capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_read_the_journal_waited_out_is_not_waited_out_again(server):
    """The server down: a command service's read of a stream goes to the journal, which
    reads again for its window and gives up; the service, which asks a read again too,
    raises it then instead of waiting a window of its own on top (both windows shortened
    here: the journal's 1 s, the service's 4 s)."""
    from kvledger.engine.service import CommandService
    from kvledger.schemas.errors import ErrorCode, KvLedgerError

    from factories import allocate_op

    url = server.create_database("waited_out")
    init_database(url)
    try:
        with open_or_create_journal(url) as j:
            j.append([allocate_op("h")])
            service = CommandService(j)
            j.retry_s, service.retry_s = 1.0, 4.0
            _crash(server)
            asked = time.monotonic()
            with pytest.raises(KvLedgerError) as lost:
                service.state("h", refresh=True)
            took = time.monotonic() - asked
    finally:
        _start(server)
    assert lost.value.code is ErrorCode.DATABASE_UNREACHABLE
    assert 0.5 <= took < 2.5, took  # asked again within the journal's window, and not after it
