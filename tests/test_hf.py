"""kvledger.hf: transformers' generate() under the journal, on tiny random models built
from configs (GQA Llama, Qwen2 with q/k/v biases, Mistral). The oracle is plain
generate(): the ids must be the same tensors, the journal verify-clean, each handle's
outputs the generated ids, and the re-execution proof must recompute every row digest."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvledger import Ledger, open_or_create_journal  # noqa: E402 - after the importorskip
from kvledger.adapters.hf_reexec import reexecute_hf  # noqa: E402
from kvledger.cli import main  # noqa: E402
from kvledger.engine.evolve import fold  # noqa: E402
from kvledger.hf import journaled_generate  # noqa: E402
from kvledger.replay import verify_journal  # noqa: E402
from kvledger.schemas import events as ev  # noqa: E402
from kvledger.schemas.errors import KvLedgerError  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, pad_token_id=0,
              bos_token_id=None)
ARCHS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON)),
}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [13, 14, 15, 16, 17]]


def _biased(model):
    """transformers initialises Qwen2's q/k/v biases to zero: random ones, so the biases
    the rows are computed with are really exercised."""
    for layer in model.model.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            if proj.bias is not None:
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model.eval()


def tiny(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    return _biased(ARCHS[arch]())


def smaller(arch: str, seed: int = 7):
    """An assistant: same vocabulary, one layer, half the width."""
    cfg = {**COMMON, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
    kind = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[arch]
    torch.manual_seed(seed)
    return _biased(getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(**cfg)))


def test_qwen2_biases_are_not_zero():
    attn = tiny("qwen2").model.layers[0].self_attn
    assert all(p.bias is not None and p.bias.abs().min() > 0 for p in (attn.q_proj, attn.k_proj, attn.v_proj))


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def run(model, tmp_path, ids, mask=None, seed=None, url=None, **kw):
    """(plain generate's result, journaled_generate's result, the journal's events); a
    seed goes to torch before plain generate and to journaled_generate as its seed=."""
    if seed is not None:
        torch.manual_seed(seed)
    ref = model.generate(input_ids=ids, attention_mask=mask, **{k: v for k, v in kw.items()
                                                             if k not in ("close_frontier", "overlap_commit", "stats")})
    with Ledger.open(url or f"sqlite:///{tmp_path}/j.db") as ledger:
        if seed is not None:
            torch.manual_seed(seed + 1)  # journaled_generate must seed the generator itself
        out = journaled_generate(model, ledger=ledger, input_ids=ids, attention_mask=mask, seed=seed, **kw)
        verdict = verify_journal(ledger.journal)
        events = list(ledger.journal.read_all())
    assert verdict.ok, verdict.findings
    return ref, out, events


def before_release(events: list[ev.Event]) -> dict[str, object]:
    """Each handle's state just before its release: what it held at the end."""
    streams: dict[str, list[ev.Event]] = {}
    for e in events:
        if not isinstance(e, ev.ReleaseEvent):
            streams.setdefault(e.stream_id, []).append(e)
    return {h: fold(evs) for h, evs in streams.items()}


def kinds(events: list[ev.Event]) -> Counter[str]:
    return Counter(e.event_type for e in events) + Counter(
        f"append:{e.payload.kind}" for e in events if isinstance(e, ev.AppendStartEvent))


def assert_closed(states, sequences: torch.Tensor, prompts: list[list[int]], eos: int | None = None) -> None:
    """Every handle ends with every token it holds run through the model (committed =
    logical), and each returned sequence has a finished handle whose committed length
    is the sequence's unpadded length (prompt + generated up to its EOS)."""
    assert states and all(s.committed_length == s.logical_length for s in states.values())
    per = len(sequences) // len(prompts)
    width = sequences.shape[1] - max(len(s.outputs) for s in states.values())
    for row, seq in enumerate(sequences.tolist()):
        prompt, gen = prompts[row // per], seq[width:]
        if eos is not None and eos in gen:
            gen = gen[:gen.index(eos) + 1]
        held = [s for s in states.values() if s.prompt == tuple(prompt) and s.outputs == tuple(gen)
                and s.lifecycle == "FINISHED"]
        assert held, f"returned sequence {row} has no finished handle"
        assert held[0].committed_length == len(prompt) + len(gen)


def closing_order(events: list[ev.Event], handle: str) -> list[str]:
    """A handle's last events: the closing decode of its last token, then its finish."""
    starts = {e.payload.txn_id: e.payload.kind for e in events if isinstance(e, ev.AppendStartEvent)}
    return [e.event_type + (f":{starts[e.payload.txn_id]}" if isinstance(e, ev.AppendStartEvent) else "")
            for e in events if e.stream_id == handle][-5:]


def assert_proof(model, events) -> int:
    r = reexecute_hf(model, events)
    assert r.mismatches == [] and r.skipped == set()
    published = sum(e.payload.accepted_count for e in events if isinstance(e, ev.AppendPublishEvent))
    assert r.verified_rows == published > 0
    return r.verified_rows


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_left_padded_batch_greedy(arch, overlap, tmp_path, capsys):
    model = tiny(arch)
    ids, mask = left_padded(PROMPTS)
    # overlap: the commit of each call's starts overlaps the call
    stats: dict[str, float] = {}
    ref, out, events = run(model, tmp_path, ids, mask, max_new_tokens=6, do_sample=False, overlap_commit=overlap,
                           stats=stats)
    assert torch.equal(out, ref)
    # six calls of generate (the prefill, five decodes), then the closing call
    assert stats["forward_calls"] == 7 and 0 < stats["journal_s"]
    # what `replay --json` shows just before the releases (which empty the handles)
    at = min(e.global_position for e in events if isinstance(e, ev.ReleaseEvent)) - 1
    replayed = kvledger(capsys, "replay", "--db", f"sqlite:///{tmp_path}/j.db", "--at", str(at), "--json")
    assert replayed.returncode == 0, replayed.stderr
    assert sorted(h["committed_length"] for h in json.loads(replayed.stdout)["handles"]) == \
        sorted(len(p) + 6 for p in PROMPTS)
    states = before_release(events)
    assert len(states) == 3
    for b, s in enumerate(states.values()):
        generated = out[b, ids.shape[1]:].tolist()
        assert s.prompt == tuple(PROMPTS[b]) and s.outputs == tuple(generated)
        # unpadded: prompt + generated, the last token too (run by the closing call)
        assert s.committed_length == s.logical_length == len(PROMPTS[b]) + 6
        assert s.lifecycle == "FINISHED"
        assert closing_order(events, s.handle_id) == ["output_emit", "append_start:decode", "append_publish",
                                                      "finish", "release"]
    assert_closed(states, out, PROMPTS)
    c = kinds(events)
    assert c["release"] == 3 and c["append:prefill"] == 3 and c["append:decode"] == 18 and c["output_emit"] == 18
    assert c["append:repair"] == 0
    assert assert_proof(model, events) == sum(map(len, PROMPTS)) + 18


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_seeded_sampling(arch, tmp_path):
    model = tiny(arch, seed=1)
    ids = torch.tensor([PROMPTS[2]])
    ref, out, events = run(model, tmp_path, ids, seed=123, max_new_tokens=8, do_sample=True, temperature=1.5)
    assert torch.equal(out, ref)
    (s,) = before_release(events).values()
    assert s.outputs == tuple(out[0, 5:].tolist()) and s.committed_length == 5 + 8
    (alloc,) = [e for e in events if isinstance(e, ev.RequestAllocateEvent)]
    sampling = alloc.payload.manifest.request_policy.sampling
    assert (sampling.kind, sampling.temperature, sampling.seed) == ("temperature", 1.5, 123)
    assert assert_proof(model, events) == 5 + 8


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_seeded_sampling_through_the_pinned_call(arch, tmp_path):
    """The caller seeds torch, as before plain generate, and calls journaled_generate
    with generate's own arguments only: the same sampled ids (a left-padded batch)."""
    model = tiny(arch, seed=5)
    ids, mask = left_padded(PROMPTS)
    kw = dict(max_new_tokens=6, do_sample=True, temperature=1.3, top_k=20)
    torch.manual_seed(77)
    ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
    with Ledger.open(f"sqlite:///{tmp_path}/j.db") as ledger:
        torch.manual_seed(77)
        out = journaled_generate(model, ledger=ledger, input_ids=ids, attention_mask=mask, **kw)
        assert verify_journal(ledger.journal).ok
        events = list(ledger.journal.read_all())
    assert torch.equal(out, ref)
    assert not torch.equal(out, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                               do_sample=False)), "sampling chose the greedy ids: a weak test"
    states = before_release(events)
    for b, s in enumerate(states.values()):
        assert s.outputs == tuple(out[b, ids.shape[1]:].tolist())
        assert s.committed_length == len(PROMPTS[b]) + 6
    assert assert_proof(model, events) == sum(map(len, PROMPTS)) + 18


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_beam_search(arch, tmp_path, db_url):
    """Beams are a fork group: forked at expansion (their prompt rows checked equal), a
    beam selected twice is a fork, a reorder_cache is a reorder; each returned sequence
    ends on the handle holding its tokens; the others are finished and released. On
    SQLite and on PostgreSQL."""
    model = tiny(arch, seed=2)
    ids, mask = left_padded(PROMPTS[:2])
    ref, out, events = run(model, tmp_path, ids, mask, url=db_url, num_beams=3, num_return_sequences=2,
                           max_new_tokens=5, do_sample=False)
    assert torch.equal(out, ref)
    c = kinds(events)
    assert c["fork"] >= 4 and c["reorder"] >= 1 and c["append:prefill"] == 2
    states = before_release(events)
    assert c["release"] == len(states) == c["finish"]
    for row in range(4):
        generated = tuple(out[row, ids.shape[1]:].tolist())
        holders = [s for s in states.values() if s.outputs == generated and s.lifecycle == "FINISHED"
                   and s.finish_ns is not None and s.prompt == tuple(PROMPTS[row // 2])]
        assert holders, f"returned sequence {row} has no handle"
        assert holders[0].committed_length == len(PROMPTS[row // 2]) + 5
        assert closing_order(events, holders[0].handle_id)[1:] == ["append_start:decode", "append_publish",
                                                                   "finish", "release"]
    assert_closed(states, out, PROMPTS[:2])
    # the closing call is one call of the four returned sequences
    closing = [e.payload.call for e in events if isinstance(e, ev.AppendStartEvent)][-4:]
    assert len({call.call_id for call in closing}) == 1 and closing[0].size == 4
    assert_proof(model, events)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("how", ["assistant", "twin_assistant", "prompt_lookup"])
def test_assisted_decoding(arch, how, tmp_path):
    """Candidates are verify appends; a publish commits only the rows transformers keeps
    after its crop; the accepted drafts are the handle's outputs."""
    model = tiny(arch, seed=4)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    kw = {"assistant": {"assistant_model": smaller(arch)}, "prompt_lookup": {"prompt_lookup_num_tokens": 3},
          "twin_assistant": {"assistant_model": tiny(arch, seed=4)}}[how]
    ref, out, events = run(model, tmp_path, ids, max_new_tokens=12, do_sample=False, **kw)
    assert torch.equal(out, ref)
    (s,) = before_release(events).values()
    assert s.outputs == tuple(out[0, 10:].tolist()) and s.committed_length == s.logical_length == 10 + 12
    assert closing_order(events, s.handle_id)[1:] == ["append_start:decode", "append_publish", "finish", "release"]
    starts = {e.payload.txn_id: e.payload for e in events if isinstance(e, ev.AppendStartEvent)}
    verifies = [(starts[e.payload.txn_id].interval_count, e.payload.accepted_count) for e in events
                if isinstance(e, ev.AppendPublishEvent) and starts[e.payload.txn_id].kind == "verify"]
    assert verifies and any(n > 1 for n, _ in verifies)
    cropped = [(n, a) for n, a in verifies if a < n]
    if how == "assistant":
        assert cropped, "the smaller assistant was never wrong"
    if how == "twin_assistant":  # the target's twin drafts what it would choose: every draft stays
        assert not cropped and len({p.call.call_id for p in starts.values()}) < 12
    assert_proof(model, events)


def test_sampled_return_sequences_are_a_fork_group(tmp_path):
    """num_return_sequences rows of one prompt: forks of its first row at the prompt."""
    model = tiny("qwen2", seed=5)
    ids, mask = left_padded(PROMPTS[1:])
    ref, out, events = run(model, tmp_path, ids, mask, seed=9, max_new_tokens=5, do_sample=True,
                           num_return_sequences=3)
    assert torch.equal(out, ref) and out.shape[0] == 6
    states = list(before_release(events).values())
    assert kinds(events)["fork"] == 4 and len(states) == 6
    by_row = sorted(states, key=lambda s: (s.handle_id.split(".")[0], s.handle_id))
    for row, s in enumerate(by_row):
        assert s.outputs == tuple(out[row, ids.shape[1]:].tolist())
    assert_closed(before_release(events), out, PROMPTS[1:])
    assert_proof(model, events)


def test_eos_row_is_repaired_and_the_rest_runs_on(tmp_path):
    """A row that emits EOS finishes there; transformers still runs its EOS token once
    (journaled as the repair that closes its frontier), then pads it, unjournaled. Only
    that row is padded: the calls after it still carry generate's 2D mask, and the proof
    rebuilds them so."""
    model = tiny("llama")
    ids, mask = left_padded([PROMPTS[0], [9, 10, 11, 12, 13], PROMPTS[2]])
    probe = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    eos = int(probe[0, ids.shape[1] + 1])  # row 0's second token
    ref, out, events = run(model, tmp_path, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=eos)
    assert torch.equal(out, ref)
    states = before_release(events)
    s0 = states[next(iter(states))]
    assert s0.outputs == (int(probe[0, ids.shape[1]]), eos)
    assert s0.committed_length == s0.logical_length  # the repair ran the EOS row
    # the others are closed after generate, not repaired: only row 0 stopped early
    assert_closed(states, out, [PROMPTS[0], [9, 10, 11, 12, 13], PROMPTS[2]], eos=eos)
    finishes = [e.payload.reason for e in events if isinstance(e, ev.FinishEvent)]
    assert finishes.count("eos") >= 1
    assert kinds(events)["append:repair"] == 1
    closing = [e.payload.call for e in events if isinstance(e, ev.AppendStartEvent)][-2:]
    assert closing[0].call_id == closing[1].call_id and closing[0].size == 2  # row 0 is not in it
    assert_proof(model, events)


@pytest.mark.parametrize("overlap", [False, True])
def test_forward_that_raises_leaves_failures_then_raises(overlap, tmp_path):
    model = tiny("qwen2")
    ids, mask = left_padded(PROMPTS)
    calls = []

    class Boom(RuntimeError):
        pass

    def explode(module, args, kwargs):
        calls.append(1)
        if len(calls) == 3:  # the second decode call, in layer 1
            raise Boom("injected in layer 1")

    hook = model.model.layers[1].self_attn.register_forward_pre_hook(explode, with_kwargs=True)
    try:
        with Ledger.open(f"sqlite:///{tmp_path}/j.db") as ledger, pytest.raises(Boom):
            journaled_generate(model, ledger=ledger, input_ids=ids, attention_mask=mask, max_new_tokens=6,
                               overlap_commit=overlap)
        with open_or_create_journal(f"sqlite:///{tmp_path}/j.db") as journal:
            assert verify_journal(journal).ok
            events = list(journal.read_all())
    finally:
        hook.remove()
    failures = [e for e in events if isinstance(e, ev.FailureEvent) and e.payload.outcome == "failed"]
    assert len(failures) == 3 and all("injected in layer 1" in f.payload.detail for f in failures)
    starts = {e.payload.txn_id: e for e in events if isinstance(e, ev.AppendStartEvent)}
    assert {starts[f.payload.txn_id].payload.kind for f in failures} == {"decode"}
    states = before_release(events)
    assert all(s.lifecycle == "CANCELLED" and not s.open_txns for s in states.values())
    assert kinds(events)["release"] == 3
    assert_proof(model, events)



@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_close_frontier_false_ends_one_row_short(arch, tmp_path):
    """The opt-out: no call after generate, so each last token is emitted, never run."""
    model = tiny(arch)
    ids, mask = left_padded(PROMPTS)
    ref, out, events = run(model, tmp_path, ids, mask, max_new_tokens=5, do_sample=False, close_frontier=False)
    assert torch.equal(out, ref)
    for b, s in enumerate(before_release(events).values()):
        assert s.outputs == tuple(out[b, ids.shape[1]:].tolist())
        assert s.committed_length == s.logical_length - 1 == len(PROMPTS[b]) + 5 - 1
        assert closing_order(events, s.handle_id)[-3:] == ["output_emit", "finish", "release"]
    c = kinds(events)
    assert c["append:repair"] == 0 and c["append:decode"] == 3 * 4
    assert assert_proof(model, events) == sum(map(len, PROMPTS)) + 3 * 4


def eos_before_the_search_ends(arch: str, seed: int):
    """A model, batch and EOS id with which a returned beam ends on EOS while the search
    runs on (so generate pads it): found by trying the tokens beam search chose."""
    model = tiny(arch, seed=seed)
    ids, mask = left_padded(PROMPTS[:2])
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, do_sample=False)
    width = ids.shape[1]
    for tok in sorted(set(model.generate(input_ids=ids, attention_mask=mask, **kw)[:, width:].flatten().tolist())):
        out = model.generate(input_ids=ids, attention_mask=mask, eos_token_id=tok, **kw)
        if any(tok in row[:-1] for row in out[:, width:].tolist()):
            return model, ids, mask, {**kw, "eos_token_id": tok}
    pytest.fail("no token ends a returned beam early")


@pytest.mark.parametrize("close", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_beam_that_ended_on_eos_early_is_closed(arch, close, tmp_path):
    """A returned beam that hit EOS while the search ran on was chosen from rows a later
    reorder moved on or away: it is forked off its parent before that reorder, and the
    closing call runs its EOS on a copy of those rows. Opted out, it still has a handle."""
    model, ids, mask, kw = eos_before_the_search_ends(arch, seed=0)
    eos = kw["eos_token_id"]
    ref, out, events = run(model, tmp_path, ids, mask, close_frontier=close, **kw)
    assert torch.equal(out, ref)
    states = before_release(events)
    if close:
        assert_closed(states, out, PROMPTS[:2], eos=eos)
    width = ids.shape[1]
    for row, seq in enumerate(out[:, width:].tolist()):
        if eos not in seq[:-1]:
            continue
        gen = tuple(seq[:seq.index(eos) + 1])
        (held,) = [s for s in states.values() if s.outputs == gen and s.lifecycle == "FINISHED"
                   and s.prompt == tuple(PROMPTS[row // 2])]
        assert held.parent_handle_id is not None  # the fork taken at the EOS
        assert held.committed_length == len(PROMPTS[row // 2]) + len(gen) - (0 if close else 1)
    assert_proof(model, events)


class StopOn(transformers.StoppingCriteria):
    """Ends a candidate on one token, as EOS would, but unseen by the wrapper."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_a_beam_stopped_early_by_a_criterion_cannot_be_closed(tmp_path):
    """A stopping criterion the wrapper cannot read ends a returned beam early: its last
    token was chosen from rows a later reorder overwrote. Refused with a code after
    generate, the journal cancelled and released, verify-clean."""
    model, ids, mask, kw = eos_before_the_search_ends("llama", seed=0)
    stop = StopOn(kw.pop("eos_token_id"))
    kw["stopping_criteria"] = transformers.StoppingCriteriaList([stop])
    url = f"sqlite:///{tmp_path}/j.db"
    with Ledger.open(url) as ledger, pytest.raises(KvLedgerError) as refused:
        journaled_generate(model, ledger=ledger, input_ids=ids, attention_mask=mask, **kw)
    assert refused.value.code.value == "FRONTIER_MISMATCH" and "ended before the beam search did" in str(refused.value)
    with open_or_create_journal(url) as journal:
        assert verify_journal(journal).ok
        events = list(journal.read_all())
    states = before_release(events)
    assert all(s.lifecycle == "CANCELLED" and not s.open_txns for s in states.values())
    assert kinds(events)["release"] == len(states)
    assert_proof(model, events)
    (tmp_path / "opt-out").mkdir()
    ref, out, _ = run(model, tmp_path / "opt-out", ids, mask, close_frontier=False, **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("which", [3, -1])  # a decode in generate; the closing call's last publish
def test_a_flipped_digest_is_named(which, tmp_path):
    model = tiny("mistral")
    ids, mask = left_padded(PROMPTS[:2])
    _, _, events = run(model, tmp_path, ids, mask, max_new_tokens=4, do_sample=False)
    publishes = [i for i, e in enumerate(events) if isinstance(e, ev.AppendPublishEvent)]
    i = publishes[which]
    p = events[i].payload
    flipped = ("0" if p.rows_sha256[0] != "0" else "1") + p.rows_sha256[1:]
    events[i] = msgspec.structs.replace(events[i], payload=msgspec.structs.replace(p, rows_sha256=flipped))
    r = reexecute_hf(model, events)
    assert [(m.handle_id, m.txn_id, m.global_position) for m in r.mismatches] == \
        [(events[i].stream_id, p.txn_id, events[i].global_position)]
    assert r.mismatches[0].recomputed == p.rows_sha256


def kvledger(capsys, *argv: str) -> subprocess.CompletedProcess[str]:
    """The command line in this process (the same main() the script runs, without a
    second interpreter loading torch and transformers)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def test_cli_generate_and_reexecute(tmp_path, capsys):
    """`generate --runtime hf` on a saved model directory returns transformers' greedy ids;
    `verify --reexecute --runtime hf` proves its journal, and names an edited digest."""
    model = tiny("llama", seed=3)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    prompt = [3, 1, 4, 1, 5, 9]
    ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=7, do_sample=False)
    db = f"sqlite:///{tmp_path}/cli.db"
    done = kvledger(capsys, "generate", "--runtime", "hf", "--model", str(model_dir), "--prompt-ids",
                    ",".join(map(str, prompt)), "--max-new-tokens", "7", "--db", db, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["output_ids"] == ref[0, len(prompt):].tolist()
    proof = kvledger(capsys, "verify", "--db", db, "--reexecute", "--runtime", "hf", "--model", str(model_dir),
                     "--json")
    assert proof.returncode == 0, proof.stdout + proof.stderr
    re = json.loads(proof.stdout)["reexecution"]
    assert re["mismatches"] == [] and re["verified_rows"] == len(prompt) + 7 and re["other_artifacts"] == []
    # the state before the release (which empties the handle): all of prompt + output committed
    replayed = kvledger(capsys, "replay", "--db", db, "--at", str(doc["position"] - 1), "--json")
    assert replayed.returncode == 0, replayed.stderr
    assert [(h["lifecycle"], h["committed_length"], h["logical_length"])
            for h in json.loads(replayed.stdout)["handles"]] == [("FINISHED", len(prompt) + 7, len(prompt) + 7)]
    # the same proof over an audit file with one publication's digest changed
    audit = tmp_path / "audit.jsonl"
    assert kvledger(capsys, "export", "--db", db, "--out", str(audit)).returncode == 0
    lines = audit.read_text().splitlines()
    k = next(i for i, line in enumerate(lines) if '"append_publish"' in line and '"decode"' not in line
             and i > 4)
    body = json.loads(lines[k])
    body["payload"]["rows_sha256"] = "f" * 64
    lines[k] = json.dumps(body)
    audit.write_text("\n".join(lines) + "\n")
    bad = kvledger(capsys, "verify", "--journal", str(audit), "--reexecute", "--runtime", "hf",
                   "--model", str(model_dir))
    assert bad.returncode == 1
    assert f"append {body['payload']['txn_id']}" in bad.stdout and "REEXECUTION_MISMATCH" in bad.stdout
    # bad input: one coded line, exit 2
    for argv in (("verify", "--db", db, "--reexecute"),
                 ("generate", "--runtime", "hf", "--prompt-ids", "1,2", "--db", db),
                 ("generate", "--runtime", "hf", "--model", str(model_dir), "--prompt-ids", "1,999", "--db", db)):
        refused = kvledger(capsys, *argv)
        assert refused.returncode == 2 and refused.stderr.startswith("INVALID_ARGUMENT"), (argv, refused.stderr)


def test_cli_seeded_sampling(tmp_path, capsys):
    """`--do-sample --seed S` gives transformers' own sample after torch.manual_seed(S),
    the same ids on every run, and the seed in the request's manifest."""
    model = tiny("qwen2", seed=6)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    prompt = [2, 7, 1, 8, 2, 8]
    samples = []
    for seed in (11, 12):
        torch.manual_seed(seed)
        samples.append(model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=9,
                                      do_sample=True)[0, len(prompt):].tolist())
    assert samples[0] != samples[1]  # the seed decides: equal ids below are not a coincidence
    db = f"sqlite:///{tmp_path}/cli.db"
    runs = []
    for seed in ("11", "11", "12"):
        done = kvledger(capsys, "generate", "--runtime", "hf", "--model", str(model_dir), "--prompt-ids",
                        ",".join(map(str, prompt)), "--max-new-tokens", "9", "--do-sample", "--seed", seed,
                        "--db", db, "--json")
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout)["output_ids"])
    assert runs == [samples[0], samples[0], samples[1]]
    with open_or_create_journal(db) as journal:
        events = list(journal.read_all())
    policies = [e.payload.manifest.request_policy.sampling for e in events if isinstance(e, ev.RequestAllocateEvent)]
    assert [(p.kind, p.seed) for p in policies] == [("temperature", 11), ("temperature", 11), ("temperature", 12)]
    assert all(s.committed_length == len(prompt) + 9 for s in before_release(events).values())
    proof = kvledger(capsys, "verify", "--db", db, "--reexecute", "--runtime", "hf", "--model", str(model_dir),
                     "--json")
    assert proof.returncode == 0, proof.stdout + proof.stderr
    re = json.loads(proof.stdout)["reexecution"]
    assert re["mismatches"] == [] and re["verified_rows"] == 3 * (len(prompt) + 9)


def test_bad_arguments_leave_the_journal_untouched(tmp_path):
    model = tiny("llama")
    ids, mask = left_padded(PROMPTS[:2])
    with Ledger.open(f"sqlite:///{tmp_path}/j.db") as ledger:
        for kw in ({"request_ids": ["only-one"]}, {"request_ids": ["same", "same"]},
                   {"attention_mask": torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])},  # not left padding
                   {"past_key_values": transformers.DynamicCache()}):
            args = {"attention_mask": mask, **kw}
            with pytest.raises(KvLedgerError) as refused:
                journaled_generate(model, ledger=ledger, input_ids=ids, max_new_tokens=2, **args)
            assert refused.value.code.value == "INVALID_ARGUMENT"
        assert ledger.journal.last_position() == 0


def _readme_block() -> str:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start = readme.index("```python\n", readme.index("## Hugging Face transformers")) + len("```python\n")
    return readme[start:readme.index("\n```", start)]


def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    """The README's block, as written, in a directory holding a tiny Qwen2 and a byte-level
    BPE tokenizer (Qwen2's kind, trained here) under the name it loads: it returns plain
    generate's ids, and the re-execution proof holds over its journal."""
    from tokenizers import ByteLevelBPETokenizer

    pad = "<|endoftext|>"
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["The capital of France is", "A KV cache holds"] * 4, vocab_size=300,
                            min_frequency=1, special_tokens=[pad])
    spec = json.loads(bpe.to_str())["model"]
    tok = transformers.Qwen2Tokenizer(vocab=spec["vocab"], merges=[tuple(m) for m in spec["merges"]], pad_token=pad,
                                      unk_token=None)
    model_dir = tmp_path / "Qwen2-0.5B-Instruct"
    tok.save_pretrained(model_dir)
    torch.manual_seed(6)
    config = transformers.Qwen2Config(**{**COMMON, "vocab_size": 320, "pad_token_id": tok.pad_token_id})
    _biased(transformers.Qwen2ForCausalLM(config)).save_pretrained(model_dir)
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    exec(compile(_readme_block(), "README.md", "exec"), scope)  # the README's own example, as written
    printed = capsys.readouterr()
    assert "The capital of France is" in printed.out and "A KV cache holds" in printed.out, printed
    batch, model, out = scope["batch"], scope["model"], scope["out"]
    ref = model.generate(**batch, max_new_tokens=64, do_sample=False)
    assert torch.equal(out, ref) and out.shape == (2, batch["input_ids"].shape[1] + 64)
    proof = kvledger(capsys, "verify", "--db", "sqlite:///kv.db", "--reexecute", "--runtime", "hf", "--model",
                     str(model_dir), "--json")
    assert proof.returncode == 0, proof.stdout + proof.stderr
    assert json.loads(proof.stdout)["reexecution"]["verified_rows"] == sum(batch["attention_mask"].sum(1)) + 128


@pytest.mark.parametrize("form", ["contiguous", "strided", "bfloat16"])
def test_a_decode_column_digests_as_its_one_row_span(form):
    """column_layers (a decode step's rows, read in one pass over the batch) gives, row
    by row, span_layers' digests of that one column, for the cache's own contiguous
    tensors (the numpy views) and for others (the torch path)."""
    from kvledger.adapters import hf_rows

    g = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if form == "bfloat16" else torch.float32

    def tensor():
        if form == "strided":  # [B, H, T, d] as a transposed view of [B, T, H, d]
            return torch.randn(5, 9, 3, 4, generator=g).transpose(1, 2)
        return torch.randn(5, 3, 9, 4, generator=g).to(dtype)

    layers = [(tensor(), tensor()) for _ in range(4)]
    assert layers[0][0].is_contiguous() == (form != "strided")
    rows = [4, 0, 2]
    got = hf_rows.column_layers(layers, rows, 6)
    assert got == [hf_rows.span_layers(layers, r, 6, 1) for r in rows]
    assert len({d for per in got for d in per}) == len(rows) * len(layers)
