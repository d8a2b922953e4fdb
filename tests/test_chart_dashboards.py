"""The chart's dashboards against a real Prometheus (Debian's package; scripts/chart-tools.sh installs it).

Prometheus scrapes a real capture proxy process (`harnessrl proxy` in front of the fake vLLM upstream, a real
PostgreSQL store) while a harness-like client makes calls through it; midway the store refuses connections for a
while, so calls are spooled and replayed as in an outage. Then every query of every dashboard goes through
Prometheus' HTTP API with the dashboard variables set to "all": each must parse, and each query of the proxy
dashboard must return at least one series (a query on a metric the proxy does not export returns none and
fails). A second test has it scrape a real learner loop (the tiny model, DeepSpeed on the CPU, two steps on
recorded rollouts) for the learner dashboard and the run overview's learner panels; the operator's queries
return series in test_chart_cluster.py, which scrapes a real operator.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kube_helpers
import pytest
import yaml
from test_learner_learning import tiny, trajectories

__all__ = ["tiny"]  # the fixture, imported
ROOT = Path(__file__).resolve().parents[1]
VARIABLES = {"$namespace": ".*", "$run": ".*", "$__rate_interval": "30s"}
wait_for = functools.partial(kube_helpers.wait_for, timeout=90.0, every=1.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def host_address() -> str:
    """This machine's address on its default route (not loopback); a UDP connect sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("198.51.100.1", 9))
        address = sock.getsockname()[0]
    assert not address.startswith("127."), address
    return address


def dashboards() -> dict[str, dict[str, Any]]:
    spec = importlib.util.spec_from_file_location("harnessrl_chart_dashboards", ROOT / "charts" / "dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name.removesuffix(".json"): json.loads(text) for name, text in module.render().items()}


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL with the variables set to all) of every panel target."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets") or []:
            expr = target["expr"]
            for variable, value in VARIABLES.items():
                expr = expr.replace(variable, value)
            out.append((panel["title"], expr))
    return out


class Processes:
    """Processes this test starts, stopped by their own ids (never by name)."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.started = logs, []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd="/")
        self.started.append((name, process, log))
        return process

    def tail(self) -> str:
        return "\n".join(f"--- {name}\n" + (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
                         for name, _, _ in self.started)

    def stop(self) -> None:
        for _, process, log in reversed(self.started):
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()


@pytest.fixture
def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("HARNESSRL_TEST_PROMETHEUS_REQUIRED", "1") != "0":
            pytest.fail("no prometheus binary: run scripts/chart-tools.sh (apt-get install prometheus)",
                        pytrace=False)
        pytest.skip("no prometheus binary (HARNESSRL_TEST_PROMETHEUS_REQUIRED=0)")
    return binary


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    running = Processes(tmp_path)
    try:
        yield running
    finally:
        print(running.tail())  # shown when the test fails
        running.stop()


def ask(prometheus: str, expr: str, since: float | None = None) -> dict[str, Any]:
    """The query's answer now, or with ``since`` every series it had at any second since then."""
    if since is None:
        url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    else:
        span = {"query": expr, "start": since, "end": time.time(), "step": 1}
        url = f"{prometheus}/api/v1/query_range?" + urllib.parse.urlencode(span)
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:  # 400: the query does not parse
        return json.load(error)


def up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_prometheus(
    processes: Processes, binary: str, targets: list[str], directory: Path,
    scrape_configs: list[dict[str, Any]] | None = None,
) -> str:
    """A Prometheus scraping ``targets`` every second, or with ``scrape_configs`` instead; its URL once it is
    ready."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": scrape_configs or [{"job_name": "harnessrl", "static_configs": [{"targets": targets}]}],
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    processes.start("prometheus", [
        binary, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ])
    url = f"http://127.0.0.1:{port}"
    wait_for("prometheus", lambda: up(f"{url}/-/ready"))
    return url


def store_outage(store_url: str, refuse: bool) -> None:
    """The store's database refuses new connections (and its open ones are ended), or takes them again."""
    from sqlalchemy import create_engine, make_url, text

    url = make_url(store_url)
    engine = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text(f'ALTER DATABASE "{url.database}" ALLOW_CONNECTIONS {"false" if refuse else "true"}'))
        if refuse:
            connection.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
                               {"d": url.database})
    engine.dispose()


