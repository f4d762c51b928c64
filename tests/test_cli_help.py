"""The CLI describes itself: `kvledger --version`, and a description for every command and
a help string for every option (a serving engineer reads `--help`, not the source)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

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

