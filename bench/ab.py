"""Two commits' write paths at once:
`python -m bench.ab REV_A REV_B [--pairs N] [--replay | --ceiling | --writer | --frames | --publish] [--json]`.

This VM's speed moves up to 2x between runs seconds apart, so a rate measured now and
another measured a minute later compare the machine as much as the code. Here both
commits run the service-alone decode steps (bench.tokens.Lockstep: 64 handles, 32
layers, one commit a step, durable SQLite) at the same time, each pinned to its own
core, and the cores are swapped from one pair to the next: what slows the machine slows
both sides. Each side reports its median time a token over its groups; the result is
each pair's ratio A/B and their median (> 1: B is faster).

Each commit is unpacked (git archive) into a temporary directory laid out as the
installed package (kvledger/ with its layers beside it), which goes first on the child's
PYTHONPATH; the harness (bench.tokens) is this checkout's for both sides. A one-off
measurement, not a section of `python -m bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("schemas", "journal", "migrations", "engine", "worker", "telemetry", "replay", "recovery", "adapters")
CHILD = """
import statistics, sys, tempfile
import kvledger
assert kvledger.__file__.startswith(sys.argv[1]), kvledger.__file__
sys.path.insert(0, sys.argv[2])
from bench.tokens import group_rates
rates, _ = group_rates(f"sqlite:///{tempfile.mkdtemp()}/ab.db", 32, 40, int(sys.argv[3]), batch=int(sys.argv[4]))
print(statistics.median(1e6 / r for r in rates))
"""
# --replay: the replay key's path instead (bench.tokens.replay_rate: read, inflate, decode
# and project a 32-layer journal of decode chains, written by that side's own code)
CHILD_REPLAY = """
import statistics, sys, tempfile
import kvledger
assert kvledger.__file__.startswith(sys.argv[1]), kvledger.__file__
sys.path.insert(0, sys.argv[2])
from bench.tokens import chain_rate, replay_rate
url = f"sqlite:///{tempfile.mkdtemp()}/ab.db"
tokens = sum(chain_rate(url, 32, 59, 1)[1] for _ in range(4))
print(statistics.median(1e6 / replay_rate(url, tokens) for _ in range(int(sys.argv[3]))))
"""

# --publish: the generic batched write path instead (bench.journal's kvledger system, the
# one journal_vs_eventsourcing_sqlite times): 1,024 allocated handles, then groups of 40
# commits of 64 publications each, the operations built inside the timed region; prints
# the median us a publication over the groups. Sides in turn, as --ceiling: run at once,
# both fsync one disk, and each side's waits are the other's.
CHILD_PUBLISH = """
import statistics, sys, tempfile, time
import kvledger
assert kvledger.__file__.startswith(sys.argv[1]), kvledger.__file__
sys.path.insert(0, sys.argv[2])
from bench.ops import Head, allocate_op, handle_ids, publish_op
from kvledger.engine.ids import new_id
from kvledger.journal import open_journal
from kvledger.migrations.storage import init_database
url = f"sqlite:///{tempfile.mkdtemp()}/ab.db"
init_database(url)
j = open_journal(url)
heads = [Head(h) for h in handle_ids(1024)]
for i in range(0, 1024, 256):
    j.append([allocate_op(h.handle, new_id) for h in heads[i:i + 256]])
k, us = 0, []
for g in range(int(sys.argv[3]) + 1):
    t = time.perf_counter()
    for _ in range(40):
        j.append([publish_op(heads[(k + x) % 1024], new_id) for x in range(64)])
        k += 64
    if g:  # the first group warms up
        us.append((time.perf_counter() - t) * 1e6 / (40 * 64))
