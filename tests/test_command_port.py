"""The command port (kvledger.engine.port): the service, the writer-process service and the
crash test's acking wrapper implement it. mypy checks each where it is defined (the
`_implements_port` functions); this checks the same at run time, on live instances."""

from __future__ import annotations

import inspect
import json

import pytest

from kvledger.engine import commands as c
from kvledger.engine.port import CommandPort
from kvledger.engine.remote import RemoteService
from kvledger.engine.service import CommandService
from kvledger.migrations.storage import init_database, open_or_create_journal
from kvledger.recovery.crash_children import _Acking

from factories import make_manifest

PROPERTIES = sorted(n for n, v in vars(CommandPort).items() if isinstance(v, property))
METHODS = sorted(n for n, v in vars(CommandPort).items()
                 if inspect.isfunction(v) and v.__qualname__.startswith("CommandPort."))


def _shape(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.fixture
def journal(tmp_path):
    url = f"sqlite:///{tmp_path}/journal.db"
    init_database(url)
    with open_or_create_journal(url) as j:
        yield j


@pytest.fixture(params=["service", "remote", "acking"])
def port(request, journal, tmp_path):
    if request.param == "service":
        impl = CommandService(journal)
    elif request.param == "remote":
        impl = RemoteService(journal)
    else:
        impl = _Acking(CommandService(journal), str(tmp_path / "acks"))
    with impl:
        yield impl


def test_the_port_names_what_workers_and_telemetry_use():
    assert PROPERTIES == ["clock", "journal", "on_commit", "on_reject", "source_instance", "states"]
    assert METHODS == ["__enter__", "__exit__", "close", "execute", "execute_many", "state", "submit_batch",
                       "submit_many"]


def test_each_implementation_has_every_member_with_the_ports_signature(port):
    assert isinstance(port, CommandPort)
    assert not hasattr(type(port), "__getattr__")  # explicit members, no delegation by lookup
    for name in PROPERTIES:
        getattr(port, name)
    for name in METHODS:
        assert _shape(getattr(type(port), name)) == _shape(getattr(CommandPort, name)), name


def test_the_acking_wrapper_acknowledges_and_shares_its_services_hooks(journal, tmp_path):
    service = CommandService(journal)
    acking = _Acking(service, str(tmp_path / "acks"))
    seen = []
    acking.on_commit.append(lambda receipt, events: seen.append(receipt.operation_id))
    assert acking.on_commit is service.on_commit and acking.journal is journal
    acking.execute(c.Allocate(handle_id="A", manifest=make_manifest(request_id="A"), reserved_capacity=8,
                              operation_id="alloc-A"))
    assert seen == ["alloc-A"]
    assert [json.loads(line)["op"] for line in (tmp_path / "acks").read_text().splitlines()] == ["alloc-A"]
    assert acking.state("A") is service.state("A") is not None
