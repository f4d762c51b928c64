"""Bounded memory of the Hugging Face surface and model loading (issue 44): each hostile
input is refused before anything it names is allocated. The figure is the peak RSS growth
while it is refused (bench.bounded).

- a checkpoint whose config.json claims a 10**12-token vocabulary and whose safetensors
  header claims the matching 128 TB embedding, in a file of a few bytes
- a config.json that is /dev/zero
- a config.json claiming 10**9 layers over real 2-layer weights
- `generate --runtime hf --max-new-tokens 1048576` (CONTEXT_TOO_LONG before loading)
- `verify --reexecute --runtime hf` over a journal whose recorded call claims 2**31 rows
"""

from __future__ import annotations

import argparse
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvledger.schemas.errors import KvLedgerError

CONFIG = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "tie_word_embeddings": False}


def _checkpoint(d: Path, config: dict[str, Any] = CONFIG) -> Path:
    from safetensors.torch import save_file

    from kvledger.worker.model import ModelConfig, Transformer

    d.mkdir(parents=True, exist_ok=True)
    model = Transformer.from_config(ModelConfig.from_hf_config(CONFIG))
    save_file({(k if k == "lm_head.weight" else f"model.{k}"): v.contiguous() for k, v in model.state_dict().items()},
              str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config))
    return d


def _refused(fn: Callable[[], object], code: str) -> None:
    try:
        fn()
    except KvLedgerError as exc:
        if exc.code.value != code:
            raise
        return
    raise RuntimeError(f"not refused with {code}")


def forged_header(tmp: Path, mode: str, ready: Callable[[], None]) -> None:
    from kvledger.worker.loading import load_model

    d = tmp / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": 10**12}))
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [10**12, 32],
                                                       "data_offsets": [0, 10**12 * 128]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    ready()
    _refused(lambda: load_model(str(d)), "INVALID_ARGUMENT")


def config_dev_zero(tmp: Path, mode: str, ready: Callable[[], None]) -> None:
    from kvledger.worker.loading import load_model

    d = _checkpoint(tmp / "m")
    (d / "config.json").unlink()
    (d / "config.json").symlink_to("/dev/zero")
    ready()
    _refused(lambda: load_model(str(d)), "INVALID_ARGUMENT")


def layers_1e9(tmp: Path, mode: str, ready: Callable[[], None]) -> None:
    from kvledger.worker.loading import load_model

    d = _checkpoint(tmp / "m", {**CONFIG, "num_hidden_layers": 10**9})
    ready()
    _refused(lambda: load_model(str(d)), "INVALID_ARGUMENT")


def generate_1m_tokens(tmp: Path, mode: str, ready: Callable[[], None]) -> None:
    # what generate() imports first, loaded before the baseline
    import kvledger.adapters.hf
    import kvledger.cmd_serve
    import kvledger.ledger  # noqa: F401 - imported for its load only
    from kvledger.cmd_hf import generate

    d = _checkpoint(tmp / "m")
    args = argparse.Namespace(model=str(d), prompt_ids=(1, 2, 3), max_new_tokens=1 << 20, num_beams=1,
                              do_sample=False, seed=0, device="cpu", db=f"sqlite:///{tmp}/j.db", json=True)
    ready()
    _refused(lambda: generate(args), "CONTEXT_TOO_LONG")


def reexecute_crafted_call(tmp: Path, mode: str, ready: Callable[[], None]) -> None:
    import msgspec
    import torch

    from kvledger.adapters.hf_reexec import reexecute_hf
    from kvledger.cmd_hf import load
    from kvledger.hf import journaled_generate
    from kvledger.migrations.storage import open_or_create_journal

    d = _checkpoint(tmp / "m")
    model = load(str(d))
    url = f"sqlite:///{tmp}/j.db"
    journaled_generate(model, torch.tensor([[1, 2, 3]]), ledger=url, max_new_tokens=4)
    with open_or_create_journal(url) as journal:
        events = list(journal.read_all())
    first = next(i for i, e in enumerate(events) if e.event_type == "append_start")
    e = events[first]
    call = msgspec.structs.replace(e.payload.call, size=1 << 31, key_extent=1 << 31)
    events[first] = msgspec.structs.replace(e, payload=msgspec.structs.replace(e.payload, call=call))
    ready()
    r = reexecute_hf(model, events)
    if not any(code == "MALFORMED_EVENT" for code, _ in r.unrunnable.values()):
        raise RuntimeError("the crafted call was not set aside")


SCENARIOS = {
    "hf_forged_header_peak_mb": forged_header,
    "hf_config_dev_zero_peak_mb": config_dev_zero,
    "hf_config_1e9_layers_peak_mb": layers_1e9,
    "hf_generate_1m_tokens_peak_mb": generate_1m_tokens,
    "hf_reexecute_crafted_call_peak_mb": reexecute_crafted_call,
}
GOALS = {key: ("<=", 16.0) for key in SCENARIOS}
