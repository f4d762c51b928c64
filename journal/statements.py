"""SQL shared by both backends, written once with `?` placeholders.

journal.sqlite uses it as is; journal.postgres converts the placeholders and replaces
the statements whose best form differs over a network (set-based, one round trip).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from journal.contract import Guard, StreamWrite


class Statements:
    placeholder = "?"

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def q(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    # -- transactions (backend-specific) --------------------------------------------
    def transaction(self, fn: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def read(self, fn: Callable[[Any], Any]) -> Any:
        cur = self.conn.cursor()
        try:
            return fn(cur)
        finally:
            cur.close()

    def schema_revision(self, version_table: str) -> str | None:
        raise NotImplementedError

    def lock_and_last_position(self, cur: Any) -> int:
        raise NotImplementedError

    def savepoint(self, cur: Any) -> None:
        cur.execute("SAVEPOINT kvl_round")

    def rollback_to_savepoint(self, cur: Any) -> None:
        cur.execute("ROLLBACK TO SAVEPOINT kvl_round")

    def release_savepoint(self, cur: Any) -> None:
        cur.execute("RELEASE SAVEPOINT kvl_round")

    # -- guarded writes: per-row forms; postgres overrides with set-based ones -------
    GUARDED_UPDATE = (
        "UPDATE kvl_heads SET generation = ?, snapshot_version = ?, stream_position = ?, "
        "committed_length = ?, phase = ? "
        "WHERE handle_id = ? AND generation = ? AND snapshot_version = ? AND stream_position = ?"
    )
    CREATE_HEAD = (
        "INSERT INTO kvl_heads (handle_id, request_id, generation, snapshot_version, "
        "stream_position, committed_length, phase, prefix_identity_sha256, cache_abi_sha256) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (handle_id) DO NOTHING"
    )
    CHECK_HEAD = (
        "SELECT 1 FROM kvl_heads WHERE handle_id = ? AND generation = ? "
        "AND snapshot_version = ? AND stream_position = ?"
    )

    def guarded_update(self, cur: Any, rows: list[tuple[StreamWrite, Guard]]) -> set[str]:
        sql, ok = self.q(self.GUARDED_UPDATE), set()
        for w, g in rows:
            h = w.head
            cur.execute(sql, (h.generation, h.snapshot_version, h.stream_position, h.committed_length,
                              h.phase, w.handle_id, g.generation, g.snapshot_version, g.stream_position))
            if cur.rowcount == 1:
                ok.add(w.handle_id)
        return ok

    def create_heads(self, cur: Any, writes: list[StreamWrite]) -> set[str]:
        sql, ok = self.q(self.CREATE_HEAD), set()
        for w in writes:
            cur.execute(sql, (w.handle_id, *_head_columns(w)))
            if cur.rowcount == 1:
                ok.add(w.handle_id)
        return ok

    def check_heads(self, cur: Any, rows: list[tuple[str, Guard]]) -> set[str]:
        sql, ok = self.q(self.CHECK_HEAD), set()
        for handle_id, g in rows:
            cur.execute(sql, (handle_id, g.generation, g.snapshot_version, g.stream_position))
            if cur.fetchone() is not None:
                ok.add(handle_id)
        return ok

    INSERT_EVENTS = (
        "INSERT INTO kvl_events (global_position, event_id, stream_id, stream_position, "
        "event_type, schema_version, operation_id, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    )
    INSERT_RECEIPTS = (
        "INSERT INTO kvl_receipts (operation_id, fingerprint, first_global_position, "
        "last_global_position, body) VALUES (?, ?, ?, ?, ?)"
    )

    def insert_events(self, cur: Any, rows: list[tuple]) -> None:
        cur.executemany(self.q(self.INSERT_EVENTS), rows)

    def insert_receipts(self, cur: Any, rows: list[tuple]) -> None:
        cur.executemany(self.q(self.INSERT_RECEIPTS), rows)

    def insert_manifests(self, cur: Any, rows: list[tuple[str, bytes]]) -> None:
        cur.executemany(
            self.q("INSERT INTO kvl_manifests (manifest_sha256, body) VALUES (?, ?) "
                   "ON CONFLICT (manifest_sha256) DO NOTHING"),
            rows,
        )

    def fetch_receipts(self, cur: Any, operation_ids: list[str]) -> dict[str, tuple[str, bytes]]:
        sql = self.q("SELECT operation_id, fingerprint, body FROM kvl_receipts WHERE operation_id = ?")
        found = {}
        for op_id in operation_ids:
            cur.execute(sql, (op_id,))
            row = cur.fetchone()
            if row is not None:
                found[row[0]] = (row[1], bytes(row[2]))
        return found

    # -- reads -------------------------------------------------------------------
    def last_position(self, cur: Any) -> int:
        cur.execute("SELECT coalesce(max(global_position), 0) FROM kvl_events")
        return int(cur.fetchone()[0])

    def stream_bodies(self, cur: Any, handle_id: str, after: int) -> list[bytes]:
        cur.execute(
            self.q("SELECT body FROM kvl_events WHERE stream_id = ? AND stream_position > ? "
                   "ORDER BY stream_position"),
            (handle_id, after),
        )
        return [bytes(r[0]) for r in cur.fetchall()]

    def bodies_after(self, cur: Any, after: int, limit: int) -> list[tuple[int, bytes]]:
        cur.execute(
            self.q("SELECT global_position, body FROM kvl_events WHERE global_position > ? "
                   "ORDER BY global_position LIMIT ?"),
            (after, limit),
        )
        return [(int(p), bytes(b)) for p, b in cur.fetchall()]

    HEAD_COLUMNS = (
        "handle_id, request_id, generation, snapshot_version, stream_position, "
        "committed_length, phase, prefix_identity_sha256, cache_abi_sha256"
    )

    def heads(self, cur: Any, prefix: str | None, handle_id: str | None) -> list[tuple]:
        sql = f"SELECT {self.HEAD_COLUMNS} FROM kvl_heads"  # constant column list, no input
        if handle_id is not None:
            cur.execute(self.q(sql + " WHERE handle_id = ?"), (handle_id,))
        elif prefix is not None:
            cur.execute(self.q(sql + " WHERE prefix_identity_sha256 = ?"), (prefix,))
        else:
            cur.execute(sql + " ORDER BY handle_id")
        return cur.fetchall()

    def manifest(self, cur: Any, manifest_sha256: str) -> bytes | None:
        cur.execute(self.q("SELECT body FROM kvl_manifests WHERE manifest_sha256 = ?"), (manifest_sha256,))
        row = cur.fetchone()
        return None if row is None else bytes(row[0])

    def upsert_checkpoint(self, cur: Any, name: str, position: int, state: bytes, now: int) -> None:
        cur.execute(
            self.q("INSERT INTO kvl_checkpoints (name, position, state, updated_wall_ns) "
                   "VALUES (?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET position = excluded.position, "
                   "state = excluded.state, updated_wall_ns = excluded.updated_wall_ns"),
            (name, position, state, now),
        )

    def checkpoint(self, cur: Any, name: str) -> tuple[int, bytes] | None:
        cur.execute(self.q("SELECT position, state FROM kvl_checkpoints WHERE name = ?"), (name,))
        row = cur.fetchone()
        return None if row is None else (int(row[0]), bytes(row[1]))


def _head_columns(w: StreamWrite) -> tuple:
    h = w.head
    return (h.request_id, h.generation, h.snapshot_version, h.stream_position, h.committed_length,
            h.phase, h.prefix_identity_sha256, h.cache_abi_sha256)
