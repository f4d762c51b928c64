"""A read-only sequence whose items are made when read (a batch's receipts and results):
indexing, negative indexes and slices as a list's, over one `_at(i)` of 0 <= i < len."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar, overload

T = TypeVar("T", covariant=True)


class Positional(Sequence[T]):
    __slots__ = ()

    def _at(self, i: int) -> T:
        """Item i, 0 <= i < len(self)."""
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: int | slice) -> T | list[T]:
        n = len(self)
        if isinstance(i, slice):
            return [self._at(k) for k in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self._at(i)


class Then(Positional[T]):
    """`run`'s items, then `rest`'s, as one sequence: a batch's answers, its decode run's
    first (built when read: journal.port.RunReceipts) and each other operation's after."""

    __slots__ = ("run", "rest")

    def __init__(self, run: Sequence[T], rest: Sequence[T]) -> None:
        self.run, self.rest = run, rest

    def __len__(self) -> int:
        return len(self.run) + len(self.rest)

    def _at(self, i: int) -> T:
        k = len(self.run)
        return self.run[i] if i < k else self.rest[i - k]

    def __iter__(self) -> Iterator[T]:
        yield from self.run
        yield from self.rest
