"""Handle state: what one handle's stream folds into. Frozen; evolve returns new ones."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any, Literal, overload

import msgspec

Lifecycle = Literal["ACTIVE", "FINISHED", "CANCELLED", "RELEASED"]


class Appended(Sequence[int]):
    """An immutable sequence of ints that shares its storage with the version it grew
    from: the first `n` items of an append-only list. A handle's outputs and their times
    grow by one a decode step, and a tuple would copy all of them each time, which for a
    long sequence costs more than the rest of the step. Equal to (and
    hashed as) the tuple of its items, and encoded as one (`enc_hook`); a decoded state
    holds plain tuples, which `grown` turns into one of these once they reach SHARED_FROM."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[int], n: int) -> None:
        self._items, self._n = items, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...
    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        if isinstance(i, slice):
            return tuple(self._items[:self._n][i])
        n = self._n
        if not -n <= i < n:
            raise IndexError("index out of range")
        return self._items[i + n if i < 0 else i]

    def __iter__(self) -> Iterator[int]:
        return islice(self._items, self._n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Appended):
            return self._n == other._n and (self._items is other._items or tuple(self) == tuple(other))
        if isinstance(other, tuple):
            return self._n == len(other) and tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other: Sequence[int]) -> tuple[int, ...]:
        return (*self, *other)

    def __radd__(self, other: Sequence[int]) -> tuple[int, ...]:
        return (*other, *self)

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (tuple(self),))


# Below this many items a tuple is copied (in C) rather than shared: a short copy is cheaper than making a view.
SHARED_FROM = 128


def appended(seq: Sequence[int], items: tuple[int, ...]) -> tuple[int, ...]:
    """`seq` followed by `items`, sharing storage when it can: an Appended, typed as the
    tuple it stands for (the state's fields keep their declared, decodable type). The
    storage only ever grows at its end, so every version sees a fixed prefix. A version
    that was grown already (a decision not committed, decided again), or that another
    thread grew at the same time (the length after the append tells), gets a copy."""
    if type(seq) is Appended:
        store, n = seq._items, seq._n
    elif len(seq) < SHARED_FROM:  # a short tuple: its copy is cheaper than a shared view
        return tuple(seq) + items
    else:  # a longer tuple (a decoded state, a cut): copied once, shared from then on
        store, n = list(seq), len(seq)
    k = n + len(items)
    if len(store) == n:
        store.extend(items)
        if len(store) == k:
            return Appended(store, k)  # type: ignore[return-value]  # a tuple to every reader
    return Appended([*store[:n], *items], k)  # type: ignore[return-value]  # as above


def grown(outputs: tuple[int, ...], output_ns: tuple[int, ...], tokens: tuple[int, ...],
          times: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A handle's outputs and their times, each followed by the new ones (`appended`,
    with the short case decided once for both: this is on every decode step)."""
    if type(outputs) is tuple and type(output_ns) is tuple and len(outputs) < SHARED_FROM:
        return outputs + tokens, output_ns + times
    return appended(outputs, tokens), appended(output_ns, times)


def enc_hook(obj: object) -> object:
    """For an encoder that may meet a handle state: its Appended fields as tuples."""
    if isinstance(obj, Appended):
        return tuple(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


class OpenTxn(msgspec.Struct, frozen=True, gc=False):
    txn_id: str
    kind: str
    base_snapshot_version: int
    interval_start: int
    interval_count: int
    token_ids: tuple[int, ...]


class HandleState(msgspec.Struct, frozen=True, gc=False):
    handle_id: str
    request_id: str
    generation: int
    snapshot_version: int
    stream_position: int
    lifecycle: Lifecycle
    prompt: tuple[int, ...]
    outputs: tuple[int, ...]  # emitted outputs, O = len(outputs); an Appended once grown
    committed_length: int  # K_c: rows every cache layer holds
    logits_ready: bool  # the newest publication's logits may still produce an output
    num_layers: int
    b_token: int
    reserved_capacity: int
    copy_tiers: tuple[str, ...]
    allocator_bytes_per_copy: int
    cache_abi_sha256: str
    prefix_identity_sha256: str
    manifest_sha256: str
    open_txns: tuple[OpenTxn, ...] = ()
    aborted_txn_ids: tuple[str, ...] = ()  # ended without publication: late completions
    parent_handle_id: str | None = None
    row_index: int | None = None
    arrival_ns: int = 0
    output_ns: tuple[int, ...] = ()
    finish_ns: int | None = None
    release_ns: int | None = None

    @property
    def logical_length(self) -> int:
        """Token state the request holds: prompt plus emitted outputs."""
        return len(self.prompt) + len(self.outputs)

    def logical_tokens(self, start: int, stop: int) -> tuple[int, ...]:
        return (*self.prompt, *self.outputs)[start:stop]

    def open_txn(self, txn_id: str) -> OpenTxn | None:
        for t in self.open_txns:
            if t.txn_id == txn_id:
                return t
        return None

    @property
    def has_frontier(self) -> bool:
        """One emitted output whose own K/V row is not committed yet."""
        return len(self.outputs) > 0 and self.logical_length == self.committed_length + 1
