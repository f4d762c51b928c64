"""kvledger.hf.journaled_generate takes what model.generate takes, the way it takes it
(positional inputs, inputs=, input_ids=, the model's generation config and transformers'
defaults), a Ledger or a database URL, and refuses what it cannot journal with a coded
error before any work: the journal is left as it was (or never created). The oracle is
plain generate on the same tiny random models test_hf builds."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402 - after the importorskip
from hypothesis import strategies as st  # noqa: E402
from test_hf import COMMON, before_release, tiny  # noqa: E402

from kvledger import Ledger, open_or_create_journal  # noqa: E402
from kvledger.hf import journaled_generate  # noqa: E402
from kvledger.replay import verify_journal  # noqa: E402
from kvledger.schemas import events as ev  # noqa: E402
from kvledger.schemas.errors import KvLedgerError  # noqa: E402

IDS = torch.tensor([[5, 6, 7, 8, 5, 6]])


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' advice on max_length defaults
        yield


def journal_of(url: str) -> tuple[bool, list[ev.Event]]:
    with open_or_create_journal(url) as journal:
        return verify_journal(journal).ok, list(journal.read_all())


def assert_journals(events: list[ev.Event], out: torch.Tensor, width: int) -> None:
    """One finished handle per row holding the returned ids, every token run."""
    states = list(before_release(events).values())
    assert len(states) == out.shape[0]
    for row, s in enumerate(states):
        assert s.lifecycle == "FINISHED" and s.outputs == tuple(out[row, width:].tolist())
        assert s.committed_length == s.logical_length == out.shape[1]
    (alloc, *_) = [e for e in events if isinstance(e, ev.RequestAllocateEvent)]
    assert alloc.payload.manifest.request_policy.max_new_tokens == out.shape[1] - width


@pytest.mark.parametrize("form", ["positional", "inputs", "input_ids", "url", "url_positional"])
def test_the_prompt_and_the_ledger_as_generate_takes_them(form, tmp_path):
    model = tiny("llama")
    ref = model.generate(IDS, max_new_tokens=4)
    url = f"sqlite:///{tmp_path}/j.db"
    call = {"positional": lambda ledger: journaled_generate(model, IDS, ledger=ledger, max_new_tokens=4),
            "inputs": lambda ledger: journaled_generate(model, inputs=IDS, ledger=ledger, max_new_tokens=4),
            "input_ids": lambda ledger: journaled_generate(model, ledger=ledger, input_ids=IDS, max_new_tokens=4),
            "url": lambda _: journaled_generate(model, ledger=url, input_ids=IDS, max_new_tokens=4),
            "url_positional": lambda _: journaled_generate(model, IDS, None, ledger=url, max_new_tokens=4)}[form]
    if form.startswith("url"):
        out = call(None)
    else:
        with Ledger.open(url) as ledger:
            out = call(ledger)
    assert torch.equal(out, ref)
    ok, events = journal_of(url)
    assert ok
    assert_journals(events, out, IDS.shape[1])


def _with_generation_config(model, **values):
    for k, v in values.items():
        setattr(model.generation_config, k, v)
    return model


@pytest.mark.parametrize("case", ["transformers_default", "model_max_length", "model_max_new_tokens",
                                  "default_capped_by_positions", "call_max_length", "generation_config_arg"])
def test_the_generation_config_defaults_as_generate_reads_them(case, tmp_path):
    """No max_new_tokens: the length generate derives (20 new tokens by default, capped
    at the model's positions; a max_length is a total length) is generated and journaled."""
    model = tiny("llama")
    ids, kw = IDS, {}
    if case == "model_max_length":
        _with_generation_config(model, max_length=10)
    elif case == "model_max_new_tokens":
        _with_generation_config(model, max_new_tokens=7)
    elif case == "default_capped_by_positions":
        ids = torch.arange(COMMON["max_position_embeddings"] - 5)[None] % 100 + 1  # no pad id
    elif case == "call_max_length":
        kw = {"max_length": 9}
    elif case == "generation_config_arg":
        kw = {"generation_config": transformers.GenerationConfig(max_length=11, pad_token_id=0)}
    ref = model.generate(ids, **kw)
    url = f"sqlite:///{tmp_path}/j.db"
    out = journaled_generate(model, ids, ledger=url, **kw)
    assert torch.equal(out, ref) and out.shape[1] > ids.shape[1]
    ok, events = journal_of(url)
    assert ok
    assert_journals(events, out, ids.shape[1])


def test_no_prompt_starts_from_bos_as_generate_does(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, "bos_token_id": 1})).eval()
    ref = model.generate(max_new_tokens=3)
    url = f"sqlite:///{tmp_path}/j.db"
    out = journaled_generate(model, ledger=url, max_new_tokens=3)
    assert torch.equal(out, ref)
    ok, events = journal_of(url)
    assert ok and before_release(events)[next(iter(before_release(events)))].prompt == (1,)


