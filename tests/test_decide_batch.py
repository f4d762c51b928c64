"""engine.decide_batch against the general path (decide and evolve, one chain a step).

Random batches over random handle states, including every way a step can be off (a
stale or a named current base, a wrong txn, position, output index or cache ABI, a
handle at its capacity, finished, cancelled or unknown, a verify or repair append open,
the same handle twice): the batch sent as one DecodeBatch (CommandService.submit_batch)
and sent as its chains (submit_many, the general path) give the same results, code and
message for every refusal, and the same journal, event for event in read_raw's bytes
(what export writes); and decide_batch's own refusals are the general path's.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.engine import commands as c
from kvledger.engine import ids, lanes
from kvledger.engine.decide_batch import decide_batch
from kvledger.engine.service import CommandService, ManualClock
from kvledger.journal import open_journal
from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.decode_batch import BatchBuilder, DecodeBatch
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.events import ForwardCall

from factories import make_manifest
from lane_helpers import fixed_commit_time

PROMPT = (11, 22, 33, 44)
SITUATIONS = ("decoding", "fresh", "tight", "finished", "cancelled", "verify", "repair", "unknown")
OFF = ("none", "none", "none", "stale_base", "current_base", "wrong_txn", "wrong_position", "wrong_output",
       "other_abi", "aborted_next")
_examples = itertools.count()
_txns = itertools.count(1)


def _txn() -> str:
    """A txn id in engine.ids' form under a prefix of its own (the rows store it as a counter)."""
    return f"{'7a' * 8}{next(_txns):016x}"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """An empty journal, copied for each example: creating one is ~50x slower."""
    root = tmp_path_factory.mktemp("decide_batch")
    with open_or_create_journal(f"sqlite:///{root}/template.db"):
        pass
    return root


@contextlib.contextmanager
def _services(root: Path, example: int) -> Iterator[tuple[CommandService, CommandService]]:
    """Two fresh journals: one takes batches, the other their chains."""
    urls = []
    for name in ("batch", "chains"):
        shutil.copy(root / "template.db", root / f"{name}-{example}.db")
        urls.append(f"sqlite:///{root}/{name}-{example}.db")
    with open_journal(urls[0]) as a, open_journal(urls[1]) as b:
        yield CommandService(a, clock=ManualClock().at(4.0)), CommandService(b, clock=ManualClock().at(4.0))


def _chain(h: str, steps: tuple[c.Step, ...]) -> c.Relative:
    return c.Relative(c.Chain(handle_id=h, steps=steps))


def _publish(h: str, txn: str) -> c.Publish:
    return c.Publish(handle_id=h, txn_id=txn, base_generation=None, base_snapshot_version=None, rows_sha256="ab" * 32)


def _begin(h: str, txn: str, kind: str, at: int, tokens: tuple[int, ...]) -> c.BeginAppend:
    return c.BeginAppend(handle_id=h, txn_id=txn, kind=kind, base_generation=None,  # type: ignore[arg-type]  # a kind
                         base_snapshot_version=None, interval_start=at, interval_count=len(tokens), token_ids=tokens,
                         cache_positions=tuple(range(at, at + len(tokens))), mask_key_extent=at + len(tokens),
                         cache_abi_sha256="")


