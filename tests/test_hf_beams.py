"""Beams (and n > 1 samples) whose prefill rows a batched CPU kernel computed in other bits
than the first beam's: transformers runs the expanded prompt as one batch, and on some
batch sizes the attention/matmul kernels give row k other bytes than row 0. Each expanded
row is journaled as a fork of the first as far as its rows are the first's bytes, and the
rest of its prompt as its own append of that call and batch row, digested from what it
holds: plain generate's ids, a clean verify and re-execution proof, one request with its
forks. Before, the adapter refused mid-run (DIGEST_MISMATCH: not a fork)."""

from __future__ import annotations

import hashlib
import json
import warnings

import msgspec
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402 - after the importorskip
from hypothesis import strategies as st  # noqa: E402
from test_hf import COMMON, kvledger, left_padded, tiny  # noqa: E402

from kvledger import Ledger  # noqa: E402
from kvledger.adapters.hf_reexec import reexecute_hf  # noqa: E402
from kvledger.hf import journaled_generate  # noqa: E402
from kvledger.replay import verify_journal  # noqa: E402
from kvledger.schemas import events as ev  # noqa: E402
from kvledger.schemas.canonical import layers_sha256  # noqa: E402

MODEL = tiny("llama", seed=8)
WIDE = ("--window-ms", "1000000", "--slo-ttft-ms", "100000", "--slo-tbt-ms", "100000")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        MODEL.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def loaded(model_dir):
    """MODEL as the command line loads it: the proof's model. Its weights (mapped from the
    file) sit otherwise in memory than MODEL's, which moves some kernels' bits."""
    from kvledger.cmd_hf import load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load(str(model_dir))


def journaled(model, url: str, ids: torch.Tensor, mask: torch.Tensor | None, **kw) -> tuple[torch.Tensor, list]:
    """journaled_generate's ids, and the K/V rows of its first call (the prefill) as the
    cache held them when that call returned: per layer (keys, values) [B, H_kv, T, d_h]."""
    first: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(module, args, kwargs, output):
        if not first:
            first.extend((layer.keys.clone(), layer.values.clone()) for layer in kwargs["cache"].layers)

    hook = model.register_forward_hook(keep, with_kwargs=True)
    try:
        out = journaled_generate(model, ids, attention_mask=mask, ledger=url, **kw)
    finally:
        hook.remove()
    return out, first


def same_columns(layers, row: int, other: int, start: int, count: int) -> int:
    """The first column of [start, start+count) where the two rows' bytes differ in some
    layer's K or V, counted from start (count if none)."""
    for col in range(count):
        for k, v in layers:
            for t in (k, v):
                a, b = t[row, :, start + col].contiguous(), t[other, :, start + col].contiguous()
                if a.view(torch.uint8).tolist() != b.view(torch.uint8).tolist():
                    return col
    return count


def rows_digest(layers, row: int, start: int, count: int) -> str:
    """What kvledger records for rows [start, start+count) of a batch row: per layer,
    SHA-256 of its K bytes then its V bytes ([H_kv, n, d_h]); combined over the layers."""
    per_layer = []
    for k, v in layers:
        h = hashlib.sha256(k[row, :, start:start + count].contiguous().view(torch.uint8).numpy().tobytes())
        h.update(v[row, :, start:start + count].contiguous().view(torch.uint8).numpy().tobytes())
        per_layer.append(h.hexdigest())
    return layers_sha256(per_layer)


def events_of(url: str) -> list[ev.Event]:
    with Ledger.open(url) as ledger:
        assert verify_journal(ledger.journal).ok
        return list(ledger.journal.read_all())


