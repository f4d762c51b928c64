"""The model work a journal proves was executed, per handle: the projector's side table,
folded one publication at a time (replay.projector) or a run of decode steps at a time
(replay.runs); in its own module so that neither of the two imports the other."""

from __future__ import annotations

import msgspec


class Work(msgspec.Struct, array_like=True):
    """Model work the journal proves was executed for one handle: rows and causal
    query-key pairs of its published appends (0x03)."""

    rows: int = 0
    pairs: int = 0
    publishes: int = 0
