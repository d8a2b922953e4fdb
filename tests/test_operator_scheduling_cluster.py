"""Scheduling controls on the real control plane (kube-scheduler, kwok nodes): a GPU pool that is tainted and
labelled takes the vLLM replica whose ``spec.rollout.scheduling`` tolerates the taint and selects the pool,
and refuses the learner whose ``spec.learner.scheduling`` selects it without the toleration; the run says so,
naming the field. An affinity the API server refuses fails the run naming the object and the field."""

from __future__ import annotations

import functools
import json

import kube_helpers
import pytest
from test_operator_cluster import get, operator, training_run
from test_operator_outage_cluster import phase as status_of

from harnessrl.devcluster import Cluster
from harnessrl.devcluster.kwok import fake_node

pytestmark = pytest.mark.postgres

wait_for = functools.partial(kube_helpers.wait_for, timeout=90.0)
POOL = ("harnessrl.test/pool", "tainted-gpus")
TAINT = {"key": "harnessrl.test/gpu", "value": "1", "effect": "NoSchedule"}


def test_tainted_pools_take_only_the_components_that_tolerate_them(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = kube_namespace
    node = fake_node("tainted-gpu-1")
    node["metadata"]["labels"][POOL[0]] = POOL[1]
    node["spec"] = {"taints": [TAINT]}
    kube.kubectl("apply", "-f", "-", input=json.dumps(node))
    pool = {"nodeSelector": {POOL[0]: POOL[1]}}
    run = training_run("pooled", pg_url)
    run["spec"]["rollout"]["scheduling"] = {
        **pool,
        "tolerations": [{"key": TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}],
    }
    run["spec"]["learner"]["scheduling"] = pool  # no toleration: no node takes it
    bad = training_run("bad-affinity", pg_url)
    bad["spec"]["rollout"]["scheduling"] = {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": []  # at least one is required
        }}}
    }
    try:
        with operator(kube, ns, monkeypatch):
            for doc in (run, bad):
                kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
            status = wait_for(
                "the learner reported unschedulable",
                lambda: (s := status_of(kube, ns, "pooled")).get("reason") == "Unschedulable" and s,
            )
            # vLLM serves from the tainted pool; rollouts go on, and the run names what stops the learner.
            assert status["phase"] == "Running", status
            assert "spec.learner.scheduling" in status["message"], status
            learner = {c["type"]: c for c in status["conditions"]}["LearnerReady"]
            assert learner["status"] == "False" and "untolerated taint" in learner["message"], learner
            replicas = get(kube, ns, "pods", "-l", "harnessrl.io/run=pooled,harnessrl.io/component=rollout")
            assert [p["spec"]["nodeName"] for p in replicas["items"]] == ["tainted-gpu-1"]

            failed = wait_for(
                "the refused affinity to fail its run",
                lambda: (s := status_of(kube, ns, "bad-affinity")).get("phase") == "Failed" and s,
            )
            assert failed["reason"] == "InvalidSpec", failed
            assert "Deployment bad-affinity-rollout" in failed["message"], failed
            assert "nodeSelectorTerms" in failed["message"] and "scheduling.affinity" in failed["message"]
            kube.kubectl("delete", "tr", "--all", "-n", ns, "--wait=true", "--timeout=90s")
    finally:
        kube.kubectl("delete", "node", "tainted-gpu-1", "--wait=false", check=False)
