"""Heads and records on NATS (journal.nats): a head message's form, what the journal
holds of a head, a record and the last record, and the heads a batch is decided against,
held in memory with the statements journal.batching's rounds run on them.

A head message (subject `kvl.<cell>.h.<token>`) holds the handle id (a token may be a
digest), how many messages before it in its batch the commit's record is (`back`: the
record's stream sequence is not known until the batch is stored), and its HeadFacts.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, NamedTuple

import msgspec

from kvledger.journal.contract import Guard, HeadFacts, StreamWrite, guard_of

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}").fullmatch


def token(name: str) -> str:
    """A subject token for an id: itself when it is one, else `~` and a digest (no id is
    both: `~` is not in the first form)."""
    return name if _TOKEN(name) else "~" + hashlib.sha256(name.encode()).hexdigest()[:40]


class Tail(NamedTuple):
    """The last record: its stream sequence, last global position and chain."""

    seq: int
    last: int
    chain: bytes


class Head(NamedTuple):
    facts: HeadFacts
    seq: int  # the head message's stream sequence (what a write expects)
    record: int  # the stream sequence of the record holding the handle's last events


class Rec(NamedTuple):
    """A record message."""

    seq: int
    first: int
    last: int
    chain: bytes
    prev: bytes
    body: bytes


class _HeadMsg(msgspec.Struct, array_like=True, frozen=True):
    handle_id: str
    back: int
    facts: HeadFacts


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_HeadMsg).decode


def head_encode(handle_id: str, back: int, facts: HeadFacts) -> bytes:
    return _encode(_HeadMsg(handle_id, back, facts))


def head_decode(data: bytes) -> tuple[str, int, HeadFacts] | None:
    """(handle id, back, facts), or None when it does not decode."""
    try:
        m = _decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return (m.handle_id, m.back, m.facts) if m.back > 0 else None


class HeadView:
    """The heads a batch reads, changed in memory as journal.batching.apply_rounds runs its
    guarded updates, creates and checks on them (journal.batching.GuardStatements, with
    savepoints as copies). `changed`: each head the batch's accepted operations leave,
    which the batch then publishes, each expecting its subject as it was read."""

    def __init__(self, heads: dict[str, HeadFacts]) -> None:
        self.heads = heads
        self.changed: dict[str, HeadFacts] = {}
        self._saved: tuple[dict[str, HeadFacts], dict[str, HeadFacts]] | None = None

    def guarded_update(self, cur: Any, rows: list[tuple[StreamWrite, Guard]],
                       last_record: int | None = None) -> set[str]:
        ok = set()
        for w, g in rows:
            facts = self.heads.get(w.handle_id)
            if facts is not None and guard_of(facts) == g:
                self.heads[w.handle_id] = self.changed[w.handle_id] = w.head
                ok.add(w.handle_id)
        return ok

    def create_heads(self, cur: Any, writes: list[StreamWrite], last_record: int | None = None) -> set[str]:
        ok = set()
        for w in writes:
            if w.handle_id not in self.heads:
                self.heads[w.handle_id] = self.changed[w.handle_id] = w.head
                ok.add(w.handle_id)
        return ok

    def check_heads(self, cur: Any, rows: list[tuple[str, Guard]]) -> set[str]:
        return {h for h, g in rows if (facts := self.heads.get(h)) is not None and guard_of(facts) == g}

    def savepoint(self, cur: Any) -> None:
        self._saved = (dict(self.heads), dict(self.changed))

    def rollback_to_savepoint(self, cur: Any) -> None:
        assert self._saved is not None
        self.heads, self.changed = dict(self._saved[0]), dict(self._saved[1])

    def release_savepoint(self, cur: Any) -> None:
        self._saved = None


__all__ = ["Head", "HeadView", "Rec", "Tail", "head_decode", "head_encode", "token"]
