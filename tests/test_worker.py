"""The torch worker under journal events: parity, staging, determinism, lifecycle paths."""

from __future__ import annotations

import random
from contextlib import nullcontext

import msgspec
import pytest
import torch

from kvledger import Ledger
from kvledger.demo import demo_workload
from kvledger.engine.remote import command_service
from kvledger.engine.service import CommandService
from kvledger.migrations.storage import open_or_create_journal
from kvledger.scenario import Action, Script
from kvledger.worker.executor import Member, run_call, shape_of
from kvledger.worker.kvstore import KVStore
from kvledger.worker.loading import load_model
from kvledger.worker.model import DEFAULT_CONFIG
from kvledger.worker.reexec import reexecute
from kvledger.worker.serving import RequestSpec, Worker


def _tokens(n, seed=0):
    rng = random.Random(seed)
    return tuple(rng.randrange(DEFAULT_CONFIG.vocab_size) for _ in range(n))


def test_cached_decode_matches_full_forward(model):
    """Prefill + 32 decode steps through the K/V store equal a full forward (fp32, 1e-4)."""
    store = KVStore(model.cfg, slots=2, capacity=128)
    store.open("h", 128)
    seq = list(_tokens(12))
    logits = run_call(model, store, [Member("h", 0, tuple(seq))], shape_of([Member("h", 0, tuple(seq))]))
    store.commit("h", len(seq))
    worst = 0.0
    for _ in range(32):
        with torch.inference_mode():
            full = model(torch.tensor([seq]), torch.arange(len(seq))[None], logits_rows="last")[0, -1]
        worst = max(worst, (logits[0, -1] - full).abs().max().item())
        tok = int(logits[0, -1].argmax())
        m = Member("h", len(seq), (tok,))
        logits = run_call(model, store, [m], shape_of([m]))
        seq.append(tok)
        store.commit("h", len(seq))
    assert worst < 1e-4


def test_whole_prefill_equals_chunked_prefill(model):
    prompt = _tokens(40, seed=1)
    whole, chunked = (KVStore(model.cfg, slots=1, capacity=64) for _ in range(2))
    whole.open("h", 64)
    chunked.open("h", 64)
    m = Member("h", 0, prompt)
    a = run_call(model, whole, [m], shape_of([m]))
    whole.commit("h", 40)
    past = 0
    for n in (13, 7, 20):
        m = Member("h", past, prompt[past:past + n])
        b = run_call(model, chunked, [m], shape_of([m]))
        past += n
        chunked.commit("h", past)
    assert (a[0, -1] - b[0, -1]).abs().max().item() < 1e-4
    for x, y in zip(whole.read("h"), chunked.read("h")):
        assert x.shape == y.shape == (model.cfg.num_layers, model.cfg.num_kv_heads, 40, model.cfg.head_dim)
        assert (x - y).abs().max().item() < 1e-4


def test_ragged_batch_equals_each_alone(model):
    members = [Member(f"h{i}", 0, _tokens(n, seed=i)) for i, n in enumerate((5, 17, 9))]
    batch = KVStore(model.cfg, slots=3, capacity=32)
    for m in members:
        batch.open(m.handle_id, 32)
    together = run_call(model, batch, members, shape_of(members))
    for b, m in enumerate(members):
        alone = KVStore(model.cfg, slots=1, capacity=32)
        alone.open(m.handle_id, 32)
        single = run_call(model, alone, [m], shape_of([m]))
        assert (together[b, -1] - single[0, -1]).abs().max().item() < 1e-4


