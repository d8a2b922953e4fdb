"""A vLLM outage long after the run started: the provisioning timeout counts from when the replicas stopped
serving, not from the run's start, so a replica that comes back within it keeps the run going; one that does
not fails it with RolloutUnavailable. On the real control plane with kwok nodes: tainting every node evicts
the replica (NoExecute) and keeps its replacement Pending, which is an outage as the operator sees it.
"""

from __future__ import annotations

import functools
import json
import time

import kube_helpers
import pytest
from test_operator_cluster import get, operator, training_run

from harnessrl.devcluster import Cluster
from harnessrl.devcluster.kwok import NODE_LABEL

pytestmark = pytest.mark.postgres

wait_for = functools.partial(kube_helpers.wait_for, timeout=90.0)
TIMEOUT_S = 4
TAINT = "harnessrl.test/outage"


def taint_nodes(kube: Cluster, on: bool) -> None:
    change = [f"{TAINT}=1:NoExecute", "--overwrite"] if on else [f"{TAINT}:NoExecute-"]
    kube.kubectl("taint", "nodes", "-l", f"{NODE_LABEL[0]}={NODE_LABEL[1]}", *change, check=False)


def phase(kube: Cluster, ns: str, run: str) -> dict:
    return get(kube, ns, "tr", run).get("status", {})


def test_an_outage_is_timed_from_when_serving_stopped(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = kube_namespace
    monkeypatch.setenv("HARNESSRL_OPERATOR_PROVISIONING_TIMEOUT_SECONDS", str(TIMEOUT_S))
    run = training_run("outage", pg_url)
    run["spec"]["learner"]["steps"] = 1000  # nothing trains here: the run stays Running
    try:
        with operator(kube, ns, monkeypatch):
            kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(run))
            wait_for("the run Running", lambda: phase(kube, ns, "outage").get("phase") == "Running")
            time.sleep(TIMEOUT_S + 1)  # the run is now older than the provisioning timeout

            # A short outage: the replica is evicted, the run waits, the replica serves again, the run goes on.
            taint_nodes(kube, on=True)
            waiting = wait_for(
                "the run to see the outage",
                lambda: (s := phase(kube, ns, "outage")).get("phase") not in ("Running", None) and s,
            )
            assert waiting["phase"] == "Provisioning", waiting
            ready = {c["type"]: c for c in waiting["conditions"]}["RolloutReady"]
            assert ready["status"] == "False"
            taint_nodes(kube, on=False)
            wait_for("the run Running again", lambda: phase(kube, ns, "outage").get("phase") == "Running")

            # An outage longer than the timeout fails the run, naming the wait.
            time.sleep(TIMEOUT_S + 1)
            taint_nodes(kube, on=True)
            failed = wait_for(
                "the run to fail", lambda: (s := phase(kube, ns, "outage")).get("phase") == "Failed" and s
            )
            assert failed["reason"] == "RolloutUnavailable", failed
            assert f"for {TIMEOUT_S} s" in failed["message"], failed
            kube.kubectl("delete", "tr", "outage", "-n", ns, "--wait=true", "--timeout=60s")
    finally:
        taint_nodes(kube, on=False)
