"""The pod backend's two API calls against the real API server: a create is idempotent by name, a refusal
raises with the server's status and body (the attempt then fails with it), a delete of a pod already gone is
no error. The create skips the client's model validation, so only the real server can tell it still works."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from harnessrl.devcluster import Cluster
from harnessrl.operator.pods import PodApi


@pytest.fixture
def pod_api(kube: Cluster) -> Iterator[tuple[PodApi, Any]]:
    api_client = config.new_client_from_config(config_file=str(kube.kubeconfig))
    yield PodApi(client.CoreV1Api(api_client)), client.CoreV1Api(api_client)
    api_client.close()


def pod(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "pod-api-test"}, "annotations": {"note": "ünïcode ✓"}},
        "spec": {
            "containers": [{"name": "harness", "image": "example.invalid/harness:1", "command": ["true"]}],
            # A field the client's V1Pod model may not know; sent as rendered, the server takes it.
            "initContainers": [
                {"name": "proxy", "image": "example.invalid/proxy:1", "restartPolicy": "Always"}
            ],
            **spec,
        },
    }


def test_create_is_idempotent_refusals_raise_and_deletes_of_gone_pods_pass(
    pod_api: tuple[PodApi, Any], kube_namespace: str
) -> None:
    api, core = pod_api
    api.create(kube_namespace, pod("p1"))
    api.create(kube_namespace, pod("p1"))  # the same attempt's pod again: a 409, taken as done
    stored = core.read_namespaced_pod("p1", kube_namespace)
    assert stored.metadata.annotations["note"] == "ünïcode ✓"
    assert stored.spec.init_containers[0].restart_policy == "Always"
    assert len(core.list_namespaced_pod(kube_namespace, label_selector="app=pod-api-test").items) == 1

    with pytest.raises(ApiException) as refused:
        api.create(kube_namespace, pod("p2", restartPolicy="Sometimes"))
    assert refused.value.status == 422 and "restartPolicy" in refused.value.body

    api.delete(kube_namespace, "p1", 0)
    deadline = time.monotonic() + 60
    while core.list_namespaced_pod(kube_namespace, label_selector="app=pod-api-test").items:
        assert time.monotonic() < deadline, "the deleted pod is still listed after 60 s"
        time.sleep(0.2)
    api.delete(kube_namespace, "p1", 0)  # gone already: a 404, no error


def test_a_delete_carries_its_grace_period(pod_api: tuple[PodApi, Any], kube_namespace: str) -> None:
    """On a node that nobody runs, the API server keeps a deleted pod Terminating for the grace period the
    delete asked for: the query parameter reached it. A delete with grace 0 then removes it at once."""
    api, core = pod_api
    api.create(kube_namespace, pod("p3", nodeName="no-such-node"))
    api.delete(kube_namespace, "p3", 45)
    stored = core.read_namespaced_pod("p3", kube_namespace)
    assert stored.metadata.deletion_timestamp is not None and stored.metadata.deletion_grace_period_seconds == 45
    api.delete(kube_namespace, "p3", 0)
    deadline = time.monotonic() + 60
    while core.list_namespaced_pod(kube_namespace, field_selector="metadata.name=p3").items:
        assert time.monotonic() < deadline, "the pod deleted with grace 0 is still listed after 60 s"
        time.sleep(0.2)
