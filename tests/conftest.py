"""Shared fixtures: a real PostgreSQL server (throwaway, or KVLEDGER_TEST_POSTGRES_URL)
and a `db_url` fixture that runs a test once per registered journal backend
(kvledger.journal.backends.BACKENDS: the contract suite runs against every one)."""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nats_cluster import nats_cells, nats_cluster  # noqa: F401  # fixtures: NATS's scratch journals start them

from kvledger.journal.backends import BACKENDS, PENDING
from kvledger.journal.pgserver import ScratchDatabases, ThrowawayPostgres, find_bin
from kvledger.migrations.storage import init_database
from kvledger.schemas.errors import ErrorCode, KvLedgerError

import budget


def _scratch_in_memory() -> None:
    """Every scratch file of the run (pytest's tmp_path, the throwaway PostgreSQL and NATS
    servers' data, what the tests' subprocesses write) on tmpfs, where the machine has
    one with room: a durable commit there costs no device flush, and no test can tell a
    flush from none (a kill -9 keeps the page cache; power loss is not tested). Set at
    import, before pytest makes its base directory; KVLEDGER_TEST_TMPFS=off or an own
    TMPDIR keeps the default."""
    shm = Path("/dev/shm")
    if os.environ.get("KVLEDGER_TEST_TMPFS") == "off" or "TMPDIR" in os.environ or not shm.is_dir():
        return
    room = os.statvfs(shm)
    if room.f_bavail * room.f_frsize >= 8 << 30:
        os.environ["TMPDIR"] = str(shm)  # inherited by every subprocess and server
        tempfile.tempdir = None  # re-read by tempfile


_scratch_in_memory()
REQUIRE_PG = os.environ.get("KVLEDGER_REQUIRE_POSTGRES") == "1"
_names = itertools.count()
_AFFINITY = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else None


@pytest.fixture(autouse=True)
def _placement_stays_in_its_test():
    """A Worker built in this process places its thread off the I/O CPU (journal.tuning):
    the pytest process's main thread, whose affinity every later subprocess inherits."""
    yield
    if _AFFINITY is not None and frozenset(os.sched_getaffinity(0)) != _AFFINITY:
        from kvledger.journal import tuning

        tuning.pin_model(False)  # the model back on every CPU, writers no longer placed
        os.sched_setaffinity(0, _AFFINITY)


def pipelined_postgres(mp: pytest.MonkeyPatch, on: bool) -> None:
    """PostgreSQL's statements pipelined (`on`: as to a remote server) or sent one by one,
    whatever the server's address (KVLEDGER_PG_PIPELINE, for this test and the processes it
    starts); without libpq's pipeline mode a pipelined test is skipped."""
    from kvledger.journal.postgres import _PIPELINE

    if on and not _PIPELINE:
        pytest.skip("libpq without pipeline mode")
    mp.setenv("KVLEDGER_PG_PIPELINE", "on" if on else "off")


class PgAdmin:
    """Creates one fresh database per test, migrated ones from a migrated template."""

    def __init__(self, admin_url: str, server: ThrowawayPostgres | None) -> None:
        self.admin_url = admin_url  # postgresql+psycopg://user@host:port/db
        self.server = server
        self.scratch = ScratchDatabases(admin_url, f"kvl_template_{os.getpid()}", init_database)

    def create(self, migrated: bool = True) -> str:
        return self.scratch.create(f"kvl_test_{os.getpid()}_{next(_names)}", migrated=migrated)

    def discard(self, url: str) -> None:
        """Drop a test's database once the test is done: the server's data stays small."""
        from sqlalchemy.engine import make_url

        self.scratch.drop(make_url(url).database)