def test_consecutive_slots_read_as_a_view_give_the_same_bits_as_a_gather(model):
    """A batch in consecutive slots attends over a view of the slab, one in scattered
    slots over a gathered copy: re-execution may land a batch in either, so the two must
    agree bit for bit (ragged prefill, then decode steps)."""
    members = [Member(f"h{i}", 0, _tokens(n, seed=i)) for i, n in enumerate((5, 17, 9, 12))]
    stores = {}
    for layout, order in (("view", (0, 1, 2, 3)), ("gather", (3, 0, 2, 1))):
        store = KVStore(model.cfg, slots=8, capacity=48)
        for i in order:  # slots are handed out in opening order
            if layout == "gather":
                store.open(f"spacer{i}", 48)
            store.open(members[i].handle_id, 48)
        stores[layout] = store
    view_slots = [stores["view"].slot[m.handle_id] for m in members]
    gather_slots = [stores["gather"].slot[m.handle_id] for m in members]
    assert view_slots == list(range(view_slots[0], view_slots[0] + 4))
    assert gather_slots != sorted(gather_slots) and len(set(gather_slots)) == 4
    batch = {k: list(members) for k in stores}
    for step in range(4):
        out = {k: run_call(model, s, batch[k], shape_of(batch[k])) for k, s in stores.items()}
        assert torch.equal(out["view"], out["gather"]), step
        for k, s in stores.items():
            nxt = []
            for b, m in enumerate(batch[k]):
                end = m.past + len(m.token_ids)
                s.commit(m.handle_id, end)
                nxt.append(Member(m.handle_id, end, (int(out[k][b, -1].argmax()),)))
            batch[k] = nxt
    for m in members:
        for x, y in zip(stores["view"].read(m.handle_id), stores["gather"].read(m.handle_id)):
            assert torch.equal(x, y)


def test_row_digests_are_sha256_of_each_layers_k_then_v_rows(model):
    """What a publication records per layer: sha256 over the layer's new K rows then V
    rows, [H_kv, n, d_h] as stored. The batched decode path (one gather for every
    single-row span) and the per-span path must both say exactly that."""
    import hashlib

    store = KVStore(model.cfg, slots=8, capacity=32)
    g = torch.Generator().manual_seed(7)
    store.k.copy_(torch.randn(store.k.shape, generator=g))
    store.v.copy_(torch.randn(store.v.shape, generator=g))
    for i in (3, 0, 5, 1):  # scattered slots
        store.open(f"h{i}", 32)
    spans = [("h3", 7, 1), ("h0", 0, 1), ("h5", 20, 3), ("h1", 31, 1)]
    got = store.rows_sha256_many(spans)
    for (h, start, n), digests in zip(spans, got):
        s = store.slot[h]
        want = [hashlib.sha256(store.k[layer, s, :, start:start + n].contiguous().numpy().tobytes()
                               + store.v[layer, s, :, start:start + n].contiguous().numpy().tobytes()).hexdigest()
                for layer in range(model.cfg.num_layers)]
        assert digests == want, h
        assert store.rows_sha256(h, start, n) == want


def test_staged_rows_are_invisible_and_a_stale_publication_changes_nothing(model, tmp_path):
    ledger = Ledger.open(f"sqlite:///{tmp_path}/j.db")
    other = Ledger.open(f"sqlite:///{tmp_path}/j.db")  # a second writer on the same journal
    _, artifact = load_model()
    worker = Worker(model, service=ledger.service, artifact=artifact, capacity=64)
    worker.submit(RequestSpec(request_id="r", prompt=_tokens(8), max_new_tokens=4))
    worker.step()  # allocate + start prefill; the call ran and staged 8 rows
    store = worker.store
    assert store.committed["r"] == 0 and store.pending["r"] == 8
    k, v = store.read("r")
    assert k.shape[2] == 0 and ledger.state("r").committed_length == 0  # nothing visible yet
    worker.step()  # prefill publishes; the first output's decode is started and staged
    assert store.committed["r"] == 8 and ledger.state("r").committed_length == 8
    assert store.pending["r"] == 9  # staged, not visible: a reader sees 8 rows
    before_k, before_v = store.read("r")
    assert before_k.shape[2] == 8
    # another writer moves the head, so the in-flight decode's publication is stale
    s = other.state("r")
    other.truncate("r", base=(s.generation, s.snapshot_version), new_length=8)
    worker.step()  # publish rejected as stale: its staged rows are discarded
    assert store.committed["r"] == 8 and store.pending["r"] == 8
    after_k, after_v = store.read("r")
    assert torch.equal(before_k, after_k) and torch.equal(before_v, after_v)
    assert any("STALE_BASE" in e for e in worker.errors)
    ledger.close()
    other.close()


