"""Unique ids for events, operations, transactions, model calls and source instances.

A random 64-bit process prefix and a counter: unique like uuid4 for our purposes, but
without a getrandom() syscall per id (the worker makes several per token). The
prefix is redrawn in a forked child, so parent and child never collide. `seeded`
makes ids reproducible, for fixtures that must regenerate byte for byte.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import uuid
from collections.abc import Callable, Iterator

_prefix = ""
_counter = itertools.count()


def _reseed() -> None:
    global _prefix, _counter
    _prefix = os.urandom(8).hex()
    _counter = itertools.count()


_reseed()
os.register_at_fork(after_in_child=_reseed)


def _unique() -> str:
    return f"{_prefix}{next(_counter):016x}"


_next: Callable[[], str] = _unique


def new_id() -> str:
    """32 hex characters, unique across processes and forks."""
    return _next()


def instance_name(component: str) -> str:
    """A source_instance for one run of `component`: the component and 8 random hex
    digits. A source's monotonic clock and local_sequence are its own, never compared
    with another's (spec), so a run after a restart or a reboot must be another source."""
    return f"{component}-{os.urandom(4).hex()}"


def new_block(count: int) -> tuple[str, int] | None:
    """`count` new ids as one prefix and the first of `count` consecutive counters (a
    decode run's, journal.decode_run), or None while ids are seeded or if the block is
    not contiguous."""
    if _next is not _unique or count <= 0:
        return None
    prefix = _prefix
    # islice over the shared counter runs in C under the GIL: no other thread draws between
    drawn = list(itertools.islice(_counter, count))
    if prefix != _prefix or drawn[-1] - drawn[0] != count - 1:
        return None
    return prefix, drawn[0]


@contextlib.contextmanager
def seeded(seed: str) -> Iterator[None]:
    """Within the block, ids come from a generator seeded by `seed` (uuid4 format)."""
    global _next
    rng = random.Random(seed)
    saved = _next
    _next = lambda: uuid.UUID(int=rng.getrandbits(128), version=4).hex  # noqa: E731 - chosen once, called per id
    try:
        yield
    finally:
        _next = saved
