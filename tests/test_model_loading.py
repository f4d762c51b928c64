"""Model loading refuses a bad checkpoint directory in one coded line before anything is
allocated for it, on both runtimes (the worker's Transformer and transformers' loader):
a truncated or corrupt safetensors file, an absurd config.json (huge, zero, negative or
mistyped sizes, heads that do not divide, missing keys, a vocabulary the weights do not
hold), no weights, a file instead of a directory, devices and FIFOs instead of files.
Never INTERNAL_ERROR, never a traceback, and no journal is created."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from kvledger.cli import main
from kvledger.schemas.errors import KvLedgerError
from kvledger.worker import checkpoint
from kvledger.worker.loading import load_model, read_config
from kvledger.worker.model import ModelConfig, Transformer

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu"}


def write_checkpoint(d: Path, config: dict | None = None, *, seed: int = 0) -> Path:
    """A Llama checkpoint directory as transformers writes one (names with "model."),
    its weights the worker's seeded random init: no transformers needed."""
    config = dict(CONFIG if config is None else config)
    d.mkdir(parents=True, exist_ok=True)
    model = Transformer.from_config(ModelConfig.from_hf_config(config), seed=seed)
    state = {(k if k == "lm_head.weight" else f"model.{k}"): v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "good")


def variant(good: Path, tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(good, d)
    return d


def _edit(**changes):
    def apply(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is _DROP:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))
    return apply


def _truncate(keep) -> object:
    def apply(d: Path) -> None:
        f = d / "model.safetensors"
        os.truncate(f, keep(f.stat().st_size))
    return apply


def _forged_header(d: Path) -> None:
    """A header that claims the config's 10**12-row embedding, in a file of a few bytes."""
    _edit(vocab_size=10**12)(d)
    header = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [10**12, 32], "data_offsets": [0, 10**12 * 128]}}
    raw = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)


def _replace(name: str, how: str):
    def apply(d: Path) -> None:
        p = d / name
        p.unlink()
        if how == "dir":
            p.mkdir()
        elif how == "dev_zero":
            p.symlink_to("/dev/zero")
        elif how == "fifo":
            os.mkfifo(p)
        elif how == "huge":
            with open(p, "wb") as f:
                f.truncate(checkpoint.MAX_JSON_BYTES + 1)
    return apply


def _index(weight_map) -> object:
    def apply(d: Path) -> None:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return apply


