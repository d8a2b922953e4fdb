"""Why vLLM is not serving, in the kubelet's words (issue 22, item 9), on the real control plane: the replica
is pinned (spec.rollout.scheduling) to a node no kwok manages, and the test writes its pod status as a kubelet
would for a container killed for memory and restarted in a loop. The run says RolloutUnavailable with the
kubelet's reason on RolloutReady, the message names the memory limit to raise, and a Warning Event says so;
before, all it said was "0/1 vLLM replicas serve the model"."""

from __future__ import annotations

import json

import pytest
from test_operator_cluster import get, operator, training_run, wait_for
from test_operator_outage_cluster import phase

from harnessrl.devcluster import Cluster
from harnessrl.devcluster.kwok import NODE_LABEL, fake_node

pytestmark = pytest.mark.postgres

NODE = "kubelet-by-hand"


def test_an_oom_killed_crash_looping_replica_is_named_with_the_kubelets_reason(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = kube_namespace
    node = fake_node(NODE)
    del node["metadata"]["labels"][NODE_LABEL[0]]  # kwok leaves it alone: this test is its kubelet
    node["metadata"]["annotations"] = {}
    kube.kubectl("apply", "-f", "-", input=json.dumps(node))
    run = training_run("oom", pg_url)
    run["spec"]["rollout"]["scheduling"] = {"nodeSelector": {"kubernetes.io/hostname": NODE}}
    try:
        with operator(kube, ns, monkeypatch):
            kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(run))
            selector = "harnessrl.io/run=oom,harnessrl.io/component=rollout"
            pod = wait_for("the replica bound to the node", lambda: [
                p for p in get(kube, ns, "pods", "-l", selector)["items"] if p["spec"].get("nodeName") == NODE
            ])[0]
            crashed = {"status": {"phase": "Running", "containerStatuses": [{
                "name": "vllm", "image": pod["spec"]["containers"][0]["image"], "imageID": "", "ready": False,
                "started": False, "restartCount": 5,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 2m40s restarting"}},
                "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
            }]}}  # fmt: skip
            kube.kubectl("patch", "pod", pod["metadata"]["name"], "-n", ns, "--subresource=status",
                         "--type=merge", "-p", json.dumps(crashed))
            status = wait_for("the run to name the OOM kill",
                              lambda: (s := phase(kube, ns, "oom")).get("reason") == "RolloutUnavailable" and s)
            assert status["phase"] == "Provisioning", status
            assert "OOMKilled" in status["message"] and "spec.rollout.resources.limits.memory" in status["message"]
            ready = {c["type"]: c for c in status["conditions"]}["RolloutReady"]
            assert (ready["status"], ready["reason"]) == ("False", "OOMKilled"), ready
            assert "5 restarts" in ready["message"]
            events = get(kube, ns, "events", "--field-selector", "involvedObject.name=oom")["items"]
            assert any(e["reason"] == "RolloutUnavailable" and e["type"] == "Warning" for e in events), events
            kube.kubectl("delete", "tr", "--all", "-n", ns, "--wait=true", "--timeout=90s")
    finally:
        kube.kubectl("delete", "node", NODE, "--wait=false", check=False)
