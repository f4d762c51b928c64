"""Each handle's last record as this connection committed it: what a new record names as
the one before it on each stream (stream_prev), known without a read."""

from __future__ import annotations

from collections.abc import Iterable

Tail = tuple[int, int]  # (a stream position, the committed record holding that event)


class Tails:
    """handle -> Tail. When an operation's guard expects the cached position, the cached
    record is its head's last one (positions never repeat), so a write needs no read.
    Only committed records go in: a transaction's tails wait in `pending` until it
    commits (`commit`); a transaction that does not commit leaves them to be replaced."""

    __slots__ = ("_committed", "pending")

    LIMIT = 1 << 16  # a cache: handles come and go

    def __init__(self) -> None:
        self._committed: dict[str, Tail] = {}
        self.pending: dict[str, Tail] = {}

    def record(self, handle_id: str, position: int) -> int | None:
        """The handle's last record, if cached at the stream position its guard expects."""
        tail = self._committed.get(handle_id)
        return tail[1] if tail is not None and tail[0] == position else None

    def records(self, expected: Iterable[tuple[str, int]]) -> dict[str, int] | None:
        """`record` of every (handle, position); None unless every one is cached: the
        general path reads them."""
        found: dict[str, int] = {}
        for h, p in expected:
            if (record := self.record(h, p)) is None:
                return None
            found[h] = record
        return found

    def commit(self) -> None:
        """The pending transaction committed: its record is now each handle's it wrote."""
        if len(self._committed) > self.LIMIT:
            self._committed.clear()
        self._committed.update(self.pending)
        self.pending = {}
