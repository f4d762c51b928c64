"""Logging: the library logs through stdlib `logging` (loggers under "kvledger") and never
to stdout; the CLI renders the records with structlog on stderr (JSON lines when stderr is
not a terminal) at --log-level, -q meaning errors only."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from kvledger.cli import main

# A library user's program: its own logging config; an audit sink that refuses every write,
# so the telemetry exporter logs a warning (kvledger.telemetry).
LIBRARY_USER = textwrap.dedent("""
    import logging, sys
    from kvledger.schemas.telemetry import Header
    from kvledger.telemetry.exporter import Exporter
    from kvledger.telemetry.metrics import Metrics

    class Refusing:
        def write(self, data):
            raise OSError(28, "No space left on device")
        def flush(self):
            pass

    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s|%(levelname)s|%(message)s")
    x = Exporter(Refusing(), capacity=16, metrics=Metrics())
    x.put(("h", Header(schema_version=1, source_instance="app", components=("command_service",))), 0)
    x.stop(10)
    print("done")
""")


def _refusing_sink_run() -> None:
    from kvledger.schemas.telemetry import Header
    from kvledger.telemetry.exporter import Exporter
    from kvledger.telemetry.metrics import Metrics

    class Refusing:
        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            pass

    x = Exporter(Refusing(), capacity=16, metrics=Metrics())  # type: ignore[arg-type]
    x.put(("h", Header(schema_version=1, source_instance="app", components=("command_service",))), 0)
    x.stop(10)


def test_a_library_users_logging_config_receives_kvledgers_records(caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="kvledger"):
        _refusing_sink_run()
    found = [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("kvledger")]
    assert found == [("kvledger.telemetry", "WARNING", "telemetry batch not written: records are dropped and "
                      "counted: OSError(28, 'No space left on device')")]
    assert capsys.readouterr().out == ""


def test_the_library_prints_nothing_to_stdout_in_a_users_process():
    out = subprocess.run([sys.executable, "-c", LIBRARY_USER], capture_output=True, text=True, timeout=60,
                         cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "done\n"  # the program's own line, nothing of kvledger's
    assert out.stderr.splitlines() == [
        "kvledger.telemetry|WARNING|telemetry batch not written: records are dropped and counted: "
        "OSError(28, 'No space left on device')"]


def _demo(tmp_path, *options: str) -> list[str]:
    return ["demo", "--db", f"sqlite:///{tmp_path}/d.db", "--requests", "1", "--max-new-tokens", "1",
            "--metrics-port", "0", "--json", *options]


@pytest.mark.parametrize("quiet", [(), ("--log-level", "error"), ("-q",), ("--log-level", "warning")])
def test_log_level_and_quiet_silence_the_info_line(tmp_path, capsys, quiet):
    argv = _demo(tmp_path, *quiet)
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["requests"] == 1  # the result, alone on stdout
    info = [json.loads(line) for line in captured.err.splitlines() if "serving metrics" in line]
    if quiet:
        assert info == [] and captured.err == ""
    else:
        assert len(info) == 1 and info[0]["level"] == "info" and info[0]["logger"] == "kvledger.cli"


def test_the_options_go_before_the_command_too(tmp_path, capsys):
    assert main(["-q", *_demo(tmp_path)]) == 0
    assert capsys.readouterr().err == ""
    assert main(["--log-level", "error", *_demo(tmp_path, "--log-level", "info")]) == 0  # the later one wins
    assert "serving metrics" in capsys.readouterr().err


def test_a_bad_level_is_one_coded_line(capsys):
    assert main(["schema", "--log-level", "loud"]) == 2
    err = capsys.readouterr().err
    assert err == "INVALID_ARGUMENT: --log-level 'loud': expected one of debug, info, warning, error\n"


def test_json_lines_on_a_pipe_and_the_environment_default(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KVLEDGER_LOG"}
    out = subprocess.run([sys.executable, "-m", "kvledger", *_demo(tmp_path)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["requests"] == 1
    lines = [json.loads(line) for line in out.stderr.splitlines()]  # every line is one JSON object
    line = next(x for x in lines if x["event"].startswith("serving metrics on http://127.0.0.1:"))
    assert line["level"] == "info" and line["logger"] == "kvledger.cli" and line["timestamp"].endswith("Z")
    quiet = subprocess.run([sys.executable, "-m", "kvledger", *_demo(tmp_path)], capture_output=True, text=True,
                           timeout=300, env={**env, "KVLEDGER_LOG": "error"})
    assert quiet.returncode == 0 and quiet.stderr == ""
