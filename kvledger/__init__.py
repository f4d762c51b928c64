"""kvledger: an event-sourced, durable source of truth for per-request KV-cache state.

The one import name. The layers install beneath it from their folders at the repository
root (kvledger.schemas, .journal, .migrations, .engine, .worker, .replay, .telemetry,
.recovery); this folder is the thin facade: the public Python API, the CLI and the demo.
The API is loaded when first used, so importing a layer (`kvledger.schemas.events`, a
writer process's `kvledger.engine.remote`) does not load the facade's dependencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.schemas import lazy

if TYPE_CHECKING:
    from kvledger.ledger import CacheLayout, Ledger, full_layers
    from kvledger.migrations.storage import init_database, open_or_create_journal

__all__ = ["CacheLayout", "Ledger", "full_layers", "init_database", "open_or_create_journal"]
__version__ = "0.1.0"

__getattr__ = lazy.exports(__name__, {"ledger": ("CacheLayout", "Ledger", "full_layers"),
                                      "migrations.storage": ("init_database", "open_or_create_journal")})
