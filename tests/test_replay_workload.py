"""A mixed workload written by real commands (kvledger.Ledger, ManualClock), and the
projector checked against a from-scratch oracle of the spec's ledger code at every
event. Other replay tests import `write_workload` from here."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvledger import Ledger
from kvledger.replay import WindowSpec, replay_journal

from factories import make_manifest
from lifecycle_helpers import ManualClock

MS = 1_000_000
WINDOW = WindowSpec(slo_ttft_ns=20 * MS, slo_tbt_ns=10 * MS)
TIERS = (("gpu",), ("gpu", "host"), ("gpu", "host", "remote"))


class Script:
    """One request's life as a generator of commands; the driver interleaves them."""

    def __init__(self, led: Ledger, rnd: random.Random, handle: str) -> None:
        self.led, self.rnd, self.h = led, rnd, handle

    def base(self, h: str | None = None) -> tuple[int, int]:
        s = self.led.state(h or self.h)
        return (s.generation, s.snapshot_version)

    def allocate(self, prompt_len: int, extra: int = 12) -> None:
        prompt = tuple(self.rnd.randrange(1, 1000) for _ in range(prompt_len))
        self.led.allocate(self.h, make_manifest(request_id=self.h, prompt=prompt),
                          reserved_capacity=prompt_len + extra, copy_tiers=self.rnd.choice(TIERS),
                          allocator_bytes_per_copy=self.rnd.choice((0, 16)))

    def append(self, txn: str, kind: str, tokens=None, h: str | None = None, **publish) -> None:
        h = h or self.h
        s = self.led.state(h)
        b = (s.generation, s.snapshot_version)
        if tokens is None:
            tokens = s.prompt[s.committed_length:] if kind in ("prefill", "chunk") else (s.outputs[-1],)
        self.led.begin_append(h, txn_id=txn, kind=kind, base=b, start=s.committed_length, token_ids=tokens)
        self.led.publish(h, txn_id=txn, base=b, workspace_bytes=self.rnd.choice((0, 32, 96)), **publish)

    def emit(self, h: str | None = None) -> None:
        s = self.led.state(h or self.h)
        self.led.emit(h or self.h, base=(s.generation, s.snapshot_version), output_index=len(s.outputs),
                      token_id=self.rnd.randrange(1, 1000))

    def decode_loop(self, n: int, h: str | None = None) -> Iterator[None]:
        for i in range(n):
            self.emit(h)
            yield
            if i < n - 1:
                self.append(f"{h or self.h}-d{i}", "decode", h=h)
                yield

    # -- scripts ---------------------------------------------------------------------

    def plain(self) -> Iterator[None]:
        self.allocate(self.rnd.randint(2, 6))
        yield
        self.append(f"{self.h}-p", "prefill")
        yield
        yield from self.decode_loop(self.rnd.randint(1, 4))
        self.led.finish(self.h, base=0)
        yield
        self.led.release(self.h, base=0)

    def chunked(self) -> Iterator[None]:
        self.allocate(10)
        yield
        s = self.led.state(self.h)
        b = self.base()
        self.led.begin_append(self.h, txn_id="c1", kind="prefill", base=b, start=0, token_ids=s.prompt[:6])
        yield
        self.led.publish(self.h, txn_id="c1", base=b)
        yield
        self.append("c2", "chunk")
        yield
        yield from self.decode_loop(3)
        self.led.finish(self.h, base=0, reason="eos")
        yield
        self.append("repair", "repair")  # close the frontier for reuse
        yield
        self.led.release(self.h, base=0)

    def speculative(self) -> Iterator[None]:
        self.allocate(5)
        yield
        self.append(f"{self.h}-p", "prefill")
        yield
        drafts = tuple(self.rnd.randrange(1, 1000) for _ in range(4))
        self.append("v1", "verify", tokens=drafts, accepted_count=2)
        yield
        self.emit()  # the correction token, one frontier ahead
        yield
        self.append("c2", "decode")
        yield
        self.led.finish(self.h, base=0)
        yield
        self.led.release(self.h, base=0)

    def failing(self) -> Iterator[None]:
        self.allocate(4)
        yield
        self.append(f"{self.h}-p", "prefill")
        yield
        self.emit()
        yield
        s = self.led.state(self.h)
        b = self.base()
        self.led.begin_append(self.h, txn_id="d1", kind="decode", base=b, start=s.committed_length,
                              token_ids=(s.outputs[-1],))
        yield
        self.led.fail(self.h, txn_id="d1", outcome="failed", code="WORKER_FAILED")
        yield
        self.append("d2", "decode")
        yield
        self.led.finish(self.h, base=0)
        yield
        self.led.release(self.h, base=0)

    def cancelled(self) -> Iterator[None]:
        self.allocate(4)
        yield
        self.append(f"{self.h}-p", "prefill")
        yield
        self.emit()
        yield
        s = self.led.state(self.h)
        self.led.begin_append(self.h, txn_id="open", kind="decode", base=self.base(),
                              start=s.committed_length, token_ids=(s.outputs[-1],))
        yield
        self.led.cancel(self.h, base=0, reason="client went away")  # aborts "open"
        yield
        self.led.release(self.h, base=0)

    def never_prefilled(self) -> Iterator[None]:
        self.allocate(3)
        yield
        self.led.cancel(self.h, base=0)
        yield
        self.led.release(self.h, base=0)

    def forked(self) -> Iterator[None]:
        self.allocate(4)
        yield
        self.append(f"{self.h}-p", "prefill")
        yield
        yield from self.decode_loop(2)
        kids = [f"{self.h}.k0", f"{self.h}.k1"]
        self.led.fork(self.h, base=self.base(), child_handle_ids=kids, prefix_length=5)
        yield
        self.led.reorder(f"{self.h}-beam", rows=kids, permutation=[1, 0])
        yield
        self.led.truncate(kids[0], base=self.base(kids[0]), new_length=3)
        yield
        self.led.finish(self.h, base=0)
        yield
        self.led.release(self.h, base=0)
        yield
        for k in kids:
            self.led.finish(k, base=0)
            yield
            self.led.release(k, base=0)
            yield


