"""Decode steps given as columns (DecodeBatch, CommandService.submit_steps) against the
same steps given as Relative chains (the general path), on both backends: the same
journal event for event (read_raw's bytes, what export writes), the same results and
hook calls, for plain steps, for steps the plain path declines (each refused
or accepted as its chain is), and for steps refused by another writer's commit (decided
again as their bound chains, as the chains are)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvledger.engine import commands as c
from kvledger.engine import ids
from kvledger.engine.service import CommandService, ManualClock
from kvledger.migrations.storage import open_or_create_journal
from kvledger.schemas.decode_batch import BatchBuilder, DecodeBatch
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.events import ForwardCall

from lane_helpers import fixed_commit_time, fresh_url, same_ids, watch_appends
from lifecycle_helpers import make_manifest

HANDLES = [f"lane-{i}" for i in range(5)]
PROMPT = (3, 1, 4, 1)


class Runner:
    """HANDLES decoding in lockstep; what each step sends, built as the worker would."""

    def __init__(self, service: CommandService) -> None:
        self.service = service
        self.txn = {h: ids.new_id() for h in HANDLES}
        self.outputs = dict.fromkeys(HANDLES, 0)
        self.at = dict.fromkeys(HANDLES, len(PROMPT))  # where the next append starts
        cmds: list[c.Command | c.Relative] = [
            c.Allocate(handle_id=h, manifest=make_manifest(request_id=h, prompt=PROMPT), reserved_capacity=40)
            for h in HANDLES]
        cmds += [c.Relative(c.BeginAppend(
            handle_id=h, txn_id=self.txn[h], kind="prefill", base_generation=None, base_snapshot_version=None,
            interval_start=0, interval_count=len(PROMPT), token_ids=PROMPT, cache_positions=(0, 1, 2, 3),
            mask_key_extent=len(PROMPT), cache_abi_sha256="")) for h in HANDLES]
        assert not any(isinstance(r, Exception) for r in service.execute_many(cmds))
        self.abi = service.state(HANDLES[0]).cache_abi_sha256

    def steps(self, k: int, off: Callable[[int, dict], None] | None = None) -> DecodeBatch:
        """Step k of every handle; `off(i, row)` may change row i's values first."""
        batch = BatchBuilder()
        for i, h in enumerate(HANDLES):
            row = dict(handle_id=h, txn_id=self.txn[h], rows_sha256=None if (i + k) % 3 == 0 else f"{k:02x}" * 32,
                       output_index=self.outputs[h], token=7 * k + i, next_txn_id=ids.new_id(),
                       position=self.at[h], cache_abi_sha256=self.abi, workspace_bytes=64 * i,
                       call=ForwardCall(ids.new_id(), i, 5, 2, self.at[h] + 1, 1) if (i + k) % 2 else None)
            if off is not None:
                off(i, row)
            detail = {k: row.pop(k) for k in ("workspace_bytes", "base", "call") if k in row}
            batch.detail(batch.add(**row), **detail)
        return batch.build()

    def advance(self, steps: DecodeBatch, results: list) -> None:
        for i, r in enumerate(results):
            if not isinstance(r, Exception):
                h = steps.handle_ids[i]
                self.txn[h], self.outputs[h], self.at[h] = steps.next_txn_ids[i], self.outputs[h] + 1, self.at[h] + 1


def _send(service: CommandService, steps: DecodeBatch, columns: bool) -> list:
    if columns:
        return list(service.execute_steps(steps))
    return list(service.execute_many([c.batch_step(steps, i) for i in range(len(steps))]))


def _outcome(r: object) -> object:
    return (r.code, r.message) if isinstance(r, KvLedgerError) else r


def _both(backend, tmp_path, request, monkeypatch, body: Callable[..., list]) -> dict[bool, tuple]:
    """`body(journal, service, runner, columns)` run twice, sending columns and chains:
    each run's tables, hook calls, results, steps given as values and events."""
    return {columns: _run(backend, tmp_path, request, monkeypatch, columns, body) for columns in (True, False)}


def _run(backend, tmp_path, request, monkeypatch, columns: bool, body: Callable[..., list]) -> tuple:
    same_ids(monkeypatch)
    url = fresh_url(backend, tmp_path, request, f"columns-{columns}")
    with open_or_create_journal(url) as journal:
        service = CommandService(journal, clock=ManualClock().at(5.0))
        hooked: list = []
        service.on_commit.append(lambda r, events: hooked.append(("commit", r, list(events))))
        service.on_reject.append(lambda cmd, exc: hooked.append(("reject", cmd, exc.code)))
        lanes: list[bool] = []
        watch_appends(journal, lambda ops, _: lanes.extend(op.step is not None for op in ops))
        out = body(journal, service, Runner(service), columns)
        return list(journal.read_raw()), hooked, [_outcome(r) for r in out], sum(lanes), list(journal.read_all())


