"""`kvledger demo --metrics-port PORT --metrics-host HOST`: /metrics served on the address
asked for (127.0.0.1 unless told), checked when parsed."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.cli import main
from kvledger.cmd_telemetry import demo_telemetry
from kvledger.schemas.errors import KvLedgerError


def _scrape(host: str, port: int) -> bytes:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as resp:
        return resp.read()


def test_metrics_listen_on_the_host_given_and_only_there():
    args = argparse.Namespace(telemetry=None, metrics_port=0, metrics_host="127.0.0.2", metrics_out=None)
    telemetry = demo_telemetry(args)
    assert telemetry is not None
    try:
        port = telemetry.metrics_port
        assert port and b"kvledger_journal_events_total" in _scrape("127.0.0.2", port)
        with pytest.raises(urllib.error.URLError):  # not on the default address
            _scrape("127.0.0.1", port)
    finally:
        telemetry.close()


def test_the_default_host_is_loopback():
    telemetry = demo_telemetry(argparse.Namespace(telemetry=None, metrics_port=0, metrics_out=None))
    assert telemetry is not None
    try:
        assert b"kvledger_journal_events_total" in _scrape("127.0.0.1", telemetry.metrics_port)
    finally:
        telemetry.close()


def test_the_demo_reports_where_it_served(tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/d.db"
    assert main(["demo", "--db", db, "--requests", "1", "--max-new-tokens", "1", "--json",
                 "--metrics-port", "0", "--metrics-host", "127.0.0.2"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)["telemetry"]
    assert out["metrics_host"] == "127.0.0.2" and out["metrics_port"] > 0
    assert f"http://127.0.0.2:{out['metrics_port']}/metrics" in captured.err


@pytest.mark.parametrize(("argv", "message"), [
    (["--metrics-host", "127.0.0.1"], "INVALID_ARGUMENT: --metrics-host needs --metrics-port"),
    (["--metrics-port", "0", "--metrics-host", "a b"], "INVALID_ARGUMENT: 'a b' is not a host name or an IP address"),
    (["--metrics-port", "0", "--metrics-host", "203.0.113.7"],  # not an address of this machine
     "INVALID_ARGUMENT: cannot serve metrics on 203.0.113.7:0"),
])
def test_a_bad_host_is_one_coded_line_and_no_journal(tmp_path, capsys, argv, message):
    db = tmp_path / "d.db"
    assert main(["demo", "--db", f"sqlite:///{db}", "--requests", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert not db.exists()


def test_host_type_takes_names_and_addresses():
    from kvledger.args import host

    assert host("0.0.0.0") == "0.0.0.0"
    assert host("[::1]") == "::1"
    assert host("metrics.internal") == "metrics.internal"
    for bad in ("", "a/b", "x" * 300, "host\n"):
        with pytest.raises(KvLedgerError):
            host(bad)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_host_text_is_taken_or_refused_with_a_code(value):
    from kvledger.args import host

    try:
        got = host(value)
    except KvLedgerError as exc:
        assert exc.code.value == "INVALID_ARGUMENT" and "\n" not in str(exc)
    else:
        assert got and got.isascii() and got.isprintable() and " " not in got and "/" not in got