def _setup(h: str, situation: str, decoded: int) -> list[list[c.Command | c.Relative]]:
    """Commits that leave handle `h` in `situation`, each its own batch."""
    if situation == "unknown":
        return []
    capacity = len(PROMPT) + (decoded + 1 if situation == "tight" else 32)
    txn = _txn()
    out: list[list[c.Command | c.Relative]] = [
        [c.Allocate(handle_id=h, manifest=make_manifest(request_id=h, prompt=PROMPT), reserved_capacity=capacity)],
        [c.Relative(_begin(h, txn, "prefill", 0, PROMPT))]]
    if situation == "fresh":
        return out
    at = len(PROMPT)
    for k in range(decoded):
        nxt = _txn()
        out.append([_chain(h, (_publish(h, txn), c.EmitOutput(handle_id=h, base_generation=None,
                                                                base_snapshot_version=None, output_index=k,
                                                                token_id=50 + k),
                               _begin(h, nxt, "decode", at, (50 + k,))))])
        txn, at = nxt, at + 1
    if situation == "finished":
        out.append([c.Relative(c.Finish(handle_id=h, base_generation=None))])
    elif situation == "cancelled":
        out.append([c.Relative(c.CancelRequest(handle_id=h, base_generation=0))])
    elif situation in ("verify", "repair"):
        emit = c.EmitOutput(handle_id=h, base_generation=None, base_snapshot_version=None, output_index=decoded,
                            token_id=9)
        then: tuple[c.Step, ...] = ((_begin(h, _txn(), "verify", at, (9, 8)),) if situation == "verify" else
                                    (c.Finish(handle_id=h, base_generation=None, reason="eos"),
                                     _begin(h, _txn(), "repair", at, (9,))))
        out.append([_chain(h, (_publish(h, txn), emit, *then))])
    return out


def _batch(service: CommandService, handles: list[str], picks: list[tuple[int, str, int, bool, bool]]) -> DecodeBatch:
    """A step for each pick (which handle, how it is off, its token, a digest?, a call?),
    built from the handle's state as a worker would build it, then moved off."""
    batch = BatchBuilder()
    for j, off, token, digest, call in picks:
        h = handles[j]
        s = service.state(h)
        txn, at, output, g, v, abi = "0" * 32, len(PROMPT), 0, 0, 0, "ef" * 32
        if s is not None:
            g, v, abi, output = s.generation, s.snapshot_version, s.cache_abi_sha256, len(s.outputs)
            if s.open_txns:
                t = s.open_txns[0]
                txn, at = t.txn_id, t.interval_start + t.interval_count
        nxt = _txn()
        base = {"stale_base": (g, v + 1), "current_base": (g, v)}.get(off)
        txn = _txn() if off == "wrong_txn" else txn
        at = at + 1 if off == "wrong_position" else at
        output = output + 1 if off == "wrong_output" else output
        abi = "cd" * 32 if off == "other_abi" else abi
        if off == "aborted_next" and s is not None and s.aborted_txn_ids:
            nxt = s.aborted_txn_ids[0]
        i = batch.add(h, txn, at, output, token, nxt, f"{token:064x}" if digest else None, abi)
        batch.detail(i, workspace_bytes=token % 3 * 64, base=base,
                     call=ForwardCall(f"{'c1' * 8}{token:016x}", 0, 2, 1, at + 1, 1) if call else None)
    return batch.build()


def _outcome(r: object) -> object:
    return (r.code, r.message) if isinstance(r, KvLedgerError) else r


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(situations=st.lists(st.tuples(st.sampled_from(SITUATIONS), st.integers(0, 3)), min_size=1, max_size=5),
       picks=st.lists(st.tuples(st.integers(0, 4), st.sampled_from(OFF), st.integers(0, 60_000), st.booleans(),
                                st.booleans()), min_size=1, max_size=8),
       rounds=st.integers(1, 3))
def test_a_batch_decides_as_its_chains_do(template, monkeypatch, situations, picks, rounds):
    fixed_commit_time(monkeypatch)
    example = next(_examples)
    with _services(template, example) as services:
        _compare(services, example, situations, picks, rounds)


