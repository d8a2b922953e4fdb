"""Opening a store database: URL checks, engine options and the SQLite settings several processes need.

SQLite is shared by the local runner's processes (scheduler, proxies, learner), so it runs in WAL mode with a
busy timeout, and write transactions start with ``BEGIN IMMEDIATE``: a deferred transaction that reads and
then writes fails at once with "database is locked" when another process committed in between, whatever the
timeout. Reads stay plain ``BEGIN`` so they never queue behind writers.

PostgreSQL connections are not pinged on every checkout (``pool_pre_ping``): that is one more round trip per
store call, and an operator pass makes a dozen calls back to back on connections used milliseconds before.
Instead a connection idle longer than ``ping_idle_s`` (30 s) is pinged before reuse (an idle-connection reaper
or a database restart shows there, and the pool opens a new connection), connections are replaced after
``POOL_RECYCLE_S`` whatever their use, and a connection that fails in use makes SQLAlchemy invalidate the
whole pool: that one call fails, and the next one gets a fresh connection.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DisconnectionError, SQLAlchemyError

from harnessrl.store import codec

SQLITE_BUSY_TIMEOUT_MS = 60_000
PING_IDLE_S = 30.0  # a PostgreSQL connection idle longer than this is pinged before reuse
POOL_RECYCLE_S = 1800  # and every one is replaced after this long (below common idle-connection reapers)
POOL_SIZE_ENV = "HARNESSRL_STORE_POOL_SIZE"
"""PostgreSQL connections a process keeps (SQLAlchemy's default: 5, and 10 more under load). A proxy sidecar
writes from one thread, so the operator sets 1 for them (one more may open for a moment), and the proxy closes
it after a few seconds with nothing to write (``HARNESSRL_STORE_RELEASE_IDLE_S``): hundreds of harness pods then
hold at most one connection each, and only while they write, which the chart's max_connections is sized for."""
WRITE_OPTION = "harnessrl_write"  # execution option that marks a connection's transactions as writes
URL_HELP = "use sqlite:///PATH/TO/FILE.db or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE"


class StoreError(RuntimeError):
    """The store cannot be opened or used as asked; the message is one line that says what to fix."""


def parse_url(url: str | URL) -> URL:
    """Parse and normalise a store URL; PostgreSQL always goes through psycopg 3 (the driver we ship)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StoreError(f"store URL {str(url)!r} is not a database URL; {URL_HELP}") from None
    backend = parsed.get_backend_name()
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+psycopg")
    if backend == "sqlite":
        if parsed.get_driver_name() not in ("pysqlite", ""):
            return parsed.set(drivername="sqlite")
        return parsed
    raise StoreError(
        f"store URL {safe_url(parsed)!r} uses {backend!r}, which the store does not support; {URL_HELP}"
    )


def safe_url(url: str | URL) -> str:
    """The URL with its password hidden, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return str(url)


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # SQLAlchemy's begin hook below emits BEGIN itself
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    # Switching a new database to WAL takes an exclusive lock and SQLite does not always run the busy handler
    # for it, so several processes opening one fresh file at once can see "database is locked": retry briefly.
    for attempt in range(100):
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            break
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == 99:
                raise
            time.sleep(0.05)
    cursor.execute("PRAGMA synchronous = NORMAL")  # durable at checkpoints; safe against corruption in WAL
    cursor.execute("PRAGMA foreign_keys = ON")
    cursor.close()


def _sqlite_on_begin(connection: Any) -> None:
    immediate = connection.get_execution_options().get(WRITE_OPTION, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _ping_when_idle(engine: Engine, idle_s: float) -> None:
    """Ping a pooled connection before reuse only when it sat idle longer than ``idle_s`` (SQLAlchemy's
    "pessimistic disconnect handling" recipe, limited to connections that may have gone stale)."""

    @event.listens_for(engine, "checkin")
    def checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since <= idle_s:
            return
        try:
            with dbapi_connection.cursor() as cursor:
                cursor.execute("SELECT 1")
            dbapi_connection.rollback()
        except Exception as exc:  # any failure: the pool drops it and tries a new connection
            raise DisconnectionError(f"stale pooled connection: {first_line(exc)}") from exc


def open_engine(url: str | URL, *, ping_idle_s: float = PING_IDLE_S, check: bool = True) -> Engine:
    """An engine for ``url``, checked by connecting once (unless ``check`` is False) so a wrong URL fails
    here with one clear line."""
    parsed = parse_url(url)
    options: dict[str, Any] = {"json_serializer": codec.dumps, "json_deserializer": codec.loads}
    if parsed.get_backend_name() == "postgresql":
        options["pool_recycle"] = POOL_RECYCLE_S
        if os.environ.get(POOL_SIZE_ENV):
            options.update(pool_size=int(os.environ[POOL_SIZE_ENV]), max_overflow=1)
    try:
        engine = create_engine(parsed, **options)
    except (SQLAlchemyError, ImportError) as exc:
        raise StoreError(f"cannot open store {safe_url(parsed)}: {first_line(exc)}") from None
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
    else:
        _ping_when_idle(engine, ping_idle_s)
    if not check:
        return engine
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as exc:
        engine.dispose()
        raise StoreError(f"cannot connect to store {safe_url(parsed)}: {first_line(exc)}") from None
    return engine


def open_engine_waiting(url: str | URL, wait_s: float, say: Callable[[str], None]) -> Engine:
    """:func:`open_engine`, retried every 2 s for ``wait_s`` while the server cannot be reached (a database
    that is starting or restarting); ``say`` hears once that it waits. The last error is the one raised."""
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            return open_engine(url)
        except StoreError as exc:
            if not str(exc).startswith("cannot connect") or time.monotonic() + 2 > deadline:
                raise
            if not told:
                say(f"{exc}; retrying for up to {wait_s:.0f} s")
                told = True
            time.sleep(2)


def first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