print(statistics.median(us))
"""

# --ceiling: the worker's ceiling instead (bench.tokens: the near-free model at batch 64,
# one torch thread, journal off then on through a writer process). It needs both cores,
# so the two sides take turns instead of running at once. Prints off's rate over on's:
# what the journal costs the run, as a factor (its inverse is journal_ceiling_vs_off).
CHILD_CEILING = """
import sys, tempfile
import kvledger
assert kvledger.__file__.startswith(sys.argv[1]), kvledger.__file__
sys.path.insert(0, sys.argv[2])
from bench import at_threads
from bench.tokens import _worker_run
off = at_threads(1, _worker_run, None, 2, 32, None)[0]
on = at_threads(1, _worker_run, f"sqlite:///{tempfile.mkdtemp()}/ab.db", 2, 32, "process")[0]
print(off / on)
"""

# --writer: what the journal's writer spends on one whole generation of the ceiling's
# worker (the near-free model at batch 64, one torch thread, an in-process service with
# each iteration's submit and commit timed, nothing overlapped); prints the ms of the
# whole generation, of its first iteration (allocations and prefill starts) and of its
# last (finishes and releases), medians of three runs. Sides in turn, as --ceiling.
CHILD_WRITER = """
import statistics, sys, tempfile, time
import kvledger
assert kvledger.__file__.startswith(sys.argv[1]), kvledger.__file__
sys.path.insert(0, sys.argv[2])
import torch
torch.set_num_threads(1)
import kvledger.engine.service as sv
from bench.decode import bench_prompts, serving_worker
from bench.tokens import BATCH, NEAR_FREE
from kvledger.migrations.storage import open_or_create_journal
from kvledger.worker.loading import load_model
from kvledger.worker.model import ModelConfig
spent = []
submit = sv.CommandService.submit_many
def timed(self, cmds, *, defer=True):
    t = time.perf_counter()
    results = submit(self, cmds, defer=defer)()
    spent.append((time.perf_counter() - t) * 1e3)
    return lambda: results
sv.CommandService.submit_many = timed
model, artifact = load_model(config=ModelConfig(**NEAR_FREE))
prompts = bench_prompts(BATCH, NEAR_FREE["vocab_size"])
runs = []
for _ in range(3):
    spent.clear()
    with open_or_create_journal(f"sqlite:///{tempfile.mkdtemp()}/ab.db") as j:
        w = serving_worker(model, artifact, prompts, 32, sv.CommandService(j))
        w.pipeline = w.lookahead = False
        w.run()
    runs.append((sum(spent), spent[0], spent[-1]))
print(*(statistics.median(r[i] for r in runs) for i in range(3)))
"""


# --frames: the writer process's own work in the ceiling's run, without the worker beside
# it. The frames that a run of the ceiling's worker (process writer) sent its writer are
# recorded once, with this checkout's code (CHILD_RECORD); each side's engine.remote.serve
# then decides and commits them (durable SQLite) from a pipe, a thread standing in for the
# worker (one frame in flight, as RemoteService sends them), pinned to its own core, both
# sides at once. Prints the median ms an iteration (the first and last,
# allocations and releases, left out), the median over `--groups` runs of all frames.
# The ceiling's on rate is bounded by this time, and --ceiling's ratio of two separately
# measured rates is too noisy on this VM to see a 10% change in it.
CHILD_RECORD = """
import sys
import msgspec
import kvledger.engine.remote as remote
from bench import at_threads
from bench.tokens import _worker_run
frames, send = [], remote.send
def record(fd, payload):
    frames.append(payload)
    send(fd, payload)
remote.send = record
at_threads(1, _worker_run, f"sqlite:///{sys.argv[1]}/record.db", 2, 32, "process")
with open(sys.argv[2], "wb") as f:
    f.write(msgspec.msgpack.encode(frames[1:]))  # not the first: the hello, with the URL
"""
CHILD_FRAMES = """
import os, statistics, sys, tempfile, threading, time
import kvledger
assert kvledger.__file__.startswith(sys.argv[1]), kvledger.__file__
import msgspec
from kvledger.engine import remote
from kvledger.migrations.storage import open_or_create_journal
with open(os.environ["KVLEDGER_AB_FRAMES"], "rb") as f:
    frames = msgspec.msgpack.decode(f.read(), type=list[bytes])
