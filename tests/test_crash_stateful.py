"""A hypothesis state machine over a writer process that crashes: appends are
acknowledged or not, the writer is killed (SIGKILL, or os._exit at a named fault point
inside the write path) and reopened. Invariant: the reopened journal holds exactly the
acknowledged prefix, plus any batch whose acknowledgement never arrived either whole
or not at all; a crash at a fault point before the commit leaves none of it, one after
the commit all of it.

Longer: python -m pytest -m slow tests/test_crash_stateful.py
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import BACKEND_NAMES, scratch_maker
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvledger.journal import Guard, Operation, faults
from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.receipts import Receipt

import crash_workers as cw
from factories import allocate_op, publish_op

BEFORE_COMMIT = ["before_update", "mid_batch", "after_update", "before_commit"]
SEEN: Counter = Counter()  # what the examples exercised, checked after the run


@dataclass
class Sent:
    ops: list[Operation]
    acked: bool
    expect: bool | None = None  # unacknowledged: must be present (True), absent (False), either (None)
    present: bool | None = None  # resolved after the crash
    receipts: list[Receipt] = field(default_factory=list)


class CrashReopen(RuleBasedStateMachine):
    """The machine, over a journal at a new URL of `make_url` and writer processes of
    `context` (`machine` binds both)."""

    make_url: Callable[[], str]
    context: Any  # a multiprocessing context (crash_workers.context())

    def __init__(self) -> None:
        super().__init__()
        self.url = self.make_url()
        self.reader = open_or_create_journal(self.url)
        self.heads: dict[str, Guard] = {}
        self.sent: list[Sent] = []
        self.looked_up: set[str] = set()
        self.n = 0
        self.crashes = 0
        self._start()

    # -- the writer process ----------------------------------------------------
    def _start(self) -> None:
        self.conn, child = self.context.Pipe()
        self.proc = self.context.Process(target=cw.writer, args=(self.url, child))
        self.proc.start()
        child.close()

    def _kill(self) -> None:
        self.proc.kill()
        self.proc.join(30)
        self.conn.close()
        self.crashes += 1

    def teardown(self) -> None:
        self._kill()
        self.reader.close()

    # -- operations ----------------------------------------------------------------
    def _batch(self, rnd: random.Random, size: int, rounds: bool = False) -> list[Operation]:
        """New handles and publishes on known ones; `rounds`: the same handle twice,
        so the batch commits in two rounds of guarded updates."""
        ops, heads = [], dict(self.heads)
        for i in range(size):
            self.n += 1
            key = f"op{self.n}"
            if not heads or (rnd.random() < 0.3 and not (rounds and i == 1)):
                h = f"h{self.n}"
                op = allocate_op(h, key)
            else:
                h = ops[-1].writes[0].handle_id if rounds and i == 1 and ops else rnd.choice(sorted(heads))
                op = publish_op(h, heads[h], key)
            w = op.writes[0].head
            heads[h] = Guard(w.generation, w.snapshot_version, w.stream_position)
            ops.append(op)
        return ops

    def _advance(self, ops: list[Operation]) -> None:
        for op in ops:
            w = op.writes[0].head
            self.heads[op.writes[0].handle_id] = Guard(w.generation, w.snapshot_version, w.stream_position)

    def _send(self, msg, *, crash_expect: bool | None) -> None:
        """Send an append; an answer is an acknowledgement, a dead writer an unknown."""
        ops = msg[1] if msg[0] == "append" else msg[1][1]
        try:
            self.conn.send(msg)
            if msg[0] == "sleep_append":
                assert self.conn.recv() == ("started", None)
                return
            status, results = self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._after_crash(Sent(ops, False, crash_expect))
            return
        assert status == "ok", results
        assert all(isinstance(r, Receipt) for r in results), results
        self.sent.append(Sent(ops, True, receipts=list(results)))
        SEEN["acknowledged"] += 1
        self._advance(ops)

    def _after_crash(self, s: Sent) -> None:
        self.proc.join(30)
        self.conn.close()
        self.crashes += 1
        present = [self.reader.receipt(op.operation_id) is not None for op in s.ops]
        assert len(set(present)) == 1, f"half a batch committed: {present}"
        s.present = present[0]
        SEEN["unacknowledged " + ("present" if s.present else "absent")] += 1
        if s.expect is not None:
            assert s.present == s.expect, f"crash expected {'all' if s.expect else 'none'} of the batch"
        if s.present:
            self._advance(s.ops)
        self.sent.append(s)
        self._start()

    # -- rules -------------------------------------------------------------------
    @rule(size=st.integers(1, 3), seed=st.integers(0, 2**16))
    def append(self, size, seed):
        self._send(("append", self._batch(random.Random(seed), size)), crash_expect=None)

    @rule(how=st.sampled_from(BEFORE_COMMIT + ["after_commit", "kill_in_txn", "kill_anytime", "idle"]),
          seed=st.integers(0, 2**16), delay=st.floats(0.0, 0.004))
    def crash(self, how, seed, delay):
        """One crash of the writer, then a reopen: os._exit at a fault point inside
        an append, SIGKILL inside the transaction, SIGKILL at a random moment of an
        append, or SIGKILL while idle."""
        rnd = random.Random(seed)
        if how == "idle":
            self._kill()
            self._start()
            SEEN["idle crash"] += 1
        elif how == "kill_in_txn":  # stalled before its commit, killed there
            # rounds: the general path (PostgreSQL's one-statement append has no before_commit)
            ops = self._batch(rnd, 2, rounds=True)
            self._send(("sleep_append", (0.2, ops)), crash_expect=None)
            time.sleep(delay)
            self.proc.kill()
            self.proc.join(30)
            self._after_crash(Sent(ops, False, False))
            SEEN["kill in transaction"] += 1
        elif how == "kill_anytime":
            ops = self._batch(rnd, 3)
            self.conn.send(("append", ops))
            time.sleep(delay)
            self.proc.kill()
            self.proc.join(30)
            self._after_crash(Sent(ops, False, None))
            SEEN["kill at a random moment"] += 1
        else:
            self.conn.send(("fault", f"{how}:exit@1"))
            assert self.conn.recv() == ("ok", None)
            ops = self._batch(rnd, 2 + seed % 2, rounds=True)
            self._send(("append", ops), crash_expect=how == "after_commit")
            SEEN[f"exit at {how}"] += not self.sent[-1].acked
            if self.sent[-1].acked:  # a writer that survived keeps the rule armed: disarm
                self.conn.send(("fault", ""))
                assert self.conn.recv() == ("ok", None)

    # -- the invariant -------------------------------------------------------------
    @invariant()
    def journal_is_exactly_the_acknowledged_prefix(self):
        want: list[str] = []
        for s in self.sent:
            if s.acked:
                for r in s.receipts:
                    want.extend(r.event_ids)
            elif s.present:
                for op in s.ops:
                    want.extend(e.event_id for w in op.writes for e in w.events)
        got = [body_id for _, body_id in _ids(self.reader)]
        assert got == want
        stored = {r.operation_id: r for r in self.reader.read_receipts()}
        for s in self.sent:
            if s.acked:
                for r in s.receipts:
                    assert stored.get(r.operation_id) == r
                    if r.operation_id not in self.looked_up:  # by id, as a retry finds it: once each
                        assert self.reader.receipt(r.operation_id) == r
                        self.looked_up.add(r.operation_id)



def machine(url_factory: Callable[[], str], ctx: Any) -> type[CrashReopen]:
    class Bound(CrashReopen):
        make_url = staticmethod(url_factory)
        context = ctx

    return Bound


def _ids(journal):
    from kvledger.schemas.codec import decode_event

    return [(p, decode_event(b).event_id) for p, b in journal.read_raw()]


@pytest.fixture(scope="module")
def ctx():
    return cw.context()


def _factory(backend, tmp_path_factory, request):
    make = scratch_maker(backend, tmp_path_factory.mktemp("crash-sm"), request)
    count = itertools.count(1)
    return lambda: make(f"j{next(count)}")


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_crash_and_reopen_keeps_exactly_the_acknowledged_prefix(backend, ctx, tmp_path_factory, request):
    faults.configure(None)
    SEEN.clear()
    cls = machine(_factory(backend, tmp_path_factory, request), ctx)
    run_state_machine_as_test(cls, settings=settings(
        max_examples=12, stateful_step_count=14, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    print(f"\n{backend}: {dict(SEEN)}")
    # the run crashed the writer at every fault point and saw both outcomes of an
    # unacknowledged batch, not only the easy path
    assert {f"exit at {p}" for p in BEFORE_COMMIT + ["after_commit"]} <= set(SEEN)
    assert SEEN["unacknowledged present"] > 0 and SEEN["unacknowledged absent"] > 0
    assert SEEN["acknowledged"] > 20


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_crash_and_reopen_long(backend, ctx, tmp_path_factory, request):
    cls = machine(_factory(backend, tmp_path_factory, request), ctx)
    run_state_machine_as_test(cls, settings=settings(
        max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)))