def run_workload(url, specs, model, *, journal_on=True, pipeline=None, writer="thread", script=None):
    """Serve `specs` to the end, `script` playing its client actions."""
    _, artifact = load_model()
    capacity = max(len(s.prompt) for s in specs) + max(s.max_new_tokens for s in specs) + 1
    with open_or_create_journal(url) as j:
        with command_service(j, writer=writer) if journal_on else nullcontext() as service:
            w = Worker(model, service=service, artifact=artifact, capacity=capacity, pipeline=pipeline)
            for s in specs:
                w.submit(s)
            out = (script or Script()).play(w)
        assert w.errors == []
        events = list(j.read_all())
    return out, events


def test_demo_journal_reexecutes_bit_for_bit(model, db_url):
    specs, script = demo_workload(16, 8, seed=3, vocab=model.cfg.vocab_size)
    out, events = run_workload(db_url, specs, model, script=script)
    kinds = {e.payload.kind for e in events if e.event_type == "append_start"}
    assert kinds == {"prefill", "chunk", "decode", "repair", "verify"}
    assert {e.event_type for e in events} >= {"fork", "truncate", "reorder", "failure", "cancel_request",
                                              "finish", "release"}
    r = reexecute(model, events, capacity=256)
    assert r.verified_rows > 500 and r.mismatches == [] and not r.skipped
    published = sum(e.payload.accepted_count for e in events if e.event_type == "append_publish")
    assert r.verified_rows == published


def test_reexecution_uses_the_recorded_thread_count(model, tmp_path):
    """CPU BLAS splits reductions by thread count, so 1 and 2 threads give different
    bits: each call records its count (ForwardCall.threads) and re-execution runs with
    it, whatever the re-executing process has set. Without the record it would not
    reproduce (the second half shows the test can fail)."""
    specs, script = demo_workload(8, 6, seed=4, vocab=model.cfg.vocab_size)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, events = run_workload(f"sqlite:///{tmp_path}/t.db", specs, model, script=script)
        torch.set_num_threads(2)
        r = reexecute(model, events, capacity=256)
        assert r.verified_rows > 100 and r.mismatches == []
        assert torch.get_num_threads() == 2  # restored afterwards
        calls = [e.payload.call for e in events if e.event_type == "append_start" and e.payload.call]
        assert calls and {c.threads for c in calls} == {1}
        unrecorded = [msgspec.structs.replace(e, payload=msgspec.structs.replace(
            e.payload, call=msgspec.structs.replace(e.payload.call, threads=0)))
            if e.event_type == "append_start" and e.payload.call else e for e in events]
        assert reexecute(model, unrecorded, capacity=256).mismatches != []
    finally:
        torch.set_num_threads(threads)


def test_paths_keep_greedy_outputs(model, tmp_path):
    """Speculation, truncate-and-redo, repair and journaling itself change no greedy output."""
    prompts = [_tokens(n, seed=10 + n) for n in (6, 11, 30)]
    plain = [RequestSpec(request_id=f"p{i}", prompt=p, max_new_tokens=12) for i, p in enumerate(prompts)]
    variants = [RequestSpec(request_id=f"p{i}", prompt=p, max_new_tokens=12, speculate=3 if i == 0 else 0)
                for i, p in enumerate(prompts)]
    script = Script((Action("p1", "truncate", after=5), Action("p2", "repair")))
    a, _ = run_workload(f"sqlite:///{tmp_path}/a.db", plain, model)
    b, events = run_workload(f"sqlite:///{tmp_path}/b.db", variants, model, script=script)
    c, _ = run_workload(f"sqlite:///{tmp_path}/c.db", plain, model, journal_on=False)
    assert a == b == c
    verify = [e for e in events if e.event_type == "append_publish" and e.payload.accepted_count > 1
              and e.stream_id == "p0"]
    assert verify, "speculation never accepted more than the anchor draft"
    repair = [e for e in events if e.event_type == "append_start" and e.payload.kind == "repair"]
    assert len(repair) == 1
    finish = next(e for e in events if e.event_type == "finish" and e.stream_id == "p2")
    publish = next(e for e in events if e.event_type == "append_publish" and e.payload.txn_id ==
                   repair[0].payload.txn_id)
    assert publish.payload.committed_length == finish.payload.committed_length + 1
    assert not publish.payload.logits_ready


