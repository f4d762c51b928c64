"""SQLite specifics: an in-process database, so per-row statements are cheap and the
writer lock is the database's own (BEGIN IMMEDIATE)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvledger.journal.contract import Integrity
from kvledger.journal.statements import Statements, T


class SqliteStatements(Statements):
    def __init__(self, conn: Any) -> None:
        super().__init__(conn)
        # Transactions are explicit: a deferred transaction that upgrades to a writer
        # gets SQLITE_BUSY that no busy timeout fixes, so every write starts IMMEDIATE.
        conn.isolation_level = None

    deferred_commit = True  # COMMIT (the fsync) runs off the caller's thread: see SqlJournal

    def begin(self) -> Any:
        cur = self.conn.cursor()
        cur.execute("BEGIN IMMEDIATE")
        return cur

    def end(self, cur: Any, commit: bool) -> None:
        try:
            cur.execute("COMMIT" if commit else "ROLLBACK")
        finally:
            cur.close()

    def transaction(self, fn: Callable[[Any], T]) -> T:
        cur = self.begin()
        try:
            result = fn(cur)
        except BaseException:
            self.end(cur, False)
            raise
        self.end(cur, True)
        return result

    def begin_read(self) -> Any:
        # A deferred BEGIN: in WAL mode its first read fixes the snapshot that every later
        # read of the transaction sees, while writers go on appending to the WAL.
        cur = self.conn.cursor()
        cur.execute("BEGIN")
        return cur

    QUICK_CHECK_ROWS = 100  # problems quick_check reports at most

    def integrity(self, cur: Any) -> Integrity:
        checked = "sqlite quick_check"
        try:
            # A constant: PRAGMA takes no bound parameters.
            cur.execute(f"PRAGMA quick_check({self.QUICK_CHECK_ROWS})")
            rows = [str(r[0]) for r in cur.fetchall()]
        except Exception as exc:  # noqa: BLE001 - damage bad enough to stop the check itself
            return Integrity(checked, (f"quick_check failed: {exc}",))
        return Integrity(checked, tuple(r for r in rows if r != "ok"))

    def existing_tables(self, names: tuple[str, ...]) -> set[str]:
        cur = self.conn.cursor()
        try:
            cur.execute(f"SELECT name FROM sqlite_master WHERE type = 'table' AND name IN "
                        f"({', '.join('?' * len(names))})", names)  # placeholders only
            return {r[0] for r in cur.fetchall()}
        finally:
            cur.close()

    def schema_revision(self, version_table: str) -> str | None:
        if not self.existing_tables((version_table,)):
            return None
        cur = self.conn.cursor()
        try:
            cur.execute(f"SELECT version_num FROM {version_table}")  # constant table name
            row = cur.fetchone()
            return None if row is None else row[0]
        finally:
            cur.close()