runs = []
for _ in range(int(sys.argv[3])):
    url = f"sqlite:///{tempfile.mkdtemp()}/ab.db"
    with open_or_create_journal(url):
        pass
    (to_r, to_w), (from_r, from_w) = os.pipe(), os.pipe()
    times = []
    def drive():  # as the worker's RemoteService: a frame, then its reply, one in flight
        remote.send(to_w, msgspec.msgpack.encode(remote._Hello(url, "kvledger")))
        remote.receive(from_r)
        for frame in frames:
            t = time.perf_counter()
            remote.send(to_w, frame)
            remote.receive(from_r)
            times.append(time.perf_counter() - t)
        os.close(to_w)
    driver = threading.Thread(target=drive)
    driver.start()
    remote.serve(to_r, from_w)  # the writer process's loop, here in the main thread (its signal handling)
    driver.join()
    for fd in (to_r, from_r, from_w):
        os.close(fd)
    runs.append(statistics.median(times[1:-1]) * 1e3)
print(statistics.median(runs))
"""

EPILOG = """examples:
  python -m bench.ab main HEAD                 decode steps' write path (journal_tokens_per_s_sqlite's)
  python -m bench.ab main HEAD --batch 256     the same at 256 steps a commit (journal_tokens_per_s_sqlite_b256's)
  python -m bench.ab main HEAD --replay        replay_tokens_per_s's path
  python -m bench.ab main HEAD --publish       journal_vs_eventsourcing_sqlite's kvledger side
  python -m bench.ab main HEAD --ceiling       journal_ceiling_vs_off (off / on, sides in turn)
  python -m bench.ab main HEAD --pairs 2 --groups 2 --json    a short run, one JSON object

Run it from a checkout that holds both commits (uncommitted changes are not measured:
commit first). Each pair prints both sides and A/B; the last line is the median of the
pairs' A/B with its range. A/B > 1 means B is faster (for --ceiling: B's journal costs
less). The range over the pairs is this machine's noise for that path: a change is a
regression only when the median is below 1 by more than the range's spread around it.
Keys no mode covers: compare `python -m bench --quick --json` of each commit, run one after
the other, and read their ratios (the keys named *_vs_* and *_overhead), not their rates."""


def unpack(rev: str, into: Path) -> Path:
    """The commit's tree laid out as the installed package; returns the PYTHONPATH entry."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    src = into / "src"
    src.mkdir(parents=True)
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(src, filter="data")
    pkg = into / "pkg"
    (pkg / "kvledger").mkdir(parents=True)
    for item in (src / "kvledger").iterdir():
        (pkg / "kvledger" / item.name).symlink_to(item)
    for layer in LAYERS:
        (pkg / "kvledger" / layer).symlink_to(src / layer)
    return pkg


def side(pkg: Path, cpu: int | None, groups: int, child: str = CHILD, batch: int = 64) -> subprocess.Popen[str]:
    """A child measuring with `pkg`'s code, on CPU `cpu` (None: on any); `batch`: the
    write path's steps a commit."""
    # TMPDIR: the run's own directory, removed at its end with the children's journals
    env = {**os.environ, "PYTHONPATH": str(pkg), "TMPDIR": str(pkg.parent)}
    pin = [] if cpu is None else ["taskset", "-c", str(cpu)]
    return subprocess.Popen([*pin, sys.executable, "-c", child, str(pkg), str(ROOT), str(groups), str(batch)], env=env,
                            stdout=subprocess.PIPE, text=True,
                            cwd=pkg.parent)  # not this checkout: its kvledger/ would shadow the package


