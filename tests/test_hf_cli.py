"""The Hugging Face runtime on the command line under bad input: `generate --runtime hf`
checks the context as the worker's `generate` does (CONTEXT_TOO_LONG before any work);
`verify --reexecute --runtime hf` with another model than the journal's is
ARTIFACT_MISMATCH (exit 1), whatever differs (vocabulary, layers, heads, dims, weights);
a crafted journal (call shapes, token ids, intervals edited) is a finding or a coded
line, never INTERNAL_ERROR."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402 - after the importorskip
from hypothesis import strategies as st  # noqa: E402
from test_hf import COMMON, kvledger  # noqa: E402

CONTEXT = COMMON["max_position_embeddings"]


def save(d: Path, seed: int = 0, **changes) -> Path:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, **changes})).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("hf") / "model")


def ids(n: int) -> str:
    return ",".join(str(1 + i % 100) for i in range(n))


@pytest.mark.parametrize("prompt,new", [(CONTEXT - 6, 5), (CONTEXT - 6, 6), (CONTEXT + 44, 1), (3, 1 << 20)])
def test_generate_checks_the_context_as_the_worker_does(prompt, new, model_dir, tmp_path, capsys):
    """A prompt plus its generation beyond the model's positions (with the slot the
    worker keeps) is CONTEXT_TOO_LONG on both runtimes, before a journal exists; within
    them both run."""
    fits = prompt + new + 1 <= CONTEXT
    for runtime in ([], ["--runtime", "hf"]):
        db = tmp_path / f"{len(runtime)}.db"
        done = kvledger(capsys, "generate", *runtime, "--model", str(model_dir), "--prompt-ids", ids(prompt),
                        "--max-new-tokens", str(new), "--db", f"sqlite:///{db}", "--json")
        if fits:
            assert done.returncode == 0, done.stderr
            assert len(json.loads(done.stdout)["output_ids"]) == new
        else:
            assert done.returncode == 2 and done.stderr.count("\n") == 1, (runtime, done.stderr)
            assert done.stderr.startswith("CONTEXT_TOO_LONG: ") and str(CONTEXT) in done.stderr
            assert not db.exists()


OTHERS = {
    "smaller_vocabulary": {"vocab_size": 64},
    "larger_vocabulary": {"vocab_size": 200},
    "more_layers": {"num_hidden_layers": 3},
    "fewer_layers": {"num_hidden_layers": 1},
    "more_heads": {"num_attention_heads": 8, "num_key_value_heads": 4},
    "more_kv_heads": {"num_key_value_heads": 4},
    "narrower": {"hidden_size": 32},
    "other_mlp": {"intermediate_size": 48},
    "other_weights": {"_seed": 9},
}


@pytest.fixture(scope="module")
def journal(model_dir, tmp_path_factory) -> str:
    """A beam search journaled by `generate --runtime hf` on model_dir; its prompt holds
    token 100, outside the smaller vocabulary."""
    from kvledger.cli import main

    db = f"sqlite:///{tmp_path_factory.mktemp('j')}/j.db"
    assert main(["generate", "--runtime", "hf", "--model", str(model_dir), "--prompt-ids", "1,2,100,3",
                 "--max-new-tokens", "4", "--num-beams", "2", "--db", db]) == 0
    return db


@pytest.mark.parametrize("other", sorted(OTHERS))
def test_verify_reexecute_with_another_model_is_artifact_mismatch(other, journal, model_dir, tmp_path, capsys):
    changes = dict(OTHERS[other])
    d = save(tmp_path / other, seed=changes.pop("_seed", 0), **changes)
    done = kvledger(capsys, "verify", "--db", journal, "--reexecute", "--runtime", "hf", "--model", str(d))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ARTIFACT_MISMATCH" in done.stdout and "INTERNAL_ERROR" not in done.stdout + done.stderr
    as_json = kvledger(capsys, "verify", "--db", journal, "--reexecute", "--runtime", "hf", "--model", str(d),
                       "--json")
    assert as_json.returncode == 1
    proof = json.loads(as_json.stdout)["reexecution"]
    assert not json.loads(as_json.stdout)["ok"]
    shaped = other not in ("larger_vocabulary", "other_mlp", "other_weights")
    # more_heads holds the very same weights (seed 0, the same tensor shapes), split into
    # other heads: the weights digest agrees, the rows' geometry does not
    assert bool(proof["other_artifacts"]) == (other != "more_heads")
    assert bool(proof["not_reexecuted"]) == shaped  # rows this model cannot compute are set aside, not run
    assert all(n["code"] == "ARTIFACT_MISMATCH" for n in proof["not_reexecuted"])
    if not shaped:  # the same cache geometry: every row recomputed, and they differ
        assert proof["verified_appends"] > 0 and proof["mismatches"]
    same = kvledger(capsys, "verify", "--db", journal, "--reexecute", "--runtime", "hf", "--model", str(model_dir),
                    "--json")
    assert same.returncode == 0 and json.loads(same.stdout)["reexecution"]["not_reexecuted"] == []


CALL_FIELDS = ("size", "new_pad", "key_extent", "index", "threads")
NUMBERS = st.integers(0, 12) | st.sampled_from([1 << 20, 1 << 31, (1 << 63) - 1]) | st.integers(-3, -1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(
    CALL_FIELDS + ("call_id", "interval_start", "token", "accepted_count", "committed_length", "prefix_length")),
    NUMBERS), min_size=1, max_size=3))
def test_a_crafted_journal_is_a_finding_never_an_internal_error(edits, journal, model_dir, tmp_path_factory,
                                                              capsys):
    """An audit file whose appends' recorded calls, intervals, token ids, publications
    or forks were edited: verify --reexecute reports (exit 0 or 1) or refuses with a
    code (exit 2), and never sizes an allocation or a thread pool by what it read."""
    out = tmp_path_factory.mktemp("audit") / "a.jsonl"
    assert kvledger(capsys, "export", "--db", journal, "--out", str(out)).returncode == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    targets = [i for i, e in enumerate(lines) if e["event_type"] in ("append_start", "append_publish", "fork")]
    for pick, field, value in edits:
        e = lines[targets[pick % len(targets)]]
        p = e["payload"]
        if field in CALL_FIELDS and p.get("call"):
            p["call"][field] = value
        elif field == "call_id" and p.get("call"):
            p["call"]["call_id"] = next(x["payload"]["call"]["call_id"] for x in lines
                                        if x["event_type"] == "append_start") if value % 2 else "f" * 32
        elif field == "token" and p.get("token_ids"):
            p["token_ids"] = [value] + p["token_ids"][1:]
        elif field in p:
            p[field] = value
    out.write_text("".join(json.dumps(e) + "\n" for e in lines))
    done = kvledger(capsys, "verify", "--journal", str(out), "--reexecute", "--runtime", "hf", "--model",
                    str(model_dir), "--json")
    assert "INTERNAL_ERROR" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode in (0, 1, 2), done.stderr
    if done.returncode == 2:
        assert done.stderr.count("\n") == 1 and done.stderr.split(":")[0].isupper(), done.stderr


@pytest.mark.parametrize("generation_config", ['{"cache_implementation": "static"}', '{"do_sample": true}',
                                               '{"max_length": 5}', "[1]"])
def test_the_checkpoints_generation_config_does_not_derail_generate(generation_config, model_dir, tmp_path, capsys):
    """generate --runtime hf sets its own generation (greedy unless --do-sample, its
    --max-new-tokens, the journaled DynamicCache) over what generation_config.json says;
    one transformers cannot read is a coded line."""
    d = tmp_path / "model"
    d.mkdir()
    for f in model_dir.iterdir():
        (d / f.name).symlink_to(f)
    (d / "generation_config.json").write_text(generation_config)
    done = kvledger(capsys, "generate", "--runtime", "hf", "--model", str(d), "--prompt-ids", "1,2,3",
                    "--max-new-tokens", "6", "--db", f"sqlite:///{tmp_path}/j.db", "--json")
    if generation_config == "[1]":
        assert done.returncode == 2 and done.stderr.startswith("INVALID_ARGUMENT: "), done.stderr
        return
    assert done.returncode == 0, done.stderr
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir).generate(
        torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False)
    assert json.loads(done.stdout)["output_ids"] == ref[0, 3:].tolist()
