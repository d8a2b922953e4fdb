"""The proxy-injection webhook through the real admission chain: kopf serves it in this process (TLS on
127.0.0.1 with the test cluster's serving certificate) and keeps its MutatingWebhookConfiguration current;
the test control plane's kube-apiserver calls it for every opted-in pod it admits.

No trace store is touched: the TrainingRuns name a PostgreSQL URL nothing listens on (the operator's
reconciler, which runs alongside, only reports it unavailable).
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kube_helpers
import pytest
from kopf.testing import KopfRunner

from harnessrl.devcluster import Cluster
from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.naming import COMPONENT_LABEL, HARNESS, RUN_LABEL
from harnessrl.operator.render_harness import PROXY_FLUSH_SECONDS, TERMINATION_GRACE_SECONDS
from harnessrl.operator.webhook import (
    INJECTED_ANNOTATION,
    INJECTION_ANNOTATION,
    SPOOL_VOLUME,
    WebhookSettings,
    pod_patch,
    render_mutating_webhook_configuration,
)

UNREACHABLE_STORE = "postgresql+psycopg://harnessrl@127.0.0.1:9/harnessrl"

# The operator provisions and schedules before anything shows: give each wait 90 s.
wait_for = functools.partial(kube_helpers.wait_for, timeout=90.0)


def training_run(name: str, store: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"path": "/models/tiny"},
        "rollout": {"replicas": 1, "gpusPerReplica": 1},
        "harness": {
            "image": "example.invalid/harness:1",
            "command": ["python", "-m", "harness"],
            "tasks": {"inline": [{"id": "t1", "data": {"q": 1}}]},
        },
        "learner": {
            "steps": 1,
            "tasksPerStep": 1,
            "checkpointDir": "/checkpoints/run",
            "checkpointVolume": {"pvc": "checkpoints", "mountPath": "/checkpoints", "readOnly": False},
        },
        "proxy": {"port": 8123},
    }
    if store is not None:
        spec["store"] = store
    return {
        "apiVersion": "harnessrl.io/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": name},
        "spec": spec,
    }


def agent_pod(name: str, run: str | None, **metadata: Any) -> dict[str, Any]:
    """Two containers, one of which points OPENAI_BASE_URL elsewhere itself, and an init container."""
    labels = {RUN_LABEL: run} if run is not None else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels, **metadata},
        "spec": {
            "initContainers": [{"name": "setup", "image": "example.invalid/agent:1"}],
            "containers": [
                {"name": "agent", "image": "example.invalid/agent:1", "env": [{"name": "A", "value": "1"}]},
                {
                    "name": "tool",
                    "image": "example.invalid/tool:1",
                    "env": [{"name": "OPENAI_BASE_URL", "value": "http://elsewhere.invalid/v1"}],
                },
            ],
        },
    }


def get(kube: Cluster, *args: str) -> dict[str, Any]:
    return json.loads(kube.kubectl("get", *args, "-o", "json").stdout)


def create(kube: Cluster, ns: str, obj: dict[str, Any], *extra: str) -> dict[str, Any]:
    return json.loads(
        kube.kubectl("create", "-n", ns, *extra, "-o", "json", "-f", "-", input=json.dumps(obj)).stdout
    )


def proxies(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in pod["spec"].get("initContainers") or [] if c["name"] == "proxy"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container.get("env") or []}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def configuration(kube: Cluster, kube_namespace: str) -> Iterator[str]:
    """The MutatingWebhookConfiguration the test's operator manages (cluster-wide: deleted afterwards)."""
    name = f"harnessrl-proxy-injector-{kube_namespace}"
    yield name
    kube.kubectl("delete", "mutatingwebhookconfiguration", name, "--ignore-not-found", check=False)


