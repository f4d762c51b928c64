"""PostgreSQL storage parameters that `kvledger init` sets (migrations._tune_postgres):
kvl_heads' fillfactor, so that a commit's head updates stay on their pages (HOT) instead
of leaving a dead row and two index entries behind per handle per commit."""

from __future__ import annotations

import os
import time

import psycopg
import pytest
from sqlalchemy.engine import make_url

from kvledger.engine import commands as c
from kvledger.engine import ids
from kvledger.engine.service import CommandService
from kvledger.journal.pgserver import conninfo
from kvledger.migrations.storage import init_database, open_or_create_journal
from kvledger.schemas.decode_batch import DecodeBatch

from lifecycle_helpers import make_manifest

HANDLES = [f"heads-{i}" for i in range(64)]
PROMPT = (3, 1, 4, 1)
STEPS = 24


def _options(url: str) -> list[str]:
    with psycopg.connect(conninfo(url)) as conn:
        return conn.execute("SELECT reloptions FROM pg_class WHERE oid = 'kvl_heads'::regclass").fetchone()[0] or []


def _heads_pages(url: str) -> int:
    with psycopg.connect(conninfo(url)) as conn:
        return conn.execute("SELECT pg_relation_size('kvl_heads') / current_setting('block_size')::int").fetchone()[0]


def _updates(url: str) -> tuple[int, int]:
    """kvl_heads' updates and HOT updates so far, once the writers' sessions have ended
    (a session reports its counts when it ends, moments after its client closes)."""
    deadline = time.monotonic() + 10
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        while True:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            upd, hot = conn.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                                    "WHERE relname = 'kvl_heads'").fetchone()
            if upd >= len(HANDLES) * STEPS or time.monotonic() > deadline:
                return upd, hot
            time.sleep(0.05)


def _reset(url: str) -> None:
    """The table as `init` left it before the setting existed."""
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute("ALTER TABLE kvl_heads RESET (fillfactor)")


def _decode(url: str) -> None:
    """HANDLES decoding in lockstep for STEPS commits: each commit updates every head once."""
    with open_or_create_journal(url) as journal:
        service = CommandService(journal)
        txn = {h: ids.new_id() for h in HANDLES}
        # allocations, then prefill starts, in commits of their own as a worker's come
        for cmds in (
            [c.Allocate(handle_id=h, manifest=make_manifest(request_id=h, prompt=PROMPT),
                        reserved_capacity=STEPS + 8) for h in HANDLES],
            [c.Relative(c.BeginAppend(
                handle_id=h, txn_id=txn[h], kind="prefill", base_generation=None, base_snapshot_version=None,
                interval_start=0, interval_count=len(PROMPT), token_ids=PROMPT, cache_positions=(0, 1, 2, 3),
                mask_key_extent=len(PROMPT), cache_abi_sha256="")) for h in HANDLES],
        ):
            assert not any(isinstance(r, Exception) for r in service.execute_many(cmds))
        abi = service.state(HANDLES[0]).cache_abi_sha256
        at = len(PROMPT)
        for k in range(STEPS):
            nxt = [ids.new_id() for _ in HANDLES]
            steps = DecodeBatch(tuple(HANDLES), tuple(txn[h] for h in HANDLES), (at,) * len(HANDLES),
                                (k,) * len(HANDLES), tuple(range(len(HANDLES))), tuple(nxt),
                                (f"{k:02x}" * 32,) * len(HANDLES), (abi,) * len(HANDLES))
            assert not any(isinstance(r, Exception) for r in service.execute_steps(steps))
            txn, at = dict(zip(HANDLES, nxt)), at + 1


@pytest.fixture
def pg_url(request) -> str:
    return request.getfixturevalue("pg_admin").create(migrated=False)


def test_init_sets_the_heads_fillfactor_and_sets_it_again_on_a_journal_made_without_it(pg_url):
    init_database(pg_url)
    assert "fillfactor=50" in _options(pg_url)
    _reset(pg_url)
    assert "fillfactor=50" not in _options(pg_url)
    init_database(pg_url)  # at head already: nothing to migrate, the setting still comes back
    assert "fillfactor=50" in _options(pg_url)
    init_database(pg_url)  # and a third time changes nothing
    assert _options(pg_url).count("fillfactor=50") == 1


def test_init_by_a_role_that_does_not_own_the_tables_succeeds_and_says_what_is_left(pg_url, caplog):
    """A service's role may write the journal without owning its tables: its init at head
    changes nothing and succeeds, and says that the setting waits for the owner's."""
    init_database(pg_url)  # as the owner
    _reset(pg_url)
    role = f"kvl_app_{os.getpid()}"
    with psycopg.connect(conninfo(pg_url), autocommit=True) as conn:
        try:
            conn.execute(f'CREATE ROLE "{role}" LOGIN')  # test-made name: not input
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("this server's test role may not create roles")
    try:
        with psycopg.connect(conninfo(pg_url), autocommit=True) as conn:
            conn.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO "{role}"')
        app = make_url(pg_url).set(username=role).render_as_string(hide_password=False)
        with caplog.at_level("WARNING", logger="kvledger"):
            init_database(app)
        assert "fillfactor=50" not in _options(pg_url)
        assert [(r.name, r.getMessage()) for r in caplog.records if r.levelname == "WARNING"] == [
            ("kvledger.migrations", "kvl_heads storage parameter (fillfactor=50) not set: this role does not own "
             "the table; run `kvledger init` as its owner once (head updates stay slower until then)")]
        init_database(pg_url)  # the owner's
        assert "fillfactor=50" in _options(pg_url)
    finally:
        with psycopg.connect(conninfo(pg_url), autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{role}"')
            conn.execute(f'DROP ROLE "{role}"')


def test_head_updates_stay_on_their_pages(request):
    """64 heads updated at every commit for STEPS commits, in a journal made as every
    test's is (a copy of a migrated template): the updates are HOT and the table keeps
    to the pages its rows need. The same run on the table without the setting is the
    control, which this test must tell apart (when written: 1,346 of 1,664 updates HOT
    and 13 pages there, against all of them and 4 pages)."""
    admin = request.getfixturevalue("pg_admin")
    tuned, control = admin.create(), admin.create()
    _reset(control)
    for url in (tuned, control):
        _decode(url)
    upd, hot = _updates(tuned)
    assert upd >= len(HANDLES) * STEPS
    assert hot >= 0.95 * upd, (upd, hot)
    assert _heads_pages(tuned) <= 8, _heads_pages(tuned)
    control_upd, control_hot = _updates(control)
    assert control_upd >= len(HANDLES) * STEPS
    assert control_hot < hot and _heads_pages(control) > _heads_pages(tuned), \
        (control_hot, hot, _heads_pages(control), _heads_pages(tuned))
