"""Helpers the tests on PostgreSQL share."""

from __future__ import annotations

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url


class BlockableDatabase:
    """Takes one PostgreSQL database away from every client and gives it back (the cluster stays up,
    so other tests sharing it are unaffected)."""

    def __init__(self, url: str) -> None:
        parsed = make_url(url)
        self.name = parsed.database
        self.admin = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")

    def block(self) -> None:
        with self.admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS false'))
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": self.name},
            )

    def unblock(self) -> None:
        with self.admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS true'))

    def close(self) -> None:
        self.unblock()
        self.admin.dispose()
