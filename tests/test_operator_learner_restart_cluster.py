"""A learner Job that fails past its backoffLimit after committing steps is recreated, so the incidents of a
long run (a node lost, a pod killed, a database restart) never add up to a lifetime limit; one that fails
without committing a step fails the run. On the real control plane with kwok nodes: the Job controller decides
that the Job failed (its backoffLimit lowered to 0, its pod deleted), the test plays the learner's commits.
"""

from __future__ import annotations

import functools
import json

import kube_helpers
import pytest
from test_operator_cluster import get, operator, training_run

from harnessrl.devcluster import Cluster
from harnessrl.store import TraceStore
from harnessrl.store.learner_ledger import LearnerLedger

pytestmark = pytest.mark.postgres

wait_for = functools.partial(kube_helpers.wait_for, timeout=120.0)
RUN = "restarts"


def learner_job(kube: Cluster, ns: str) -> dict | None:
    found = kube.kubectl("get", "job", f"{RUN}-learner", "-n", ns, "-o", "json", check=False)
    return json.loads(found.stdout) if found.returncode == 0 else None


def fail_the_job(kube: Cluster, ns: str) -> str:
    """The Job controller fails the Job: no failure left in its backoffLimit, then its pod goes."""
    job = wait_for("the learner Job", lambda: learner_job(kube, ns))
    uid = job["metadata"]["uid"]
    kube.kubectl("patch", "job", f"{RUN}-learner", "-n", ns, "--type=merge", "-p", '{"spec":{"backoffLimit":0}}')
    wait_for("its pod", lambda: get(kube, ns, "pods", "-l", f"controller-uid={uid}")["items"])
    kube.kubectl("delete", "pods", "-n", ns, "-l", f"controller-uid={uid}", "--wait=false")
    return uid


def status(kube: Cluster, ns: str) -> dict:
    return get(kube, ns, "tr", RUN).get("status", {})


def test_a_failed_learner_job_that_made_progress_is_recreated_and_one_that_did_not_fails_the_run(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = kube_namespace
    run = training_run(RUN, pg_url)
    run["spec"]["learner"]["steps"] = 1000  # the run stays Running
    store = TraceStore.connect(pg_url)
    ledger = LearnerLedger(store, RUN)
    try:
        with operator(kube, ns, monkeypatch):
            kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(run))
            wait_for("the run Running", lambda: status(kube, ns).get("phase") == "Running")
            first = wait_for("the operator to count from the Job", lambda: status(kube, ns).get("learner"))
            assert first == {"restarts": 0, "jobUid": learner_job(kube, ns)["metadata"]["uid"], "sinceStep": 0}

            ledger.consume(1, None, [])  # the learner commits a step, then its Job fails past its backoff
            failed_uid = fail_the_job(kube, ns)
            recreated = wait_for(
                "the Job recreated",
                lambda: (job := learner_job(kube, ns)) and job["metadata"]["uid"] != failed_uid and job,
            )
            counted = wait_for(
                "the restart counted",
                lambda: (s := status(kube, ns)).get("learner", {}).get("jobUid") == recreated["metadata"]["uid"]
                and s,
            )
            assert counted["phase"] == "Running", counted
            assert counted["learner"] == {"restarts": 1, "jobUid": recreated["metadata"]["uid"], "sinceStep": 1}
            events = get(kube, ns, "events", "--field-selector", f"involvedObject.name={RUN}")["items"]
            restarted = [e for e in events if e["reason"] == "LearnerRestarted"]
            assert len(restarted) == 1 and restarted[0]["type"] == "Warning", events
            assert "after committing steps 1-1" in restarted[0]["message"], restarted[0]
            assert "BackoffLimitExceeded" in restarted[0]["message"], restarted[0]

            # The recreated Job fails before committing anything: not transient, the run fails.
            fail_the_job(kube, ns)
            ended = wait_for("the run to fail", lambda: (s := status(kube, ns)).get("phase") == "Failed" and s)
            assert ended["reason"] == "LearnerCrashed", ended
            assert "without committing a step since it started (at step 1)" in ended["message"], ended
            assert ended["learner"]["restarts"] == 1
            kube.kubectl("delete", "tr", RUN, "-n", ns, "--wait=true", "--timeout=60s")
    finally:
        store.close()
