"""PostgreSQL specifics: every statement is a network round trip, so guarded updates,
head creation and event inserts are one set-based statement per batch (unnest of
bound arrays), and the writer lock is an explicit table lock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from journal.contract import Guard, StreamWrite
from journal.statements import Statements, _head_columns


class PostgresStatements(Statements):
    placeholder = "%s"

    def __init__(self, conn: Any) -> None:
        super().__init__(conn)
        if conn.info.transaction_status != 0:  # SQLAlchemy may have left one open
            conn.rollback()
        conn.autocommit = True  # reads see the newest commit; writes open their own txn

    def transaction(self, fn: Callable[[Any], Any]) -> Any:
        with self.conn.transaction(), self.conn.cursor() as cur:
            return fn(cur)

    def schema_revision(self, version_table: str) -> str | None:
        with self.conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s) IS NOT NULL", (version_table,))
            if not cur.fetchone()[0]:
                return None
            cur.execute(f"SELECT version_num FROM {version_table}")  # constant table name
            row = cur.fetchone()
            return None if row is None else row[0]

    def lock_and_last_position(self, cur: Any) -> int:
        # EXCLUSIVE conflicts with every writer but not with plain SELECTs: writers are
        # serialized, so positions are gapless and in commit order, and readers never wait.
        cur.execute("LOCK TABLE kvl_events IN EXCLUSIVE MODE")
        return self.last_position(cur)

    def guarded_update(self, cur: Any, rows: list[tuple[StreamWrite, Guard]]) -> set[str]:
        if not rows:
            return set()
        cols = list(zip(*[
            (w.handle_id, g.generation, g.snapshot_version, g.stream_position, w.head.generation,
             w.head.snapshot_version, w.head.stream_position, w.head.committed_length, w.head.phase)
            for w, g in rows
        ]))
        cur.execute(
            "UPDATE kvl_heads AS h SET generation = v.ng, snapshot_version = v.ns, "
            "stream_position = v.np, committed_length = v.nc, phase = v.ph "
            "FROM unnest(%s::text[], %s::bigint[], %s::bigint[], %s::bigint[], %s::bigint[], "
            "%s::bigint[], %s::bigint[], %s::bigint[], %s::text[]) AS v(h, g, s, p, ng, ns, np, nc, ph) "
            "WHERE h.handle_id = v.h AND h.generation = v.g AND h.snapshot_version = v.s "
            "AND h.stream_position = v.p RETURNING h.handle_id",
            [list(c) for c in cols],
        )
        return {r[0] for r in cur.fetchall()}

    def create_heads(self, cur: Any, writes: list[StreamWrite]) -> set[str]:
        if not writes:
            return set()
        cols = list(zip(*[(w.handle_id, *_head_columns(w)) for w in writes]))
        cur.execute(
            f"INSERT INTO kvl_heads ({self.HEAD_COLUMNS}) "
            "SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::bigint[], "
            "%s::bigint[], %s::bigint[], %s::text[], %s::text[], %s::text[]) "
            "ON CONFLICT (handle_id) DO NOTHING RETURNING handle_id",
            [list(c) for c in cols],
        )
        return {r[0] for r in cur.fetchall()}

    def check_heads(self, cur: Any, rows: list[tuple[str, Guard]]) -> set[str]:
        if not rows:
            return set()
        cols = list(zip(*[(h, g.generation, g.snapshot_version, g.stream_position) for h, g in rows]))
        cur.execute(
            "SELECT h.handle_id FROM kvl_heads h JOIN unnest(%s::text[], %s::bigint[], "
            "%s::bigint[], %s::bigint[]) AS v(h, g, s, p) ON h.handle_id = v.h "
            "AND h.generation = v.g AND h.snapshot_version = v.s AND h.stream_position = v.p",
            [list(c) for c in cols],
        )
        return {r[0] for r in cur.fetchall()}

    def insert_events(self, cur: Any, rows: list[tuple]) -> None:
        cur.execute(
            "INSERT INTO kvl_events (global_position, event_id, stream_id, stream_position, "
            "event_type, schema_version, operation_id, body) SELECT * FROM unnest("
            "%s::bigint[], %s::text[], %s::text[], %s::bigint[], %s::text[], %s::int[], "
            "%s::text[], %s::bytea[])",
            [list(c) for c in zip(*rows)],
        )

    def insert_receipts(self, cur: Any, rows: list[tuple]) -> None:
        cur.execute(
            "INSERT INTO kvl_receipts (operation_id, fingerprint, first_global_position, "
            "last_global_position, body) SELECT * FROM unnest(%s::text[], %s::text[], "
            "%s::bigint[], %s::bigint[], %s::bytea[])",
            [list(c) for c in zip(*rows)],
        )

    def fetch_receipts(self, cur: Any, operation_ids: list[str]) -> dict[str, tuple[str, bytes]]:
        cur.execute(
            "SELECT operation_id, fingerprint, body FROM kvl_receipts WHERE operation_id = ANY(%s)",
            (operation_ids,),
        )
        return {r[0]: (r[1], bytes(r[2])) for r in cur.fetchall()}