_DROP = object()
BAD = {
    "truncated_half": _truncate(lambda n: n // 2),
    "truncated_in_header": _truncate(lambda n: 20),
    "truncated_to_5_bytes": _truncate(lambda n: 5),
    "empty_weights": _truncate(lambda n: 0),
    "trailing_garbage": lambda d: open(d / "model.safetensors", "ab").write(b"xx"),
    "forged_terabyte_header": _forged_header,
    "no_weights": lambda d: (d / "model.safetensors").unlink(),
    "weights_a_directory": _replace("model.safetensors", "dir"),
    "weights_dev_zero": _replace("model.safetensors", "dev_zero"),
    "config_dev_zero": _replace("config.json", "dev_zero"),
    "config_fifo": _replace("config.json", "fifo"),
    "config_huge": _replace("config.json", "huge"),
    "config_a_directory": _replace("config.json", "dir"),
    "no_config": lambda d: (d / "config.json").unlink(),
    "config_not_json": lambda d: (d / "config.json").write_text("{\"vocab_size\": "),
    "config_a_list": lambda d: (d / "config.json").write_text("[1, 2]"),
    "index_escapes": _index({"model.embed_tokens.weight": "../good/model.safetensors"}),
    "index_names_nothing": _index({}),
    "index_names_a_missing_file": _index({"model.embed_tokens.weight": "other.safetensors"}),
    "vocab_huge": _edit(vocab_size=10**12),
    "vocab_larger_than_the_weights": _edit(vocab_size=97),
    "hidden_huge": _edit(hidden_size=2**40),
    "hidden_other": _edit(hidden_size=64, num_attention_heads=8, num_key_value_heads=4),
    "layers_huge": _edit(num_hidden_layers=10**9),
    "layers_more": _edit(num_hidden_layers=3),
    "layers_fewer": _edit(num_hidden_layers=1),
    "heads_negative": _edit(num_attention_heads=-4),
    "heads_zero": _edit(num_attention_heads=0),
    "kv_heads_zero": _edit(num_key_value_heads=0),
    "heads_not_dividing_hidden": _edit(num_attention_heads=5, num_key_value_heads=5),
    "kv_heads_not_dividing": _edit(num_key_value_heads=3),
    "head_dim_odd": _edit(head_dim=7),
    "layers_text": _edit(num_hidden_layers="2"),
    "layers_float": _edit(num_hidden_layers=2.0),
    "heads_bool": _edit(num_attention_heads=True),
    "rope_theta_text": _edit(rope_theta="1e4"),
    "rope_theta_too_big": _edit(rope_theta=10**400),
    "rope_parameters_a_list": _edit(rope_parameters=[1]),
    "eps_negative": _edit(rms_norm_eps=-1.0),
    "tied_text": _edit(tie_word_embeddings="false"),
    "quantized": _edit(quantization_config={"quant_method": "bitsandbytes"}),
    "missing_vocab": _edit(vocab_size=_DROP),
    "missing_layers": _edit(num_hidden_layers=_DROP),
    "missing_heads": _edit(num_attention_heads=_DROP),
    "other_model_type": _edit(model_type="gpt2"),
}


def refused_in_one_line(capsys, argv: list[str]) -> str:
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 2, (argv, out, err)
    assert err.count("\n") == 1 and err.startswith("INVALID_ARGUMENT: "), err
    assert "INTERNAL_ERROR" not in err and "Traceback" not in out + err
    return err


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_checkpoint_is_refused_in_one_coded_line(case, good, tmp_path, capsys):
    d = variant(good, tmp_path, case)
    BAD[case](d)
    with pytest.raises(KvLedgerError) as refused:
        load_model(str(d))
    assert refused.value.code.value == "INVALID_ARGUMENT" and "\n" not in str(refused.value)
    db = tmp_path / "j.db"
    runtimes = [[], ["--runtime", "hf"]] if _has_transformers() else [[]]
    for runtime in runtimes:
        refused_in_one_line(capsys, ["generate", *runtime, "--model", str(d), "--prompt-ids", "1,2,3",
                                     "--max-new-tokens", "2", "--db", f"sqlite:///{db}"])
    assert not db.exists()


def test_a_model_path_that_is_a_file_is_refused(good, tmp_path, capsys):
    f = tmp_path / "model"
    f.write_text("x")
    with pytest.raises(KvLedgerError):
        load_model(str(f))
    refused_in_one_line(capsys, ["generate", "--model", str(f), "--prompt-ids", "1", "--db",
                                 f"sqlite:///{tmp_path}/j.db"])


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401 - only whether it is there
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tied", [False, True])
def test_the_tensors_a_config_implies_are_the_models(arch, tied):
    """expected_tensors is what both loaders build: the worker's Transformer's state dict
    (with transformers' "model." names) and transformers' own model's."""
    cfg_json = {**CONFIG, "model_type": arch, "tie_word_embeddings": tied, "max_position_embeddings": 4096}
    cfg = ModelConfig.from_hf_config(cfg_json)
    want = checkpoint.expected_tensors(cfg)
    assert len(want) == checkpoint.expected_count(cfg)
    with torch.device("meta"):
        ours = Transformer(cfg)
    names = {(k if k == "lm_head.weight" else f"model.{k}"): tuple(v.shape) for k, v in ours.state_dict().items()}
    if tied:
        names.pop("lm_head.weight", None)
    assert names == want
    if _has_transformers():
        import transformers

        hf_cfg = transformers.AutoConfig.for_model(**cfg_json)
        with torch.device("meta"):
            theirs = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        got = {k: tuple(v.shape) for k, v in theirs.state_dict().items() if not k.endswith("inv_freq")}
        if tied:
            got.pop("lm_head.weight", None)
        assert got == want


def test_a_good_checkpoint_loads_on_both_runtimes(good, tmp_path, capsys):
    model, artifact = load_model(str(good))
    assert model.cfg.vocab_size == CONFIG["vocab_size"]
    assert main(["generate", "--model", str(good), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--db",
                 f"sqlite:///{tmp_path}/w.db", "--json"]) == 0
    worker_ids = json.loads(capsys.readouterr().out)["output_ids"]
    if _has_transformers():
        assert main(["generate", "--runtime", "hf", "--model", str(good), "--prompt-ids", "1,2,3",
                     "--max-new-tokens", "2", "--db", f"sqlite:///{tmp_path}/h.db", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["output_ids"] == worker_ids


JSON_VALUES = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, 2, 3, 7, 96])
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
               | st.lists(st.integers(-3, 200), max_size=3)
               | st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
        "rope_scaling", "tie_word_embeddings", "hidden_act", "sliding_window", "layer_types", "eos_token_id",
        "bos_token_id", "pad_token_id", "attention_bias", "mlp_bias", "torch_dtype", "dtype", "quantization_config",
        "use_sliding_window", "initializer_range", "attention_dropout", "pretraining_tp")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(KEYS), JSON_VALUES | st.just(_DROP), min_size=1, max_size=4))
