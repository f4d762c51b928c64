"""Unique ids for events, operations, transactions and model calls.

A random 64-bit process prefix and a counter: unique like uuid4 for our purposes, but
without a getrandom() syscall per id (the worker makes several per token). The
prefix is redrawn in a forked child, so parent and child never collide.
"""

from __future__ import annotations

import itertools
import os

_prefix = ""
_counter = itertools.count()


def _reseed() -> None:
    global _prefix, _counter
    _prefix = os.urandom(8).hex()
    _counter = itertools.count()


_reseed()
os.register_at_fork(after_in_child=_reseed)


def new_id() -> str:
    """32 hex characters, unique across processes and forks."""
    return f"{_prefix}{next(_counter):016x}"