class _Draft(transformers.LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


REFUSED = {
    "static_cache": {"cache_implementation": "static"},
    "offloaded_cache": {"cache_implementation": "offloaded"},
    "quantized_cache": {"cache_implementation": "quantized"},
    "paged_cache": {"cache_implementation": "paged"},
    "model_static_cache": {"_model": {"cache_implementation": "static"}},
    "user_cache": {"past_key_values": "dynamic"},
    "user_cache_new_name": {"cache": "dynamic"},
    "user_static_cache": {"past_key_values": "static"},
    "no_cache": {"use_cache": False},
    "chunked_prefill": {"prefill_chunk_size": 2},
    "custom_generate": {"custom_generate": lambda model, input_ids, **kw: input_ids},
    "hub_generate": {"custom_generate": "transformers-community/contrastive-search"},
    "contrastive": {"penalty_alpha": 0.6, "top_k": 4},
    "group_beams": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0},
    "constrained_beams": {"num_beams": 2, "force_words_ids": [[9]]},
    "dola": {"dola_layers": "low"},
    "mtp": {"use_mtp": True},
    "token_healing": {"token_healing": True},
    "synced_gpus": {"synced_gpus": True},
    "trust_remote_code": {"trust_remote_code": True, "_says": "trust_remote_code=True runs a decoding loop"},
    "assisted_beams": {"num_beams": 2, "prompt_lookup_num_tokens": 2},
    "assisted_batch": {"prompt_lookup_num_tokens": 2, "_ids": torch.tensor([[5, 6, 7], [5, 6, 8]])},
    "inputs_embeds": {"inputs_embeds": torch.zeros(1, 3, COMMON["hidden_size"]), "_ids": None},
    "position_ids": {"position_ids": torch.arange(6)[None] + 2},
    "typo": {"max_new_token": 3},
    "zero_new_tokens": {"max_new_tokens": 0},
    "negative_new_tokens": {"max_new_tokens": -2},
    "text_new_tokens": {"max_new_tokens": "4"},
    "short_max_length": {"max_length": 4, "max_new_tokens": None},
    "greedy_returns_two": {"num_return_sequences": 2},
    "generation_config_not_one": {"generation_config": {"max_new_tokens": 2}},
    "inputs_and_input_ids": {"inputs": IDS, "input_ids": IDS},
    "negative_id": {"_ids": torch.tensor([[5, -1, 7]])},
    "id_past_vocabulary": {"_ids": torch.tensor([[5, COMMON["vocab_size"], 7]])},
    "empty_prompt": {"_ids": torch.zeros((1, 0), dtype=torch.long)},
    "empty_batch": {"_ids": torch.zeros((0, 3), dtype=torch.long)},
    "float_ids": {"_ids": torch.tensor([[5.0, 6.0]])},
    "bool_ids": {"_ids": torch.tensor([[True, False]])},
    "flat_ids": {"_ids": torch.tensor([5, 6, 7])},
    "list_ids": {"_ids": [[5, 6, 7]]},
    "no_prompt_no_bos": {"_ids": None},
    "mask_shape": {"attention_mask": torch.ones(1, 3, dtype=torch.long)},
    "mask_values": {"attention_mask": torch.full((1, 6), 2)},
    "mask_right_padded": {"attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]])},
    "pad_inside_the_prompt": {"_ids": torch.tensor([[5, COMMON["pad_token_id"], 7]])},  # generate masks it
    "request_ids_text": {"request_ids": "abc"},
    "request_ids_numbers": {"request_ids": [1]},
    "seed_text": {"seed": "7"},
    "ledger_not_one": {"_ledger": 3},
    "model_not_one": {"_model_obj": "gpt2"},
    "request_id_too_long": {"request_ids": ["r" * 257]},
    "request_id_empty": {"request_ids": [""]},
    "request_id_no_room_for_beams": {"request_ids": ["r" * 250], "num_beams": 2},
    "stats_not_a_dict": {"stats": []},
    "eos_negative": {"eos_token_id": [-5]},
    "eos_beyond_int64": {"eos_token_id": 10**30},
    "temperature_nan": {"do_sample": True, "temperature": float("nan")},
    "temperature_text": {"do_sample": True, "temperature": "hot"},
    "int8_ids": {"_ids": IDS.to(torch.int8)},
    "meta_ids": {"_ids": torch.ones((1, 3), dtype=torch.long, device="meta")},
}


def _user_cache(kind: str, model):
    cfg = model.config.get_text_config(decoder=True)
    if kind == "static":
        return transformers.StaticCache(config=cfg, max_cache_len=16)
    return transformers.DynamicCache(config=cfg)


@pytest.mark.parametrize("case", sorted(REFUSED))
@pytest.mark.parametrize("ledger_kind", ["ledger", "url"])
def test_what_cannot_be_journaled_is_refused_before_any_work(case, ledger_kind, tmp_path):
    """INVALID_ARGUMENT before the journal is touched: a Ledger's journal stays empty, a
    URL's database is never created."""
    model = tiny("llama")
    kw = {"max_new_tokens": 3, **REFUSED[case]}
    ids, says = kw.pop("_ids", IDS), kw.pop("_says", "")  # _says: the refusal is that check's, not a later one's
    for key, value in kw.pop("_model", {}).items():
        setattr(model.generation_config, key, value)
    for key in ("past_key_values", "cache"):
        if isinstance(kw.get(key), str):
            kw[key] = _user_cache(kw[key], model)
    kw = {k: v for k, v in kw.items() if v is not None or k == "max_new_tokens"}
    if kw.get("max_new_tokens") is None:
        kw.pop("max_new_tokens")
    args = () if ids is None or "inputs" in kw else (ids,)
    model = kw.pop("_model_obj", model)
    db = tmp_path / "j.db"
    url = f"sqlite:///{db}"
    with pytest.raises(KvLedgerError) as refused:
        if ledger_kind == "url" or "_ledger" in kw:
            journaled_generate(model, *args, ledger=kw.pop("_ledger", url), **kw)
        else:
            with Ledger.open(url) as ledger:
                try:
                    journaled_generate(model, *args, ledger=ledger, **kw)
                finally:
                    assert ledger.journal.last_position() == 0
    assert refused.value.code.value == "INVALID_ARGUMENT" and says in refused.value.message, refused.value
    assert "\n" not in str(refused.value)
    if ledger_kind == "url":
        assert not db.exists()


def test_positional_arguments_bind_as_generate_binds_them(tmp_path):
    """Past generate's own positional parameters, or one also given by keyword: the
    TypeError Python raises for any function, before the journal is touched."""
    from kvledger.adapters.hf_args import NAMED

    model, db = tiny("llama"), tmp_path / "j.db"
    with pytest.raises(TypeError, match="at most"):
        journaled_generate(model, IDS, *([None] * len(NAMED)), None, ledger=f"sqlite:///{db}")
    with pytest.raises(TypeError, match="multiple values for argument 'inputs'"):
        journaled_generate(model, IDS, inputs=IDS, ledger=f"sqlite:///{db}")
    assert not db.exists()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.lists(st.integers(-3, COMMON["vocab_size"] + 3), min_size=0, max_size=4),
                     min_size=1, max_size=2),
       masks=st.none() | st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=4), min_size=2, max_size=2),
       beams=st.sampled_from([1, 2]))
