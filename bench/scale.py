"""4. Append scale: the cost of a publication with 10,000 live handles over 1,000.

Each size is its own journal with that many allocated handles; every batch publishes on
64 distinct handles drawn uniformly from all of them (a serving system's decode step
touches whichever requests are running), 64 per commit, through `SqlJournal.append`.
Both sizes run interleaved in the same run; cost per event = 1 / best rate. The
headline is the worse of the two backends.
"""

from __future__ import annotations

import random
from typing import Any

from bench import Context, best_rate
from bench.journal import BATCH, Kvledger, measure

GOALS = {"append_cost_ratio_10k_vs_1k_handles": ("<=", 1.2)}
NOTES = {
    "append_cost_ratio_10k_vs_1k_handles": "head lookups are primary-key probes and "
    "positions come from the primary-key index: per-event work does not depend on the "
    "number of handles; what grows is cache footprint (random heads and stream-index pages)",
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
                for size, system in systems.items():
                    rates[size].append(measure(system, draw(size, n_batches)))
        finally:
            for s in systems.values():
                s.close()
        best_small, best_large = best_rate(rates[small]), best_rate(rates[large])
        ratio = round(best_small / best_large, 3)
        ratios.append(ratio)
        out[f"{backend}_{small}_handles_per_s"] = round(best_small, 1)
        out[f"{backend}_{large}_handles_per_s"] = round(best_large, 1)
        out[f"append_cost_ratio_10k_vs_1k_handles_{backend}"] = ratio
    out["append_cost_ratio_10k_vs_1k_handles"] = max(ratios) if ratios else None
    return out
