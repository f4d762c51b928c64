"""Where the model thread and the journal's writers run (kvledger.worker.placement): the I/O CPU
read from /proc/interrupts, its override, and the affinities a worker's set-up leaves on
real threads and a real writer process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.worker import placement

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


def test_the_io_cpu_is_the_one_with_the_most_block_device_interrupts():
    assert placement.busiest(TABLE, frozenset({0, 1, 2})) == 1
    assert placement.busiest(TABLE, frozenset({0, 2})) == 2  # CPU1 not ours: the NVMe one
    assert placement.busiest(TABLE, frozenset({0})) is None  # no disk interrupts there
    no_disks = "\n".join(line for line in TABLE.splitlines() if "req" not in line and "nvme" not in line)
    assert placement.busiest(no_disks, frozenset({0, 1, 2})) is None
    assert placement.busiest("", frozenset({0, 1})) is None


def _probe(env_cpu: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run the worker's set-up steps in a fresh interpreter (affinity is per thread and
    the I/O CPU is read once per process) and report what each thread was left on."""
    script = f"""
import json, os, threading
import torch
from kvledger.engine.remote import command_service
from kvledger.engine.service import CommandService
from kvledger.worker.serving import use_threads, leave_a_core
from kvledger.worker import placement
from kvledger.migrations.storage import init_database, open_or_create_journal
from tests.test_remote_service import _allocate

out = {{"allowed": sorted(os.sched_getaffinity(0)), "io": placement.io_cpu()}}
full = torch.get_num_threads()
init_database("sqlite:///{tmp_path}/j.db")
out["threads_less"] = leave_a_core()
out["model_less"] = sorted(os.sched_getaffinity(0))
with open_or_create_journal("sqlite:///{tmp_path}/j.db") as j:
    remote = command_service(j, writer="process")
    out["writer_process"] = sorted(os.sched_getaffinity(remote.pid))
    remote.close()
    service = CommandService(j)
    service.submit_many([_allocate("A")])()  # the commit thread starts here
    [committer] = [t for t in threading.enumerate() if t.name.startswith("kvledger-commit")]
    out["commit_thread"] = sorted(os.sched_getaffinity(committer.native_id))
use_threads(full)
out["model_full"] = sorted(os.sched_getaffinity(0))
with open_or_create_journal("sqlite:///{tmp_path}/j.db") as j:
    remote = command_service(j, writer="process")
    out["writer_process_full"] = sorted(os.sched_getaffinity(remote.pid))
    remote.close()
print(json.dumps(out))
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "KVLEDGER_IO_CPU": env_cpu,
           "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120, cwd=root)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="placing writers apart needs two CPUs")
def test_a_pool_that_leaves_a_core_leaves_the_io_cpu_to_the_writers(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    io = allowed[-1]
    run = _probe(str(io), tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["io"] == io
    rest = [c for c in allowed if c != io]
    assert out["model_less"] == rest  # the model thread left the I/O CPU...
    assert out["writer_process"] == [io]  # ...to the writer process...
    assert out["commit_thread"] == [io]  # ...and to the commit thread
    assert out["model_full"] == allowed  # a full pool may run anywhere again
    assert out["writer_process_full"] == allowed  # and its writer is not pinned behind it


def test_placement_can_be_turned_off_and_a_bad_override_is_refused(tmp_path):
    run = _probe("none", tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["io"] is None
    assert out["model_less"] == out["allowed"] == out["writer_process"] == out["commit_thread"]
    bad = _probe("99999", tmp_path)
    assert bad.returncode != 0 and "KVLEDGER_IO_CPU='99999': not one of this process's CPUs" in bad.stderr