SCRIPTS = ("plain", "chunked", "speculative", "failing", "cancelled", "never_prefilled", "forked")


def write_workload(led: Ledger, clock: ManualClock, seed: int = 0, rounds: int = 1,
                   finish: bool = True) -> None:
    """Every script `rounds` times, interleaved at random; 1-3 ms between commands.
    finish=False stops after 40 commands per round, with requests still live."""
    rnd = random.Random(seed)
    live: list[Iterator[None]] = []
    for r in range(rounds):
        for name in SCRIPTS:
            live.append(getattr(Script(led, rnd, f"{name}-{seed}-{r}"), name)())
    total = 0
    t = 0.0
    while live:
        t += rnd.randint(1, 3)
        clock.at(t)
        it = rnd.choice(live)
        try:
            next(it)
        except StopIteration:
            live.remove(it)
        total += 1
        if not finish and total >= 40 * rounds:
            return


@pytest.fixture
def workload(db_url):
    clock = ManualClock()
    with Ledger.open(db_url, clock=clock) as led:
        write_workload(led, clock, seed=7, rounds=2)
        yield led.journal


def oracle(states: dict, owning: set[str]) -> dict:
    """The spec's snapshot_ledger (0x02), re-summed from scratch over the handles."""
    logical = materialized = reserved = copies = 0
    resident: dict[str, int] = {}
    payloads = []
    for h in owning:
        s = states[h]
        t, c, r = s.committed_length, s.reserved_capacity, len(s.copy_tiers)
        assert 0 <= t <= c
        logical += t * s.b_token
        materialized += r * t * s.b_token
        reserved += r * c * s.b_token
        copies += r
        payloads.append(t * s.b_token)
        for tier in s.copy_tiers:
            resident[tier] = resident.get(tier, 0) + c * s.b_token + s.allocator_bytes_per_copy
    allocator = sum(len(states[h].copy_tiers) * states[h].allocator_bytes_per_copy for h in owning)
    return {"logical": logical, "materialized": materialized, "reserved": reserved,
            "allocator": allocator, "physical": reserved + allocator,
            "resident": {k: v for k, v in resident.items() if v},
            "rectangular": len(owning) * max(payloads, default=0)}


def test_incremental_ledgers_equal_a_full_resum_at_every_event(workload):
    from kvledger.engine.evolve import evolve

    report = replay_journal(workload, WINDOW, trajectory=True)
    events = list(workload.read_all())
    assert len(report.trajectory) == len(events) > 120
    states: dict = {}
    owning: set[str] = set()
    area = [0, 0]  # logical, physical byte-ns: bytes held constant until the next event
    prev = None
    for e, point in zip(events, report.trajectory):
        if prev is not None:
            dt = e.monotonic_ns - prev[0]
            area[0] += prev[1]["logical"] * dt
            area[1] += prev[1]["physical"] * dt
        states[e.stream_id] = evolve(states.get(e.stream_id), e)
        if e.event_type in ("append_publish", "fork"):
            owning.add(e.stream_id)
        elif e.event_type == "release":
            owning.discard(e.stream_id)
        want = oracle(states, owning)
        led = point.ledger
        got = {k: getattr(led, k) for k in want if k != "resident"}
        got["resident"] = {k: v for k, v in led.resident.items() if v}
        assert got == want, (point.position, e.event_type)
        assert sum(led.resident.values()) == led.physical
        ws = e.payload.workspace_bytes if e.event_type == "append_publish" else 0
        assert led.workspace == ws and led.instantaneous == led.physical + ws
        assert led.phantom == led.rectangular - led.logical >= 0
        prev = (e.monotonic_ns, want)
    bt = report.byte_time
    assert [bt.logical_byte_ns, bt.physical_byte_ns] == area and area[0] > 0
    assert (bt.start_ns, bt.end_ns) == (events[0].monotonic_ns, events[-1].monotonic_ns)
    # everything closed: the terminal allocation is zero
    assert report.ledger.physical == 0 and all(v == 0 for v in report.ledger.resident.values())


def test_workload_metrics_follow_the_conventions(workload):
    report = replay_journal(workload, WINDOW)
    by_handle = {r.handle_id: r for r in report.requests}
    outcomes = {r.outcome for r in report.requests}
    assert outcomes == {"finished", "cancelled"}
    for r in report.requests:
        if r.outputs > 1:
            assert r.tpot_ns == pytest.approx(sum(r.tbt_ns) / len(r.tbt_ns))
            assert r.tpot_ns > 0
        else:
            assert r.tpot_ns is None
        if r.outcome == "cancelled":
            assert not r.slo_valid
    # a cancelled request is never counted as completed
    finished = [r for r in report.requests if r.outcome == "finished"]
    assert report.window.completed == len(finished)
    assert report.window.slo_valid == sum(r.slo_valid for r in finished)
    # verify appends: accepted drafts are outputs at their publish
    spec = by_handle["speculative-7-0"]
    assert spec.outputs == 3 and spec.tbt_ns[0] == 0  # two drafts accepted at one publish
    # the executed rows of a chunked prefill equal one prefill's; repair adds one row
    chunked = by_handle["chunked-7-0"].saved_work
    assert chunked.executed_rows == 10 + 2 + 1 and chunked.executed_appends == 5
    never = by_handle["never_prefilled-7-0"]
    assert never.outputs == 0 and never.ttft_ns is None and never.saved_work.rows_cache is None