@pytest.mark.postgres
def test_every_dashboard_query_runs_on_prometheus_and_the_proxys_return_series(
    prometheus_binary: str, processes: Processes, tmp_path: Path, pg_url: str
) -> None:
    bin_dir = Path(sys.executable).parent
    upstream_port, proxy_port, metrics_port = free_port(), free_port(), free_port()
    processes.start("upstream", [sys.executable, "-m", "harnessrl.proxy.fake_upstream", "--port", str(upstream_port)])
    processes.start("proxy", [
        str(bin_dir / "harnessrl"), "proxy", "--upstream", f"http://127.0.0.1:{upstream_port}",
        "--store", pg_url, "--upgrade-db", "--port", str(proxy_port),
        "--run", "dash", "--spool", str(tmp_path / "proxy.spool"), "--metrics-port", str(metrics_port),
    ])
    # Prometheus scrapes the metrics listener a sidecar's proxy opens on its pod's address (its API is on
    # loopback): /metrics alone, on every address.
    prometheus = start_prometheus(processes, prometheus_binary, [f"127.0.0.1:{metrics_port}"], tmp_path)
    proxy = f"http://127.0.0.1:{proxy_port}"
    wait_for("the proxy", lambda: up(f"{proxy}/healthz"))
    metrics = f"http://{host_address()}:{metrics_port}"
    assert httpx.get(f"{metrics}/metrics").status_code == 200
    assert httpx.get(f"{metrics}/healthz").status_code == 404
    assert httpx.post(f"{metrics}/v1/chat/completions", json={"model": "m", "messages": []}).status_code == 404
    # A harness's traffic: calls of a few rollouts, each ending with its reward, over some scrapes; calls 6 to
    # 11 meet a store outage (spooled), replayed once it is back.
    with httpx.Client(timeout=30) as client:
        for i in range(18):
            if i in (6, 12):
                store_outage(pg_url, refuse=i == 6)
            base = f"{proxy}/rollouts/dash-r{i % 4}/attempts/0/v1"
            answer = client.post(f"{base}/chat/completions",
                                 json={"model": "m", "messages": [{"role": "user", "content": f"hello {i}"}]})
            assert answer.status_code == 200, answer.text
            time.sleep(0.5)
        for r in range(4):
            assert client.post(f"{proxy}/rollouts/dash-r{r}/attempts/0/v1/reward", json={"value": 0.5}).is_success

    boards = dashboards()
    for name, dashboard in boards.items():
        for title, expr in queries(dashboard):
            answer = ask(prometheus, expr)
            assert answer["status"] == "success", f"{name}: {title!r}: {expr}: {answer.get('error')}"
    for title, expr in queries(boards["proxy"]):
        wait_for(f"a series for proxy panel {title!r}: {expr}", lambda expr=expr: ask(prometheus, expr)["data"]["result"])


@pytest.mark.slow
def test_the_learner_panels_return_series_from_a_real_learner(
    prometheus_binary: str, processes: Processes, tmp_path: Path, tiny: Path
) -> None:
    from learner_helpers import record_group
    from prometheus_client import start_http_server

    from harnessrl.store import TraceStore
    from harnessrl.trainer.engine import EngineSettings, PolicyEngine
    from harnessrl.trainer.learner import Learner, LearnerSettings
    from harnessrl.trainer.metrics import LearnerMetrics

    store = TraceStore.connect(f"sqlite:///{tmp_path / 'store.db'}")
    store.upgrade()
    samples = trajectories(tiny)
    for task in ("t0", "t1"):
        record_group(store, "dash", task, samples)
    settings = LearnerSettings(run="dash", model_dir=tiny, output_dir=tmp_path / "out", steps=2, tasks_per_step=1,
                               group_size=4, engine=EngineSettings(lr=5e-4), wait_timeout_s=0)
    metrics = LearnerMetrics()
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    try:
        prometheus = start_prometheus(processes, prometheus_binary, [f"127.0.0.1:{port}"], tmp_path)
        started = time.time()
        outcomes = Learner(settings, PolicyEngine(tiny, settings.engine), store, metrics=metrics).run()
        assert [o.version for o in outcomes] == [1, 2]
        boards = dashboards()
        learner_queries = queries(boards["learner"]) + [
            (title, expr) for title, expr in queries(boards["runs"]) if "harnessrl_operator_" not in expr
        ]
        assert len(learner_queries) > len(queries(boards["learner"]))
        for title, expr in learner_queries:
            wait_for(f"a series for learner panel {title!r}: {expr}",
                     lambda expr=expr: ask(prometheus, expr, since=started)["data"]["result"])
        # And the numbers are the learner's: its last step reaches Prometheus (at the next scrape).
        wait_for("Prometheus to see step 2",
                 lambda: [r for r in ask(prometheus, "max(harnessrl_learner_step)")["data"]["result"]
                          if float(r["value"][1]) == 2.0])
    finally:
        server.shutdown()
        store.close()
