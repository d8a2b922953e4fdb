"""Many proxies, few database connections: harness pods outnumber the server's connection slots.

Every harness pod runs a proxy sidecar, so a run's pods share the database's ``max_connections``. A role with a
``CONNECTION LIMIT`` stands in for a full server here (PostgreSQL refuses the next connection the same way:
an ``OperationalError`` at connect), so the test needs no second server.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.register_assert_rewrite("proxy_servers")  # also loaded as a plugin below
from proxy_servers import RunningProxy, metric_value, proxy_config
from sqlalchemy import text
from sqlalchemy.engine import make_url

from harnessrl.store import TraceStore
from harnessrl.store.engine import POOL_SIZE_ENV

pytest_plugins = ["proxy_servers"]  # fixtures: loops, upstream

PROXIES = 8
SLOTS = 3  # the role's connection limit: fewer slots than proxies
CALLS = 3  # per proxy


def connections(admin: TraceStore, role: str) -> int:
    with admin.engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE usename = :r"), {"r": role}).scalar()


def wait_for(predicate, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def limited_role(pg_url: str) -> Iterator[tuple[str, str, TraceStore]]:
    """A migrated store, and a role that may write to it over at most ``SLOTS`` connections."""
    admin = TraceStore.connect(pg_url)
    admin.upgrade()
    role = f"harnessrl_proxy_{uuid.uuid4().hex[:8]}"
    with admin.engine.connect() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT {SLOTS}"))
        conn.execute(text(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}"))
        conn.execute(text(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}"))
        conn.commit()
    try:
        yield make_url(pg_url).set(username=role, password=None).render_as_string(hide_password=False), role, admin
    finally:
        with admin.engine.connect() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))
            conn.commit()
        admin.close()


@pytest.mark.postgres
def test_more_proxies_than_connection_slots_store_every_call_and_let_go_when_idle(
    loops, upstream, limited_role, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight proxies (one connection each, as the operator configures sidecars) write through a role that
    has three slots. While the test holds all three, every proxy is refused and spools; once it lets go the
    proxies take turns: each gives its connection back after a short idle time, so every call is stored and
    the role ends with no connection open. Before proxies let go of idle connections, the first three kept
    theirs and the other five spooled for good."""
    role_url, role, admin = limited_role
    monkeypatch.setenv(POOL_SIZE_ENV, "1")
    stores = [TraceStore.connect(role_url, check=False) for _ in range(PROXIES)]
    proxies = [
        RunningProxy(
            loops,
            proxy_config(
                [upstream.url], role_url, tmp_path / f"spool-{i}.jsonl", rollout_id=f"r-{i}",
                store_release_idle_s=0.3,
            ),
            store,
        )
        for i, store in enumerate(stores)
    ]
    blockers = [TraceStore.connect(role_url) for _ in range(SLOTS)]  # each keeps its checked connection
    try:
        assert connections(admin, role) == SLOTS

        def send(proxy: RunningProxy) -> None:
            for _ in range(CALLS):
                resp = httpx.post(f"{proxy.v1}/chat/completions", timeout=60,
                                  json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                assert resp.status_code == 200  # the harness never waits for the database

        senders = [threading.Thread(target=send, args=(p,)) for p in proxies]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(120)
        wait_for(lambda: all(p.proxy.writer.spool.pending == CALLS for p in proxies), "every proxy to spool")
        for proxy in proxies:  # refused at connect, as by a full server
            exposition = httpx.get(f"{proxy.url}/metrics").text
            assert metric_value(exposition, "harnessrl_proxy_write_errors_total", kind="outage") >= 1

        for blocker in blockers:
            blocker.close()
        for proxy in proxies:
            proxy.flush(timeout=120)
        with admin.engine.connect() as conn:
            stored = conn.execute(text("SELECT rollout_id, count(*) FROM llm_calls GROUP BY rollout_id")).all()
        assert dict(stored) == {f"r-{i}": CALLS for i in range(PROXIES)}
        wait_for(lambda: connections(admin, role) == 0, "the proxies to close their idle connections", 60)
    finally:
        for blocker in blockers:
            blocker.close()
        for proxy in proxies:
            proxy.stop()
        for store in stores:
            store.close()
