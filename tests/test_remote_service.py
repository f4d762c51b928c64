"""The command service in a writer process (kvledger.engine.remote, `--writer process`): the
same results as in-process, and what a caller can know when either process dies (a
real os._exit at a fault point, a real SIGKILL of the writer or of its parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvledger.engine import commands as c
from kvledger.engine.remote import command_service
from kvledger.engine.service import CommandService
from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.receipts import Receipt

from factories import make_manifest


def _allocate(h: str) -> c.Allocate:
    return c.Allocate(handle_id=h, manifest=make_manifest(request_id=h), reserved_capacity=8,
                      operation_id=f"alloc-{h}")


def _batch(h: str) -> list:
    """A prefill start and publish plus an emit, all relative, as a worker sends them."""
    start = c.BeginAppend(handle_id=h, txn_id=f"{h}-p", kind="prefill", base_generation=None,
                          base_snapshot_version=None, interval_start=0, interval_count=4,
                          token_ids=(11, 22, 33, 44), cache_positions=(0, 1, 2, 3), mask_key_extent=4,
                          cache_abi_sha256="")
    publish = c.Publish(handle_id=h, txn_id=f"{h}-p", base_generation=None, base_snapshot_version=None)
    emit = c.EmitOutput(handle_id=h, base_generation=None, base_snapshot_version=None, output_index=0, token_id=9)
    return [c.Relative(x) for x in (start, publish, emit)]


def test_the_writer_process_decides_as_the_service_here_does(db_url):
    """One batch with commits, a refusal and hooks: same results as an in-process service
    on the same journal, and the hooks see the same receipts, events and refusals."""
    with open_or_create_journal(db_url) as j:
        remote = command_service(j, writer="process", source_instance="t")
        try:
            seen, refused = [], []
            remote.on_commit.append(lambda r, evs: seen.append((r.operation_id, [e.event_type for e in evs])))
            remote.on_reject.append(lambda cmd, exc: refused.append((type(cmd).__name__, exc.code)))
            [a] = remote.execute_many([_allocate("A")])
            wait = remote.submit_many([*_batch("A"), c.Relative(c.Truncate(
                handle_id="A", base_generation=0, base_snapshot_version=0, new_length=5))])
            *ok, grow = wait()
            assert isinstance(a, Receipt) and all(isinstance(r, Receipt) for r in ok)
            assert isinstance(grow, KvLedgerError) and grow.code is ErrorCode.TRUNCATE_GROWS
            assert [kinds for _, kinds in seen] == [["request_allocate"], ["append_start"],
                                                    ["append_publish"], ["output_emit"]]
            assert refused == [("Truncate", ErrorCode.TRUNCATE_GROWS)]  # bound, as decided there
            assert remote.state("A").outputs == (9,) and remote.states == {}
        finally:
            remote.close()
        here = CommandService(j)
        assert here.state("A").outputs == (9,)
        [b] = here.execute_many([_allocate("B")])
        results = here.execute_many(_batch("B"))
        assert [type(r) for r in results] == [type(r) for r in ok] and isinstance(b, Receipt)


def test_callables_and_a_closed_service_are_clear_errors(db_url):
    with open_or_create_journal(db_url) as j:
        remote = command_service(j, writer="process")
        with pytest.raises(KvLedgerError) as info:
            remote.submit_many([lambda state: _allocate("A")])
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        remote.close()
        with pytest.raises(KvLedgerError) as info:
            remote.execute_many([_allocate("A")])
        assert info.value.code is ErrorCode.DATABASE_UNREACHABLE
        with pytest.raises(KvLedgerError) as info:
            command_service(j, writer="fork")
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        assert j.last_position() == 0


@pytest.mark.parametrize("point, committed", [("before_update", False), ("after_commit", True)])
def test_a_writer_that_dies_mid_batch_acknowledges_nothing(db_url, monkeypatch, point, committed):
    """The writer exits (os._exit, no cleanup) inside the second batch: the caller gets
    DATABASE_UNREACHABLE, the first batch stays acknowledged and stored, and the second
    is absent (died before writing) or committed whole without an acknowledgement (died
    after COMMIT): the in-doubt outcome a receipt lookup resolves."""
    monkeypatch.setenv("KVLEDGER_FAULTS", f"{point}:exit@2")
    with open_or_create_journal(db_url) as j:
        remote = command_service(j, writer="process")
        try:
            [first] = remote.execute_many([_allocate("A")])
            assert isinstance(first, Receipt)
            wait = remote.submit_many(_batch("A"))
            with pytest.raises(KvLedgerError) as info:
                wait()
            assert info.value.code is ErrorCode.DATABASE_UNREACHABLE
            assert "outcome of the last batch is unknown" in info.value.message
            with pytest.raises(KvLedgerError) as again:  # and it stays that way, loudly
                remote.execute_many([_allocate("B")])
            assert again.value.code is ErrorCode.DATABASE_UNREACHABLE
        finally:
            remote.close()
    monkeypatch.delenv("KVLEDGER_FAULTS")
    with open_or_create_journal(db_url) as other:
        assert other.receipt("alloc-A") == first
        assert other.last_position() == (4 if committed else 1)  # the batch: all or nothing
        assert other.head("B") is None


def test_a_killed_writer_loses_nothing_acknowledged(db_url):
    with open_or_create_journal(db_url) as j:
        remote = command_service(j, writer="process")
        try:
            acked = [remote.execute_many([_allocate(f"h{i}")])[0] for i in range(5)]
            os.kill(remote.pid, signal.SIGKILL)
            assert remote._proc.wait(timeout=30) == -signal.SIGKILL
            with pytest.raises(KvLedgerError) as info:
                remote.execute_many([_allocate("late")])
            assert info.value.code is ErrorCode.DATABASE_UNREACHABLE
            assert j.last_position() == 5  # reads are this process's own
        finally:
            remote.close()
        assert [j.receipt(r.operation_id) for r in acked] == acked


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_writer_outlives_no_parent(db_url):
    """A parent SIGKILLed while its writer waits: the writer sees the pipe close and
    exits by itself (no orphan holding the database)."""
    code = ("import os, signal\n"
            "from kvledger.engine.remote import command_service\n"
            "from kvledger.migrations.storage import open_or_create_journal\n"
            f"s = command_service(open_or_create_journal({db_url!r}), writer='process')\n"
            "print(s.pid, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert _gone(int(p.stdout.split()[0]))


def test_the_database_url_never_reaches_the_command_line(db_url):
    with open_or_create_journal(db_url) as j:
        remote = command_service(j, writer="process")
        try:
            args = " ".join(remote._proc.args)
            assert db_url not in args and "sqlite" not in args and "postgres" not in args
        finally:
            remote.close()


def _decoding(h: str, abi: str) -> list:
    """A prefill, its publication, the first output and the start of the decode that
    processes it: the handle then has a running decode append `{h}-d0` at row 4."""
    start = c.BeginAppend(handle_id=h, txn_id=f"{h}-p", kind="prefill", base_generation=None,
                          base_snapshot_version=None, interval_start=0, interval_count=4,
                          token_ids=(11, 22, 33, 44), cache_positions=(0, 1, 2, 3), mask_key_extent=4,
                          cache_abi_sha256=abi)
    publish = c.Publish(handle_id=h, txn_id=f"{h}-p", base_generation=None, base_snapshot_version=None)
    emit = c.EmitOutput(handle_id=h, base_generation=None, base_snapshot_version=None, output_index=0, token_id=9)
    return [c.Relative(x) for x in (start, publish, emit, _begin(h, "d0", 4, 9, abi))]


def _begin(h: str, txn: str, at: int, token: int, abi: str) -> c.BeginAppend:
    return c.BeginAppend(handle_id=h, txn_id=f"{h}-{txn}", kind="decode", base_generation=None,
                         base_snapshot_version=None, interval_start=at, interval_count=1, token_ids=(token,),
                         cache_positions=(at,), mask_key_extent=at + 1, cache_abi_sha256=abi)


def _step(h: str, txn: str, abi: str, token: int = 7) -> c.Relative:
    """The decode chain a worker sends: publish `txn`, emit output 1, start the next."""
    publish = c.Publish(handle_id=h, txn_id=f"{h}-{txn}", base_generation=None, base_snapshot_version=None,
                        rows_sha256="ab" * 32)
    emit = c.EmitOutput(handle_id=h, base_generation=None, base_snapshot_version=None, output_index=1,
                        token_id=token)
    return c.Relative(c.Chain(handle_id=h, steps=(publish, emit, _begin(h, "d1", 5, token, abi))))


def test_decode_chains_cross_the_pipe_as_columns_with_the_same_results(db_url, tmp_path):
    """A worker's batch: plain decode chains on four handles, one of them with a finish
    after it (so it stays a command), one naming an append that is not running (refused
    at the writer, as its chain), and an allocation between them. The chains that may
    travel as columns do; results, hooks and states are those of the service here on a
    journal of its own."""
    from kvledger.engine.gather import split_steps, submit_split
    from kvledger.schemas.manifest import cache_abi_sha256

    abi = cache_abi_sha256(make_manifest(request_id="A"))
    handles = ("A", "B", "C", "D")
    batch = [_step("A", "d0", abi), _step("B", "d0", abi), c.Allocate(
        handle_id="E", manifest=make_manifest(request_id="E"), reserved_capacity=8), _step("C", "d0", abi),
        c.Relative(c.Finish(handle_id="C", base_generation=None)), _step("D", "nope", abi, token=3)]
    split = split_steps(batch)
    assert split is not None and split[1] == [0, 1, 5] and split[0].handle_ids == ("A", "B", "D")
    assert [c.batch_step(split[0], j) for j in range(3)] == [batch[i] for i in split[1]]
    seen: dict[str, list] = {}
    for name, url in (("remote", db_url), ("here", f"sqlite:///{tmp_path}/here.db")):
        with open_or_create_journal(url) as j:
            service = command_service(j, writer="process" if name == "remote" else "thread", source_instance="t")
            try:
                hooks: list = []
                service.on_commit.append(lambda r, evs, hooks=hooks: hooks.append([e.event_type for e in evs]))
                service.on_reject.append(lambda cmd, exc, hooks=hooks: hooks.append((type(cmd).__name__, exc.code)))
                setup = [_allocate(h) for h in handles]
                for h in handles:
                    setup += _decoding(h, abi)
                assert all(isinstance(r, Receipt) for r in service.execute_many(setup))
                hooks.clear()
                results = submit_split(service, batch)()
                seen[name] = [[r.code if isinstance(r, KvLedgerError) else type(r).__name__ for r in results], hooks,
                              [(service.state(h).outputs, service.state(h).lifecycle) for h in handles]]
            finally:
                service.close()
    assert seen["remote"] == seen["here"]
    codes, hooks, states = seen["remote"]
    assert codes[:5] == ["Receipt"] * 5 and codes[5] is ErrorCode.TXN_NOT_OPEN
    assert states[0] == ((9, 7), "ACTIVE") and states[2] == ((9, 7), "FINISHED") and states[3][0] == (9,)
    assert hooks[-1] == ("Chain", ErrorCode.TXN_NOT_OPEN)


@pytest.mark.parametrize("tuning", ["on", "off"])
def test_the_writer_process_freezes_what_it_loaded_before_its_first_frame(tmp_path, tuning):
    """serve() opens the journal, then freezes the heap (journal.tuning.freeze_heap) before
    it answers the hello: a full collection while it commits leaves the libraries' objects
    alone; with KVLEDGER_TUNING=off nothing is frozen. Run as the writer process runs it
    (serve in a fresh process's main thread), a thread standing in for the worker on the
    other ends of the pipes."""
    script = f"""
import gc, os, threading
import msgspec
from kvledger.engine import remote
from kvledger.migrations.storage import init_database
url = "sqlite:///{tmp_path}/w.db"
init_database(url)
(to_r, to_w), (from_r, from_w) = os.pipe(), os.pipe()
seen = []
def drive():
    remote.send(to_w, msgspec.msgpack.encode(remote._Hello(url, "kvledger")))
    remote.receive(from_r)
    seen.append(gc.get_freeze_count())  # the hello is answered: frozen by now
    os.close(to_w)
print(gc.get_freeze_count())
driver = threading.Thread(target=drive)
driver.start()
remote.serve(to_r, from_w)
driver.join()
print(seen[0])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVLEDGER_TUNING": tuning})
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = map(int, done.stdout.split())
    assert before == 0
    if tuning == "on":
        assert after > 10_000  # the journal's modules, sqlalchemy, msgspec, ...
    else:
        assert after == 0


def _sent_after(fd: int, delay: float, payload: bytes | None) -> threading.Thread:
    """A thread that sends one frame on `fd` (or closes it: None) after `delay` seconds."""
    from kvledger.engine import remote

    def run() -> None:
        time.sleep(delay)
        if payload is None:
            os.close(fd)
        else:
            remote.send(fd, payload)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_frame_is_received_whole_whether_it_comes_while_polling_or_after():
    """receive(fd, spin_s) polls the pipe up to spin_s, then sleeps in read(): a frame that
    comes during the poll, one that comes after it, one larger than a pipe holds and the
    end of the stream all read as without polling."""
    from kvledger.engine import remote

    r, w = os.pipe()
    try:
        big = os.urandom(200_000)  # more than a pipe holds: read while it is being written
        for delay, spin, payload in ((0.1, 0.5, b"during"), (0.2, 0.02, b"after"), (0.05, 0.5, big)):
            sender = _sent_after(w, delay, payload)
            assert remote.receive(r, spin) == payload
            sender.join()
        sender = _sent_after(w, 0.1, None)
        assert remote.receive(r, 0.5) is None
        sender.join()
    finally:
        os.close(r)


@pytest.mark.parametrize("hooked", [False, True])
def test_a_run_written_whole_comes_back_as_the_run(db_url, hooked):
    """A batch of plain decode steps the writer wrote whole comes back as its run, whose
    receipts are built here when read, each the one the journal gives a retry of its
    operation; with a commit hook listening, as receipts with their events."""
    from kvledger.engine import ids
    from kvledger.schemas.decode_batch import BatchBuilder

    handles = [f"run-{i}" for i in range(3)]
    txn = {h: ids.new_id() for h in handles}
    with open_or_create_journal(db_url) as j:
        remote = command_service(j, writer="process", source_instance="t")
        try:
            kinds: list[list[str]] = []
            if hooked:
                remote.on_commit.append(lambda r, evs: kinds.append([e.event_type for e in evs]))
            remote.execute_many([_allocate(h) for h in handles] + [c.Relative(c.BeginAppend(
                handle_id=h, txn_id=txn[h], kind="prefill", base_generation=None, base_snapshot_version=None,
                interval_start=0, interval_count=4, token_ids=(11, 22, 33, 44), cache_positions=(0, 1, 2, 3),
                mask_key_extent=4, cache_abi_sha256="")) for h in handles])
            abi = remote.state(handles[0]).cache_abi_sha256
            batch = BatchBuilder()
            for k, h in enumerate(handles):
                batch.add(h, txn[h], 4, 0, 7 + k, ids.new_id(), None, abi)
            kinds.clear()
            results = remote.submit_batch(batch.build(), [], defer=False)()
            run, rest = results.parts()
            assert results.refused() == [] and len(results) == len(handles)
            whole = not hooked and not db_url.startswith("nats")  # NATS appends a run as its operations
            assert (len(run), len(rest)) == ((3, 0) if whole else (0, 3))
            receipts = list(results)
            assert [r.handles[0].handle_id for r in receipts] == handles
            assert receipts == [j.receipt(r.operation_id) for r in receipts]
            assert [r.handles[0].snapshot_version for r in receipts] == [1, 1, 1]
            assert kinds == ([["append_publish", "output_emit", "append_start"]] * 3 if hooked else [])
            assert [remote.state(h).outputs for h in handles] == [(7,), (8,), (9,)]
        finally:
            remote.close()
