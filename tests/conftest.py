"""Shared fixtures: fresh, empty databases on SQLite and on a real PostgreSQL server.

``store_url`` runs a test once per database kind; ``pg_url`` is for tests that need PostgreSQL only.
PostgreSQL comes from ``HARNESSRL_TEST_PG_URL`` (a superuser URL on a server the tests may create databases
on), else the local cluster's socket. Each test gets its own database, created and dropped around it. When no
server answers, the PostgreSQL cases are skipped with the reason; with ``HARNESSRL_TEST_PG_REQUIRED=1`` (CI,
where a server was started) they fail instead, so a broken server never turns into a quietly green run.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL, make_url

from harnessrl.store import TraceStore

PG_URL_ENV = "HARNESSRL_TEST_PG_URL"
PG_REQUIRED_ENV = "HARNESSRL_TEST_PG_REQUIRED"
DEFAULT_PG_URL = "postgresql+psycopg://postgres@/postgres?host=/var/run/postgresql"


@functools.cache
def _pg_admin_url() -> tuple[URL | None, str]:
    """(server URL, "") when a PostgreSQL server answers, else (None, why not). Checked once per session."""
    raw = os.environ.get(PG_URL_ENV) or DEFAULT_PG_URL
    url = make_url(raw)
    if url.get_backend_name() == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    try:
        engine = create_engine(url, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as exc:  # any failure to reach the server means "no server here"
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        return None, (
            f"no PostgreSQL server at {url.render_as_string(hide_password=True)} ({reason}); "
            f"set {PG_URL_ENV} or start one (pg_ctlcluster 15 main start)"
        )
    return url, ""


@functools.cache
def _pg_admin_engine() -> Engine:
    """One pooled AUTOCOMMIT engine for CREATE/DROP DATABASE (they cannot run inside a transaction)."""
    url, _ = _pg_admin_url()
    return create_engine(url, isolation_level="AUTOCOMMIT")


def _require_pg() -> URL:
    url, reason = _pg_admin_url()
    if url is None:
        if os.environ.get(PG_REQUIRED_ENV) == "1":
            pytest.fail(f"{PG_REQUIRED_ENV}=1 but {reason}")
        pytest.skip(reason)
    return url


def _fresh_pg_database() -> Iterator[str]:
    """Create a uniquely named empty database, yield its URL, drop it afterwards (even if still connected)."""
    admin_url = _require_pg()
    name = f"hrl_test_{uuid.uuid4().hex[:16]}"
    admin = _pg_admin_engine()
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def pg_url() -> Iterator[str]:
    """URL of a fresh, empty PostgreSQL database (skipped when no server answers)."""
    yield from _fresh_pg_database()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """URL of a fresh, empty database: once on SQLite (a file in tmp_path), once on PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
    else:
        yield from _fresh_pg_database()


@pytest.fixture
def store(store_url: str) -> Iterator[TraceStore]:
    """A migrated ``TraceStore`` on a fresh database of each kind."""
    trace_store = TraceStore.connect(store_url)
    trace_store.upgrade()
    yield trace_store
    trace_store.close()
