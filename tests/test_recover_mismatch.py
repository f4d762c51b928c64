"""`kvledger recover` on a journal whose recorded row digests it cannot reproduce
(fixtures/recover_digest_mismatch, a real one): exit 1 and one DIGEST_MISMATCH line a
mismatch on stderr in the text report, the same mismatches in --json; never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stored_rows import cli

pytest.importorskip("torch")

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "recover_digest_mismatch" / "journal.db"


def _copy(tmp_path: Path, name: str) -> str:
    db = tmp_path / name
    shutil.copy(FIXTURE, db)  # recover writes: never the fixture itself
    return f"sqlite:///{db}"


def test_a_digest_mismatch_is_reported_line_by_line_and_exits_1(tmp_path, capsys):
    # the text report from the command as users run it; the JSON one in this process (a
    # second process would import torch again for the same recovery)
    text = subprocess.run([sys.executable, "-m", "kvledger", "recover", "--db", _copy(tmp_path, "text.db")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    code, out, err = cli(capsys, "recover", "--db", _copy(tmp_path, "json.db"), "--json")
    assert text.returncode == code == 1, text.stderr + err
    assert "Traceback" not in text.stderr and "INTERNAL_ERROR" not in text.stderr, text.stderr
    found = json.loads(out)["digest_mismatches"]
    # 19 here, the first at position 12; another CPU's kernels may reproduce fewer or more
    assert found and all(m["recorded"] != m["recomputed"] for m in found)
    lines = [x for x in text.stderr.splitlines() if x.startswith("DIGEST_MISMATCH: ")]
    assert lines == [f"DIGEST_MISMATCH: {m['handle_id']} txn {m['txn_id']} at {m['global_position']}: "
                     f"recorded {m['recorded']}, recomputed {m['recomputed']}" for m in found[:10]]
