"""Random command sequences against a small independent model of the lifecycle rules.

Run longer with: python -m pytest -m slow tests/test_lifecycle_stateful.py
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvledger import Ledger, full_layers
from kvledger.engine.evolve import fold
from kvledger.schemas import events as ev
from kvledger.schemas.errors import ErrorCode, KvLedgerError

from factories import make_manifest

LAYERS = 2
PROMPT = (3, 1, 4, 1)
CAPACITY = 12


@dataclass
class Model:
    """What a handle should look like, by the spec's rules, kept independently of engine/."""

    generation: int = 0
    snapshot: int = 0
    committed: int = 0
    outputs: list[int] = field(default_factory=list)
    logits: bool = False
    lifecycle: str = "ACTIVE"
    # txn -> (start, n, kind, snapshot it started at)
    open: dict[str, tuple[int, int, str, int]] = field(default_factory=dict)

    @property
    def logical(self) -> int:
        return len(PROMPT) + len(self.outputs)

    def tokens(self) -> list[int]:
        return list(PROMPT) + self.outputs


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvl-hyp-")
        self.url = f"sqlite:///{os.path.join(self.dir, 'j.db')}"
        self.ledger = Ledger.open(self.url)
        self.models: dict[str, Model] = {}
        self.n = 0

    def teardown(self) -> None:
        self.ledger.close()
        shutil.rmtree(self.dir, ignore_errors=True)  # one directory an example: on tmpfs, memory

    def _name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def _attempt(self, ok: bool, fn, *args, **kwargs) -> bool:
        before = list(self.ledger.journal.read_raw())
        try:
            fn(*args, **kwargs)
        except KvLedgerError as exc:
            assert not ok, f"model accepts, ledger rejected: {exc}"
            assert list(self.ledger.journal.read_raw()) == before, "a rejection wrote something"
            return False
        assert ok, "model rejects, ledger accepted"
        return True

    def _live(self) -> list[str]:
        return sorted(self.models)

    # -- rules ---------------------------------------------------------------------
    @rule()
    def allocate(self) -> None:
        h = self._name("h")
        self.ledger.allocate(h, make_manifest(h, prompt=PROMPT), reserved_capacity=CAPACITY)
        self.models[h] = Model()

    @precondition(lambda self: self.models)
    @rule(data=st.data(), kind=st.sampled_from(["prefill", "chunk", "decode", "repair", "verify"]),
          n=st.integers(1, 3), stale=st.booleans())
    def begin_append(self, data, kind, n, stale) -> None:
        h = data.draw(st.sampled_from(self._live()))
        m = self.models[h]
        start = m.committed
        if kind in ("decode", "repair"):
            n = 1
        if kind == "verify":
            toks = [7] * n
        else:
            toks = m.tokens()[start:start + n] or [0]
            n = len(toks)
        snap = m.snapshot - 1 if stale else m.snapshot
        ok = (m.lifecycle == "ACTIVE" or (m.lifecycle == "FINISHED" and kind == "repair")) \
            and not stale and start + n <= CAPACITY and m.lifecycle != "RELEASED"
        if kind == "verify":
            ok = ok and m.logits and m.logical == start
        else:
            ok = ok and start + n <= m.logical and toks == m.tokens()[start:start + n]
            if kind == "prefill":
                ok = ok and start == 0 and n <= len(PROMPT)
            if kind == "chunk":
                ok = ok and start > 0
            if kind in ("decode", "repair"):
                ok = ok and bool(m.outputs) and m.logical == m.committed + 1
            if kind == "repair":
                ok = ok and m.lifecycle == "FINISHED"
        txn = self._name("t")
        if self._attempt(ok, self.ledger.begin_append, h, txn_id=txn, kind=kind,
                         base=(m.generation, snap), start=start, token_ids=toks):
            m.open[txn] = (start, n, kind, m.snapshot)

    @precondition(lambda self: any(m.lifecycle == "ACTIVE" for m in self.models.values()))
    @rule(data=st.data(), token=st.integers(0, 9))
    def advance(self, data, token) -> None:
        """The next ordinary step of a live request: prefill the rest, emit, or decode.
        Random rules alone rarely reach decode; this keeps every phase in play."""
        h = data.draw(st.sampled_from(sorted(h for h, m in self.models.items() if m.lifecycle == "ACTIVE")))
        m = self.models[h]
        if m.open:
            return
        if m.logits:
            self.ledger.emit(h, base=(m.generation, m.snapshot), output_index=len(m.outputs), token_id=token)
            m.outputs.append(token)
            m.logits = False
            return
        start, n = m.committed, m.logical - m.committed
        if n <= 0 or start + n > CAPACITY:
            return
        kind = "prefill" if start == 0 else "decode" if start >= len(PROMPT) and n == 1 else "chunk"
        txn = self._name("a")
        b = (m.generation, m.snapshot)
        self.ledger.begin_append(h, txn_id=txn, kind=kind, base=b, start=start,
                                 token_ids=m.tokens()[start:start + n])
        self.ledger.publish(h, txn_id=txn, base=b)
        m.snapshot += 1
        m.committed = start + n
        m.logits = True

    @precondition(lambda self: any(m.open for m in self.models.values()))
    @rule(data=st.data(), layer_subset=st.sets(st.integers(0, LAYERS - 1), min_size=1),
          accept=st.integers(0, 3))
    def publish(self, data, layer_subset, accept) -> None:
        h = data.draw(st.sampled_from([h for h, m in self.models.items() if m.open]))
        m = self.models[h]
        txn = data.draw(st.sampled_from(sorted(m.open)))
        start, n, kind, started_at = m.open[txn]
        accepted = min(accept, n) if kind == "verify" else n
        layers = tuple(r for r in full_layers(LAYERS, start, accepted) if r.layer in layer_subset)
        # stale when anything moved the snapshot since this txn started: another
        # publication, or a truncate (even one to the same length: a new snapshot)
        ok = (len(layer_subset) == LAYERS and start == m.committed and started_at == m.snapshot
              and (m.lifecycle == "ACTIVE" or (m.lifecycle == "FINISHED" and kind == "repair")))
        if self._attempt(ok, self.ledger.publish, h, txn_id=txn, base=(m.generation, m.snapshot),
                         layers=layers, accepted_count=accepted if kind == "verify" else None):
            del m.open[txn]
            m.snapshot += 1
            if kind == "verify":
                m.outputs += [7] * accepted
            m.committed = start + accepted
            m.logits = kind != "repair" and m.committed == m.logical

    @precondition(lambda self: any(m.open for m in self.models.values()))
    @rule(data=st.data())
    def fail(self, data) -> None:
        h = data.draw(st.sampled_from([h for h, m in self.models.items() if m.open]))
        txn = sorted(self.models[h].open)[0]
        self._attempt(True, self.ledger.fail, h, txn_id=txn, outcome="failed")
        del self.models[h].open[txn]

    @precondition(lambda self: self.models)
    @rule(data=st.data(), token=st.integers(0, 9))
    def emit(self, data, token) -> None:
        h = data.draw(st.sampled_from(self._live()))
        m = self.models[h]
        ok = m.lifecycle == "ACTIVE" and m.logits
        if self._attempt(ok, self.ledger.emit, h, base=(m.generation, m.snapshot),
                         output_index=len(m.outputs), token_id=token):
            m.outputs.append(token)
            m.logits = False

    @precondition(lambda self: self.models)
    @rule(data=st.data(), extra=st.integers(-2, 1))
    def fork(self, data, extra) -> None:
        h = data.draw(st.sampled_from(self._live()))
        m = self.models[h]
        prefix = max(0, m.committed + extra)
        ok = m.lifecycle in ("ACTIVE", "FINISHED") and prefix <= m.committed
        child = self._name("f")
        if self._attempt(ok, self.ledger.fork, h, base=(m.generation, m.snapshot),
                         child_handle_ids=[child], prefix_length=prefix):
            self.models[child] = self._cut(m, prefix, Model())

    def _cut(self, m: Model, new_len: int, into: Model) -> Model:
        keep = max(0, min(len(m.outputs), new_len - len(PROMPT) + 1))
        unchanged = new_len == m.committed and keep == len(m.outputs)
        into.outputs, into.committed = m.outputs[:keep], new_len
        into.logits = m.logits and unchanged
        return into

    @precondition(lambda self: self.models)
    @rule(data=st.data(), shrink=st.integers(-1, 3))
    def truncate(self, data, shrink) -> None:
        h = data.draw(st.sampled_from(self._live()))
        m = self.models[h]
        new_len = max(0, m.committed - shrink)
        ok = m.lifecycle == "ACTIVE" and new_len <= m.committed
        if self._attempt(ok, self.ledger.truncate, h, base=(m.generation, m.snapshot), new_length=new_len):
            self._cut(m, new_len, m)
            m.snapshot += 1

    @precondition(lambda self: len(self.models) >= 2)
    @rule(data=st.data(), swap=st.booleans())
    def reorder(self, data, swap) -> None:
        a, b = data.draw(st.lists(st.sampled_from(self._live()), min_size=2, max_size=2, unique=True))
        ok = all(self.models[x].lifecycle == "ACTIVE" for x in (a, b))
        self._attempt(ok, self.ledger.reorder, "g", rows=[a, b], permutation=[1, 0] if swap else [0, 1],
                      bases=[(self.models[x].generation, self.models[x].snapshot) for x in (a, b)])

    @precondition(lambda self: self.models)
    @rule(data=st.data(), op=st.sampled_from(["cancel", "finish", "release"]))
    def end(self, data, op) -> None:
        h = data.draw(st.sampled_from(self._live()))
        m = self.models[h]
        if op == "release":
            ok = m.lifecycle in ("FINISHED", "CANCELLED")
            if self._attempt(ok, self.ledger.release, h, base=m.generation):
                m.generation += 1
                m.snapshot += 1
                m.committed = 0
                m.lifecycle, m.open, m.logits = "RELEASED", {}, False
            return
        ok = m.lifecycle == "ACTIVE"
        fn = self.ledger.cancel if op == "cancel" else self.ledger.finish
        if self._attempt(ok, fn, h, base=m.generation):
            m.open = {}
            m.lifecycle = "CANCELLED" if op == "cancel" else "FINISHED"
            if op == "cancel":
                m.snapshot += 1
                m.logits = False

    @rule()
    def reopen(self) -> None:
        before = {h: self.ledger.state(h, refresh=False) for h in self.models}
        self.ledger.close()
        self.ledger = Ledger.open(self.url)
        for h, s in before.items():
            assert self.ledger.state(h) == s  # a reopened journal yields the same state

    # -- invariants ----------------------------------------------------------------
    @invariant()
    def journal_agrees(self) -> None:
        streams: dict[str, list] = {}
        for e in self.ledger.journal.read_all():
            streams.setdefault(e.stream_id, []).append(e)
        for h, m in self.models.items():
            events = streams[h]
            s = fold(events)
            assert (s.generation, s.snapshot_version, s.committed_length, s.lifecycle) == (
                m.generation, m.snapshot, m.committed, m.lifecycle)
            assert list(s.outputs) == m.outputs and s.logits_ready == m.logits
            assert s.committed_length <= s.logical_length or s.lifecycle == "RELEASED"
            # the committed length rebuilt from the publications: each one extends the
            # previous by its rows over every layer
            length = 0
            released = False
            for e in events:
                assert not released, "an event after release"
                if isinstance(e, ev.ForkEvent):
                    length = e.payload.prefix_length
                elif isinstance(e, ev.AppendPublishEvent):
                    p = e.payload
                    assert p.layers_complete == LAYERS
                    assert p.committed_length - p.accepted_count == length
                    length = p.committed_length
                elif isinstance(e, ev.TruncateEvent):
                    length = e.payload.new_length
                elif isinstance(e, ev.ReleaseEvent):
                    length, released = 0, True
            assert length == m.committed


TestLifecycle = LifecycleMachine.TestCase
TestLifecycle.settings = settings(max_examples=12, stateful_step_count=25, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
class TestLifecycleLong(LifecycleMachine.TestCase):
    settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow])


def test_a_truncate_that_cuts_nothing_still_fences_an_open_append(tmp_path):
    """Found by the machine above (its model had missed it): a truncate makes a new
    snapshot even when it keeps every row, so an append started before it is stale."""
    ledger = Ledger.open(f"sqlite:///{tmp_path}/j.db")
    ledger.allocate("h", make_manifest("h", prompt=PROMPT), reserved_capacity=CAPACITY)
    ledger.begin_append("h", txn_id="t", kind="prefill", base=(0, 0), start=0, token_ids=list(PROMPT[:1]))
    ledger.truncate("h", base=(0, 0), new_length=0)
    before = list(ledger.journal.read_raw())
    with pytest.raises(KvLedgerError) as e:
        ledger.publish("h", txn_id="t", base=(0, 1), layers=full_layers(LAYERS, 0, 1))
    assert e.value.code is ErrorCode.STALE_BASE
    assert list(ledger.journal.read_raw()) == before
    ledger.close()
