"""9. Bounded memory: each hostile input that once grew a process without bound, run in
a process of its own (two such processes at a time). The figure is its peak RSS over the
same process's RSS just before the input began (after imports and set-up): a baseline
measured in the same run.

A scenario is a function `fn(tmp: Path, mode: str, ready: Callable[[], None]) -> None` in
one of MODULES' `SCENARIOS` dicts (key: the headline figure's name, ending `_peak_mb`). It
sets up, calls `ready()` once, then feeds the hostile input until its bound shows. The
child process reports `{"baseline_mb", "peak_mb"}`; the section reports the growth
(peak - baseline) under the scenario's key and both figures beside it.
"""

from __future__ import annotations

import importlib
import json
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import Context, peak_rss_mb

# One module per surface; each defines SCENARIOS (and may define GOALS for its keys).
MODULES: list[str] = ["bench.hostile_records", "bench.hostile_serve", "bench.hostile_recorder", "bench.hostile_hf"]

Scenario = Callable[[Path, str, Callable[[], None]], None]


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / (1 << 20)


def _scenarios() -> dict[str, tuple[str, Scenario]]:
    out: dict[str, tuple[str, Scenario]] = {}
    for name in MODULES:
        for key, fn in importlib.import_module(name).SCENARIOS.items():
            out[key] = (name, fn)
    return out


def goals() -> dict[str, tuple[str, float]]:
    out: dict[str, tuple[str, float]] = {}
    for name in MODULES:
        out.update(getattr(importlib.import_module(name), "GOALS", {}))
    return out


def run(ctx: Context) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    def one(key: str, module: str) -> dict[str, Any]:
        ctx.log(f"   {key}")
        tmp = ctx.tmp / key
        tmp.mkdir()
        proc = subprocess.run([sys.executable, "-m", "bench.bounded", module, key, str(tmp), ctx.mode],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{key}: exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        return {key: round(doc["peak_mb"] - doc["baseline_mb"], 1),
                key.removesuffix("_peak_mb") + "_baseline_mb": round(doc["baseline_mb"], 1)}

    # Two children at a time: each figure is a memory peak of a process of its own, which
    # a neighbour's CPU use does not raise (the timed recorder scenarios mostly wait, the
    # others mostly import), so running them two by two costs no figure its meaning.
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = [pool.submit(one, key, module) for key, (module, _) in _scenarios().items()]
        result: dict[str, Any] = {}
        for future in done:
            result.update(future.result())
    return result


def __getattr__(name: str) -> Any:
    if name == "GOALS":  # the bench runner reads GOALS after import: the modules' own
        return goals()
    raise AttributeError(name)


def _child(module: str, key: str, tmp: Path, mode: str) -> None:
    fn = importlib.import_module(module).SCENARIOS[key]
    baseline: list[float] = []

    def ready() -> None:
        baseline.append(_current_rss_mb())

    fn(tmp, mode, ready)
    if not baseline:
        raise RuntimeError(f"{key} never called ready()")
    print(json.dumps({"baseline_mb": baseline[0], "peak_mb": peak_rss_mb()}))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4])
