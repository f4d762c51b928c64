"""The CLI surface of the foundation: help, schema, init, and bad URLs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvledger import migrations
from kvledger.journal.tables import SCHEMA_REVISION


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvledger", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0
    for cmd in ("init", "schema", "demo", "generate"):
        assert cmd in r.stdout


def test_schema_prints_the_event_union():
    r = run("schema", "--compact")
    assert r.returncode == 0
    s = json.loads(r.stdout)
    assert "append_publish" in s["discriminator"]["mapping"]


def test_init_on_unreachable_postgres_hides_the_password():
    r = run("init", "--db", "postgresql+psycopg://user:secret@127.0.0.1:1/x")
    assert r.returncode == 2
    assert "secret" not in r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("DATABASE_UNREACHABLE:")
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "url, code",
    [
        ("mysql://u:topsecret@h/d", "BAD_DATABASE_URL"),
        ("::::", "BAD_DATABASE_URL"),
        ("sqlite:////no/such/dir/x.db", "BAD_DATABASE_URL"),
        ("postgresql+psycopg://u:topsecret@127.0.0.1:1/", "BAD_DATABASE_URL"),
    ],
)
def test_bad_urls_fail_in_one_line(url, code):
    r = run("init", "--db", url)
    assert r.returncode == 2
    assert r.stderr.startswith(code) and len(r.stderr.strip().splitlines()) == 1
    assert "topsecret" not in r.stderr


def test_init_sqlite_and_env_default(tmp_path):
    db = tmp_path / "j.db"
    r = run("init", "--json", env={"KVLEDGER_DB": f"sqlite:///{db}"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["revision"] == SCHEMA_REVISION
    assert db.exists()
    r = run("init", "--db", f"sqlite:///{db}")  # idempotent
    assert r.returncode == 0


def test_alembic_head_is_the_revision_the_code_reads():
    assert migrations.head_revision() == SCHEMA_REVISION


@pytest.mark.sql_storage("compares the SQL tables alembic made with their metadata")
def test_migrated_schema_matches_the_table_metadata(db_url):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from kvledger.journal import make_engine, parse_url
    from kvledger.journal.tables import metadata

    engine = make_engine(parse_url(db_url))
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": "kvl_alembic_version"})
        diff = compare_metadata(ctx, metadata)
    engine.dispose()
    assert diff == []


def test_unmigrated_postgres_is_refused_with_a_hint(pg_admin):
    url = pg_admin.create(migrated=False)
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.schemas.errors import ErrorCode, KvLedgerError

    with pytest.raises(KvLedgerError) as e:
        open_or_create_journal(url)
    assert e.value.code is ErrorCode.NOT_MIGRATED and "kvledger init" in str(e.value)


def test_new_sqlite_file_initializes_itself(tmp_path):
    from kvledger.migrations.storage import open_or_create_journal

    with open_or_create_journal(f"sqlite:///{tmp_path}/fresh.db") as j:
        assert j.last_position() == 0
