"""Opening a store for reading only, and telling a store from an older schema apart.

The UI may point at the database of a run that is training (or at a cluster's PostgreSQL with a read-only role):
every connection it opens refuses writes at the database level, not by convention.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.exc import SQLAlchemyError

from harnessrl.store.engine import first_line, open_engine, safe_url
from harnessrl.store.migrate import current_revision, head_revision

REVISION_CHECK_S = 10.0  # how long a schema check is trusted: a store being upgraded is noticed this fast


def _sqlite_read_only(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA query_only = ON")
    cursor.close()


def _postgres_read_only(dbapi_connection: Any, _record: Any) -> None:
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    with dbapi_connection.cursor() as cursor:
        cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    dbapi_connection.autocommit = autocommit


def open_read_only(url: str) -> Engine:
    """An engine on ``url`` whose every connection refuses writes (``StoreError`` naming the URL if it fails)."""
    engine = open_engine(url)
    listener = _sqlite_read_only if engine.dialect.name == "sqlite" else _postgres_read_only
    event.listen(engine, "connect", listener)
    engine.dispose()  # the connection open_engine checked with was opened before the listener
    return engine


@dataclass
class SchemaCheck:
    """Whether the store's schema is the one this code reads; re-checked at most every ``REVISION_CHECK_S``."""

    engine: Engine
    _checked_at: float = field(default=-1e9, init=False)
    _problem: str | None = field(default=None, init=False)

    def problem(self) -> str | None:
        """None when the store is at head, else one line saying what to run."""
        now = time.monotonic()
        if now - self._checked_at < REVISION_CHECK_S:
            return self._problem
        try:
            revision = current_revision(self.engine)
        except SQLAlchemyError as exc:
            revision, error = None, first_line(exc)
        else:
            error = None
        head = head_revision()
        url = safe_url(self.engine.url)
        if error is not None:
            self._problem = f"cannot read the schema revision of {url}: {error}"
        elif revision != head:
            at = "was never migrated" if revision is None else f"is at schema revision {revision}"
            self._problem = (f"the store {url} {at}, this harnessrl reads revision {head}: run "
                             f"`harnessrl db upgrade --url {url}`")
        else:
            self._problem = None
        self._checked_at = now
        return self._problem