@pytest.fixture(scope="session")
def pg_admin():
    url = os.environ.get("KVLEDGER_TEST_POSTGRES_URL")
    if url:
        yield PgAdmin(url, None)
        return
    reason = None
    if find_bin() is None:
        reason = "no PostgreSQL server binaries (set KVLEDGER_TEST_POSTGRES_URL)"
    server = None
    if reason is None:
        try:
            server = ThrowawayPostgres(fsync=False).start()
        except Exception as exc:  # noqa: BLE001 - whatever stops the server starting is the reason reported
            reason = f"cannot start a throwaway PostgreSQL: {exc}"
    if reason:
        if REQUIRE_PG:
            pytest.fail(f"KVLEDGER_REQUIRE_POSTGRES=1 but {reason}")
        pytest.skip(reason)
    yield PgAdmin(server.url(), server)
    server.stop()


@pytest.fixture(scope="session")
def model():
    """The default seeded model (read-only: tests must not change its weights)."""
    from kvledger.worker.model import DEFAULT_CONFIG, Transformer

    return Transformer.from_config(DEFAULT_CONFIG, seed=0)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> Path:
    """A migrated SQLite journal to copy: migrating one takes ~0.1 s, copying it ~1 ms."""
    path = tmp_path_factory.mktemp("template") / "journal.db"
    init_database(f"sqlite:///{path}")
    return path


def _sqlite_journal(directory: Path, name: str, request) -> str:
    path = directory / f"{name}.db"
    shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
    return f"sqlite:///{path}"


def _postgres_journal(directory: Path, name: str, request) -> str:
    admin = request.getfixturevalue("pg_admin")
    url = admin.create()
    request.addfinalizer(lambda: admin.discard(url))
    return url


def _nats_journal(directory: Path, name: str, request) -> str:
    from nats_cluster import drop_cell

    url = request.getfixturevalue("nats_cells").take()
    request.addfinalizer(lambda: drop_cell(url))
    return url


# How a test gets a fresh, migrated journal of each registered backend (its URL), given
# a directory of the test's own, a name unique in it, and the test's request. A backend
# added to journal.backends needs its entry here: until then every test of it fails.
SCRATCH: dict[str, Callable[[Path, str, pytest.FixtureRequest], str]] = {
    "sqlite": _sqlite_journal,
    "postgres": _postgres_journal,
    "nats": _nats_journal,
}
# A backend not yet registered (journal.backends.PENDING) joins the parametrization when
# KVLEDGER_TEST_PENDING names it (e.g. `nats`): how far the suite is on it, before it is.
_PENDING_ASKED = set(os.environ.get("KVLEDGER_TEST_PENDING", "").split(","))
BACKEND_NAMES = [b.name for b in BACKENDS] + [b.name for b in PENDING if b.name in _PENDING_ASKED]


def scratch_maker(backend: str, directory: Path, request) -> Callable[[str], str]:
    """A function that makes fresh journals of `backend`, named in `directory`."""
    make = SCRATCH.get(backend)
    if make is None:
        pytest.fail(f"journal backend {backend!r} is registered (kvledger.journal.backends) but "
                    "tests/conftest.py SCRATCH cannot make a journal of it")
    return lambda name: make(directory, name, request)


@pytest.fixture(params=BACKEND_NAMES)
def backend(request) -> str:
    return request.param


@pytest.fixture
def fresh_url(backend, tmp_path, request) -> Callable[[str], str]:
    """Makes another fresh journal on the parametrized backend: fresh_url(name) -> URL."""
    return scratch_maker(backend, tmp_path, request)


@pytest.fixture
def db_url(fresh_url) -> str:
    """A fresh, migrated journal database on the parametrized backend."""
    return fresh_url("journal")