def _without_lanes(run: tuple) -> tuple:
    """A run but for how many steps went as values (columns: the plain ones; chains: none)."""
    return run[:3] + run[4:]


@pytest.fixture(autouse=True)
def _commit_time(monkeypatch):
    fixed_commit_time(monkeypatch)


def test_plain_steps_as_columns_write_what_their_chains_write(backend, tmp_path, request, monkeypatch):
    def body(journal, service, runner, columns):
        out = []
        for k in range(8):
            steps = runner.steps(k)
            service.clock.at(5.0 + k)
            results = _send(service, steps, columns)
            assert not any(isinstance(r, Exception) for r in results), results
            runner.advance(steps, results)
            out += results
        return out

    runs = _both(backend, tmp_path, request, monkeypatch, body)
    assert runs[True][3] == 8 * len(HANDLES)  # every step went to the journal as values
    assert _without_lanes(runs[True]) == _without_lanes(runs[False])
    assert len(runs[True][4]) == 2 * len(HANDLES) + 8 * 3 * len(HANDLES)  # allocations, prefill starts, steps


OFF = {
    "wrong_output_index": lambda row: row.update(output_index=row["output_index"] + 1),
    "wrong_txn": lambda row: row.update(txn_id=ids.new_id()),
    "unknown_handle": lambda row: row.update(handle_id="nobody"),
    "wrong_position": lambda row: row.update(position=row["position"] + 2),
    "other_abi": lambda row: row.update(cache_abi_sha256="e" * 64),
    "call_id_not_engine_form": lambda row: row.update(call=ForwardCall("call-7", 0, 5, 2, 9, 1)),
    "txn_id_not_engine_form": lambda row: row.update(next_txn_id="txn-next"),
    "stale_named_base": lambda row: row.update(base=(0, 0)),
}


def _three_steps(off: Callable[[CommandService, int], Callable[[int, dict], None]]) -> Callable[..., list]:
    """A body for _both: three steps of every handle, step k's rows changed by off(service, k)."""
    def body(journal, service, runner, columns):
        out = []
        for k in range(3):
            steps = runner.steps(k, off(service, k))
            results = _send(service, steps, columns)
            runner.advance(steps, results)
            out += results
        return out
    return body


@pytest.mark.parametrize("shape", sorted(OFF))
def test_a_step_the_lane_declines_is_decided_as_its_chain(backend, tmp_path, request, monkeypatch, shape):
    """One step of a batch off the lane's form: it is refused (or stored as events)
    exactly as its chain is, and the batch's other steps commit beside it."""
    def off(service, k):
        return lambda i, row: OFF[shape](row) if i == 2 and k == 1 else None

    runs = _both(backend, tmp_path, request, monkeypatch, _three_steps(off))
    assert _without_lanes(runs[True]) == _without_lanes(runs[False])
    outcomes = runs[True][2]
    refused = [o for o in outcomes if isinstance(o, tuple)]
    if shape in ("call_id_not_engine_form", "txn_id_not_engine_form"):
        # the lane takes it; the journal's row writer stores its events
        assert not refused and runs[True][3] == 3 * len(HANDLES)
    else:
        assert len(refused) >= 1 and all(not isinstance(o, tuple) for o in outcomes[:len(HANDLES)])