def test_fork_gives_two_sampled_branches(model, tmp_path):
    spec = RequestSpec(request_id="f", prompt=_tokens(9), max_new_tokens=10, n=2, temperature=1.0, seed=5)
    out, events = run_workload(f"sqlite:///{tmp_path}/f.db", [spec], model)
    assert set(out) == {"f", "f.1"} and len(out["f"]) == len(out["f.1"]) == 10
    assert out["f"] != out["f.1"]
    fork = next(e for e in events if e.event_type == "fork")
    assert fork.stream_id == "f.1" and fork.payload.prefix_length == 9


def test_pipelined_commits_give_the_same_outputs_and_rows(model, tmp_path):
    """The loop that overlaps each commit with the next model call (the default on a GPU)
    journals the same outputs, and its rows re-execute bit for bit."""
    specs, script = demo_workload(12, 8, seed=5, vocab=model.cfg.vocab_size)
    sync, _ = run_workload(f"sqlite:///{tmp_path}/s.db", specs, model, pipeline=False, script=script)
    piped, events = run_workload(f"sqlite:///{tmp_path}/p.db", specs, model, pipeline=True, script=script)
    greedy = {s.request_id for s in specs if s.temperature == 0}
    assert {h: o for h, o in piped.items() if h in greedy} == {h: o for h, o in sync.items() if h in greedy}
    r = reexecute(model, events, capacity=256)
    assert r.verified_rows > 0 and r.mismatches == []


def test_a_writer_process_journals_the_same_run(model, db_url, tmp_path):
    """Commands decided and committed by a writer process (overlapped with the model
    call) journal the same greedy outputs as the in-process service, on both backends; the journal verifies
    clean and its rows re-execute bit for bit."""
    from kvledger.replay import verify_journal

    specs, script = demo_workload(12, 8, seed=6, vocab=model.cfg.vocab_size)
    here, _ = run_workload(f"sqlite:///{tmp_path}/t.db", specs, model, script=script)
    there, events = run_workload(db_url, specs, model, pipeline=True, writer="process", script=script)
    greedy = {s.request_id for s in specs if s.temperature == 0}
    assert {h: o for h, o in there.items() if h in greedy} == {h: o for h, o in here.items() if h in greedy}
    r = reexecute(model, events, capacity=256)
    assert r.verified_rows > 0 and r.mismatches == []
    with open_or_create_journal(db_url) as j:
        assert verify_journal(j).findings == []


def test_a_failing_model_call_still_waits_for_its_overlapped_commit(model, tmp_path):
    """The commit of an iteration runs while its model call does. If the call raises
    something the worker does not handle (a bug, not a device error), the commit is still
    awaited and applied: the journal holds what was acknowledged, its writer lock is free
    (another thread appends), and verify is clean."""
    import threading

    from kvledger.engine import commands as c
    from kvledger.replay import verify_journal

    from factories import make_manifest

    url = f"sqlite:///{tmp_path}/f.db"
    _, artifact = load_model()
    with open_or_create_journal(url) as j:
        w = Worker(model, service=CommandService(j), artifact=artifact, capacity=32, pipeline=True)
        w.submit(RequestSpec(request_id="f", prompt=_tokens(6), max_new_tokens=4))
        w.step()  # allocate + prefill start, then the prefill call
        real_run = w._run

        def broken(call_id, members):
            raise ValueError("model call failed")

        w._run = broken
        with pytest.raises(ValueError, match="model call failed"):
            w.step()  # publishes the prefill, emits, starts the decode: committed meanwhile
        w._run = real_run
        s = w.service.state("f")
        assert s.committed_length == 6 and len(s.outputs) == 1 and len(s.open_txns) == 1
        assert w.store.committed["f"] == 6  # the publication's rows were applied
        done = []
        other = c.Allocate(handle_id="other", manifest=make_manifest(request_id="other"), reserved_capacity=8)
        t = threading.Thread(target=lambda: done.append(CommandService(j).execute(other)))
        t.start()
        t.join(10)
        assert done and done[0].first_global_position > 0  # the writer lock was released
        assert verify_journal(j).findings == []


