"""Journal a Hugging Face model's generate() (needs the `hf` extra: transformers).

    from kvledger import Ledger
    from kvledger.hf import journaled_generate
    with Ledger.open("sqlite:///kv.db") as ledger:
        out = journaled_generate(model, ledger=ledger, input_ids=ids, attention_mask=mask, max_new_tokens=32)

`out` is exactly what `model.generate(...)` returns; see kvledger.adapters.hf.
"""

from __future__ import annotations

from kvledger.adapters.hf import JournaledCache, journaled_generate

__all__ = ["JournaledCache", "journaled_generate"]
