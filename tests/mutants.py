"""Mutants of the product that tests build to prove their checks notice a broken journal.

Nothing here is a switch the product reads: a mutant is made from the statements a
journal really runs, on one open journal, by the test (or the test's child process).
"""

from __future__ import annotations

from typing import Any

from kvledger.journal import SqlJournal

# The guard of the guarded head update, as each backend writes it, and what the mutant
# puts in its place (SQLite's bound parameters keep their places; PostgreSQL's are named).
_GUARDS = {
    "GUARDED_UPDATE": ("WHERE handle_id = ? AND generation = ? AND snapshot_version = ? AND stream_position = ?",
                       "WHERE handle_id = ? AND ? IS NOT NULL AND ? IS NOT NULL AND ? IS NOT NULL"),
    "GUARDED_UPDATE_SET": (" AND h.generation = v.g AND h.snapshot_version = v.s AND h.stream_position = v.p",
                           ""),
}


def unguard(journal: SqlJournal) -> SqlJournal:
    """Disable `journal`'s conditional write: its guarded head update matches the handle
    whatever its generation, snapshot and stream position, and the read-only head checks
    (a fork's parent) always pass. Returns the same journal."""
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
