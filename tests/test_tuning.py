"""Machine tuning (kvledger.journal.tuning): where the model thread and the journal's writers
run (the I/O CPU read from /proc/interrupts, its override, the affinities a worker's set-up
leaves on real threads and a real writer process), polling before sleeping, the frozen
start-up heap and the paused collector. KVLEDGER_TUNING=off turns every one off, and a run
then writes the same journal."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.cli import main
from kvledger.journal import tuning
from kvledger.migrations.storage import init_database
from kvledger.schemas.errors import ErrorCode, KvLedgerError

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="placing writers apart needs two CPUs")
tuned = pytest.mark.skipif(not tuning.enabled(), reason="this test process runs with KVLEDGER_TUNING=off")

# The shape of /proc/interrupts on the VMs these figures come from (trimmed), plus an
# NVMe queue and a network queue whose counts must not count as disk completions.
TABLE = """\
           CPU0       CPU1       CPU2
 24:          1          0          0  IO-APIC   5-edge      ACPI:Ged
 36:          0   11135429          7  PCI-MSIX-0000:00:02.0   1-edge      virtio1-req.0
 38:   99999999          0          0  PCI-MSIX-0000:00:03.0   1-edge      virtio2-input.0
 40:          0          3     500000  PCI-MSIX-0000:00:04.0   0-edge      nvme0q1
LOC:    5102938    4988211    4000000   Local timer interrupts
"""


def _run(script: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter (tuning is read once a process, affinity is
    per thread) with `env` added."""
    full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _python(script: str, env: dict[str, str], timeout: float = 300) -> dict:
    """_run, which must succeed; the script's last stdout line is JSON."""
    run = _run(script, env, timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


# -- the switch ----------------------------------------------------------------------------


def test_a_bad_switch_is_refused_where_the_cli_starts(tmp_path, monkeypatch, capsys):
    """A typo in KVLEDGER_TUNING is a one-line INVALID_ARGUMENT before any work: the
    database is not created."""
    monkeypatch.setenv("KVLEDGER_TUNING", "of")
    assert main(["init", "--db", f"sqlite:///{tmp_path}/j.db"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("INVALID_ARGUMENT: KVLEDGER_TUNING='of'"), err
    assert not (tmp_path / "j.db").exists()
    for good in ("off", " ON ", ""):
        monkeypatch.setenv("KVLEDGER_TUNING", good)
        tuning.check()


def test_the_pipeline_switch_decides_over_the_host(tmp_path, monkeypatch, capsys):
    """KVLEDGER_PG_PIPELINE: on or off whatever the host; auto (or unset) pipelines a
    connection to a host that is neither loopback nor a Unix socket, with tuning on; any
    other value is refused where the CLI starts."""
    hosts = ("db.internal", "10.0.0.7", "127.0.0.1", "localhost", "::1", "/run/postgresql")
    remote = tuning.enabled()
    for value, expected in (("", (remote, remote, False, False, False, False)),
                            ("auto", (remote, remote, False, False, False, False)),
                            (" ON ", (True,) * 6), ("off", (False,) * 6)):
        monkeypatch.setenv("KVLEDGER_PG_PIPELINE", value)
        assert tuple(map(tuning.pipelined, hosts)) == expected, value
        tuning.check()
    monkeypatch.setenv("KVLEDGER_PG_PIPELINE", "yes")
    assert main(["init", "--db", f"sqlite:///{tmp_path}/j.db"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("INVALID_ARGUMENT: KVLEDGER_PG_PIPELINE='yes'"), err
    assert not (tmp_path / "j.db").exists()


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=12))
def test_any_switch_value_is_on_off_or_a_coded_refusal(value):
    saved = os.environ.get("KVLEDGER_TUNING")
    os.environ["KVLEDGER_TUNING"] = value
    try:
        tuning.check()
    except KvLedgerError as exc:
        assert exc.code is ErrorCode.INVALID_ARGUMENT and "\n" not in str(exc)
        assert value.strip().lower() not in ("", "on", "off")
    else:
        assert value.strip().lower() in ("", "on", "off")
    finally:
        if saved is None:
            del os.environ["KVLEDGER_TUNING"]
        else:
            os.environ["KVLEDGER_TUNING"] = saved


def test_a_library_caller_with_a_bad_switch_is_warned_and_keeps_tuning_on():
    script = "import json; from kvledger.journal import tuning; print(json.dumps(tuning.enabled()))"
    run = _run(script, {"KVLEDGER_TUNING": "false"}, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "true", run.stderr
    assert "KVLEDGER_TUNING='false': expected 'on' or 'off'; tuning stays on" in run.stderr


# -- CPU placement -------------------------------------------------------------------------


def test_the_io_cpu_is_the_one_with_the_most_block_device_interrupts():
    assert tuning.busiest(TABLE, frozenset({0, 1, 2})) == 1
    assert tuning.busiest(TABLE, frozenset({0, 2})) == 2  # CPU1 not ours: the NVMe one
    assert tuning.busiest(TABLE, frozenset({0})) is None  # no disk interrupts there
    no_disks = "\n".join(line for line in TABLE.splitlines() if "req" not in line and "nvme" not in line)
    assert tuning.busiest(no_disks, frozenset({0, 1, 2})) is None
    assert tuning.busiest("", frozenset({0, 1})) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=40), st.sampled_from(TABLE.splitlines())), max_size=6),
       st.frozensets(st.integers(0, 4)))