def _compare(services: tuple[CommandService, CommandService], example: int,
             situations: list[tuple[str, int]], picks: list, rounds: int) -> None:
    handles = [f"x{example}-{j}" for j in range(len(situations))]
    picks = [(j % len(handles), *rest) for j, *rest in picks]
    saved = ids._prefix, ids._counter
    # each side draws its ids from a counter of its own, from the same start
    counters = {name: itertools.count((example + 1) << 24) for name in ("batch", "chains")}
    ids._prefix = "5eed0000000000aa"
    try:
        setup = [cmds for h, (situation, decoded) in zip(handles, situations)
                 for cmds in _setup(h, situation, decoded)]
        for name, service in zip(counters, services):
            ids._counter = counters[name]
            for cmds in setup:
                service.execute_many(cmds)
        seen: dict[str, list] = {"batch": [], "chains": []}
        for _ in range(rounds):
            batch = _batch(services[1], handles, picks)  # the chains' side: reading takes no handle out of the lanes
            states = {h: services[1].state(h) for h in handles}
            decided = decide_batch(batch, states, services[1].clock.monotonic_ns())
            ids._counter = counters["batch"]
            seen["batch"].append([_outcome(r) for r in services[0].submit_batch(batch, ())()])
            ids._counter = counters["chains"]
            chains = [_outcome(r) for r in services[1].execute_many([c.batch_step(batch, i)
                                                                     for i in range(len(batch))])]
            seen["chains"].append(chains)
            for i, refusal in enumerate(decided.refused):
                if refusal is not None:  # decide_batch's own refusal is the general path's
                    assert chains[i] == (refusal.code, refusal.message), (i, batch)
                else:
                    assert not isinstance(chains[i], tuple), (i, chains[i], batch)
        assert seen["batch"] == seen["chains"]
        _same_journal_and_states(services, handles)
    finally:
        ids._prefix, ids._counter = saved


def _same_journal_and_states(services: tuple[CommandService, CommandService], handles: list[str]) -> None:
    """Both journals the same event for event, and each handle's state the same on both
    sides and as a fresh fold of the journal reads it (the lanes' states built whole)."""
    raws = [list(service.journal.read_raw()) for service in services]
    assert raws[0] == raws[1]
    fresh = CommandService(services[0].journal)
    states = [{h: service.state(h) for h in handles} for service in (*services, fresh)]
    assert states[0] == states[1] == states[2]


# mostly plain steps, so that whole batches are decided in the lanes
PLAIN_OFF = ("none",) * 6 + OFF[3:]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(situations=st.lists(st.tuples(st.sampled_from(("decoding",) * 4 + SITUATIONS), st.integers(0, 3)),
                           min_size=1, max_size=8),
       rounds=st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 7), st.sampled_from(PLAIN_OFF),
                                                    st.integers(0, 60_000), st.booleans(), st.booleans()),
                                          min_size=1, max_size=8),
                                 st.sampled_from(("none", "none", "read", "finish")), st.integers(0, 7)),
                       min_size=1, max_size=5))
def test_batches_decided_in_the_lanes_leave_what_their_chains_leave(template, monkeypatch, situations, rounds):
    """Every batch of one or more steps on distinct handles goes to the lanes
    (engine.lanes.FEW at 1); between batches a handle's state is read, or a command
    finishes a handle the batch does not step (in its commit), taking it out of the
    lanes: the results, the journal and every handle's state are the chains'."""
    fixed_commit_time(monkeypatch)
    monkeypatch.setattr(lanes, "FEW", 1)
    example = next(_examples)
    handles = [f"l{example}-{j}" for j in range(len(situations))]
    saved = ids._prefix, ids._counter
    counters = {name: itertools.count((example + 1) << 24) for name in ("batch", "chains")}
    ids._prefix = "5eed0000000000bb"
    try:
        setup = [cmds for h, (situation, decoded) in zip(handles, situations) for cmds in _setup(h, situation, decoded)]
        with _services(template, example) as services:
            for name, service in zip(counters, services):
                ids._counter = counters[name]
                for cmds in setup:
                    service.execute_many(cmds)
            for picks, action, which in rounds:
                distinct = {j % len(handles): (j % len(handles), *rest) for j, *rest in picks}
                batch = _batch(services[1], handles, list(distinct.values()))
                other = handles[which % len(handles)]
                cmds: list[c.Command | c.Relative] = []
                if action == "finish" and other not in batch.handle_ids:
                    cmds = [c.Relative(c.Finish(handle_id=other, base_generation=None))]
                ids._counter = counters["batch"]
                got = [_outcome(r) for r in services[0].submit_batch(batch, cmds)()]
                ids._counter = counters["chains"]
                want = [_outcome(r) for r in services[1].execute_many(
                    [c.batch_step(batch, i) for i in range(len(batch))] + cmds)]
                assert got == want
                if action == "read":
                    assert services[0].state(other) == services[1].state(other)
            _same_journal_and_states(services, handles)
    finally:
        ids._prefix, ids._counter = saved
