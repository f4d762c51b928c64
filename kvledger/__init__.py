"""kvledger: an event-sourced, durable source of truth for per-request KV-cache state.

The one import name. The layers install beneath it from their folders at the repository
root (kvledger.schemas, .journal, .migrations, .engine, .worker, .replay, .telemetry,
.recovery); this folder is the thin facade: the public Python API, the CLI and the demo.
The API is loaded when first used, so importing a layer (`kvledger.schemas.events`, a
writer process's `kvledger.engine.remote`) does not load the facade's dependencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvledger.ledger import CacheLayout, Ledger, full_layers
    from kvledger.migrations.storage import init_database, open_or_create_journal

__all__ = ["CacheLayout", "Ledger", "full_layers", "init_database", "open_or_create_journal"]
__version__ = "0.1.0"

_WHERE = {"CacheLayout": "kvledger.ledger", "Ledger": "kvledger.ledger", "full_layers": "kvledger.ledger",
          "init_database": "kvledger.migrations.storage",
          "open_or_create_journal": "kvledger.migrations.storage"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'kvledger' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