def measured(proc: subprocess.Popen[str], out: str, rev: str) -> list[float]:
    """What a side printed (`out`, once `proc` has ended), or exit naming the side whose
    child failed (its traceback is above, on this process's stderr)."""
    try:
        values = [float(x) for x in out.split()]
    except ValueError:
        values = []
    if not values:
        raise SystemExit(f"bench.ab: the child measuring {rev} failed (exit {proc.returncode}); its error is above")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    parser.add_argument("a", help="the commit before (any git revision: a branch, a hash, HEAD~3)")
    parser.add_argument("b", help="the commit after")
    parser.add_argument("--pairs", type=int, default=6, help="pairs of runs, one side each (default 6)")
    parser.add_argument("--groups", type=int, default=6,
                        help="groups of 40 steps a side a pair (--replay: replays of its journal)")
    parser.add_argument("--batch", type=int, default=64,
                        help="the write path's decode steps a commit (default 64; 256: the _b256 key's)")
    parser.add_argument("--replay", action="store_true", help="time the replay path, not the write path")
    parser.add_argument("--ceiling", action="store_true",
                        help="the worker's ceiling (off rate / on rate, process writer), sides in turn")
    parser.add_argument("--writer", action="store_true",
                        help="the writer's ms over one generation of the ceiling's worker (whole, first and "
                             "last iteration), sides in turn")
    parser.add_argument("--frames", action="store_true",
                        help="the ceiling's writer process alone: the frames a ceiling run sent it, decided and "
                             "committed by each side (ms an iteration), both sides at once")
    parser.add_argument("--publish", action="store_true",
                        help="the generic batched publication path (journal_vs_eventsourcing_sqlite's "
                             "kvledger side), us a publication, sides in turn")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the pairs and their median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        a, b = unpack(args.a, Path(tmp) / "a"), unpack(args.b, Path(tmp) / "b")
        if args.frames:
            frames = Path(tmp) / "frames"
            subprocess.run([sys.executable, "-c", CHILD_RECORD, tmp, str(frames)], check=True, cwd=ROOT)
            os.environ["KVLEDGER_AB_FRAMES"] = str(frames)  # the sides' environment (side())
        pairs: list[list[float]] = []
        parts: list[tuple[list[float], list[float]]] = []  # --writer: first and last iteration, each side
        for i in range(args.pairs):
            if args.ceiling or args.writer or args.publish:  # in turn, A first in even pairs
                first, second = (a, b) if i % 2 == 0 else (b, a)
                child = CHILD_WRITER if args.writer else CHILD_PUBLISH if args.publish else CHILD_CEILING
                got = {}
                for pkg in (first, second):
                    proc = side(pkg, None, args.groups, child)
                    got[pkg] = measured(proc, proc.communicate()[0], args.a if pkg is a else args.b)
                us = [got[a][0], got[b][0]]
                if args.writer:
                    parts.append(([round(x, 2) for x in got[a][1:]], [round(x, 2) for x in got[b][1:]]))
            else:
                child = CHILD_REPLAY if args.replay else CHILD_FRAMES if args.frames else CHILD
                procs = (side(a, i % 2, args.groups, child, args.batch),
                         side(b, 1 - i % 2, args.groups, child, args.batch))
                outs = [p.communicate()[0] for p in procs]  # both ended before either is judged
                us = [measured(p, out, rev)[0] for p, out, rev in zip(procs, outs, (args.a, args.b))]
            pairs.append(us)
            if not args.json:
                unit = ("x off's time" if args.ceiling else "ms" if args.writer or args.frames
                        else "us/publication" if args.publish else "us/token")
                more = f" (first, last: A {parts[-1][0]}, B {parts[-1][1]})" if args.writer else ""
                print(f"pair {i + 1}: A {us[0]:.2f} {unit}, B {us[1]:.2f}, A/B {us[0] / us[1]:.2f}{more}",
                      file=sys.stderr)
    ratios = sorted(x / y for x, y in pairs)
    unit = ("pairs_off_over_on" if args.ceiling else "pairs_writer_ms" if args.writer
            else "pairs_iteration_ms" if args.frames else "pairs_us_per_publication" if args.publish
            else "pairs_us_per_token")
    result: dict[str, object] = {"a": args.a, "b": args.b, unit: [[round(x, 2), round(y, 2)] for x, y in pairs],
              "median_a_over_b": round(statistics.median(ratios), 3),
              "min": round(ratios[0], 3), "max": round(ratios[-1], 3)}
    if parts:
        result["median_first_last_ms"] = {
            side: [round(statistics.median(p[k][j] for p in parts), 2) for j in range(2)]
            for k, side in enumerate(("a", "b"))}
    print(json.dumps(result) if args.json else
          f"median A/B {result['median_a_over_b']} (from {result['min']} to {result['max']})"
          + (f"; first and last iteration, ms: {result['median_first_last_ms']}" if parts else ""))


if __name__ == "__main__":
    main()
