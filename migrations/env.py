from __future__ import annotations

from alembic import context

from kvledger.journal.tables import VERSION_TABLE, metadata

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError("kvledger migrations run through migrations.upgrade(engine)")

context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
