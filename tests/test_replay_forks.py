"""Replay's service metrics count requests: a request is a handle its request_allocate
made (the root of a fork tree); its forks (beams, n > 1 samples, a beam taken twice)
are reported apart, each naming its request, with their own window figures, in the text
output and in --json. One prompt with 4 beams is one completed request, not 30."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import kvledger, left_padded, tiny  # noqa: E402 - after the importorskip

from kvledger.hf import journaled_generate  # noqa: E402
from kvledger.replay import WindowSpec, replay_jsonl  # noqa: E402
from kvledger.replay.metrics import fork_roots  # noqa: E402

WIDE = ("--window-ms", "1000000", "--slo-ttft-ms", "100000", "--slo-tbt-ms", "100000")


def generate(tmp_path, prompts, **kw) -> str:
    url = f"sqlite:///{tmp_path}/j.db"
    ids, mask = left_padded(prompts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        journaled_generate(tiny("llama", seed=2), ids, ledger=url, attention_mask=mask, **kw)
    return url


@pytest.mark.parametrize("case", ["beams", "beams_batch", "sampled_n", "plain_batch"])
def test_forks_are_reported_apart_from_requests(case, tmp_path, capsys):
    prompts = {"beams": [[5, 6, 7]], "beams_batch": [[5, 6, 7], [9, 10, 11, 12]],
               "sampled_n": [[5, 6, 7]], "plain_batch": [[5, 6, 7], [9, 10]]}[case]
    kw = {"beams": {"num_beams": 4, "max_new_tokens": 12},
          "beams_batch": {"num_beams": 4, "num_return_sequences": 2, "max_new_tokens": 8},
          "sampled_n": {"do_sample": True, "num_return_sequences": 4, "max_new_tokens": 6, "seed": 4},
          "plain_batch": {"max_new_tokens": 5}}[case]
    url = generate(tmp_path, prompts, **kw)
    done = kvledger(capsys, "replay", "--db", url, "--json", *WIDE)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    handles = doc["handles"]
    roots = [h["handle_id"] for h in handles if h["parent_handle_id"] is None]
    assert len(roots) == len(prompts)
    requests, window = doc["requests"], doc["window"]
    assert [r["handle_id"] for r in requests] == roots
    assert window["completed"] == window["slo_valid"] == len(prompts)  # every prompt's request finished
    if case == "plain_batch":
        assert "forks" not in doc and "fork_window" not in doc
        assert all("fork_of" not in r and "forks" not in r for r in requests)
        return
    forks = doc["forks"]
    assert len(roots) + len(forks) == len(handles) > len(roots)
    by_id = {h["handle_id"]: h for h in handles}
    for f in forks:  # each fork names its request: the root its parents lead to
        h = by_id[f["handle_id"]]
        while h["parent_handle_id"] is not None:
            h = by_id[h["parent_handle_id"]]
        assert f["fork_of"] == h["handle_id"]
    assert {r["handle_id"]: r["forks"] for r in requests} == {
        root: sum(f["fork_of"] == root for f in forks) for root in roots}
    assert doc["fork_window"]["completed"] == sum(f["outcome"] == "finished" for f in forks) == len(forks)
    # the token goodput of each: requests' own outputs, forks' own outputs
    assert window["slo_valid_tokens"] == sum(r["outputs"] for r in requests)
    assert doc["fork_window"]["slo_valid_tokens"] == sum(f["outputs"] for f in forks)
    text = kvledger(capsys, "replay", "--db", url, *WIDE)
    assert text.returncode == 0, text.stderr
    assert f"completed {len(prompts)}, SLO-valid {len(prompts)};" in text.stdout
    assert f"forks: {len(forks)} of {len(prompts)} requests, counted apart: completed {len(forks)}," in text.stdout


def test_a_fork_of_a_fork_belongs_to_the_first_request():
    """fork_roots follows parents to the root, however deep (a beam taken twice is a fork
    of a fork): over the handles of a replayed beam search."""
    from kvledger.replay.projector import Projector

    model = tiny("llama", seed=2)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        url = f"sqlite:///{d}/j.db"
        journaled_generate(model, torch.tensor([[5, 6, 7]]), ledger=url, num_beams=4, max_new_tokens=12)
        from kvledger import open_or_create_journal

        with open_or_create_journal(url) as journal:
            projector = Projector().feed(journal.read_all())
    roots = fork_roots(projector.handles)
    (root,) = [h for h, s in projector.handles.items() if s.parent_handle_id is None]
    assert roots and set(roots.values()) == {root}
    depth = {h: 0 for h in projector.handles}
    for h, s in projector.handles.items():
        if s.parent_handle_id is not None:
            depth[h] = depth[s.parent_handle_id] + 1
    assert max(depth.values()) >= 2  # forks of forks were there to follow


def test_the_spec_trace_has_no_forks_and_its_numbers_stand(capsys):
    """The spec's worked trace (0x05): two requests, no fork: the same figures as ever
    and no fork keys."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "fixtures" / "phase_trace.jsonl"
    report = replay_jsonl(path, WindowSpec(slo_ttft_ns=15_000_000, slo_tbt_ns=10_000_000, start_ns=0,
                                           width_ns=100_000_000))
    assert report.forks is None and report.fork_window is None
    w = report.window
    assert (w.completed, w.slo_valid, w.throughput_rps, w.goodput_rps) == (2, 1, 20.0, 10.0)
