"""Finished runs give their accelerators back at once (issue 22, item 8), on the real control plane with kwok
nodes: when a run succeeds or fails, its vLLM Deployment is scaled to 0 and its learner Job deleted with its
pods, without waiting for spec.ttlSecondsAfterFinished; the Deployment object, the Services, the run's Secret
and the stored traces stay."""

from __future__ import annotations

import json

import pytest
from test_operator_cluster import Harnesses, get, operator, training_run, wait_for
from test_operator_outage_cluster import phase

from harnessrl.devcluster import Cluster
from harnessrl.store import TraceStore
from harnessrl.store.learner_ledger import LearnerLedger

pytestmark = pytest.mark.postgres


def component_pods(kube: Cluster, ns: str, run: str, component: str) -> list[dict]:
    selector = f"harnessrl.io/run={run},harnessrl.io/component={component}"
    return get(kube, ns, "pods", "-l", selector)["items"]


def assert_released(kube: Cluster, ns: str, run: str) -> None:
    wait_for(
        f"{run}: no vLLM or learner pod left",
        lambda: not component_pods(kube, ns, run, "rollout") and not component_pods(kube, ns, run, "learner"),
    )
    assert get(kube, ns, "deployment", f"{run}-rollout")["spec"]["replicas"] == 0
    assert kube.kubectl("get", "job", f"{run}-learner", "-n", ns, check=False).returncode != 0
    kept = (("service", f"{run}-rollout"), ("service", f"{run}-learner"), ("secret", f"{run}-config"))
    for kind, name in kept:
        assert get(kube, ns, kind, name)["metadata"]["name"] == name
    events = get(kube, ns, "events", "--field-selector", f"involvedObject.name={run}")["items"]
    released = [e["message"] for e in events if e["reason"] == "Released"]
    assert released and "deleted Job" in released[0] and "to 0" in released[0], released


def test_succeeded_and_failed_runs_release_vllm_and_the_learner(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = kube_namespace
    done = training_run("done", pg_url)
    done["spec"]["learner"]["steps"] = 1
    late = training_run("late", pg_url)
    late["spec"]["activeDeadlineSeconds"] = 5  # fails with DeadlineExceeded while vLLM and the learner run
    harnesses = Harnesses(kube, ns, "done", pg_url, lambda rollout, attempt: (1.0, 0))
    with operator(kube, ns, monkeypatch):
        for doc in (done, late):
            kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
        harnesses.start()
        try:
            wait_for("rollouts to succeed", lambda: phase(kube, ns, "done").get("rollouts", {}).get("succeeded"))
            assert component_pods(kube, ns, "done", "rollout") and component_pods(kube, ns, "done", "learner")
            with TraceStore.connect(pg_url) as store:
                LearnerLedger(store, "done").commit(1, "/ckpt/v1", {}, [])  # the learner's last step
                stored = len(store.list_attempts("done"))
            status = wait_for(
                "done to succeed", lambda: (s := phase(kube, ns, "done")).get("phase") == "Succeeded" and s
            )
            assert status["reason"] == "Completed"
            assert_released(kube, ns, "done")
            with TraceStore.connect(pg_url) as store:
                assert len(store.list_attempts("done")) >= stored > 0  # the traces stay
        finally:
            harnesses.close()
        status = wait_for("late to fail", lambda: (s := phase(kube, ns, "late")).get("phase") == "Failed" and s)
        assert status["reason"] == "DeadlineExceeded"
        assert_released(kube, ns, "late")
        for run in ("done", "late"):
            kube.kubectl("delete", "tr", run, "-n", ns, "--wait=true", "--timeout=60s")