# (prompt, generate's arguments, forks): the prompts' prefill rows diverge on this CPU at
# the batch size of the expansion (batches of 2 and 3; 4 and 5 happen to agree)
CASES = {
    "beams2_first_row_differs": ([0, 0, 1], {"num_beams": 2, "max_new_tokens": 1}, 1),  # 2 pad columns
    "beams2_second_row_differs": ([5, 6, 7], {"num_beams": 2, "max_new_tokens": 1}, 1),
    "beams3": ([7, 7], {"num_beams": 3, "max_new_tokens": 1}, 2),
    "sampled3": ([5, 6, 7], {"do_sample": True, "num_return_sequences": 3, "max_new_tokens": 4, "seed": 3}, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_diverging_beams_are_forks_as_far_as_their_rows_agree(case, loaded, model_dir, tmp_path, capsys):
    prompt, kw, n_forks = CASES[case]
    kw = dict(kw)
    ids = torch.tensor([prompt])
    seed = kw.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    ref = loaded.generate(ids, **kw)
    url = f"sqlite:///{tmp_path}/j.db"
    out, first = journaled(loaded, url, ids, None, seed=seed, **kw)
    assert torch.equal(out, ref)  # the same tokens as plain generate

    events = events_of(url)
    [root] = [e for e in events if isinstance(e, ev.RequestAllocateEvent)]
    n = len(root.payload.manifest.input_identity.prompt_token_ids)
    pad = ids.shape[1] - n
    [prefill] = [e for e in events if isinstance(e, ev.AppendStartEvent) and e.stream_id == root.stream_id
                 and e.payload.kind == "prefill"]
    starts = {e.payload.txn_id: e for e in events if isinstance(e, ev.AppendStartEvent)}
    publishes = {e.payload.txn_id: e for e in events if isinstance(e, ev.AppendPublishEvent)}
    expansion = len(first[0][0])
    diverged = 0
    for k in range(1, expansion):
        agree = same_columns(first, 0, k, pad, n)  # what beam k holds as beam 0's bytes
        diverged += agree < n
        child = f"{root.stream_id}.b{k}"
        [fork] = [e for e in events if isinstance(e, ev.ForkEvent) and e.stream_id == child]
        assert (fork.payload.parent_handle_id, fork.payload.prefix_length) == (root.stream_id, agree)
        own = [e for e in starts.values() if e.stream_id == child and e.payload.kind in ("prefill", "chunk")]
        if agree == n:
            assert own == []
            continue
        [rest] = own
        p = rest.payload
        assert (p.kind, p.interval_start, p.interval_count) == ("chunk" if agree else "prefill", agree, n - agree)
        assert p.token_ids == tuple(prompt[pad + agree:])
        # the call it ran in: the prefill's, at its own batch row
        assert p.call == msgspec.structs.replace(prefill.payload.call, index=k)
        # what beam k really holds from there on, as the cache held it after the call
        assert publishes[p.txn_id].payload.rows_sha256 == rows_digest(first, k, pad + agree, n - agree)
    if not diverged:
        pytest.skip("this CPU computed every expanded prefill row in beam 0's bits: nothing diverged")

    assert kvledger(capsys, "verify", "--db", url).returncode == 0
    proof = kvledger(capsys, "verify", "--db", url, "--reexecute", "--runtime", "hf", "--model", str(model_dir),
                     "--json")
    assert proof.returncode == 0, proof.stdout + proof.stderr
    re = json.loads(proof.stdout)["reexecution"]
    assert re["mismatches"] == [] and re["not_reexecuted"] == []
    assert re["verified_rows"] == sum(e.payload.accepted_count for e in publishes.values())

    done = kvledger(capsys, "replay", "--db", url, "--json", *WIDE)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [r["handle_id"] for r in doc["requests"]] == [root.stream_id]
    assert doc["window"]["completed"] == 1
    assert [f["fork_of"] for f in doc["forks"]] == [root.stream_id] * n_forks
    assert doc["requests"][0]["forks"] == n_forks


def test_a_fork_claimed_past_the_rows_beam_0_shares_is_a_mismatch(tmp_path):
    """The proof runs a diverged beam's prompt again in its call: the rows before its own
    append must come out as those its fork holds. A journal whose fork claims one row
    more of beam 0's than beam 1 holds, with the true digest of beam 1's remaining row,
    is a mismatch of that publication (it is not, if only the append's rows are checked)."""
    url = f"sqlite:///{tmp_path}/j.db"
    ids = torch.tensor([[5, 6, 7]])
    _, first = journaled(MODEL, url, ids, None, num_beams=2, max_new_tokens=1)
    agree = same_columns(first, 0, 1, 0, 3)
    if agree != 1:
        pytest.skip(f"beam 1 agrees with beam 0 on {agree} rows on this CPU, not 1")
    events = events_of(url)
    assert reexecute_hf(MODEL, events).mismatches == []
    child = next(e.stream_id for e in events if isinstance(e, ev.ForkEvent))
    i_fork = next(i for i, e in enumerate(events) if isinstance(e, ev.ForkEvent))
    i_start = next(i for i, e in enumerate(events) if isinstance(e, ev.AppendStartEvent) and e.stream_id == child)
    i_pub = next(i for i, e in enumerate(events) if isinstance(e, ev.AppendPublishEvent) and e.stream_id == child)
    edit = msgspec.structs.replace

    def payload(i, **changes):
        events[i] = edit(events[i], payload=edit(events[i].payload, **changes))

    payload(i_fork, prefix_length=2)
    payload(i_start, interval_start=2, interval_count=1, token_ids=(7,), cache_positions=(2,), mask_key_extent=3)
    payload(i_pub, accepted_count=1, rows_sha256=rows_digest(first, 1, 2, 1))
    r = reexecute_hf(MODEL, events)
    assert [(m.handle_id, m.global_position) for m in r.mismatches] == [(child, events[i_pub].global_position)]
    assert "differ from the rows the handle holds" in r.mismatches[0].recomputed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.lists(st.integers(0, COMMON["vocab_size"] - 1), min_size=1, max_size=4),
                        min_size=1, max_size=2),
       mode=st.sampled_from([{"num_beams": 2}, {"num_beams": 3}, {"num_beams": 2, "num_return_sequences": 2},
                             {"do_sample": True, "num_return_sequences": 2},
                             {"do_sample": True, "num_return_sequences": 3}]),
       new=st.integers(1, 3))
def test_any_prompt_expanded_is_journaled_and_proven(prompts, mode, new, tmp_path_factory):
    """Prompts (left-padded, pad ids inside them too) expanded by beams or n samples: plain
    generate's ids, a clean verify, a clean re-execution proof over every publication,
    and one request per prompt with every other handle a fork of it."""
    ids, mask = left_padded(prompts)
    kw = {"max_new_tokens": new, **mode}
    torch.manual_seed(5)
    ref = MODEL.generate(ids, attention_mask=mask, **kw)
    url = f"sqlite:///{tmp_path_factory.mktemp('j')}/j.db"
    out = journaled_generate(MODEL, ids, attention_mask=mask, ledger=url, seed=5, **kw)
    assert torch.equal(out, ref)
    events = events_of(url)
    r = reexecute_hf(MODEL, events)
    assert r.mismatches == [] and r.unrunnable == {} and r.skipped == set()
    assert r.verified_rows == sum(e.payload.accepted_count for e in events if isinstance(e, ev.AppendPublishEvent))
    roots = [e.stream_id for e in events if isinstance(e, ev.RequestAllocateEvent)]
    forks = [e for e in events if isinstance(e, ev.ForkEvent)]
    expand = max(mode.get("num_beams", 1), mode.get("num_return_sequences", 1))
    assert len(roots) == len(prompts) and len(forks) >= len(prompts) * (expand - 1)