def test_any_interrupt_table_gives_an_allowed_cpu_or_none(lines, allowed):
    found = tuning.busiest("\n".join(lines), allowed)
    assert found is None or found in allowed


_PLACEMENT = """
import json, os, threading
import torch
from kvledger.engine.remote import command_service
from kvledger.engine.service import CommandService
from kvledger.journal import tuning
from kvledger.worker.serving import use_threads, leave_a_core
from kvledger.migrations.storage import init_database, open_or_create_journal
from test_remote_service import _allocate

url = "sqlite:///{tmp}/j.db"
out = {{"allowed": sorted(os.sched_getaffinity(0)), "io": tuning.io_cpu()}}
full = torch.get_num_threads()
init_database(url)
out["threads_less"] = leave_a_core()
out["model_less"] = sorted(os.sched_getaffinity(0))
with open_or_create_journal(url) as j:
    remote = command_service(j, writer="process")
    out["writer_process"] = sorted(os.sched_getaffinity(remote.pid))
    remote.close()
    service = CommandService(j)
    service.submit_many([_allocate("A")])()  # the commit thread starts here
    [committer] = [t for t in threading.enumerate() if t.name.startswith("kvledger-commit")]
    out["commit_thread"] = sorted(os.sched_getaffinity(committer.native_id))
use_threads(full)
out["model_full"] = sorted(os.sched_getaffinity(0))
with open_or_create_journal(url) as j:
    remote = command_service(j, writer="process")
    out["writer_process_full"] = sorted(os.sched_getaffinity(remote.pid))
    remote.close()
print(json.dumps(out))
"""


def _placed(tmp_path: Path, **env: str) -> dict:
    """Run the worker's set-up steps and report what each thread was left on."""
    return _python(_PLACEMENT.format(tmp=tmp_path), env, timeout=120)


@two_cpus
def test_a_pool_that_leaves_a_core_leaves_the_io_cpu_to_the_writers(tmp_path):
    io = ALLOWED[-1]
    out = _placed(tmp_path, KVLEDGER_IO_CPU=str(io), KVLEDGER_TUNING="on")
    assert out["io"] == io
    rest = [c for c in ALLOWED if c != io]
    assert out["model_less"] == rest  # the model thread left the I/O CPU...
    assert out["writer_process"] == [io]  # ...to the writer process...
    assert out["commit_thread"] == [io]  # ...and to the commit thread
    assert out["model_full"] == ALLOWED  # a full pool may run anywhere again
    assert out["writer_process_full"] == ALLOWED  # and its writer is not pinned behind it


@two_cpus
@pytest.mark.parametrize("env", [{"KVLEDGER_IO_CPU": "none"}, {"KVLEDGER_TUNING": "off"}],
                         ids=["io-cpu-none", "tuning-off"])
def test_placement_can_be_turned_off(tmp_path, env):
    """KVLEDGER_IO_CPU=none, or KVLEDGER_TUNING=off even with an I/O CPU named: no thread
    or process is moved."""
    out = _placed(tmp_path, **{"KVLEDGER_IO_CPU": str(ALLOWED[-1]), **env})
    assert out["io"] is None
    assert out["model_less"] == out["allowed"] == out["writer_process"] == out["commit_thread"] == ALLOWED