@contextmanager
def operator(
    kube: Cluster, ns: str, configuration: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[KopfRunner]:
    """The operator with the webhook, once the API server injects through it (index filled, config live)."""
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))
    monkeypatch.delenv("HARNESSRL_OPERATOR_STORE_URL", raising=False)
    monkeypatch.setenv("HARNESSRL_WEBHOOK_LISTEN", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("HARNESSRL_WEBHOOK_CERT", str(kube.pki.serving_cert))
    monkeypatch.setenv("HARNESSRL_WEBHOOK_KEY", str(kube.pki.serving_key))
    monkeypatch.setenv("HARNESSRL_WEBHOOK_CA", str(kube.pki.ca_cert))
    monkeypatch.setenv("HARNESSRL_WEBHOOK_CONFIGURATION", configuration)
    args = ["run", "--standalone", "--namespace", ns]
    args += ["-m", "harnessrl.operator.handlers", "-m", "harnessrl.operator.webhook"]
    with KopfRunner(args, timeout=120) as runner:
        probe = agent_pod("probe", "ready")
        wait_for(
            "the webhook to inject through the API server",
            lambda: proxies(create(kube, ns, probe, "--dry-run=server")),
        )
        yield runner
    assert runner.exception is None, runner.output


def test_opted_in_pods_get_exactly_one_proxy_and_the_configuration_fails_open(
    kube: Cluster, kube_namespace: str, configuration: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = kube_namespace
    store = {"postgres": {"url": UNREACHABLE_STORE}}
    for run in (training_run("ready", store), training_run("swe", store), training_run("no-store")):
        kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(run))
    with operator(kube, ns, configuration, monkeypatch):
        manifest = json.dumps(agent_pod("agent", "swe"))
        kube.kubectl("apply", "-n", ns, "-f", "-", input=manifest)
        pod = get(kube, "pod", "agent", "-n", ns)
        (proxy,) = proxies(pod)
        assert [c["name"] for c in pod["spec"]["initContainers"]] == ["proxy", "setup"]
        assert proxy["restartPolicy"] == "Always"
        assert pod["metadata"]["annotations"][INJECTED_ANNOTATION] == "true"
        proxy_env = env_of(proxy)
        assert proxy_env["HARNESSRL_ROLLOUT_ID"] == {
            "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}
        }
        assert proxy_env["HARNESSRL_ATTEMPT"] == "0"
        assert proxy_env["HARNESSRL_POLICY_VERSION"] == "0"
        assert proxy_env["HARNESSRL_RUN"] == "swe"
        assert proxy_env["HARNESSRL_STORE_URL"] == UNREACHABLE_STORE
        assert proxy_env["HARNESSRL_PROXY_PORT"] == "8123"
        assert proxy["startupProbe"]["exec"]["command"][0] == "python3"
        assert {"name": SPOOL_VOLUME, "emptyDir": {}} in pod["spec"]["volumes"]
        # The pod asked for nothing (the API server's default is 30 s): the proxy's flush gets the harness pods'.
        assert pod["spec"]["terminationGracePeriodSeconds"] == TERMINATION_GRACE_SECONDS
        agent, tool = pod["spec"]["containers"]
        assert env_of(agent) == {
            "A": "1",
            "OPENAI_BASE_URL": "http://127.0.0.1:8123/v1",
            "HARNESSRL_REWARD_URL": "http://127.0.0.1:8123/v1/reward",
        }
        assert env_of(tool)["OPENAI_BASE_URL"] == "http://elsewhere.invalid/v1"  # its own value wins
        assert env_of(tool)["HARNESSRL_REWARD_URL"] == "http://127.0.0.1:8123/v1/reward"

        kube.kubectl("apply", "-n", ns, "-f", "-", input=manifest)
        again = get(kube, "pod", "agent", "-n", ns)
        assert len(proxies(again)) == 1 and again["spec"]["containers"] == pod["spec"]["containers"]

        clone = {"apiVersion": "v1", "kind": "Pod", "spec": copy.deepcopy(pod["spec"])}
        clone["metadata"] = {"name": "clone", "labels": pod["metadata"]["labels"]}
        clone["metadata"]["annotations"] = {INJECTED_ANNOTATION: "true"}
        clone["spec"].pop("nodeName", None)
        created = create(kube, ns, clone)
        assert len(proxies(created)) == 1 and created["spec"]["containers"] == pod["spec"]["containers"]

        generated = agent_pod("", "swe")
        del generated["metadata"]["name"]
        generated["metadata"]["generateName"] = "agent-"
        assert len(proxies(create(kube, ns, generated))) == 1

        plain = create(kube, ns, agent_pod("plain", None))
        assert not proxies(plain) and not (plain["metadata"].get("annotations") or {})
        assert env_of(plain["spec"]["containers"][0]) == {"A": "1"}

        for pod_name, run, why in (
            ("ghost-agent", "ghost", "no TrainingRun 'ghost'"),
            ("sqlite-agent", "no-store", "spec.store"),
        ):
            skipped = create(kube, ns, agent_pod(pod_name, run))
            assert not proxies(skipped) and INJECTED_ANNOTATION not in skipped["metadata"]["annotations"]
            assert skipped["metadata"]["annotations"][INJECTION_ANNOTATION].startswith("skipped: ")
            assert why in skipped["metadata"]["annotations"][INJECTION_ANNOTATION]
            assert skipped["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]

        harness = agent_pod("harness-like", "swe")
        harness["metadata"]["labels"][COMPONENT_LABEL] = HARNESS
        assert not proxies(create(kube, ns, harness))

    (webhook,) = get(kube, "mutatingwebhookconfiguration", configuration)["webhooks"]
    assert webhook["failurePolicy"] == "Ignore"
    assert webhook["sideEffects"] == "None"
    assert webhook["timeoutSeconds"] <= 10
    assert webhook["namespaceSelector"] == {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}
        ]
    }
    assert webhook["objectSelector"] == {
        "matchExpressions": [
            {"key": RUN_LABEL, "operator": "Exists"},
            {"key": COMPONENT_LABEL, "operator": "DoesNotExist"},
        ]
    }
    assert webhook["clientConfig"]["caBundle"] == base64.b64encode(kube.pki.ca_cert.read_bytes()).decode()
    assert webhook["rules"][0]["operations"] == ["CREATE"] and webhook["rules"][0]["resources"] == ["pods"]

    # The operator has stopped; its configuration stays, and the API server admits pods without the webhook.
    down = create(kube, ns, agent_pod("while-down", "swe"))
    assert not proxies(down) and not (down["metadata"].get("annotations") or {})


