"""`python -m bench.ab --frames`, the A/B of the ceiling's writer process (docs/PERFORMANCE.md
measures the ceiling's regression with it): it records a ceiling run's frames and has
each side decide and commit them; and `--publish`, the generic batched path. Tiny sizes:
the figures are not checked, only that both sides measured and the ratio is theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ab(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.ab", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TMPDIR": str(tmp)})


@pytest.fixture(scope="module")
def head() -> str:
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip("not a git checkout: bench.ab unpacks commits")
    return found.stdout.strip()


@pytest.mark.parametrize(("mode", "key"), [("--frames", "pairs_iteration_ms"),
                                         ("--publish", "pairs_us_per_publication")])
def test_both_sides_measure(head, mode, key, tmp_path):
    """--frames: the ceiling's writer process; --publish: the generic batched path that
    journal_vs_eventsourcing_sqlite times. Nothing is left in the temporary directory."""
    proc = _ab(head, head, mode, "--pairs", "1", "--groups", "1", "--json", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []  # the unpacked sides and the children's journals
    result = json.loads(proc.stdout)
    [(a, b)] = result[key]
    assert a > 0 and b > 0
    # the one ratio, as the printed pair (each side to 0.01) bounds it; the ratio to 0.001
    low, high = (a - 0.005) / (b + 0.005), (a + 0.005) / (b - 0.005)
    assert low - 0.0005 <= result["median_a_over_b"] <= high + 0.0005, (a, b, result["median_a_over_b"])
