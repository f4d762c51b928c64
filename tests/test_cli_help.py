"""The CLI describes itself: `kvledger --version`, and a description for every command and
a help string for every option (a serving engineer reads `--help`, not the source)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from kvledger.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvledger", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))


def test_version_prints_the_installed_package_version():
    r = run("--version")
    assert r.returncode == 0, r.stderr
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert r.stdout == f"kvledger {version('kvledger')}\n"
    assert version("kvledger") == declared  # the installed metadata is this checkout's
    assert re.fullmatch(r"kvledger \d+\.\d+\.\d+\S*\n", r.stdout)


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser and every parser beneath it (subcommands, sub-subcommands), each once."""
    found = [parser]
    for action in parser._actions:  # argparse has no public way to list its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += _parsers(child)
    return found


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    missing = [] if (parser.description or "").strip() else [f"`{parser.prog}`: no description"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):  # the one-line help of each listed command
            listed = {c.dest for c in action._choices_actions if (c.help or "").strip()}
            primary = {id(child): name for name, child in reversed(action.choices.items())}  # aliases come after
            missing += [f"`{parser.prog} {name}`: no help in the command list"
                        for name in primary.values() if name not in listed]
            continue
        if not (action.help or "").strip():
            name = "/".join(action.option_strings) or action.metavar or action.dest
            missing.append(f"`{parser.prog}` {name}: no help string")
    return missing


def test_every_command_has_a_description_and_every_option_a_help_string():
    parsers = _parsers(build_parser())
    assert {"kvledger generate", "kvledger kv-events record"} <= {p.prog for p in parsers}  # the walk reaches them
    missing = [m for p in parsers for m in _undocumented(p)]
    assert not missing, "\n".join(missing)


def test_the_walk_finds_what_is_missing():
    # The check itself can fail: a parser without a description and an option without help are named.
    bare = argparse.ArgumentParser(prog="bare")
    bare.add_argument("--flag")
    sub = bare.add_subparsers(dest="c")
    sub.add_parser("child")
    found = [m for p in _parsers(bare) for m in _undocumented(p)]
    assert found == ["`bare`: no description", "`bare` --flag: no help string",
                     "`bare child`: no help in the command list", "`bare child`: no description"]
