"""`kvledger import` into a NATS cell is all or nothing, though it takes many atomic
batches: one that fails partway is undone (the cell is empty again), and one whose
process is SIGKILLed partway leaves a cell that refuses every use as CORRUPT_JOURNAL
until an import into it completes (journal.nats_import)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
from nats_cluster import fresh_cell, nats_url  # noqa: F401  # a fixture

from kvledger.journal.nats import NatsJournal
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import verify_journal
from kvledger.replay.archive import export_jsonl, import_jsonl
from kvledger.schemas.errors import ErrorCode, KvLedgerError

from factories import allocate_op

HANDLES = 700  # a record each, so the import's messages take several batches (journal.nats_import.BATCH)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("export")
    with open_or_create_journal(f"sqlite:///{path}/source.db") as j:
        for i in range(HANDLES):
            j.append([allocate_op(f"h{i}")])
        export_jsonl(j, path / "source.jsonl")
    return str(path / "source.jsonl")


def _messages(j: NatsJournal) -> int:
    return int((j.client.api(f"STREAM.INFO.{j.stream}").get("state") or {}).get("messages", 0))


def _imported_whole(url: str, exported: str) -> None:
    with NatsJournal(url) as j:
        assert b"".join(body + b"\n" for _, body in j.read_raw()) == open(exported, "rb").read()
        assert len(j.heads()) == HANDLES


def test_an_import_refused_partway_is_undone(nats_url, exported):  # noqa: F811
    """Another writer's message between two of the import's batches makes the next batch's
    expectation fail: the import stops, the cell is empty again, and a second import of
    the same file then loads all of it."""
    with NatsJournal(nats_url) as j:
        publish_batch = j.client.publish_batch
        calls = []

        def interleaved(batch):
            if calls:  # after the first batch: another writer's message
                j.client.publish(f"{j.prefix}.c.other", b"x", {})
            calls.append(len(batch))
            return publish_batch(batch)

        j.client.publish_batch = interleaved  # type: ignore[method-assign]  # the interleaving writer
        with pytest.raises(KvLedgerError) as exc:
            import_jsonl(j, exported)
        assert exc.value.code is ErrorCode.DATABASE_ERROR and "undone" in str(exc.value), exc.value
        assert len(calls) == 2 and _messages(j) == 0
        j.client.publish_batch = publish_batch  # type: ignore[method-assign]
        assert j.last_position() == 0
        import_jsonl(j, exported)
    _imported_whole(nats_url, exported)


_KILLED = textwrap.dedent("""
    import os, signal, sys
    from kvledger.journal.nats import NatsJournal
    from kvledger.replay.archive import import_jsonl

    j = NatsJournal(sys.argv[1])
    publish_batch = j.client.publish_batch

    def then_die(batch):
        publish_batch(batch)
        os.kill(os.getpid(), signal.SIGKILL)  # after the first batch is stored

    j.client.publish_batch = then_die
    import_jsonl(j, sys.argv[2])
""")


def test_an_import_killed_partway_is_refused_until_imported_again(nats_cluster, exported):
    """SIGKILL the importing process after its first batch: every later open of the cell
    refuses reads, writes and verify as CORRUPT_JOURNAL naming the unfinished import, and
    `kvledger import` of the file replaces it whole."""
    url = fresh_cell(nats_cluster, "killed")
    killed = subprocess.run([sys.executable, "-c", _KILLED, url, exported], capture_output=True, text=True,
                            timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    with NatsJournal(url) as j:
        assert 0 < _messages(j) < HANDLES
        for use in (j.last_position, lambda: list(j.read_raw()), lambda: j.append([allocate_op("late")])):
            with pytest.raises(KvLedgerError) as exc:
                use()
            assert exc.value.code is ErrorCode.CORRUPT_JOURNAL and "unfinished" in str(exc.value)

    with pytest.raises(KvLedgerError) as exc, NatsJournal(url) as j:
        verify_journal(j)
    assert exc.value.code is ErrorCode.CORRUPT_JOURNAL
    again = subprocess.run([sys.executable, "-m", "kvledger", "import", exported, "--db", url, "--json"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    with NatsJournal(url) as j:
        assert verify_journal(j).ok
    _imported_whole(url, exported)
