"""Journal a Hugging Face model's generate() (needs the `hf` extra: transformers).

    from kvledger import Ledger
    from kvledger.hf import journaled_generate
    with Ledger.open("sqlite:///kv.db") as ledger:
        out = journaled_generate(model, ids, ledger=ledger, attention_mask=mask, max_new_tokens=32)

`journaled_generate(model, *args, ledger=..., **kwargs)` takes what `model.generate`
takes, the same way (positional `inputs`, `inputs=` or `input_ids=`, the model's
generation config and transformers' defaults), and returns exactly what it returns;
`ledger` is a kvledger.Ledger or a database URL (opened for the call, then closed).
See kvledger.adapters.hf.
"""

from __future__ import annotations

from typing import Any

from kvledger.adapters.hf import HasService, JournaledCache, prepare, run

__all__ = ["JournaledCache", "journaled_generate"]


def journaled_generate(model: Any, *args: Any, ledger: HasService | str, **kwargs: Any) -> Any:
    """model.generate(*args, **kwargs), journaled in `ledger` (a Ledger or a database URL).
    Arguments the journal cannot follow are refused (INVALID_ARGUMENT) before the
    journal is opened or touched; kvledger.adapters.hf.run says what is journaled."""
    call, options = prepare(model, *args, **kwargs)
    if isinstance(ledger, str):
        from kvledger.engine.ids import instance_name
        from kvledger.ledger import Ledger

        with Ledger.open(ledger, source_instance=instance_name("kvledger-hf")) as opened:
            return run(model, call, options, opened)
    return run(model, call, options, ledger)
