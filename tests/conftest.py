"""Shared fixtures: fresh, empty databases on SQLite and on a real PostgreSQL server, and a real Kubernetes
control plane.

``store_url`` runs a test once per database kind; ``pg_url`` is for tests that need PostgreSQL only.
PostgreSQL comes from ``HARNESSRL_TEST_PG_URL`` (a superuser URL on a server the tests may create databases
on), else the local cluster's socket. Each test gets its own database, created and dropped around it. When no
server answers, the PostgreSQL cases are skipped with the reason; with ``HARNESSRL_TEST_PG_REQUIRED=1`` (CI,
where a server was started) they fail instead, so a broken server never turns into a quietly green run.

``kube`` is one control plane per test session (``harnessrl.devcluster``: etcd, kube-apiserver, controller
manager, scheduler, kwok nodes, with the TrainingRun CRD applied); ``kube_namespace`` gives each test its own
namespace. They fail when the cluster cannot start unless ``HARNESSRL_TEST_KUBE_REQUIRED=0`` (then they skip
with the reason): ``scripts/test.sh`` builds the binaries first, so a missing cluster is never a quiet skip.
"""

from __future__ import annotations

import functools
import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL, make_url

from harnessrl.devcluster import BuildError, Cluster, ClusterError, start_cluster
from harnessrl.spec.crd import CRD_PATH
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


KUBE_REQUIRED_ENV = "HARNESSRL_TEST_KUBE_REQUIRED"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A running control plane with the committed TrainingRun CRD applied and established."""
    yield from _cluster_with_crd("no Kubernetes control plane", tmp_path_factory.mktemp("kube"))


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane with a real node (kubelet, containerd, CoreDNS, volumes, NetworkPolicies) and no kwok
    nodes, per test module: one real node fits a machine, so modules take turns. Fails when it cannot start
    (root and a few kernel features are needed), unless HARNESSRL_TEST_KUBE_REQUIRED=0."""
    yield from _cluster_with_crd("no real node", tmp_path_factory.mktemp("real"), nodes=0, real_node=True)


def _cluster_with_crd(missing: str, directory: Path, **options) -> Iterator[Cluster]:
    """Start a cluster with the CRD applied, stopped afterwards; one that cannot start fails the test, or skips
    it with HARNESSRL_TEST_KUBE_REQUIRED=0."""
    from harnessrl.devcluster.node import NodeError

    try:
        cluster = start_cluster(directory, log=lambda line: None, **options)
    except (BuildError, ClusterError, NodeError) as exc:
        if os.environ.get(KUBE_REQUIRED_ENV, "1") != "0":
            pytest.fail(f"{missing}: {exc}", pytrace=False)
        pytest.skip(f"{missing}: {exc} ({KUBE_REQUIRED_ENV}=0)")
    try:
        cluster.apply_crd(ROOT / CRD_PATH)
        yield cluster
    finally:
        cluster.stop()


def _fresh_namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 60
    while cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode != 0:
        assert time.monotonic() < deadline, f"no default ServiceAccount in namespace {name} after 60 s"
        time.sleep(0.1)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def real_namespace(real_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace on the real-node cluster for one test, deleted afterwards."""
    yield from _fresh_namespace(real_cluster, request)


@pytest.fixture
def kube_namespace(kube: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test (pods can be created in it at once), deleted afterwards."""
    yield from _fresh_namespace(kube, request)