def test_any_prompt_and_mask_is_journaled_as_generate_runs_it_or_refused(rows, masks, beams, tmp_path_factory):
    """A space of prompts (ids in and out of the vocabulary, ragged, empty) and masks:
    either the ids plain generate returns, journaled verify-clean, or INVALID_ARGUMENT
    with the journal still empty."""
    model = _MODEL
    width = max(map(len, rows))
    if any(len(r) != width for r in rows):
        rows = [r + [0] * (width - len(r)) for r in rows]
    ids = torch.tensor(rows, dtype=torch.long).reshape(len(rows), width)
    mask = None if masks is None else torch.tensor(masks)[:ids.shape[0], :ids.shape[1]]
    url = f"sqlite:///{tmp_path_factory.mktemp('j')}/j.db"
    kw = {"max_new_tokens": 2, "num_beams": beams, "attention_mask": mask}
    with Ledger.open(url) as ledger:
        try:
            out = journaled_generate(model, ids, ledger=ledger, **kw)
        except KvLedgerError as exc:
            assert exc.code.value == "INVALID_ARGUMENT", exc
            assert ledger.journal.last_position() == 0
            return
        assert verify_journal(ledger.journal).ok
    assert torch.equal(out, model.generate(ids, **kw))
    assert 0 <= int(ids.min()) and int(ids.max()) < COMMON["vocab_size"] and ids.shape[1] > 0


_MODEL = tiny("llama", seed=8)
