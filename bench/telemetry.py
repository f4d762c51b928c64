"""5. Telemetry: worker decode tokens/s with telemetry on vs off, journal on in both.

The workload is the decode section's (B requests of 32-token prompts, G greedy tokens
each, end to end): "off" is the worker under the journal as in section 3; "on" adds an
kvledger.telemetry.producer.Telemetry attached to the service and the worker, writing every
audit record and observation to a file and keeping the Prometheus metrics. An "on" run
is timed until the telemetry is closed, so every record it emitted is written. Runs are
interleaved and repeated at torch's full pool and at one core fewer (with the journal
in the worker's process, its commit thread and the telemetry writer then have a core),
and the best rate of each side is kept; a quick run drops, after its first repeat, a
pool that served a side at under half the other's rate then (bench.first_repeat_losers).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from bench import Context, at_threads, best_rate, first_repeat_losers
from bench.decode import bench_prompts, serving_worker

GOALS = {"telemetry_overhead": ("<=", 0.05)}
NOTES = {
    "telemetry_cpu_share": "telemetry's own CPU (hooks replayed, then rendering) / the rest of a "
                           "telemetry-on run's process CPU; single-threaded replay, so other "
                           "tenants of the machine barely move it",
    "telemetry_cpu_overhead": "process CPU time (all threads) on / off - 1, least of the repeats, "
                              "at the torch pool that served off best",
    "telemetry_overhead": "(off rate / on rate) - 1 at batch 16, each side at its better torch "
                          "pool; the hooks (per commit and per applied receipt) and the rendering "
                          "of each batch of 64 run on the worker's thread, the writes on the "
                          "exporter thread",
}


def _rate(ctx: Context, model, artifact, prompts, g: int, telemetry_on: bool) -> tuple[float, dict]:
    from kvledger.engine.service import CommandService
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.telemetry.producer import Telemetry

    url = ctx.sqlite_journal_url("telemetry")
    with open_or_create_journal(url) as j:
        service = CommandService(j)
        w = serving_worker(model, artifact, prompts, g, service)
        telemetry = None
        if telemetry_on:
            telemetry = Telemetry(ctx.tmp / f"{ctx.name('telemetry')}.jsonl")
            telemetry.attach(service, w)
        t0, c0 = time.perf_counter(), time.process_time()
        w.run()
        if telemetry is not None:
            telemetry.close()
        dt = time.perf_counter() - t0
        stats = {"cpu_s": time.process_time() - c0}
        if telemetry is not None:
            stats.update(telemetry.stats())
        assert not w.errors, w.errors[:3]
    return len(prompts) * g / dt, stats


class _Journal:
    def last_position(self) -> int:
        return 0


class _Service:
    """Just enough of a CommandService for a replayed Telemetry."""

    def __init__(self, source) -> None:
        self.source_instance, self.clock, self.journal = source.source_instance, source.clock, _Journal()
        self.on_commit: list = []
        self.on_reject: list = []
        self.states: dict = {}


def _intrinsic(ctx: Context, model, artifact, prompts, g: int) -> tuple[float, float]:
    """(telemetry CPU seconds, the rest of the run's CPU seconds): record every hook call
    of one telemetry-on run, then replay the calls into a fresh Telemetry and render what
    they queued, on one thread, timed with process CPU time."""
    import io

    from kvledger.engine.service import CommandService
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.telemetry.producer import Telemetry

    calls: list[tuple] = []
    with open_or_create_journal(ctx.sqlite_journal_url("telemetry")) as j:
        service = CommandService(j)
        w = serving_worker(model, artifact, prompts, g, service)
        telemetry = Telemetry(io.BytesIO()).attach(service, w)
        on_commit, on_applied = service.on_commit[-1], w.on_applied
        service.on_commit[-1] = lambda r, e: (calls.append((0, r, e)), on_commit(r, e))
        w.on_applied = lambda r: (calls.append((1, r)), on_applied(r))
        c0 = time.process_time()
        w.run()
        run_cpu = time.process_time() - c0
        telemetry.close()
        replay = Telemetry(io.BytesIO())
        replay.exporter.stop()  # its writer thread: this replay only renders
        replay.attach(_Service(service), w)
        queued: list[tuple] = []
        replay.exporter.put = lambda item, n: queued.append(item) or True
        hooks = replay.service.on_commit[0], w.on_applied
        c0 = time.process_time()
        for call in calls:
            hooks[call[0]](*call[1:])
        replay.exporter.render(queued)
        cost = time.process_time() - c0
    return cost, run_cpu - cost


def run(ctx: Context) -> dict[str, Any]:
    from kvledger.worker.loading import load_model
    from kvledger.worker.model import DEFAULT_CONFIG
    from kvledger.worker.serving import leave_a_core

    b, g = 16, ctx.size(smoke=8, quick=64, full=128)
    model, artifact = load_model(config=DEFAULT_CONFIG)
    prompts = bench_prompts(b, DEFAULT_CONFIG.vocab_size)
    _rate(ctx, model, artifact, prompts, min(g, 8), True)  # warm up both paths once
    full = torch.get_num_threads()
    pools = sorted({full, at_threads(full, leave_a_core)}, reverse=True)
    rates: dict[tuple[bool, int], list[float]] = {}
    cpu: dict[tuple[bool, int], list[float]] = {}
    stats: dict = {}
    # Short runs, many of them, interleaved off/on/on/off: on a shared machine a burst of
    # other work lands on some runs; the best of each side is the one it spared.
    skip: set[tuple[bool, int]] = set()
    for i in range(ctx.size(smoke=1, quick=8, full=10)):
        for telemetry_on in ((False, True) if i % 2 == 0 else (True, False)):
            for n in pools:
                if (telemetry_on, n) in skip:
                    continue
                rate, s = at_threads(n, _rate, ctx, model, artifact, prompts, g, telemetry_on)
                rates.setdefault((telemetry_on, n), []).append(rate)
                cpu.setdefault((telemetry_on, n), []).append(s["cpu_s"])
                if telemetry_on:
                    stats = s
        if i == 0 and ctx.mode == "quick":  # a pool far behind in the first repeat: not again
            skip = first_repeat_losers(rates, [tuple((t, n) for n in pools) for t in (False, True)])
    on = [r for (t, _), v in rates.items() if t for r in v]
    off = [r for (t, _), v in rates.items() if not t for r in v]
    # CPU at the pool size that served "off" best: a smaller pool spins less at barriers
    pool = max(pools, key=lambda n: best_rate(rates[False, n]))
    cpu_on, cpu_off = cpu[True, pool], cpu[False, pool]
    r_on, r_off = best_rate(on), best_rate(off)
    intrinsic = [_intrinsic(ctx, model, artifact, prompts, g) for _ in range(ctx.size(smoke=1, quick=2, full=3))]
    cost, rest = min(intrinsic, key=lambda x: x[0] / x[1])
    ctx.log(f"   b{b} g{g}: telemetry on {r_on:.0f} tok/s, off {r_off:.0f} tok/s, "
            f"{stats.get('records', 0)} records, {stats.get('dropped', 0)} dropped; telemetry's own "
            f"CPU {cost / (b * g) * 1e6:.1f} us/token = {cost / rest:.1%} of the rest")
    return {
        "telemetry_overhead": round(r_off / r_on - 1, 4),
        # process CPU seconds (all threads), least of the repeats: less sensitive to other tenants
        "telemetry_cpu_overhead": round(min(cpu_on) / min(cpu_off) - 1, 4),
        "telemetry_cpu_share": round(cost / rest, 4),
        "telemetry_cpu_us_per_token": round(cost / (b * g) * 1e6, 1),
        "decode_tokens_per_s_telemetry_on_b16": round(r_on, 1),
        "decode_tokens_per_s_telemetry_off_b16": round(r_off, 1),
        **{f"decode_tokens_per_s_telemetry_{'on' if t else 'off'}_b16_threads{n}": round(best_rate(v), 1)
           for (t, n), v in sorted(rates.items())},
        "telemetry_records_per_run": stats.get("records", 0),
        "telemetry_dropped_per_run": stats.get("dropped", 0),
    }
