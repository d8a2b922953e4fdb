"""The pod informer's typed decoding: summaries from the few fields it decodes equal summaries from whole pods.

Fast unit-level checks with the watch stream and the list given as the API server sends them (JSON text);
the informer against the real API server runs in tests/test_operator_cluster.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from harnessrl.operator.naming import ATTEMPT_ANNOTATION, COMPONENT_LABEL, ROLLOUT_ANNOTATION, RUN_LABEL
from harnessrl.operator.pod_informer import PodInformer
from harnessrl.operator.pods import summarize_pod
from harnessrl.operator.workload_pods import summarize_workload_pod

SPEC_BULK = {  # what a real pod carries besides what the informer reads: decoding must skip it
    "containers": [{"name": "harness", "image": "h:1", "env": [{"name": f"E{i}", "value": "x" * 50} for i in range(30)]}],
    "initContainers": [{"name": "proxy", "restartPolicy": "Always", "image": "p:1"}],
    "volumes": [{"name": "task", "configMap": {"name": "t"}}],
}
MANAGED = [{"manager": "kwok", "operation": "Update", "fieldsV1": {"f:status": {"f:phase": {}}}}]


def harness_pod(name: str, phase: str, state: dict[str, Any] | None = None, **status: Any) -> dict[str, Any]:
    body_status: dict[str, Any] = {"phase": phase, "hostIP": "10.0.0.1", "qosClass": "Burstable", **status}
    if state is not None:
        body_status["containerStatuses"] = [
            {"name": "harness", "state": state, "image": "h:1", "ready": False, "restartCount": 0},
            {"name": "other", "state": {"running": {"startedAt": "2026-12-04T10:00:09Z"}}},
        ]
        body_status["initContainerStatuses"] = [{"name": "proxy", "state": {"running": {}}, "started": True}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": "u-" + name,
            "resourceVersion": "17",
            "creationTimestamp": "2026-12-04T10:00:00Z",
            "labels": {RUN_LABEL: "swe", COMPONENT_LABEL: "harness"},
            "annotations": {ROLLOUT_ANNOTATION: name, ATTEMPT_ANNOTATION: "1"},
            "managedFields": MANAGED,
            "ownerReferences": [{"kind": "TrainingRun", "name": "swe", "uid": "u"}],
        },
        "spec": SPEC_BULK,
        "status": body_status,
    }


PODS = [
    harness_pod("pending", "Pending"),
    harness_pod("running", "Running", {"running": {"startedAt": "2026-12-04T10:00:02Z"}}),
    harness_pod("done", "Succeeded", {"terminated": {"exitCode": 0, "reason": "Completed"}}),
    harness_pod("exit-3", "Failed", {"terminated": {"exitCode": 3, "reason": "Error", "message": "boom"}}),
    harness_pod("evicted", "Failed", reason="Evicted", message="The node was low on resource: memory."),
    harness_pod("bad-image", "Pending", {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off"}}),
]
DELETING = harness_pod("deleting", "Running", {"running": {"startedAt": "2026-12-04T10:00:02Z"}})
DELETING["metadata"]["deletionTimestamp"] = "2026-12-04T10:01:00Z"
UNSCHEDULABLE = {
    "metadata": {"name": "swe-rollout-x", "labels": {RUN_LABEL: "swe", COMPONENT_LABEL: "rollout"},
                 "managedFields": MANAGED},
    "spec": SPEC_BULK,
    "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes: GPUs"}
    ]},
}
FOREIGN = {"metadata": {"name": "someone-else", "labels": {"app": "x"}}, "spec": SPEC_BULK, "status": {}}


def lines(*events: tuple[str, dict[str, Any]]) -> list[str]:
    return [json.dumps({"type": kind, "object": obj}) for kind, obj in events]


def informer(changes: list[tuple[str, bool]] | None = None, core: Any = None) -> PodInformer:
    seen = changes if changes is not None else []
    return PodInformer(core, "ns", lambda namespace, run, summary, deleted: seen.append((summary.name, deleted)))


def test_watched_pods_are_summarized_as_from_the_whole_object() -> None:
    changes: list[tuple[str, bool]] = []
    pods = informer(changes)
    pods._follow(lines(*(("ADDED", pod) for pod in [*PODS, DELETING, UNSCHEDULABLE, FOREIGN]),
                       ("BOOKMARK", {"metadata": {"resourceVersion": "20"}})))
    expected = [summarize_pod(pod) for pod in [*PODS, DELETING]]
    assert all(summary is not None for summary in expected)
    assert sorted(pods.pods("swe"), key=lambda s: s.name) == sorted(expected, key=lambda s: s.name)
    assert pods.pods("other-run") == []
    assert pods.workload_pods("swe") == (summarize_workload_pod(UNSCHEDULABLE),)
    assert pods.workload_pods("swe")[0].problem == "Unschedulable"
    assert sorted(changes) == [("bad-image", False), ("done", False), ("evicted", False), ("exit-3", False)]
    view = pods.view("swe")
    assert view.get(("running", 1)) == summarize_pod(PODS[1]) and view.get(("running", 0)) is None
    assert pods.view("other-run").get(("running", 1)) is None and pods.view("other-run").pods() == []
    pods._follow(lines(("DELETED", PODS[1])))
    assert ("running", True) in changes and "running" not in {s.name for s in view.pods()}
    assert view.get(("running", 1)) is None


def test_an_error_event_raises_with_the_servers_message() -> None:
    error = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
             "message": "too old resource version: 5 (17)", "reason": "Expired", "code": 410}
    with pytest.raises(RuntimeError, match="too old resource version"):
        informer()._follow(lines(("ERROR", error)))


def test_a_list_replaces_the_view_and_reports_pods_gone_meanwhile() -> None:
    listing = {"kind": "PodList", "metadata": {"resourceVersion": "42"}, "items": [PODS[2], UNSCHEDULABLE, FOREIGN]}
    core = SimpleNamespace(list_namespaced_pod=lambda *a, **k: SimpleNamespace(data=json.dumps(listing).encode()))
    changes: list[tuple[str, bool]] = []
    pods = informer(changes, core)
    pods._follow(lines(("ADDED", PODS[1])))
    assert pods._relist() == "42"
    assert [s.name for s in pods.pods("swe")] == ["done"] and pods.pods("swe")[0] == summarize_pod(PODS[2])
    assert pods.view("swe").get(("running", 1)) is None and pods.view("swe").get(("done", 1)) is not None
    assert pods.workload_pods("swe") == (summarize_workload_pod(UNSCHEDULABLE),)
    assert ("running", True) in changes and ("done", False) in changes
