"""The Hugging Face runtime on the command line: `generate --runtime hf` and
`verify --reexecute --runtime hf` (transformers is needed only when they run)."""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from kvledger.schemas.errors import ErrorCode, KvLedgerError


def load(model_dir: str, device: str = "cpu") -> Any:
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--runtime hf needs transformers: "
                                                        "pip install 'kvledger[hf]'") from None
    # stderr carries one coded line on failure: no progress bars or advice from the loader
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"cannot load {model_dir}: {type(exc).__name__}") from None
    return model.to(device).eval()


def generate(args: argparse.Namespace) -> int:
    import torch

    from kvledger.adapters.hf import journaled_generate
    from kvledger.cmd_serve import print_generated
    from kvledger.journal import resolve_url
    from kvledger.ledger import Ledger

    model = load(args.model, args.device)
    prompt = args.prompt_ids
    if max(prompt) >= model.config.get_text_config(decoder=True).vocab_size:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"token id {max(prompt)} is outside the vocabulary")
    handle = f"gen-{uuid.uuid4().hex[:12]}"
    kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "num_beams": args.num_beams,
                              "do_sample": args.do_sample, "seed": args.seed if args.do_sample else None}
    url = resolve_url(args.db)
    with Ledger.open(url, source_instance="kvledger-generate-hf") as ledger:
        first = ledger.journal.last_position()
        ids = torch.tensor([prompt], device=args.device)
        out = journaled_generate(model, ledger=ledger, input_ids=ids, request_ids=[handle], **kwargs)
        position = ledger.journal.last_position()
    return print_generated(args, url, handle, prompt, out[0, len(prompt):].tolist(), first, position)


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
            "unrecorded_calls": sorted(r.skipped)}
