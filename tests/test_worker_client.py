"""What a client asks of a running request through the worker's public API (cancel,
truncate, reorder, repair), between iterations; and the demo's client, a script over
that API alone."""

from __future__ import annotations

import pytest

from kvledger.engine.service import CommandService
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import verify_journal
from kvledger.scenario import Action, Script
from kvledger.worker.loading import load_model
from kvledger.worker.reexec import reexecute
from kvledger.worker.serving import RequestSpec, Worker

from test_worker import _tokens, run_workload


def _worker(model, journal, **kw) -> Worker:
    _, artifact = load_model()
    return Worker(model, service=CommandService(journal), artifact=artifact, capacity=48, **kw)


def _until(w: Worker, handle: str, outputs: int) -> None:
    while handle not in w.live or len(w.live[handle].outputs) < outputs:
        w.step()


def test_cancel_aborts_the_running_call_and_releases_the_handle(model, db_url):
    """Asked between iterations, while the request's next decode call has run: that
    call's append is aborted, not published, and no output comes of it; the handle is
    released. The other request runs to its end; a request not arrived yet is dropped
    with nothing written."""
    with open_or_create_journal(db_url) as j:
        w = _worker(model, j)
        w.submit(RequestSpec(request_id="c", prompt=_tokens(7), max_new_tokens=8))
        w.submit(RequestSpec(request_id="o", prompt=_tokens(5, seed=1), max_new_tokens=8))
        w.submit(RequestSpec(request_id="late", prompt=_tokens(5, seed=2), max_new_tokens=4, arrival_step=50))
        _until(w, "c", 3)
        running = next(r.planned.txn for r in w.ran if r.planned.handle == "c")  # its next decode ran, unpublished
        w.cancel("c")
        w.cancel("late")
        out = w.run()
        assert w.errors == []
        assert len(out["c"]) == 3 and len(out["o"]) == 8 and "late" not in out
        c = [e for e in j.read_all() if e.stream_id == "c"]
        assert [e.event_type for e in c[-3:]] == ["failure", "cancel_request", "release"]
        assert c[-3].payload.outcome == "aborted" and c[-3].payload.txn_id == running
        assert not any(e.event_type == "append_publish" and e.payload.txn_id == running for e in c)
        assert sum(e.event_type == "output_emit" for e in c) == 3
        assert not any(e.stream_id == "late" for e in j.read_all())
        assert "c" not in w.store.slot  # released
        assert verify_journal(j).findings == []


def test_truncate_rolls_back_and_decodes_the_same_greedy_tokens_again(model, db_url, tmp_path):
    """A truncate to two outputs after five: the running call is aborted, the journal
    cuts the rows and outputs past the cut, decoding goes on from the second output
    and (greedy) chooses what it chose before; its rows re-execute bit for bit."""
    spec = RequestSpec(request_id="t", prompt=_tokens(9, seed=3), max_new_tokens=8)
    plain, _ = run_workload(f"sqlite:///{tmp_path}/plain.db", [spec], model)
    with open_or_create_journal(db_url) as j:
        w = _worker(model, j)
        w.submit(spec)
        _until(w, "t", 5)
        w.truncate("t", 9 + 1)  # keep the prompt and the first output's row: the second is the frontier
        out = w.run()
        assert w.errors == [] and out == plain
        events = list(j.read_all())
        [cut] = [e for e in events if e.event_type == "truncate"]
        assert (cut.payload.new_length, cut.payload.output_count) == (10, 2)
        before = events[events.index(cut) - 1]
        assert before.event_type == "failure" and before.payload.outcome == "aborted"
        assert verify_journal(j).findings == []
    r = reexecute(model, events, capacity=48)
    assert r.mismatches == [] and not r.skipped


def test_client_asks_that_cannot_be_met_are_refused_at_once(model, tmp_path):
    with open_or_create_journal(f"sqlite:///{tmp_path}/j.db") as j:
        w = _worker(model, j)
        w.submit(RequestSpec(request_id="r", prompt=_tokens(6), max_new_tokens=4))
        with pytest.raises(ValueError, match="not running"):
            w.truncate("r", 6)  # not arrived yet
        _until(w, "r", 2)
        with pytest.raises(ValueError, match="prompt rows"):
            w.truncate("r", 5)  # into the prompt
        with pytest.raises(ValueError, match="at most 7 rows"):
            w.truncate("r", 8)  # past the newest output
        with pytest.raises(ValueError, match="not a permutation"):
            w.reorder(("r", "r.1"), (0, 0))
        with pytest.raises(ValueError, match="distinct"):
            w.reorder(("r", "r"), (1, 0))
        w.run()
        with pytest.raises(ValueError, match="not running"):
            w.truncate("r", 6)  # finished
        assert w.errors == [] and verify_journal(j).findings == []


def test_a_script_only_uses_the_workers_public_api(model, tmp_path):
    """Every action of the demo's script on one run: cancel, truncate, repair, reorder
    and an injected decode failure; the journal holds each, verifies, re-executes."""
    specs = [RequestSpec(request_id=f"s{i}", prompt=_tokens(6 + i, seed=i), max_new_tokens=6,
                         n=2 if i == 3 else 1, temperature=0.8 if i == 3 else 0.0) for i in range(5)]
    script = Script((Action("s0", "cancel", after=2), Action("s1", "truncate", after=4, rows=2),
                     Action("s2", "repair"), Action("s3", "reorder", after=2, permutation=(1, 0)),
                     Action("s4", "fault", after=1)))
    out, events = run_workload(f"sqlite:///{tmp_path}/s.db", specs, model, script=script)
    types = {e.event_type for e in events}
    assert {"cancel_request", "truncate", "reorder", "failure"} <= types
    assert any(e.event_type == "append_start" and e.payload.kind == "repair" and e.stream_id == "s2"
               for e in events)
    assert len(out["s0"]) == 2 and all(len(out[h]) == 6 for h in ("s1", "s2", "s3", "s3.1", "s4"))
    assert not model._forward_hooks  # the injected fault's hook is gone
    r = reexecute(model, events, capacity=64)
    assert r.mismatches == [] and not r.skipped