@two_cpus
def test_a_bad_io_cpu_override_is_refused(tmp_path):
    bad = _run(_PLACEMENT.format(tmp=tmp_path), {"KVLEDGER_IO_CPU": "99999"}, timeout=120)
    assert bad.returncode != 0 and "KVLEDGER_IO_CPU='99999': not one of this process's CPUs" in bad.stderr


# -- polling -------------------------------------------------------------------------------


@tuned
def test_poll_returns_when_ready_or_when_its_window_closes():
    """At once for a readable pipe; after its window, not before and not much later, for
    one that stays empty."""
    r, w = os.pipe()
    try:
        os.write(w, b"x")
        t0 = time.perf_counter()
        tuning.poll(r, spin_s=5.0)
        assert time.perf_counter() - t0 < 1.0
        os.read(r, 1)
        took: list[float] = []

        def empty() -> None:
            t = time.perf_counter()
            tuning.poll(r, spin_s=0.2)
            took.append(time.perf_counter() - t)

        t = threading.Thread(target=empty, daemon=True)  # a poll that missed its deadline would not end
        t.start()
        t.join(timeout=10)
        assert took and 0.2 <= took[0] < 5.0, took
    finally:
        os.close(r)
        os.close(w)


@tuned
@pytest.mark.parametrize("by", ["freeze_heap", "host"])
def test_a_frozen_heap_is_counted_once_not_at_every_replay(monkeypatch, by):
    """gc.get_freeze_count walks every frozen object (~50 ms for torch's): a paused
    collector asks it only until it sees a frozen heap, and then never unfreezes it."""
    import gc

    calls: list[str] = []
    frozen = [0]
    monkeypatch.setattr(tuning, "_frozen", by == "freeze_heap")
    monkeypatch.setattr(tuning, "_host_frozen", False)
    monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append("count") or frozen[0])
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    if by == "host":
        with tuning.collector_paused():
            pass
        assert calls == ["count", "freeze", "unfreeze"]  # nothing frozen: what it made goes old
        calls.clear()
        frozen[0] = 190_000  # the host freezes its start-up heap
    for _ in range(3):
        with tuning.collector_paused():
            pass
    assert calls == ([] if by == "freeze_heap" else ["count"])


@tuned
def test_polled_passes_the_generator_through():
    """polled yields what the wrapped generator waits for, sends it what the waiter found,
    and returns its result, also when it has nothing to wait for."""

    def talk():
        got = yield 2  # write
        got2 = yield 1  # read
        return (got, got2)

    def nothing():
        return "done"
        yield  # a generator

    r, w = os.pipe()
    try:
        os.write(w, b"x")  # readable: the poll before the read returns at once
        g = tuning.polled(talk(), r)
        assert next(g) == 2
        assert g.send("w") == 1
        with pytest.raises(StopIteration) as end:
            g.send("r")
        assert end.value.value == ("w", "r")
        with pytest.raises(StopIteration) as empty:
            next(tuning.polled(nothing(), r))
        assert empty.value.value == "done"
    finally:
        os.close(r)
        os.close(w)


# -- the heap and the collector; every mechanism off -----------------------------------------

_COLLECTOR = """
import gc, json, os, time
from kvledger.engine.service import CommandService
from kvledger.journal import tuning
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay.metrics import WindowSpec
from kvledger.replay.run import replay_journal
from kvledger.worker.loading import load_model
from kvledger.worker.serving import RequestSpec, Worker

out = {{"enabled": tuning.enabled()}}
r, w = os.pipe()
t = time.perf_counter()
tuning.poll(r, spin_s=0.5)  # nothing comes: polls the whole window, or not at all
out["poll_s"] = time.perf_counter() - t
model, artifact = load_model()
with open_or_create_journal("{url}") as j:
    out["frozen_before"] = gc.get_freeze_count()
    worker = Worker(model, service=CommandService(j), artifact=artifact, capacity=32)
    out["frozen"] = gc.get_freeze_count()
    worker.submit(RequestSpec(request_id="r", prompt=(1, 2, 3), max_new_tokens=4))
    worker.run()
    during = []
    replay_journal(j, WindowSpec(slo_ttft_ns=10**9, slo_tbt_ns=10**8),
                   progress=lambda n: during.append(gc.isenabled()))
    out["collector_during_fold"] = during
    out["collector_after"] = gc.isenabled()
    out["frozen_after_replay"] = gc.get_freeze_count()
print(json.dumps(out))
"""


