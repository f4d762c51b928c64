"""4. Append scale: the cost of a publication with 10,000 live handles over 1,000.

Each size is its own journal with that many allocated handles; every batch publishes on
64 distinct handles drawn uniformly from all of them (a serving system's decode step
touches whichever requests are running), 64 per commit, through `SqlJournal.append`.
Both sizes run interleaved in the same run; the ratio is the median over repeats of
rate(1k) / rate(10k) (= cost per event at 10k over 1k), each repeat running the two
back to back. The headline is the worse of the two backends.
"""

from __future__ import annotations

import random
from typing import Any

from bench import Context, best_rate, paired_ratio
from bench.journal import BATCH, Kvledger, measure

GOALS = {"append_cost_ratio_10k_vs_1k_handles": ("<=", 1.2)}
NOTES = {
    "append_cost_ratio_10k_vs_1k_handles": "PostgreSQL ~1 (heads by primary key, row-sized WAL); "
    "SQLite ~1.4-1.6: its WAL is page-sized, and with 10k handles every head and stream-index "
    "entry of a batch is on its own page (~1.5x the WAL bytes per commit); bounded, schema-level",
}


def run(ctx: Context) -> dict[str, Any]:
    small, large = ctx.size(smoke=(100, 1000), quick=(1000, 10000), full=(1000, 10000))
    n_batches = ctx.size(smoke=2, quick=30, full=100)
    repeats = ctx.size(smoke=1, quick=7, full=9)
    rng = random.Random(8)
    out: dict[str, Any] = {"small_handles": small, "large_handles": large}
    ratios = []
    for backend in ("sqlite", "postgres"):
        systems = {}
        try:
            for size in (small, large):
                ctx.log(f"scale: allocating {size} handles on {backend}")
                systems[size] = Kvledger(ctx, backend, size)
        except RuntimeError as exc:  # no PostgreSQL
            ctx.log(f"scale: {backend} unavailable: {exc}")
            out[f"unavailable_{backend}"] = str(exc)
            for s in systems.values():
                s.close()
            continue
        try:
            def draw(size: int, count: int) -> list[list[int]]:
                return [rng.sample(range(size), BATCH) for _ in range(count)]

            for size, system in systems.items():  # warm up
                measure(system, draw(size, max(1, n_batches // 10)))
            rates: dict[int, list[float]] = {small: [], large: []}
            for rep in range(repeats):
                ctx.log(f"scale: {backend} repeat {rep + 1}/{repeats}")
                order = list(systems.items())
                for size, system in (order if rep % 2 == 0 else order[::-1]):
                    rates[size].append(measure(system, draw(size, n_batches)))
        finally:
            for s in systems.values():
                s.close()
        best_small, best_large = best_rate(rates[small]), best_rate(rates[large])
        ratio = paired_ratio(rates[small], rates[large])  # cost at 10k / cost at 1k
        if ratio is not None:
            ratios.append(ratio)
        out[f"{backend}_{small}_handles_per_s"] = round(best_small, 1)
        out[f"{backend}_{large}_handles_per_s"] = round(best_large, 1)
        out[f"append_cost_ratio_10k_vs_1k_handles_{backend}"] = ratio
    out["append_cost_ratio_10k_vs_1k_handles"] = max(ratios) if ratios else None
    return out