def test_a_step_another_writer_overtook_is_decided_again_as_its_bound_chain(backend, tmp_path, request,
                                                                          monkeypatch):
    """A second service commits a step on one handle behind the first one's back; the
    first one's batch is refused for that handle at the journal's guard, and decided
    again against the new head as the chain it bound (refused: it named the old base),
    while the other handles commit: the same as with chains, hook calls included."""
    def body(journal, service, runner, columns):
        other = CommandService(journal, clock=ManualClock().at(9.0))
        first = runner.steps(0)
        out = _send(service, first, columns)
        runner.advance(first, out)
        h = HANDLES[1]
        s = other.state(h)
        t = s.open_txns[0]
        at = t.interval_start + t.interval_count
        [r] = other.execute_many([c.Relative(c.Chain(handle_id=h, steps=(
            c.Publish(handle_id=h, txn_id=t.txn_id, base_generation=None, base_snapshot_version=None),
            c.EmitOutput(handle_id=h, base_generation=None, base_snapshot_version=None,
                         output_index=len(s.outputs), token_id=99),
            c.BeginAppend(handle_id=h, txn_id=ids.new_id(), kind="decode", base_generation=None,
                          base_snapshot_version=None, interval_start=at, interval_count=1, token_ids=(99,),
                          cache_positions=(at,), mask_key_extent=at + 1, cache_abi_sha256=s.cache_abi_sha256))))])
        assert not isinstance(r, Exception)
        second = runner.steps(1)
        results = _send(service, second, columns)
        assert [isinstance(x, Exception) for x in results] == [i == 1 for i in range(len(HANDLES))]
        return out + results

    runs = _both(backend, tmp_path, request, monkeypatch, body)
    assert _without_lanes(runs[True]) == _without_lanes(runs[False])
    rejected = [(cmd, code) for kind, cmd, code in runs[True][1] if kind == "reject"]
    assert [code.value for _, code in rejected] == ["STALE_BASE"]
    assert all(type(cmd) is c.Chain and cmd.operation_id is not None for cmd, _ in rejected)  # as bound


def test_columns_of_unequal_length_are_refused_before_anything_is_written(db_url):
    with open_or_create_journal(db_url) as journal:
        service = CommandService(journal)
        runner = Runner(service)
        steps = runner.steps(0)
        before = journal.last_position()
        import msgspec

        short = msgspec.structs.replace(steps, tokens=steps.tokens[:-1])
        with pytest.raises(KvLedgerError) as raised:
            service.execute_steps(short)
        assert raised.value.code.value == "INVALID_ARGUMENT" and "column tokens" in raised.value.message
        assert journal.last_position() == before


def test_a_step_that_names_its_current_base_goes_by_the_lane(backend, tmp_path, request, monkeypatch):
    """A producer that knows a handle's base may name it: the step is decided as the
    chain that names it, and the lane still takes it (the same journal as chains)."""
    def named(service, k):
        bases = {h: (s.generation, s.snapshot_version) for h in HANDLES if (s := service.state(h))}
        return lambda i, row: row.update(base=bases[row["handle_id"]])

    runs = _both(backend, tmp_path, request, monkeypatch, _three_steps(named))
    assert _without_lanes(runs[True]) == _without_lanes(runs[False])
    assert runs[True][3] == 3 * len(HANDLES) and not any(isinstance(o, tuple) for o in runs[True][2])


def test_a_step_refused_beside_a_run_written_whole_keeps_its_answer(db_url):
    """The batch's leading plain steps are written whole, as one run; the last step
    names a base the handle never had and is refused when decided, with nothing else
    to write: every step still has its answer, the refusal in its place."""
    with open_or_create_journal(db_url) as journal:
        service = CommandService(journal, clock=ManualClock().at(5.0))
        runner = Runner(service)
        last = len(HANDLES) - 1
        steps = runner.steps(0, lambda i, row: row.update(base=(0, 99)) if i == last else None)
        results = service.execute_steps(steps)
    assert len(results) == len(HANDLES)
    assert not any(isinstance(r, KvLedgerError) for r in results[:last])
    assert isinstance(results[last], KvLedgerError) and results[last].code.value == "STALE_BASE"


@pytest.mark.parametrize("point", ["before_update", "after_commit"])
def test_a_batch_whose_commit_outcome_was_lost_is_sent_again_and_lands_once(db_url, tmp_path, point):
    """A decode batch's commit fails with its outcome unknown (DATABASE_UNREACHABLE): at
    before_update nothing was written, at after_commit all of it was and only the
    acknowledgement is lost. The service sends the same operations again: every step
    is acknowledged, and each lands once."""
    from kvledger.journal import faults
    from kvledger.replay import verify_journal

    log = tmp_path / "faults.log"
    with open_or_create_journal(db_url) as journal:
        service = CommandService(journal)
        runner, results = Runner(service), []
        faults.configure(f"{point}:raise@2", log=str(log))
        try:
            for k in range(4):
                steps = runner.steps(k)
                results += service.execute_steps(steps)
                runner.advance(steps, results[-len(steps):])
        finally:
            faults.configure(None)
        assert log.read_text().split()[0] == point  # it fired
        assert all(type(r).__name__ == "Receipt" for r in results)
        for h in HANDLES:  # its allocation, prefill start, then publish, emit, start per step
            assert [e.stream_position for e in journal.read_stream(h)] == list(range(1, 2 + 1 + 3 * 4))
        assert verify_journal(journal).ok