def test_any_config_json_loads_or_is_refused_with_a_code(changes, good, tmp_path_factory):
    """Over config.json's values (any JSON, or a key dropped): the checkpoint loads, and
    then the model is exactly the config's, or INVALID_ARGUMENT, before any allocation
    (a 10**12-row vocabulary would not fit: the refusal is what shows nothing was built)."""
    d = variant(good, tmp_path_factory.mktemp("cfg"), "m")
    _edit(**changes)(d)
    try:
        model, _ = load_model(str(d))
    except KvLedgerError as exc:
        assert exc.code.value == "INVALID_ARGUMENT" and "\n" not in str(exc)
        return
    assert checkpoint.expected_tensors(model.cfg).keys() == {
        (k if k == "lm_head.weight" else f"model.{k}") for k in model.state_dict()} - (
        {"lm_head.weight"} if model.cfg.tie_word_embeddings else set())
    assert read_config(d) == model.cfg
    if _has_transformers():  # what the worker loads, transformers' loader loads, or refuses with a code
        from kvledger.cmd_hf import load

        try:
            theirs = load(str(d))
        except KvLedgerError as exc:
            assert exc.code.value == "INVALID_ARGUMENT" and "\n" not in str(exc)
            return
        assert theirs.config.get_text_config(decoder=True).num_hidden_layers == model.cfg.num_layers


def _rewrite_header(edit) -> object:
    """model.safetensors with its header JSON replaced by edit(header) (bytes: as is)."""
    def apply(d: Path) -> None:
        f = d / "model.safetensors"
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        new = edit(json.loads(raw[8:8 + n]))
        new = new if isinstance(new, bytes) else json.dumps(new).encode()
        f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    return apply


def _first(h: dict) -> str:
    return next(k for k in h if k != "__metadata__")


def _set(h: dict, name: str, **fields) -> dict:
    h[name] = {**h[name], **fields}
    return h


def _gap(h: dict) -> dict:
    """The last tensor's extent moved one element on: a gap before it, past the data."""
    name = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    a, b = h[name]["data_offsets"]
    return _set(h, name, data_offsets=[a - 4, b - 4])


# each forged header names the check that refuses it
FORGED = {
    "header_not_json": (_rewrite_header(lambda h: b"{not json"), "header is not JSON"),
    "header_a_list": (_rewrite_header(lambda h: b"[1]"), "header is not a JSON object"),
    "tensor_undescribed": (_rewrite_header(lambda h: {**h, _first(h): 5}), "is not described"),
    "tensor_int8": (_rewrite_header(lambda h: _set(h, _first(h), dtype="I8")), "has dtype 'I8'"),
    "tensor_shape_negative": (_rewrite_header(lambda h: _set(h, _first(h), shape=[-1])), "malformed shape"),
    "tensor_shape_other": (_rewrite_header(lambda h: _set(h, _first(h), shape=[1])), "spans"),
    "tensor_overlap": (_rewrite_header(_gap), "overlaps or leaves a gap"),
    "tensor_in_two_files": (lambda d: shutil.copy(d / "model.safetensors", d / "copy.safetensors"),
                            "in more than one weight file"),
    "tensor_renamed": (_rewrite_header(lambda h: {("model.norm.weighs" if k == "model.norm.weight" else k): v
                                                  for k, v in h.items()}), "the weights lack 'model.norm.weight'"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_a_forged_safetensors_header_is_refused_by_its_check(case, good, tmp_path):
    d = variant(good, tmp_path, case)
    forge, why = FORGED[case]
    forge(d)
    with pytest.raises(KvLedgerError) as refused:
        load_model(str(d))
    assert refused.value.code.value == "INVALID_ARGUMENT" and why in refused.value.message, refused.value