def test_without_the_webhook_settings_the_operator_runs_and_serves_nothing(
    kube: Cluster, kube_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kopf refuses to run with admission handlers and no server: the module must be safe to load unused."""
    ns = kube_namespace
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))
    monkeypatch.delenv("HARNESSRL_WEBHOOK_LISTEN", raising=False)
    kube.kubectl(
        "apply",
        "-n",
        ns,
        "-f",
        "-",
        input=json.dumps(training_run("swe", {"postgres": {"url": UNREACHABLE_STORE}})),
    )
    args = ["run", "--standalone", "--namespace", ns]
    args += ["-m", "harnessrl.operator.handlers", "-m", "harnessrl.operator.webhook"]
    with KopfRunner(args, timeout=120) as runner:
        wait_for("the run's status", lambda: get(kube, "tr", "swe", "-n", ns).get("status", {}).get("phase"))
        pod = create(kube, ns, agent_pod("agent", "swe"))
        assert not proxies(pod) and not (pod["metadata"].get("annotations") or {})
    assert runner.exception is None, runner.output


# --- the pure parts ----------------------------------------------------------------------------------------


def run_doc(name: str = "swe", **spec: Any) -> dict[str, Any]:
    doc = training_run(name, {"postgres": {"url": UNREACHABLE_STORE}})
    doc["spec"].update(spec)
    return doc


def test_pod_patch_leaves_injected_and_operator_pods_alone() -> None:
    config = OperatorConfig()
    pod = agent_pod("a", "swe")
    patch = pod_patch(pod, "swe", run_doc(), config)
    injected = copy.deepcopy(pod)
    injected["spec"].update(patch["spec"])
    injected["metadata"]["annotations"] = patch["metadata"]["annotations"]
    assert pod_patch(injected, "swe", run_doc(), config) == {}
    del injected["metadata"]["annotations"]
    assert pod_patch(injected, "swe", run_doc(), config) == {}  # the proxy init container alone suffices
    operator_pod = agent_pod("b", "swe")
    operator_pod["metadata"]["labels"][COMPONENT_LABEL] = "rollout"
    assert pod_patch(operator_pod, "swe", run_doc(), config) == {}


def test_pod_patch_skips_with_the_fix_when_it_cannot_inject() -> None:
    config = OperatorConfig()
    invalid = run_doc()
    del invalid["spec"]["harness"]
    note = pod_patch(agent_pod("a", "swe"), "swe", invalid, config)["metadata"]["annotations"]
    assert set(note) == {INJECTION_ANNOTATION}
    assert note[INJECTION_ANNOTATION].startswith("skipped: TrainingRun 'swe' is invalid (spec.harness")
    taken = agent_pod("a", "swe")
    taken["spec"]["volumes"] = [{"name": SPOOL_VOLUME, "emptyDir": {}}]
    note = pod_patch(taken, "swe", run_doc(), config)["metadata"]["annotations"][INJECTION_ANNOTATION]
    assert "rename it" in note


def test_the_grace_period_leaves_the_proxy_its_flush_and_keeps_a_longer_one() -> None:
    """A proxy whose pod ends during a store outage flushes its spool for up to PROXY_FLUSH_SECONDS: a pod
    asking for less grace (30 s by default) gets the harness pods' grace; one asking for more keeps it."""
    for asked, granted in ((None, TERMINATION_GRACE_SECONDS), (30, TERMINATION_GRACE_SECONDS), (3600, 3600)):
        pod = agent_pod("a", "swe")
        if asked is not None:
            pod["spec"]["terminationGracePeriodSeconds"] = asked
        patch = pod_patch(pod, "swe", run_doc(), OperatorConfig())
        assert patch["spec"]["terminationGracePeriodSeconds"] == granted
    assert TERMINATION_GRACE_SECONDS > PROXY_FLUSH_SECONDS


def test_policy_version_and_operator_store_come_from_the_run_and_config() -> None:
    doc = training_run("swe")
    doc["status"] = {"policyVersion": 7}
    patch = pod_patch(
        agent_pod("a", "swe"), "swe", doc, OperatorConfig(store_url="postgresql+psycopg://op@db/x")
    )
    proxy = env_of(patch["spec"]["initContainers"][0])
    assert proxy["HARNESSRL_POLICY_VERSION"] == "7"
    assert proxy["HARNESSRL_STORE_URL"] == {"secretKeyRef": {"name": "swe-config", "key": "store-url"}}


def test_webhook_settings_are_opt_in() -> None:
    assert WebhookSettings.from_env({}) is None
    with pytest.raises(ValueError, match="HARNESSRL_WEBHOOK_CERT"):
        WebhookSettings.from_env({"HARNESSRL_WEBHOOK_LISTEN": "0.0.0.0:9443"})
    settings = WebhookSettings.from_env(
        {"HARNESSRL_WEBHOOK_LISTEN": ":9443", "HARNESSRL_WEBHOOK_CERT": "c", "HARNESSRL_WEBHOOK_KEY": "k"}
    )
    assert settings == WebhookSettings("0.0.0.0", 9443, "c", "k")


def test_the_configuration_can_target_a_service() -> None:
    service = {"namespace": "harnessrl-system", "name": "harnessrl-operator", "port": 443}
    (webhook,) = render_mutating_webhook_configuration(service, "Q0E=")["webhooks"]
    assert webhook["clientConfig"] == {"service": {**service, "path": "/inject-proxy"}, "caBundle": "Q0E="}
    assert webhook["failurePolicy"] == "Ignore" and webhook["sideEffects"] == "None"
