"""Two commits' write paths at once: `python -m bench.ab REV_A REV_B [--pairs N] [--replay | --ceiling] [--json]`.

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
rates, _ = group_rates(f"sqlite:///{tempfile.mkdtemp()}/ab.db", 32, 40, int(sys.argv[3]))
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


def side(pkg: Path, cpu: int | None, groups: int, child: str = CHILD) -> subprocess.Popen[str]:
    """A child measuring with `pkg`'s code, on CPU `cpu` (None: on any)."""
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    pin = [] if cpu is None else ["taskset", "-c", str(cpu)]
    return subprocess.Popen([*pin, sys.executable, "-c", child, str(pkg), str(ROOT), str(groups)], env=env,
                            stdout=subprocess.PIPE, text=True,
                            cwd=pkg.parent)  # not this checkout: its kvledger/ would shadow the package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--groups", type=int, default=6,
                        help="groups of 40 steps a side a pair (--replay: replays of its journal)")
    parser.add_argument("--replay", action="store_true", help="time the replay path, not the write path")
    parser.add_argument("--ceiling", action="store_true",
                        help="the worker's ceiling (off rate / on rate, process writer), sides in turn")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        a, b = unpack(args.a, Path(tmp) / "a"), unpack(args.b, Path(tmp) / "b")
        pairs = []
        for i in range(args.pairs):
            if args.ceiling:  # in turn, A first in even pairs
                first, second = (a, b) if i % 2 == 0 else (b, a)
                got = {pkg: float(side(pkg, None, 0, CHILD_CEILING).communicate()[0]) for pkg in (first, second)}
                us = [got[a], got[b]]
            else:
                child = CHILD_REPLAY if args.replay else CHILD
                procs = side(a, i % 2, args.groups, child), side(b, 1 - i % 2, args.groups, child)
                us = [float(p.communicate()[0]) for p in procs]
            pairs.append(us)
            if not args.json:
                unit = "x off's time" if args.ceiling else "us/token"
                print(f"pair {i + 1}: A {us[0]:.2f} {unit}, B {us[1]:.2f}, A/B {us[0] / us[1]:.2f}", file=sys.stderr)
    ratios = sorted(x / y for x, y in pairs)
    result = {"a": args.a, "b": args.b,
              "pairs_off_over_on" if args.ceiling else "pairs_us_per_token": [[round(x, 2), round(y, 2)]
                                                                               for x, y in pairs],
              "median_a_over_b": round(statistics.median(ratios), 3),
              "min": round(ratios[0], 3), "max": round(ratios[-1], 3)}
    print(json.dumps(result) if args.json else
          f"median A/B {result['median_a_over_b']} (from {result['min']} to {result['max']})")


if __name__ == "__main__":
    main()
