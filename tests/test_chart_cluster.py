"""The chart installed for real: helm v4 against the test control plane (kube-apiserver, controller manager,
scheduler, kwok nodes), and the operator running as the chart's ServiceAccount.

kwok plays the kubelet, so the operator pod the chart creates is scheduled and reported Running but no
container runs, and the chart's PostgreSQL is off here (tests/test_real_node_e2e.py installs, upgrades,
uninstalls and reinstalls the chart with its images on the real node, where its claim binds through the
provisioner). What the operator may do is proven by running the real `harnessrl operator` process on this
machine with a token of the chart's ServiceAccount from the real apiserver: it takes a run through create, pods,
status, events, deadline, TTL clean-up and delete, and the API server's audit log of that
ServiceAccount must show no refused request and every granted verb used (RBAC that grants more than the
operator does fails the test). A real Prometheus scrapes that operator meanwhile: every query of the operator
dashboard must return series (but those on counters of failures, which a healthy run never creates).

The cluster is this module's own (not the session's `kube`): it audits the ServiceAccount, and the chart
installs the CRD itself.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kube_helpers
import pytest
import yaml
from test_chart_dashboards import (
    Processes,
    ask,
    dashboards,
    free_port,
    prometheus_binary,
    queries,
    start_prometheus,
    up,
)
from test_operator_cluster import Harnesses, checkpoint_claim, training_run

from harnessrl.devcluster import BuildError, Cluster, ClusterError, start_cluster
from harnessrl.devcluster.helm import HelmError, ensure_helm

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "harnessrl"
SYSTEM = "harnessrl-system"
RELEASE = "hrl"
SERVICE_ACCOUNT = f"{RELEASE}-harnessrl"
SA_USER = f"system:serviceaccount:{SYSTEM}:{SERVICE_ACCOUNT}"

pytestmark = pytest.mark.slow
__all__ = ["prometheus_binary"]  # the fixture, imported
# Counters of failures only: a healthy run has none of their series (the names are checked in test_chart.py).
FAILURES_ONLY = ("harnessrl_operator_reconcile_errors_total", "harnessrl_operator_pod_create_failures_total")
wait_for = functools.partial(kube_helpers.wait_for, timeout=120.0)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    try:
        kube = start_cluster(Path(tempfile.mkdtemp(prefix="harnessrl-chart-")), audit_users=[SA_USER],
                             log=lambda line: None)
    except (BuildError, ClusterError) as exc:
        if os.environ.get("HARNESSRL_TEST_KUBE_REQUIRED", "1") != "0":
            pytest.fail(f"no Kubernetes control plane: {exc}", pytrace=False)
        pytest.skip(f"no Kubernetes control plane: {exc} (HARNESSRL_TEST_KUBE_REQUIRED=0)")
    try:
        yield kube
    finally:
        kube.stop()


@pytest.fixture(scope="module")
def helm(cluster: Cluster) -> Any:
    try:
        binary = ensure_helm()
    except HelmError as error:
        pytest.fail(f"no helm: {error}", pytrace=False)

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([str(binary), "--kubeconfig", str(cluster.kubeconfig), *args],
                                capture_output=True, text=True, check=False, cwd=ROOT)
        if check and result.returncode != 0:
            pytest.fail(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}", pytrace=False)
        return result

    return run


def get(kube: Cluster, *args: str) -> dict[str, Any]:
    return json.loads(kube.kubectl("get", *args, "-o", "json").stdout)


def install(kube: Cluster, helm: Any, release: str, namespace: str, *values: str) -> None:
    """helm install --wait, without the embedded PostgreSQL (the operator's store is a Secret's URL)."""
    kube.kubectl("create", "namespace", namespace)
    helm("install", release, str(CHART), "--namespace", namespace, "--wait", "--timeout", "120s",
         "--set", "postgresql.enabled=false,store.existingSecret=store", *values)


def token_kubeconfig(kube: Cluster, directory: Path) -> Path:
    """A kubeconfig that authenticates with a token the API server issued to the chart's ServiceAccount."""
    token = kube.kubectl("create", "token", SERVICE_ACCOUNT, "-n", SYSTEM, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(kube.kubeconfig.read_text())
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": admin["clusters"][0]["name"], "user": "operator"}}],
        "current-context": "operator",
    }
    path = directory / "operator.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def granted(kube: Cluster) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every rule of the release's ClusterRoles."""
    out = set()
    for name in (SERVICE_ACCOUNT, f"{SERVICE_ACCOUNT}-cluster"):
        for rule in get(kube, "clusterrole", name)["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out |= {(group, resource, verb) for verb in rule["verbs"]}
    return out


def audited(kube: Cluster) -> tuple[set[tuple[str, str, str]], list[str]]:
    """What the ServiceAccount did, as (apiGroup, resource, verb), and every refused request. A server-side
    apply that created its object (PATCH answered 201) needed create as well as patch."""
    used, refused = set(), []
    for line in kube.audit_log.read_text().splitlines():
        event = json.loads(line)
        ref = event.get("objectRef")
        if event["user"]["username"] != SA_USER or event["stage"] != "ResponseComplete" or not ref:
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        code = event.get("responseStatus", {}).get("code")
        if code == 403:
            refused.append(f"{event['verb']} {resource} in {ref.get('namespace', '(cluster)')}")
        used.add((ref.get("apiGroup", ""), resource, event["verb"]))
        if event["verb"] == "patch" and code == 201:
            used.add((ref.get("apiGroup", ""), resource, "create"))
    return used, refused


@pytest.mark.postgres
def test_the_operator_runs_a_whole_run_as_the_charts_service_account_with_exactly_its_rights(
    cluster: Cluster, helm: Any, pg_url: str, tmp_path: Path, prometheus_binary: str
) -> None:
    """Also the operator dashboard on a real Prometheus that scraped this operator: every query returns series."""
    install(cluster, helm, RELEASE, SYSTEM, "--set", "webhook.enabled=false")
    ns, run = "team-a", "rbac"
    cluster.kubectl("create", "namespace", ns)
    # The spec names a Secret (the store) and a ConfigMap (the tasks): the operator reads both.
    cluster.kubectl("create", "secret", "generic", "store", "-n", ns, f"--from-literal=url={pg_url}")
    tasks = "\n".join(json.dumps({"id": f"t{i}", "data": {"q": i}}) for i in range(4))
    cluster.kubectl("create", "configmap", "tasks", "-n", ns, f"--from-literal=tasks.jsonl={tasks}")
    checkpoint_claim(cluster, ns)  # and the checkpoint claim, for its access modes
    doc = training_run(run, pg_url)
    doc["spec"]["store"] = {"postgres": {"secretRef": {"name": "store", "key": "url"}}}
    doc["spec"]["harness"]["tasks"] = {"configMap": {"name": "tasks", "key": "tasks.jsonl"}}
    # It ends by its deadline (no learner runs here), and its children go at once (the TTL clean-up).
    doc["spec"].update(activeDeadlineSeconds=25, ttlSecondsAfterFinished=0)

    env = {**os.environ, "KUBECONFIG": str(token_kubeconfig(cluster, tmp_path))}
    log_path = tmp_path / "operator.log"
    harnesses = Harnesses(cluster, ns, run, pg_url, lambda rollout, attempt: (1.0, 0))
    # A port of its own for kopf's liveness endpoint (port 0 would be read as 80: taken when another operator
    # runs on this machine).
    metrics_port, liveness = free_port(), f"http://127.0.0.1:{free_port()}/healthz"
    processes = Processes(tmp_path)
    prometheus = start_prometheus(processes, prometheus_binary, [f"127.0.0.1:{metrics_port}"], tmp_path)
    started = time.time()
    with open(log_path, "wb") as log:
        operator = subprocess.Popen(
            [str(Path(sys.executable).parent / "harnessrl"), "operator", "--metrics-port", str(metrics_port),
             "--liveness", liveness],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/",
        )
    try:
        # What the chart's probes ask: kopf's liveness endpoint answers once the operator has started.
        wait_for("the operator's liveness endpoint", lambda: up(liveness))
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
        harnesses.start()
        wait_for("a harness pod to succeed", lambda: harnesses.seen)
        status = wait_for(
            "the run to fail by its deadline",
            lambda: s if (s := get(cluster, "tr", run, "-n", ns).get("status", {})).get("phase") == "Failed" else None,
        )
        assert status["reason"] == "DeadlineExceeded", status
        wait_for(
            "the TTL clean-up to delete the run's children",
            lambda: not get(cluster, "deployments,jobs,services,secrets,networkpolicies", "-n", ns,
                            "-l", f"harnessrl.io/run={run}")["items"],
        )
        events = get(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={run}")["items"]
        assert {"DeadlineExceeded", "CleanedUp"} <= {e["reason"] for e in events}
        cluster.kubectl("delete", "tr", run, "-n", ns, "--wait=true", "--timeout=60s")
        for title, expr in queries(dashboards()["operator"]):
            if not any(metric in expr for metric in FAILURES_ONLY):
                wait_for(f"a series for operator panel {title!r}: {expr}",
                         lambda expr=expr: ask(prometheus, expr, since=started)["data"]["result"])
    finally:
        processes.stop()
        harnesses.close()
        operator.terminate()
        operator.wait(30)
        output = log_path.read_text(errors="replace")
        run_now = cluster.kubectl("get", "tr", run, "-n", ns, "-o", "json", check=False).stdout
        # Shown when the test fails:
        print(f"operator exit code {operator.returncode}, log (tail):\n{output[-6000:]}\nrun: {run_now[-3000:]}")
    # The API server logs a watch when it ends: the operator's watches (its TrainingRuns, and the pods' Warning
    # Events for volume errors) ended with the process.
    wait_for("the operator's watches in the audit log",
             lambda: {("harnessrl.io", "trainingruns", "watch"), ("", "events", "watch")} <= audited(cluster)[0])
    used, refused = audited(cluster)
    assert not refused, f"the chart's RBAC refused the operator: {refused}\n{output[-3000:]}"
    # (the log has timestamps at INFO: look for the error's own words, not any "403")
    assert "Forbidden" not in output and "status=403" not in output, output[-3000:]
    # The operator's pod log says what it does (kopf.run alone leaves logging at warnings only).
    assert "[INFO" in output, output[-3000:]
    unused = granted(cluster) - used
    assert not unused, f"the ClusterRoles grant what the operator never did: {sorted(unused)}"


def test_the_service_account_cannot_do_what_the_operator_does_not(cluster: Cluster, helm: Any) -> None:
    """Impersonation through the real authorizer: with watchNamespaces the workload rights hold only there."""
    cluster.kubectl("create", "namespace", "team-b")
    install(cluster, helm, "narrow", "narrow-system", "--set", "operator.watchNamespaces={team-b}",
            "--set", "webhook.enabled=false")
    user = "system:serviceaccount:narrow-system:narrow-harnessrl"

    def can(*args: str) -> bool:
        result = cluster.kubectl("auth", "can-i", *args, f"--as={user}", check=False)
        return result.stdout.strip() == "yes"

    assert can("get", "secrets", "-n", "team-b") and can("create", "pods", "-n", "team-b")
    assert can("patch", "trainingruns.harnessrl.io", "--subresource=status", "-n", "team-b")
    assert can("list", "customresourcedefinitions.apiextensions.k8s.io")
    assert not can("get", "secrets", "-n", "kube-system")
    assert not can("list", "secrets", "--all-namespaces")
    assert not can("create", "pods", "-n", "default")
    assert not can("delete", "nodes")
    assert not can("create", "pods", "--subresource=exec", "-n", "team-b")
    assert not can("update", "trainingruns.harnessrl.io", "-n", "team-b")
    assert not can("get", "pods", "-n", "team-b")  # it knows its pods from list and watch only
    assert not can("create", "clusterrolebindings")
    assert not can("patch", "customresourcedefinitions.apiextensions.k8s.io")
