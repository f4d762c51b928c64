"""Alembic environment and versions for the journal tables.

`upgrade(engine)` brings a database to head; `kvledger init` calls it.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from journal.tables import VERSION_TABLE

HERE = Path(__file__).resolve().parent


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("version_table", VERSION_TABLE)
    return cfg


def head_revision() -> str:
    return ScriptDirectory.from_config(_config()).get_current_head() or ""


def upgrade(engine: Engine, revision: str = "head") -> None:
    cfg = _config()
    with engine.begin() as conn:
        # env.py uses this connection: no URL (and no password) ever enters alembic's config.
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
