"""Alembic environment for the trace store.

It is driven only programmatically (``harnessrl.store.migrate``), which hands over an open connection inside
a transaction, so no ``alembic.ini`` or URL is read here. Batch mode is always on so that the same
revision scripts run on SQLite (which cannot ALTER most things) and PostgreSQL.
"""

from __future__ import annotations

from typing import Any

from alembic import context

from harnessrl.store.schema import Base, UTCDateTime


def render_item(type_: str, obj: Any, autogen_context: Any) -> str | bool:
    """Render our column types as plain SQLAlchemy types, so revision scripts do not import the models."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


connection = context.config.attributes.get("connection")
if connection is None or context.is_offline_mode():
    raise RuntimeError(
        "run store migrations through harnessrl.store.migrate (harnessrl db upgrade --url URL)"
    )

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=True,
    compare_type=True,
    render_item=render_item,
)
with context.begin_transaction():
    context.run_migrations()
