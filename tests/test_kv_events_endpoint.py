"""The ZMQ endpoint check of `kv-events record` and `serve` (issue 44): a tcp port
outside 1..65535 is INVALID_ARGUMENT, and over arbitrary strings the check either
accepts an endpoint a URL parser reads with a port in range, or refuses it with that
code; nothing else escapes."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.cli import main
from kvledger.cmd_kv_events import endpoint
from kvledger.schemas.errors import ErrorCode, KvLedgerError


@pytest.mark.parametrize("port", ["0", "00000", "65536", "99999"])
def test_a_port_outside_the_tcp_range_is_refused(capsys, port):
    for command in (["record", "--endpoint"], ["serve", "--bind"]):
        assert main(["kv-events", *command, f"tcp://127.0.0.1:{port}", "--idle-exit", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("INVALID_ARGUMENT") and "1..65535" in err, err


def test_endpoints_that_engines_use_are_accepted():
    for value in ("tcp://127.0.0.1:5557", "tcp://*:5557", "tcp://engine-0.local:1", "tcp://[::1]:65535",
                  "ipc:///tmp/kv.sock", "inproc://kv"):
        assert endpoint(value) == value


def _check(value: str) -> None:
    try:
        got = endpoint(value)
    except KvLedgerError as exc:
        assert exc.code is ErrorCode.INVALID_ARGUMENT
        return
    assert got == value and len(value) <= 200 and value.isprintable() and not any(ch.isspace() for ch in value)
    if value.startswith("tcp://"):
        port = urlsplit(value.replace("tcp://*:", "tcp://star:")).port  # the URL parser's reading
        assert port is not None and 1 <= port <= 65535, value
    else:
        assert value.startswith(("ipc://", "inproc://")), value


PIECES = st.one_of(st.text(max_size=12), st.sampled_from(["127.0.0.1", "*", "[::1]", "host", "a:b", "", " ", "\n"]))
PORTS = st.one_of(st.integers(-10, 10 ** 7).map(str), st.text(alphabet="0123456789٠١٢ +-x", max_size=7))


@settings(max_examples=400, deadline=None)
@given(scheme=st.sampled_from(["tcp://", "ipc://", "inproc://", "http://", "tcp:/", ""]), host=PIECES,
       sep=st.sampled_from([":", "", "::", "/"]), port=PORTS, tail=st.sampled_from(["", "\n", "/", " ", ":1"]))
def test_fuzz_endpoint_strings(scheme, host, sep, port, tail):
    _check(scheme + host + sep + port + tail)


@settings(max_examples=200, deadline=None)
@given(port=st.integers(-(2 ** 70), 2 ** 70))
def test_fuzz_tcp_ports(port):
    value = f"tcp://127.0.0.1:{port}"
    if 1 <= port <= 65535:
        assert endpoint(value) == value
    else:
        with pytest.raises(KvLedgerError) as exc:
            endpoint(value)
        assert exc.value.code is ErrorCode.INVALID_ARGUMENT


@settings(max_examples=200, deadline=None)
@given(value=st.text(max_size=260))
def test_fuzz_any_text(value):
    _check(value)
