"""Why vLLM is not serving, in the kubelet's words (issue 22, item 9), on the real control plane: the replica
is pinned (spec.rollout.scheduling) to a node no kwok manages, and the test writes its pod status (and Events)
as a kubelet would: for a container killed for memory and restarted in a loop, and for a volume that cannot be
attached. The run says RolloutUnavailable with the kubelet's reason on RolloutReady, the message names what to
change, and a Warning Event says so; before, all it said was "0/1 vLLM replicas serve the model"."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import pytest
from test_operator_cluster import get, operator, training_run, wait_for
from test_operator_outage_cluster import phase

from harnessrl.devcluster import Cluster
from harnessrl.devcluster.kwok import NODE_LABEL, fake_node

pytestmark = pytest.mark.postgres

NODE = "kubelet-by-hand"


@contextmanager
def replica_on_a_hand_node(kube: Cluster, ns: str, name: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
                           ) -> Iterator[dict[str, Any]]:
    """The run ``name`` under the operator, its one vLLM replica bound to a node whose kubelet is the test."""
    node = fake_node(NODE)
    del node["metadata"]["labels"][NODE_LABEL[0]]  # kwok leaves it alone: this test is its kubelet
    node["metadata"]["annotations"] = {}
    kube.kubectl("apply", "-f", "-", input=json.dumps(node))
    run = training_run(name, pg_url)
    run["spec"]["rollout"]["scheduling"] = {"nodeSelector": {"kubernetes.io/hostname": NODE}}
    try:
        with operator(kube, ns, monkeypatch):
            kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(run))
            selector = f"harnessrl.io/run={name},harnessrl.io/component=rollout"
            yield wait_for("the replica bound to the node", lambda: [
                p for p in get(kube, ns, "pods", "-l", selector)["items"] if p["spec"].get("nodeName") == NODE
            ])[0]
            kube.kubectl("delete", "tr", "--all", "-n", ns, "--wait=true", "--timeout=90s")
    finally:
        kube.kubectl("delete", "node", NODE, "--wait=false", check=False)


def write_status(kube: Cluster, ns: str, pod: dict[str, Any], phase: str, **container: Any) -> None:
    """The pod's status as its kubelet would write it: every container in the state ``container`` gives."""
    statuses = [{"name": c["name"], "image": c["image"], "imageID": "", "ready": False, "started": False,
                 "restartCount": 0, **container} for c in pod["spec"]["containers"]]
    kube.kubectl("patch", "pod", pod["metadata"]["name"], "-n", ns, "--subresource=status", "--type=merge", "-p",
                 json.dumps({"status": {"phase": phase, "containerStatuses": statuses}}))


def test_an_oom_killed_crash_looping_replica_is_named_with_the_kubelets_reason(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = kube_namespace
    with replica_on_a_hand_node(kube, ns, "oom", pg_url, monkeypatch) as pod:
        write_status(kube, ns, pod, "Running", restartCount=5,
                     state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 2m40s restarting"}},
                     lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}})
        status = wait_for("the run to name the OOM kill",
                          lambda: (s := phase(kube, ns, "oom")).get("reason") == "RolloutUnavailable" and s)
        assert status["phase"] == "Provisioning", status
        assert "OOMKilled" in status["message"] and "spec.rollout.resources.limits.memory" in status["message"]
        ready = {c["type"]: c for c in status["conditions"]}["RolloutReady"]
        assert (ready["status"], ready["reason"]) == ("False", "OOMKilled"), ready
        assert "5 restarts" in ready["message"]
        events = get(kube, ns, "events", "--field-selector", "involvedObject.name=oom")["items"]
        assert any(e["reason"] == "RolloutUnavailable" and e["type"] == "Warning" for e in events), events


def test_a_replica_whose_volume_cannot_attach_is_named_with_the_event_reason(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pod sits in ContainerCreating, and only an Event (the attach/detach controller's) says why."""
    ns = kube_namespace
    with replica_on_a_hand_node(kube, ns, "attach", pg_url, monkeypatch) as pod:
        write_status(kube, ns, pod, "Pending", state={"waiting": {"reason": "ContainerCreating"}})
        name = pod["metadata"]["name"]
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        said = ('Multi-Attach error for volume "pvc-7f3a" Volume is already used by pod(s) attach-learner-0-x '
                "on another node")
        event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": f"{name}.attach", "namespace": ns},
                 "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": ns,
                                    "uid": pod["metadata"]["uid"]},
                 "reason": "FailedAttachVolume", "message": said, "type": "Warning", "count": 1,
                 "source": {"component": "attachdetach-controller"}, "firstTimestamp": now, "lastTimestamp": now}
        kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(event))
        status = wait_for("the run to name the volume",
                          lambda: (s := phase(kube, ns, "attach")).get("reason") == "RolloutUnavailable" and s)
        assert status["phase"] == "Provisioning", status
        assert "Multi-Attach error" in status["message"] and "ReadWriteOnce" in status["message"], status
        ready = {c["type"]: c for c in status["conditions"]}["RolloutReady"]
        assert (ready["status"], ready["reason"]) == ("False", "FailedAttachVolume"), ready
        events = get(kube, ns, "events", "--field-selector", "involvedObject.name=attach")["items"]
        assert any(e["reason"] == "RolloutUnavailable" and e["type"] == "Warning" for e in events), events
