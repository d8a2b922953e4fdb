"""Applying the Alembic migrations in ``harnessrl/store/migrations`` without an ``alembic.ini``.

Many pods may start at once and each may call ``upgrade``; on PostgreSQL the whole upgrade runs in one
transaction under an advisory lock, on SQLite under ``BEGIN IMMEDIATE``, so the first one migrates and the
others then find the schema at head and do nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

from harnessrl.store.engine import WRITE_OPTION

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
ADVISORY_LOCK_KEY = 0x68726C5F6462  # "hrl_db": serialises concurrent upgrades on one PostgreSQL database


def alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at; None for a database never migrated."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


@contextmanager
def _migration_transaction(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as connection:
        sqlite = engine.dialect.name == "sqlite"
        if sqlite:
            # Batch mode recreates SQLite tables; with foreign keys enforced that would cascade or fail.
            # The pragma only takes effect outside a transaction, hence the raw driver connection.
            connection.connection.driver_connection.execute("PRAGMA foreign_keys = OFF")
        try:
            connection.execution_options(**{WRITE_OPTION: True})
            with connection.begin():
                if engine.dialect.name == "postgresql":
                    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADVISORY_LOCK_KEY})
                yield connection
        finally:
            if sqlite:
                connection.connection.driver_connection.execute("PRAGMA foreign_keys = ON")


def upgrade(engine: Engine, revision: str = "head") -> str | None:
    """Migrate to ``revision`` (idempotent); returns the revision the database is at afterwards."""
    with _migration_transaction(engine) as connection:
        command.upgrade(alembic_config(connection), revision)
    return current_revision(engine)


def downgrade(engine: Engine, revision: str) -> str | None:
    """Migrate down to ``revision``; for tests that build a store as an older release left it."""
    with _migration_transaction(engine) as connection:
        command.downgrade(alembic_config(connection), revision)
    return current_revision(engine)


def autogenerate_revision(engine: Engine, message: str) -> None:
    """Write a new revision script from the difference between the models and a database at head.

    For developers changing ``schema.py``: run it against a scratch database, then read and fix the script.
    """
    upgrade(engine)
    with _migration_transaction(engine) as connection:
        command.revision(alembic_config(connection), message=message, autogenerate=True)
