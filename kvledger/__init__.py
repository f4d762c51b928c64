"""kvledger: an event-sourced, durable source of truth for per-request KV-cache state.

The thin facade: the public Python API and the CLI. Nothing imports this package.
"""

from kvledger.ledger import Ledger, full_layers
from kvledger.storage import init_database, open_journal

__all__ = ["Ledger", "full_layers", "init_database", "open_journal"]
__version__ = "0.1.0"
