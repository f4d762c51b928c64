"""Concurrent writers in several processes on one handle: exactly one winner per base,
no gap or duplicate, and a tailing reader sees every committed event once, in order."""

from __future__ import annotations

from collections import Counter

from kvledger.migrations.storage import open_or_create_journal

import race_workers
from crash_workers import context
from factories import allocate_op

WORKERS, ATTEMPTS = 4, 200


def test_racing_publishers_one_winner_per_base(db_url):
    with open_or_create_journal(db_url) as j:
        j.append([allocate_op("H")])
    ctx = context()  # the racers' forkserver: its children start with the journal imported
    out, tail_out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    reader = ctx.Process(target=race_workers.tailer, args=(db_url, stop, tail_out))
    reader.start()
    procs = [ctx.Process(target=race_workers.publisher, args=(db_url, "H", w, ATTEMPTS, out))
             for w in range(WORKERS)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    assert all(isinstance(rs, list) for rs in results.values()), results
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    stop.set()
    seen = tail_out.get(timeout=120)
    reader.join(timeout=60)

    attempts = [a for rs in results.values() for a in rs]
    assert len(attempts) == WORKERS * ATTEMPTS
    wins = Counter(base for base, won, _, _ in attempts if won)
    losses = [code for _, won, code, _ in attempts if not won]
    assert set(losses) <= {"STALE_BASE", "DATABASE_BUSY"}
    with open_or_create_journal(db_url) as j:
        final = j.head("H").snapshot_version
        stream = j.read_stream("H")
        everything = [(e.global_position, e.event_id) for e in j.read_all()]
    given_up = {op for _, _, code, op in attempts if code == "DATABASE_BUSY"}
    assert not given_up & {getattr(e.payload, "txn_id", None) for e in stream}  # wrote nothing
    # every base 0..final-1 was won exactly once, and nothing else was won
    assert wins == Counter(range(final))
    assert final == sum(wins.values()) and final >= ATTEMPTS  # someone made progress each round
    assert [e.stream_position for e in stream] == list(range(1, final + 2))
    assert [p for p, _ in everything] == list(range(1, final + 2))
    assert len({eid for _, eid in everything}) == len(everything)
    # the tailing reader saw every committed event exactly once and in order
    assert seen == everything