@pytest.mark.parametrize("switch", ["on", "off"])
def test_tuning_off_freezes_nothing_pauses_nothing_and_polls_nothing(tmp_path, switch):
    """On: the first Worker freezes the start-up heap, a replay's fold runs with the
    collector paused (and leaves the frozen heap frozen), and a poll of an empty pipe takes
    its window. Off: none of it."""
    url = f"sqlite:///{tmp_path}/j.db"
    init_database(url)
    out = _python(_COLLECTOR.format(url=url), {"KVLEDGER_TUNING": switch})
    assert out["enabled"] is (switch == "on")
    assert out["frozen_before"] == 0 and out["collector_during_fold"] and out["collector_after"]
    if switch == "on":
        assert out["poll_s"] >= 0.5
        assert out["frozen"] > 10_000  # torch, the model, the libraries
        assert out["collector_during_fold"] == [False] * len(out["collector_during_fold"])
        # the replay did not unfreeze it (refcounting frees a few frozen objects meanwhile)
        assert out["frozen_after_replay"] > out["frozen"] - 1_000
    else:
        assert out["poll_s"] < 0.25
        assert out["frozen"] == out["frozen_after_replay"] == 0
        assert out["collector_during_fold"] == [True] * len(out["collector_during_fold"])


# -- the same journal either way -----------------------------------------------------------

_DEMO = """
import gc, json
from kvledger.demo import DemoOptions, run_demo
from kvledger.journal import tuning
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import export_jsonl
from kvledger.worker.serving import leave_a_core

leave_a_core()  # as `kvledger demo --writer process` does: the model thread leaves the I/O CPU
with open_or_create_journal("{url}") as j:
    result = run_demo(j, DemoOptions(requests=8, max_new_tokens=6, seed=5, run_id="same",
                                     source_instance="kvledger-demo-same", writer="process"))
    export_jsonl(j, "{out}")
print(json.dumps({{"errors": result["errors"], "frozen": gc.get_freeze_count(),
                  "io_cpu": tuning.describe()["io_cpu"]}}))
"""

_ID = re.compile(r"[0-9a-f]{32}")
_CLOCKS = ("monotonic_ns", "observed_wall_time")


def _without_clocks_and_ids(path: Path) -> list[dict]:
    """An export's events with their clocks dropped and every 32-hex id replaced by the
    order it first appeared in (ids are random per process: the writer process draws them)."""
    names: dict[str, str] = {}

    def walk(v):
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items() if k not in _CLOCKS}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str) and _ID.fullmatch(v):
            return names.setdefault(v, f"id-{len(names)}")
        return v

    return [walk(json.loads(line)) for line in path.read_text().splitlines()]


@pytest.fixture
def two_journals(backend, tmp_path, request) -> tuple[str, str]:
    if backend == "sqlite":
        urls = (f"sqlite:///{tmp_path}/on.db", f"sqlite:///{tmp_path}/off.db")
        for url in urls:
            init_database(url)
        return urls
    admin = request.getfixturevalue("pg_admin")
    return admin.create(), admin.create()


@pytest.mark.nats_case("tuning places the machine's threads, whatever the backend: SQLite shows it")
@pytest.mark.sqlite_case("tuning places the machine's threads, whatever the backend")
def test_a_demo_writes_the_same_journal_with_tuning_on_and_off(two_journals, tmp_path):
    """The demo's workload (forks, cancels, truncations, repairs, a reorder, a failed call)
    through a writer process, tuning on and off: the exports are the same event for event
    but for clocks and ids. On, the mechanisms ran (heap frozen; writers placed when there
    are two CPUs)."""
    env = {"KVLEDGER_IO_CPU": str(ALLOWED[-1])} if len(ALLOWED) > 1 else {}
    exports = []
    for switch, url in zip(("on", "off"), two_journals):
        out_file = tmp_path / f"{switch}.jsonl"
        out = _python(_DEMO.format(url=url, out=out_file), {**env, "KVLEDGER_TUNING": switch})
        assert out["errors"] == []
        assert (out["frozen"] > 0) is (switch == "on")
        assert (out["io_cpu"] is not None) is (switch == "on" and len(ALLOWED) > 1)
        exports.append(_without_clocks_and_ids(out_file))
    on, off = exports
    assert len(on) > 100 and {"fork", "truncate", "failure"} <= {e["event_type"] for e in on}
    assert on == off
