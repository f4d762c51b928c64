"""The Hugging Face runtime on the command line: `generate --runtime hf` and
`verify --reexecute --runtime hf` (transformers is needed only when they run)."""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path
from typing import Any

from kvledger.schemas.errors import ErrorCode, KvLedgerError


def load(model_dir: str, device: str = "cpu") -> Any:
    """transformers' model of a checkpoint directory, once its config and the headers of
    its weights are shown to agree (worker.checkpoint): nothing is allocated before."""
    from kvledger.worker import checkpoint
    from kvledger.worker.loading import read_config

    path = Path(model_dir)
    checkpoint.check(path, read_config(path))
    try:
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--runtime hf needs transformers: "
                                                        "pip install 'kvledger[hf]'") from None
    # stderr carries one coded line on failure: no progress bars or advice from the loader
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)  # its own checks, before the weights
        model: Any = AutoModelForCausalLM.from_pretrained(path, config=config, dtype="float32",
                                                          use_safetensors=True, local_files_only=True)
    # the loader's refusals of a checkpoint (the config's strict field types too)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, StrictDataclassError) as exc:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"cannot load {model_dir}: {type(exc).__name__}: "
                                                        f"{str(exc)[:200]}") from None
    return model.to(device).eval()


def generate(args: argparse.Namespace) -> tuple[str, str, list[int], list[int], int, int]:
    """`generate --runtime hf`: (url, handle, prompt, outputs, first position, last position),
    which the generate command prints as it prints the worker's."""
    import torch

    from kvledger.adapters.hf import journaled_generate
    from kvledger.engine.ids import instance_name
    from kvledger.journal import resolve_url
    from kvledger.ledger import Ledger
    from kvledger.worker.loading import read_config, require_context

    prompt = args.prompt_ids
    cfg = read_config(Path(args.model))
    if max(prompt) >= cfg.vocab_size:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"token id {max(prompt)} is outside the vocabulary "
                                                        f"[0, {cfg.vocab_size})")
    # as the worker's generate: the prompt plus the generation within the model's positions
    require_context(cfg, len(prompt) + args.max_new_tokens + 1)
    model = load(args.model, args.device)
    handle = f"gen-{uuid.uuid4().hex[:12]}"
    # the journaled DynamicCache, whatever cache the checkpoint's generation_config.json names
    kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "num_beams": args.num_beams,
                              "do_sample": args.do_sample, "seed": args.seed if args.do_sample else None,
                              "cache_implementation": None}
    url = resolve_url(args.db)
    with Ledger.open(url, source_instance=instance_name("kvledger-generate-hf")) as ledger:
        first = ledger.journal.last_position()
        ids = torch.tensor([prompt], device=args.device)
        out = journaled_generate(model, ledger=ledger, input_ids=ids, request_ids=[handle], **kwargs)
        position = ledger.journal.last_position()
    return url, handle, list(prompt), out[0, len(prompt):].tolist(), first, position


def reexecute(args: argparse.Namespace, events: list[Any]) -> dict[str, Any]:
    """The proof over `events`: every publication's rows recomputed by the model."""
    from kvledger.adapters.hf_identity import artifact_identity
    from kvledger.adapters.hf_reexec import reexecute_hf

    if not args.model:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--reexecute needs --model DIR")
    model = load(args.model)
    r = reexecute_hf(model, events)
    ours = artifact_identity(model).model_artifact_sha256
    return {"verified_appends": r.verified_appends, "verified_rows": r.verified_rows,
            "other_artifacts": sorted(a for a in r.artifacts if a != ours),
            "mismatches": [{"handle_id": m.handle_id, "txn_id": m.txn_id, "global_position": m.global_position,
                            "recorded": m.recorded, "recomputed": m.recomputed} for m in r.mismatches],
            "unrecorded_calls": sorted(r.skipped),
            "not_reexecuted": [{"handle_id": h, "code": code, "reason": why}
                               for h, (code, why) in sorted(r.unrunnable.items())]}
