"""The writer-process journal (journal.process) beyond the shared contract, which
tests/test_journal_contract.py already runs through it: a writer that dies (a real
os._exit at a fault point, a real SIGKILL), a parent that dies, and what a caller can
then know."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
from factories import allocate_op, guard_of, publish_op

from kvledger.storage import open_journal
from schemas.errors import ErrorCode, KvLedgerError
from schemas.receipts import Receipt


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("point, committed", [("before_update", False), ("after_commit", True)])
def test_a_writer_that_dies_mid_append_acknowledges_nothing(db_url, monkeypatch, point, committed):
    """The writer exits (os._exit, no cleanup) inside the second append: the caller gets
    DATABASE_UNREACHABLE, the first append stays acknowledged and stored, and the second
    is either absent (died before writing) or committed without an acknowledgement
    (died after it): the in-doubt outcome a receipt lookup resolves."""
    monkeypatch.setenv("KVLEDGER_FAULTS", f"{point}:exit@2")
    j = open_journal(db_url, writer="process")
    try:
        [first] = j.append([allocate_op("h1")])
        assert isinstance(first, Receipt)
        wait = j.append_deferred([publish_op("h1", guard_of(j.head("h1")), "p1")])
        with pytest.raises(KvLedgerError) as info:
            wait()
        assert info.value.code is ErrorCode.DATABASE_UNREACHABLE
        assert "outcome of the last append is unknown" in info.value.message
        with pytest.raises(KvLedgerError) as again:  # and it stays that way, loudly
            j.append([allocate_op("h2")])
        assert again.value.code is ErrorCode.DATABASE_UNREACHABLE
    finally:
        j.close()
    monkeypatch.delenv("KVLEDGER_FAULTS")
    with open_journal(db_url) as other:
        assert other.receipt("alloc-h1") == first
        assert (other.receipt("p1") is not None) is committed
        assert other.last_position() == (2 if committed else 1)
        assert other.head("h2") is None


def test_a_killed_writer_loses_nothing_acknowledged(db_url):
    j = open_journal(db_url, writer="process")
    try:
        acked = [j.append([allocate_op(f"h{i}")])[0] for i in range(5)]
        os.kill(j._proc.pid, signal.SIGKILL)
        assert j._proc.wait(timeout=30) == -signal.SIGKILL
        with pytest.raises(KvLedgerError) as info:
            j.append([allocate_op("late")])
        assert info.value.code is ErrorCode.DATABASE_UNREACHABLE
        assert j.last_position() == 5  # reads still work: they are this process's own
    finally:
        j.close()
    with open_journal(db_url) as other:
        assert [other.receipt(r.operation_id) for r in acked] == acked


def test_the_writer_outlives_no_parent(db_url, tmp_path):
    """A parent SIGKILLed while its writer waits: the writer sees the pipe close and
    exits by itself (no orphan holding the database)."""
    code = ("import os, sys, signal\n"
            "from kvledger.storage import open_journal\n"
            f"j = open_journal({db_url!r}, writer='process')\n"
            "print(j._proc.pid, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert _gone(int(p.stdout.split()[0]))


def test_the_database_url_never_reaches_the_command_line(db_url):
    with open_journal(db_url, writer="process") as j:
        args = " ".join(j._proc.args)
        assert db_url not in args and "sqlite" not in args and "postgres" not in args


def test_bad_input_is_refused_before_anything_is_sent(db_url):
    with open_journal(db_url, writer="process") as j:
        op = allocate_op("h1")
        hollow = msgspec.structs.replace(op, writes=(msgspec.structs.replace(op.writes[0], events=()),))
        with pytest.raises(KvLedgerError) as info:
            j.append([hollow])
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        assert j.last_position() == 0
        assert isinstance(j.append([allocate_op("h1")])[0], Receipt)  # the writer is fine


def test_unknown_writer_is_a_clear_error(db_url):
    with pytest.raises(KvLedgerError) as info:
        open_journal(db_url, writer="fork")
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