def test_chains_carry_publish_emit_and_start_in_one_operation(model, tmp_path):
    spec = RequestSpec(request_id="c", prompt=_tokens(7), max_new_tokens=6)
    _, events = run_workload(f"sqlite:///{tmp_path}/c.db", [spec], model)
    by_op: dict[str, list[str]] = {}
    for e in events:
        by_op.setdefault(e.operation_id, []).append(e.event_type)
    assert ["append_publish", "output_emit", "append_start"] in by_op.values()
    with open_or_create_journal(f"sqlite:///{tmp_path}/c.db") as j:
        for op, types in by_op.items():
            receipt = j.receipt(op)
            assert receipt is not None and len(receipt.event_ids) == len(types)


def test_plain_decode_steps_go_to_the_service_as_one_decode_batch(model, tmp_path):
    """Each iteration's plain decode steps reach the service as one DecodeBatch
    (submit_batch), built by the worker, every plain step of the journal among them; the
    same run with each batch's steps sent as their chains (the general path) journals the
    same outputs and the same operations, event type for event type."""
    from kvledger.engine.service import BatchSurface

    specs = [RequestSpec(request_id=f"b{i}", prompt=_tokens(5 + i, seed=i), max_new_tokens=6 + i, arrival_step=i)
             for i in range(4)]
    _, artifact = load_model()
    class Watched(CommandService):
        """Counts the steps of each batch; with `as_chains`, sends them as chains."""

        def submit_batch(self, steps, cmds, *, defer=True):
            self.sizes.append(len(steps))
            if self.as_chains:
                return BatchSurface.submit_batch(self, steps, cmds, defer=defer)
            return super().submit_batch(steps, cmds, defer=defer)

    runs = []
    for as_chains in (False, True):
        with open_or_create_journal(f"sqlite:///{tmp_path}/{as_chains}.db") as j:
            service = Watched(j)
            service.sizes, service.as_chains = [], as_chains
            w = Worker(model, service=service, artifact=artifact, capacity=32)
            for spec in specs:
                w.submit(spec)
            out = Script().play(w)
            assert w.errors == []
            events = list(j.read_all())
        by_op: dict[str, list[str]] = {}
        for e in events:
            by_op.setdefault(e.operation_id, []).append(e.event_type)
        runs.append((out, list(by_op.values()), service.sizes))
    (out, ops, sizes), (out_chains, ops_chains, sizes_chains) = runs
    assert out == out_chains and ops == ops_chains and sizes == sizes_chains
    plain = sum(types == ["append_publish", "output_emit", "append_start"] for types in ops)
    assert sum(sizes) == plain == sum(s.max_new_tokens - 1 for s in specs)  # the last token finishes instead
    assert max(sizes) == len(specs)  # the running sequences' steps in one batch


def test_the_first_worker_freezes_the_heap_it_starts_with_and_later_ones_do_not(tmp_path):
    """The first Worker made in a process freezes every object alive (freeze_heap): a
    full collection during serving then leaves the model's and the libraries' objects
    alone. A later worker freezes nothing more. A fresh process: the flag is per
    process."""
    import subprocess
    import sys

    script = f"""
import gc
from kvledger.engine.service import CommandService
from kvledger.migrations.storage import open_or_create_journal
from kvledger.worker.loading import load_model
from kvledger.worker.serving import RequestSpec, Worker
model, artifact = load_model()
kept = [[i] for i in range(1000)]  # alive, tracked, made before the first run
before = gc.get_freeze_count()
with open_or_create_journal("sqlite:///{tmp_path}/j.db") as j:
    for n in range(2):
        more = [[i] for i in range(5000 * n)]  # made between the runs: stays collectable
        w = Worker(model, service=CommandService(j), artifact=artifact, capacity=32)
        w.submit(RequestSpec(request_id=f"r{{n}}", prompt=(1, 2, 3), max_new_tokens=2))
        w.run()
        print(gc.get_freeze_count())
print(before)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second, last = done.stdout.split("\n")[:3]
    assert int(last) == 0  # nothing was frozen before the first worker
    assert int(first) > 1000  # the first worker froze what was alive, the kept lists among it
    # the second worker froze nothing more: the 5,000 lists made before it stay collectable
    # (the count of frozen objects moves by a few as some of them go)
    assert abs(int(second) - int(first)) < 1000, (first, second)
