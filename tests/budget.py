"""How many repetitions CI's randomized and exhaustive tests run.

CI's whole run must stay under 15 minutes on two cores. Where a test repeats one check
over many histories or edits, the README's command runs fewer, still reaching every path
the test names (each backend, each kind of fault); `KVLEDGER_TEST_SCALE=full` runs the
counts the tests were written with: before a release, or after a change to what they race.
"""

from __future__ import annotations

import os

SCALES = ("ci", "full")
SCALE = os.environ.get("KVLEDGER_TEST_SCALE", "ci")  # conftest refuses any other value
FULL = SCALE == "full"


def scaled(ci: int, full: int) -> int:
    """`ci` repetitions in the README's command, `full` under KVLEDGER_TEST_SCALE=full."""
    return full if FULL else ci
