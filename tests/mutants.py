"""Mutants of the product that tests build to prove their checks notice a broken journal.

Nothing here is a switch the product reads: a mutant is made from the statements a
journal really runs, on one open journal, by the test (or the test's child process).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvledger.journal import SqlJournal
from kvledger.journal.contract import Guard, Operation
from kvledger.journal.port import Journal

# The guard of the guarded head update, as each backend writes it, and what the mutant
# puts in its place (SQLite's bound parameters keep their places; PostgreSQL's are named).
_GUARDS = {
    "GUARDED_UPDATE": ("WHERE handle_id = ? AND generation = ? AND snapshot_version = ? AND stream_position = ?",
                       "WHERE handle_id = ? AND ? IS NOT NULL AND ? IS NOT NULL AND ? IS NOT NULL"),
    "GUARDED_UPDATE_SET": (" AND h.generation = v.g AND h.snapshot_version = v.s AND h.stream_position = v.p",
                           ""),
}


def unguard(journal: Journal) -> Journal:
    """Disable `journal`'s conditional write: its guarded head update matches the handle
    whatever its generation, snapshot and stream position, and the read-only head checks
    (a fork's parent) always pass. Returns the same journal."""
    if not isinstance(journal, SqlJournal):
        return _unguard_nats(journal)
    sql = journal.sql
    statement = "GUARDED_UPDATE_SET" if hasattr(sql, "GUARDED_UPDATE_SET") else "GUARDED_UPDATE"
    guard, mutant = _GUARDS[statement]
    text = getattr(sql, statement)
    # the product's statement must still hold its guard as written here, or the mutant mutates nothing
    assert guard in text, f"{statement} no longer reads {guard!r}: update tests/mutants.py"
    setattr(sql, statement, text.replace(guard, mutant))  # on this instance only

    def every_head(cur: Any, rows: list[tuple[str, Any]]) -> set[str]:
        return {h for h, _ in rows}

    sql.check_heads = every_head  # type: ignore[method-assign]  # the mutant: no head check
    return journal


def _unguard_nats(journal: Any) -> Any:
    """The NATS journal's mutant (journal.nats): the heads a commit is decided on read as
    the ones its operations expect, so every guard and check holds whatever is stored,
    and the head messages it publishes expect no subject sequence. The record keeps its
    expectation (positions stay gapless): the guard is what is lost, as on SQL."""
    from kvledger.journal.nats import NatsJournal

    assert isinstance(journal, NatsJournal), f"no mutant for {type(journal).__name__}: update tests/mutants.py"
    decide, read_heads, publish_batch = journal._decide, journal._read_heads, journal.client.publish_batch

    def unguarded_decide(ops: Sequence[Operation], tail: Any) -> Any:
        expected: dict[str, Guard] = {}
        for op in ops:  # the first guard each handle is named with: later ones chain on it in memory
            for w in op.writes:
                if w.expected is not None:
                    expected.setdefault(w.handle_id, w.expected)
            for c in op.checks:
                expected.setdefault(c.handle_id, c.expected)

        def as_expected(handles: list[str]) -> dict[str, Any]:
            found = read_heads(handles)
            return {h: head._replace(facts=msgspec.structs.replace(
                head.facts, generation=g.generation, snapshot_version=g.snapshot_version,
                stream_position=g.stream_position)) if (g := expected.get(h)) is not None else head
                for h, head in found.items()}

        journal._read_heads = as_expected  # on this instance, for this decision only
        try:
            return decide(ops, tail)
        finally:
            journal._read_heads = read_heads

    def unexpected_heads(batch: list[tuple[str, bytes, dict[str, str]]], wait: float | None = None) -> Any:
        return publish_batch([(s, d, {k: v for k, v in h.items() if not (
            f"{journal.prefix}.h." in s and k == "Nats-Expected-Last-Subject-Sequence")}) for s, d, h in batch], wait)

    journal._decide = unguarded_decide
    journal.client.publish_batch = unexpected_heads
    return journal
