"""Recovery after a crash: in-doubt appends aborted idempotently, live K/V rebuilt by
re-execution with every digest checked, every unfinished request run to completion
with the outputs of an uninterrupted run; a second recovery writes nothing. And the
acceptance run: `kill -9` of `kvledger demo` at a random moment, `kvledger recover`,
`kvledger verify` clean, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvledger.engine.evolve import fold
from kvledger.engine.service import CommandService
from kvledger.migrations.storage import init_database, open_or_create_journal
from kvledger.recovery.recover import recover, verify_findings
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.worker.loading import load_model
from kvledger.worker.serving import RequestSpec, Worker

from stored_rows import cli

WORKER = {"capacity": 64, "prefill_chunk": 16, "prefill_tokens": 32, "max_running": 4}


@pytest.fixture(scope="module")
def served():
    return load_model()


def _specs(prefix: str, seed: int = 1) -> list[RequestSpec]:
    rng = random.Random(seed)
    return [RequestSpec(request_id=f"{prefix}-{i}", max_new_tokens=8, arrival_step=i // 2,
                        prompt=tuple(rng.randrange(512) for _ in range(40 if i == 1 else rng.randint(3, 12))))
            for i in range(5)]


def _serve(url, specs, served, steps=None):
    """Run the worker; with `steps`, stop after that many iterations and walk away
    (what a crash leaves: open appends, staged rows lost, requests half done)."""
    model, artifact = served
    with open_or_create_journal(url) as j:
        w = Worker(model, service=CommandService(j), artifact=artifact, **WORKER)
        for s in specs:
            w.submit(s)
        if steps is None:
            return w.run()
        for _ in range(steps):
            w.step()  # each step's commit is durable when it returns
        return None


def _outputs(j, handles):
    return {h: list(fold(j.read_stream(h)).outputs) for h in handles}


@pytest.fixture(scope="module")
def baseline(served, tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('base')}/b.db"
    init_database(url)
    out = _serve(url, _specs("r"), served)
    return {h.split("-")[1]: v for h, v in out.items()}


def test_nothing_to_recover_writes_nothing(db_url, served):
    with open_or_create_journal(db_url) as j:
        r = recover(j, served=served)
        assert r.ok and r.events_written == 0 and r.live_handles == [] and r.verify_findings == []


@pytest.mark.parametrize("steps", [1, 3, 6, 10])
def test_recovery_finishes_an_abandoned_run_with_the_same_outputs(db_url, served, baseline, steps):
    specs = _specs(f"s{steps}")
    _serve(db_url, specs, served, steps=steps)
    model, artifact = served
    with open_or_create_journal(db_url) as j:
        open_before = sum(len(fold(j.read_stream(h)).open_txns) for h in j.heads())
        r = recover(j, served=(model, artifact))
        assert r.ok, r.to_dict()
        assert r.verify_findings == [] and r.verify_after == [] and r.digest_mismatches == []
        assert len(r.aborted) == open_before > 0
        assert r.rows_reexecuted > 0 or steps == 1
        assert set(r.released) == set(r.live_handles) and r.unfinished == []
        heads = j.heads()
        assert all(heads[h].lifecycle == "RELEASED" for h in heads)
        # every request the journal accepted finished with the uninterrupted outputs
        got = _outputs(j, [s.request_id for s in specs if s.request_id in heads])
        assert got and all(v == baseline[h.split("-")[1]] for h, v in got.items())
        # the aborts have deterministic operation ids: a second run writes nothing
        again = recover(j, served=(model, artifact))
        assert again.ok and again.events_written == 0 and again.live_handles == []
        for handle, txn in r.aborted:
            receipt = j.receipt(f"recover-abort-{handle}-{txn}")
            assert receipt is not None
            [failure] = [e for e in j.read_stream(handle) if e.event_id in receipt.event_ids]
            assert failure.event_type == "failure" and failure.payload.outcome == "aborted"
        assert verify_findings(j) == []


def test_a_fork_child_is_recovered_as_its_own_handle_and_samples_the_same(db_url, served, tmp_path):
    spec = RequestSpec(request_id="f", prompt=tuple(range(3, 12)), max_new_tokens=10, n=2, temperature=1.0,
                       seed=5)
    url = f"sqlite:///{tmp_path}/whole.db"
    init_database(url)
    whole = _serve(url, [spec], served)
    assert set(whole) == {"f", "f.1"} and whole["f"] != whole["f.1"]
    _serve(db_url, [spec], served, steps=4)  # prefill, fork, a few sampled outputs
    with open_or_create_journal(db_url) as j:
        assert j.head("f.1") is not None
        r = recover(j, served=served)
        assert r.ok and set(r.continued) == {"f", "f.1"}
        assert _outputs(j, ["f", "f.1"]) == whole


def test_a_journal_from_another_model_is_refused_before_anything_is_written(db_url, served):
    _serve(db_url, _specs("abi"), served, steps=3)
    other = load_model(seed=1)
    with open_or_create_journal(db_url) as j:
        before = j.last_position()
        with pytest.raises(KvLedgerError) as info:
            recover(j, served=other)
        assert info.value.code is ErrorCode.ABI_MISMATCH
        assert j.last_position() == before


def test_a_digest_that_does_not_recompute_stops_recovery(served, tmp_path):
    from kvledger.replay import export_jsonl, import_jsonl

    src, dst = f"sqlite:///{tmp_path}/src.db", f"sqlite:///{tmp_path}/dst.db"
    init_database(src)
    init_database(dst)
    _serve(src, _specs("d"), served, steps=5)
    with open_or_create_journal(src) as j:
        export_jsonl(j, tmp_path / "j.jsonl")
    lines = (tmp_path / "j.jsonl").read_bytes().splitlines()
    for i, line in enumerate(lines):
        e = json.loads(line)
        if e["event_type"] == "append_publish" and e["stream_id"] == "d-0":
            e["payload"]["rows_sha256"] = "0" * 64  # rows that were never computed
            lines[i] = json.dumps(e, separators=(",", ":")).encode()
            break
    (tmp_path / "j.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with open_or_create_journal(dst) as j:
        import_jsonl(j, tmp_path / "j.jsonl")
        r = recover(j, served=served)
        assert not r.ok and r.digest_mismatches and r.continued == []
        assert {m["handle_id"] for m in r.digest_mismatches} == {"d-0"}
        assert any(j.heads()[h].lifecycle != "RELEASED" for h in j.heads())  # nothing continued


# -- the acceptance run: kill -9 of `kvledger demo`, then recover and verify -------------

def _cli(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_FAULTS")}
    return subprocess.run([sys.executable, "-m", "kvledger", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _wait_gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
            assert time.monotonic() < deadline, f"process {pid} outlived its parent"
            time.sleep(0.01)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.nats_case("one writer on NATS: tests/test_nats_failover.py kills a demo there too", writer="thread")
@pytest.mark.sqlite_case("a writer process killed with the demo, on SQLite: the thread case covers PostgreSQL",
                         writer="process")
@pytest.mark.parametrize("writer", ["thread", "process"])
def test_kill_9_of_kvledger_demo_then_recover_and_verify(db_url, writer, capsys):
    rng = random.Random(os.getpid())
    threshold = rng.randint(20, 150)
    demo = subprocess.Popen([sys.executable, "-m", "kvledger", "demo", "--db", db_url, "--requests", "16",
                             "--max-new-tokens", "12", "--json", "--writer", writer],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with open_or_create_journal(db_url) as j:
        deadline = time.monotonic() + 120
        writers = None  # the demo's writer process, looked up once it has written (before the kill)
        while j.last_position() < threshold and demo.poll() is None and time.monotonic() < deadline:
            if writers is None and j.last_position() > 0:
                writers = _children(demo.pid)
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.01))  # the process writer serves this workload in ~0.2 s
        assert writers is not None and (len(writers) == 1) is (writer == "process"), writers
        demo.send_signal(signal.SIGKILL)
        assert demo.wait(30) == -signal.SIGKILL, "the demo finished before the kill"
        # A writer process finishes the append it already received (a commit the dead
        # demo never acknowledged), sees its pipe closed and exits: recover after that.
        _wait_gone(writers)
        killed_at = j.last_position()
        live = [h for h, f in j.heads().items() if f.lifecycle != "RELEASED"]
    assert live, f"killed at position {killed_at} with no live handle"
    p = _cli("recover", "--db", db_url, "--json")
    assert p.returncode == 0, p.stderr + p.stdout
    r = json.loads(p.stdout)
    assert r["ok"] and r["position_before"] == killed_at and r["events_written"] > 0
    assert set(r["released"]) == set(live) and r["digest_mismatches"] == [] and r["verify_after"] == []
    # what follows the recovery runs in this process: the kill and recover were the processes'
    code, out, err = cli(capsys, "verify", "--db", db_url, "--json")
    assert code == 0, out + err
    with open_or_create_journal(db_url) as j:
        heads = j.heads()
        assert all(f.lifecycle == "RELEASED" for f in heads.values())
        # a recovered request ran to its max_new_tokens (forks included); a cancelled
        # one was only released
        for h in live:
            s = fold(j.read_stream(h))
            assert s.lifecycle == "RELEASED"
    code, out, _ = cli(capsys, "recover", "--db", db_url)
    assert code == 0 and "nothing to recover" in out


def test_recover_cli_errors_are_one_line_with_a_code(tmp_path, capsys):
    code, _, err = cli(capsys, "recover", "--db", "mysql://nope/x")
    assert code == 2 and err.startswith("BAD_DATABASE_URL")
    missing = tmp_path / "missing.db"
    code, _, err = cli(capsys, "recover", "--db", f"sqlite:///{missing}")
    assert code == 2 and err.startswith("DATABASE_NOT_FOUND") and not missing.exists()
    init_database(f"sqlite:///{tmp_path}/x.db")
    # A --model that is not a checkpoint is refused when parsed, before recover writes
    # anything (aborting in-doubt appends comes before the model is loaded).
    code, _, err = cli(capsys, "recover", "--db", f"sqlite:///{tmp_path}/x.db", "--model", str(tmp_path))
    assert code == 2 and err.startswith("INVALID_ARGUMENT") and err.count("\n") == 1
    code, _, _ = cli(capsys, "recover", "--db", f"sqlite:///{tmp_path}/x.db")
    assert code == 0  # no live handle: the model is never needed


def test_adopt_without_ready_logits_recomputes_the_last_row(served, tmp_path):
    """A handle whose newest publication has ready logits that the caller cannot supply
    (adopt(..., logits=None)): the worker truncates one row, decodes it again and goes
    on with the same greedy outputs."""
    from kvledger.engine import commands as c
    from kvledger.worker.reexec import reexecute

    model, artifact = served
    spec = RequestSpec(request_id="g", prompt=tuple(range(20, 31)), max_new_tokens=6)
    url = f"sqlite:///{tmp_path}/whole.db"
    init_database(url)
    whole = _serve(url, [spec], served)["g"]
    url = f"sqlite:///{tmp_path}/cut.db"
    init_database(url)
    with open_or_create_journal(url) as j:
        service = CommandService(j)
        w = Worker(model, service=service, artifact=artifact, **WORKER)
        w.submit(spec)
        w.step()  # allocate, start the prefill, run it
        [ran] = w.ran
        s = service.state("g")
        service.execute(c.Publish(handle_id="g", txn_id=ran.planned.txn, base_generation=s.generation,
                                  base_snapshot_version=s.snapshot_version, rows_sha256=ran.rows_sha256))
        state = service.state("g", refresh=True)
        assert state.logits_ready and not state.outputs and state.committed_length == len(spec.prompt)
        r = reexecute(model, j.read_all(), capacity=64)
        assert r.mismatches == [] and "g" in r.logits
        k, v = r.store.read("g")
        w2 = Worker(model, service=CommandService(j), artifact=artifact, **WORKER)
        w2.adopt(state, spec, k, v, logits=None)
        assert w2.run()["g"] == whole
        events = [e.event_type for e in j.read_stream("g")]
        assert "truncate" in events and events[-1] == "release" and w2.errors == []
        assert verify_findings(j) == []


def test_a_journal_that_breaks_its_own_rules_is_not_continued(served, tmp_path):
    """A head row that no stream of events leads to (written by hand here): recovery's
    first verify finds it, and nothing is aborted, re-executed or written."""
    from stored_rows import copy_head

    url = f"sqlite:///{tmp_path}/cut.db"
    init_database(url)
    _serve(url, _specs("cut"), served, steps=3)  # open appends a recovery would abort
    copy_head(url, "cut-0", "ghost")
    with open_or_create_journal(url) as j:
        before = (list(j.read_raw()), j.heads())
        r = recover(j, served=served)
        assert not r.ok and r.verify_findings and r.live_handles == [] and r.events_written == 0
        assert any("ghost" in str(f) for f in r.verify_findings), r.verify_findings[:3]
        assert (list(j.read_raw()), j.heads()) == before
