"""An in-memory index of the records' ids, as runs of keys: what the SQL backends keep in
kvl_record_ids (journal.keys.id_runs), for a backend with no table to keep it in (NATS).

A record's ids are a few runs of consecutive keys (one writer's operation and event ids
count up), so the index costs a few dozen bytes a record, not a set entry an id. Like
the SQL index it answers candidates: a key may be shared by two ids, so a hit names the
records to read for the exact id, and a miss proves the id is not stored.

Runs are kept per bucket of the key's top 24 bits (the hash of a writer's prefix or a
stem, keys.id_keys), where one writer's runs arrive in ascending order: an insert is an
append, and a lookup a bisection over the bucket's runs.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable

from kvledger.journal.keys import MAX_RUN

_BUCKET = 40  # keys.id_keys' counter bits: a bucket is one prefix's (or stem's) keys


class _Runs:
    """One bucket's runs, sorted by first key: three columns of int64."""

    __slots__ = ("firsts", "lasts", "seqs")

    def __init__(self) -> None:
        self.firsts, self.lasts, self.seqs = array("q"), array("q"), array("q")

    def add(self, first: int, last: int, seq: int) -> None:
        at = len(self.firsts)
        if at and self.firsts[-1] > first:  # out of order: another writer's, or a collision
            at = bisect_right(self.firsts, first)
        self.firsts.insert(at, first)
        self.lasts.insert(at, last)
        self.seqs.insert(at, seq)


class RunIndex:
    """Runs of keys -> the stream sequence (or any int) of the record that holds them."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Runs] = {}
        self.runs = 0

    def add(self, runs: Iterable[tuple[int, int]], seq: int) -> None:
        for first, last in runs:
            bucket = self._buckets.get(first >> _BUCKET)
            if bucket is None:
                bucket = self._buckets[first >> _BUCKET] = _Runs()
            bucket.add(first, last, seq)
            self.runs += 1

    def candidates(self, runs: Iterable[tuple[int, int]]) -> set[int]:
        """The records holding a key of `runs`: a stored run meets (a, b) when it starts
        in [a - MAX_RUN + 1, b] (no run is longer) and ends at a or later."""
        found: set[int] = set()
        for a, b in runs:
            lo = a - MAX_RUN + 1
            for key in range(lo >> _BUCKET, (b >> _BUCKET) + 1):
                bucket = self._buckets.get(key)
                if bucket is None:
                    continue
                firsts, lasts, seqs = bucket.firsts, bucket.lasts, bucket.seqs
                for i in range(bisect_left(firsts, lo), bisect_right(firsts, b)):
                    if lasts[i] >= a:
                        found.add(seqs[i])
        return found


__all__ = ["RunIndex"]