class _SessionScratch:
    """The session's request, as a shared journal's scratch maker sees it. Its clean-up
    runs as the session ends, which may be after its server's: a throwaway PostgreSQL or
    NATS cluster that stopped took the journal with it, and there is nothing to drop."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request

    def getfixturevalue(self, name: str) -> object:
        return self._request.getfixturevalue(name)

    def addfinalizer(self, drop: Callable[[], object]) -> None:
        def after_the_server() -> None:
            try:
                drop()
            except KvLedgerError as exc:
                if exc.code is not ErrorCode.DATABASE_UNREACHABLE:
                    raise

        self._request.addfinalizer(after_the_server)


@pytest.fixture(scope="session")
def _shared_journals(request) -> tuple[dict[tuple[str, str], str], _SessionScratch]:
    return {}, _SessionScratch(request)


@pytest.fixture
def shared_journal(backend, _shared_journals, tmp_path_factory, capsys) -> Callable[[str, Callable[[str], None]], str]:
    """shared_journal(name, build) -> URL: a journal of the parametrized backend that
    `build(url)` filled, made once per test process and name (a demo costs a test 1-6 s).
    A test only reads it, or puts back what it edits (in a `finally`)."""
    built, session = _shared_journals

    def get(name: str, build: Callable[[str], None]) -> str:
        if (backend, name) not in built:
            url = scratch_maker(backend, tmp_path_factory.mktemp(name), session)(name)
            build(url)
            capsys.readouterr()  # what the build printed is not the test's output
            built[backend, name] = url
        return built[backend, name]

    return get


# The backends whose journals are SQL tables. A test marked `sql_storage(reason)` edits or
# inspects those tables in a way no other backend has an equivalent of (the reason says
# why): it runs on these only, and its cases on any other backend are deselected.
SQL_BACKENDS = frozenset({"sqlite", "postgres"})


def pytest_configure(config):
    if budget.SCALE not in budget.SCALES:
        raise pytest.UsageError(f"KVLEDGER_TEST_SCALE={budget.SCALE!r}: expected one of {', '.join(budget.SCALES)}")
    config.addinivalue_line("markers", "sql_storage(reason): runs on the SQL backends only, for the reason given")
    config.addinivalue_line("markers", "nats_case(reason, **params): on NATS, only the case with these other "
                            "parameters (none given: no case; the reason names the NATS test that covers it)")
    config.addinivalue_line("markers", "sqlite_case(reason, **params): the cases with these other parameters "
                            "(all, if none) run on SQLite only, for the reason given")


def _dropped(item) -> bool:
    """Whether the parametrized case `item` is deselected (see the markers above).

    `nats_case` and `sqlite_case` keep CI within its time: a test above the journal (the
    worker, the demo, tuning, the collector) runs in one of its variants on the other
    backends, or in a test of its own there, rather than in every one; the journal's own
    contract runs whole on every backend."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    backend = params.get("backend")
    if backend is None:
        return False
    mark = _marked(item, "sql_storage")
    if mark is not None and backend not in SQL_BACKENDS:
        return True
    mark = _marked(item, "nats_case")
    if mark is not None and backend == "nats":
        return not mark.kwargs or any(params.get(k) != v for k, v in mark.kwargs.items())
    mark = _marked(item, "sqlite_case")
    if mark is not None and backend != "sqlite":
        return all(params.get(k) == v for k, v in mark.kwargs.items())
    return False


def _marked(item, name: str):
    """The item's `name` marker, which must give its reason, or None."""
    mark = item.get_closest_marker(name)
    if mark is not None:
        assert mark.args and isinstance(mark.args[0], str), f"{item.nodeid}: {name} needs its reason"
    return mark


def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        (dropped if _dropped(item) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say per backend how many parametrized cases ran, so a CI log shows PostgreSQL
    was really exercised (not skipped)."""
    counts: dict[str, dict[str, int]] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(rep, "nodeid", "")
            for backend in BACKEND_NAMES:
                if f"[{backend}" in nodeid or f"-{backend}]" in nodeid or f"-{backend}-" in nodeid:
                    counts.setdefault(backend, {}).setdefault(outcome, 0)
                    counts[backend][outcome] += 1
    if counts:
        parts = [f"{b}: " + ", ".join(f"{n} {o}" for o, n in sorted(c.items())) for b, c in sorted(counts.items())]
        terminalreporter.write_line("kvledger backends -> " + " | ".join(parts))
