"""The operator for real: kopf runs it in this process against the test control plane (kube-apiserver,
controller manager, scheduler, kwok nodes) and a real PostgreSQL trace store.

kwok plays the kubelet: the vLLM replicas become Ready at once, so the run provisions and starts rollouts. The
test plays each harness: when a harness pod appears it stores the rollout's reward (what the harness would
POST to its proxy) and annotates the pod so kwok ends it with the exit code the scenario wants.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import kube_helpers
import pytest
from kopf.testing import KopfRunner
from sqlalchemy import select

from harnessrl.devcluster import Cluster
from harnessrl.devcluster.kwok import EXIT_CODE, IMAGE_PULL_BACKOFF_IMAGE, RUN_FOR
from harnessrl.operator.metrics import METRICS
from harnessrl.operator.naming import (
    ATTEMPT_ANNOTATION,
    COMPONENT_LABEL,
    HARNESS,
    ROLLOUT_ANNOTATION,
    RUN_LABEL,
)
from harnessrl.store import RolloutState, TraceStore
from harnessrl.store.schema import Run

pytestmark = pytest.mark.postgres

# The operator provisions and schedules before anything shows: give each wait 90 s.
wait_for = functools.partial(kube_helpers.wait_for, timeout=90.0)


def training_run(name: str, store_url: str, **harness: Any) -> dict[str, Any]:
    return {
        "apiVersion": "harnessrl.io/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": "/models/tiny"},  # baked into the image: kwok runs no container to check
            "rollout": {"replicas": 1, "gpusPerReplica": 1},
            "harness": {
                "image": "example.invalid/harness:1",
                "command": ["python", "-m", "harness"],
                "tasks": {"inline": [{"id": "t1", "data": {"q": 1}}, {"id": "t2", "data": {"q": 2}}]},
                "groupSize": 2,
                "concurrency": 4,
                "timeoutSeconds": 120,
                "maxAttempts": 2,
                **harness,
            },
            # Groups outstanding are bounded by (maxStaleness + 1) * tasksPerStep: 16 rollouts, no learner here.
            "learner": {
                "steps": 3,
                "tasksPerStep": 4,
                # the claim `operator()` creates: vLLM loads what the learner writes from it
                "checkpointDir": f"/checkpoints/{name}",
                "checkpointVolume": {"pvc": CHECKPOINT_CLAIM, "mountPath": "/checkpoints", "readOnly": False},
            },
            "store": {"postgres": {"url": store_url}},
        },
    }


CHECKPOINT_CLAIM = "checkpoints"


def checkpoint_claim(
    kube: Cluster, ns: str, name: str = CHECKPOINT_CLAIM, modes: tuple[str, ...] = ("ReadWriteMany",)
) -> None:
    """A claim bound at once to a volume made for it (no provisioner runs here; kwok mounts nothing)."""
    volume = f"{ns}-{name}"[:253]
    kube.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": list(modes), "storageClassName": "",
                  "persistentVolumeReclaimPolicy": "Delete", "hostPath": {"path": f"/tmp/harnessrl-test/{volume}"},
                  "claimRef": {"namespace": ns, "name": name}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
         "spec": {"accessModes": list(modes), "storageClassName": "", "volumeName": volume,
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ]}))


def get(kube: Cluster, ns: str, *args: str) -> dict[str, Any]:
    return json.loads(kube.kubectl("get", "-n", ns, *args, "-o", "json").stdout)


def harness_pods(kube: Cluster, ns: str, run: str) -> list[dict[str, Any]]:
    return get(kube, ns, "pods", "-l", f"{RUN_LABEL}={run},{COMPONENT_LABEL}={HARNESS}")["items"]


@contextmanager
def operator(kube: Cluster, ns: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[KopfRunner]:
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))
    checkpoint_claim(kube, ns)
    args = ["run", "--standalone", "--namespace", ns, "-m", "harnessrl.operator.handlers"]
    with KopfRunner(args, timeout=120) as runner:
        yield runner
    assert runner.exception is None, runner.output


class Harnesses(threading.Thread):
    """Plays every harness pod of a run: decides its outcome, stores its reward, lets kwok end the pod."""

    def __init__(
        self,
        kube: Cluster,
        ns: str,
        run: str,
        store_url: str,
        outcome: Callable[[str, int], tuple[float | None, int | None]],
    ) -> None:
        super().__init__(daemon=True)
        self.kube, self.ns, self.run_name = kube, ns, run
        self.store = TraceStore.connect(store_url)
        self.outcome = outcome
        self.seen: set[str] = set()
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            for pod in harness_pods(self.kube, self.ns, self.run_name):
                name = pod["metadata"]["name"]
                if name in self.seen or pod["status"].get("phase") != "Running":
                    continue
                self.seen.add(name)
                annotations = pod["metadata"]["annotations"]
                rollout, attempt = annotations[ROLLOUT_ANNOTATION], int(annotations[ATTEMPT_ANNOTATION])
                reward, exit_code = self.outcome(rollout, attempt)
                if reward is not None:
                    self.store.set_reward(rollout, attempt, reward)
                if exit_code is None:
                    continue  # this harness hangs
                end = [f"{RUN_FOR}=1s"] + ([f"{EXIT_CODE}={exit_code}"] if exit_code else [])
                self.kube.kubectl("annotate", "pod", name, "-n", self.ns, *end, check=False)
            time.sleep(0.3)

    def close(self) -> None:
        self.stop_event.set()
        self.join(10)
        self.store.close()


def test_a_run_provisions_children_runs_rollouts_and_reports_status(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, run = kube_namespace, "swe"
    # Index 1 of every group fails with exit code 3 on its first attempt and succeeds on its retry.
    harnesses = Harnesses(
        kube,
        ns,
        run,
        pg_url,
        lambda rollout, attempt: (0.5, 3) if rollout.endswith("r001") and attempt == 0 else (1.0, 0),
    )
    with operator(kube, ns, monkeypatch):
        kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(training_run(run, pg_url)))
        uid = get(kube, ns, "tr", run)["metadata"]["uid"]
        harnesses.start()
        try:
            for kind, name in (
                ("deployment", f"{run}-rollout"),
                ("service", f"{run}-rollout"),
                ("service", f"{run}-rollout-pods"),
                ("job", f"{run}-learner"),
                ("service", f"{run}-learner"),
                ("networkpolicy", f"{run}-harness"),
                ("networkpolicy", f"{run}-rollout"),
            ):
                child = wait_for(
                    f"{kind}/{name}",
                    lambda kind=kind, name=name: (
                        kube.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False).stdout
                    ),
                )
                owner = json.loads(child)["metadata"]["ownerReferences"][0]
                assert (owner["kind"], owner["uid"], owner["controller"]) == ("TrainingRun", uid, True)

            # vLLM's control port admits the run's learner pods only; its pods listen through the gate alone
            ingress = get(kube, ns, "networkpolicy", f"{run}-rollout")["spec"]["ingress"]
            learners = {"podSelector": {"matchLabels": {RUN_LABEL: run, COMPONENT_LABEL: "learner"}}}
            assert ingress == [{"ports": [{"protocol": "TCP", "port": 8000}]},
                               {"from": [learners], "ports": [{"protocol": "TCP", "port": 8001}]}]
            vllm_pod = get(kube, ns, "deployment", f"{run}-rollout")["spec"]["template"]["spec"]
            assert [c["name"] for c in vllm_pod["containers"]] == ["vllm", "gate"]
            learner = get(kube, ns, "job", f"{run}-learner")["spec"]["template"]["spec"]["containers"][0]
            assert f"dns://{run}-rollout-pods:8001" in learner["command"]
            status = wait_for(
                "6 rollouts to succeed",
                lambda: (
                    s
                    if (s := get(kube, ns, "tr", run).get("status", {}))
                    .get("rollouts", {})
                    .get("succeeded", 0)
                    >= 6
                    else None
                ),
            )
            assert status["phase"] == "Running" and status["reason"] == "Running"
            conditions = {c["type"]: c["status"] for c in status["conditions"]}
            assert conditions == {
                "StoreReady": "True",
                "RolloutReady": "True",
                "LearnerReady": "True",
                "Progressing": "True",
                "CheckpointsShared": "True",
            }
            assert status["observedGeneration"] == 1
            # every pass is timed (the operator runs in this process: its registry is this one)
            passes = METRICS.registry.get_sample_value(
                "harnessrl_operator_reconcile_seconds_count", {"namespace": ns, "run": run}
            )
            assert passes is not None and passes >= 1
            # the chart's learner PodMonitor finds rank 0 by the Job controller's completion-index label
            index = f"{RUN_LABEL}={run},{COMPONENT_LABEL}=learner,batch.kubernetes.io/job-completion-index=0"
            assert len(get(kube, ns, "pods", "-l", index)["items"]) == 1
        finally:
            harnesses.close()

        store = TraceStore.connect(pg_url)
        failed = [a for a in store.list_attempts(run) if a.state is RolloutState.FAILED]
        assert failed and all(a.reason == "HarnessFailed: exit code 3 (Error)" for a in failed)
        retried = {(a.rollout_id, a.attempt) for a in store.list_attempts(run) if a.attempt == 1}
        assert {rollout for rollout, _ in retried} == {a.rollout_id for a in failed}
        # Never more than `concurrency` harness pods at once, and never two pods for one attempt.
        names = [p["metadata"]["name"] for p in harness_pods(kube, ns, run)]
        assert len(names) == len(set(names)) <= 4
        events = get(kube, ns, "events", "--field-selector", f"involvedObject.name={run}")["items"]
        assert {"Provisioning", "Running"} <= {e["reason"] for e in events}

        kube.kubectl("delete", "tr", run, "-n", ns, "--wait=true", "--timeout=60s")
        wait_for(
            "the garbage collector to remove the children",
            lambda: (
                not any(
                    get(kube, ns, kind, "-l", f"{RUN_LABEL}={run}")["items"]
                    for kind in ("deployments", "jobs", "services", "pods")
                )
            ),
        )
        active = [
            a for a in store.list_attempts(run) if a.state in (RolloutState.QUEUED, RolloutState.RUNNING)
        ]
        assert active == []  # cancelled by the finalizer; the traces stay
        assert store.count_attempts(run)[RolloutState.SUCCEEDED] >= 6
        store.close()


def test_pods_that_cannot_start_time_out_or_are_evicted_end_their_attempts(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, run = kube_namespace, "faults"
    # 15 s: long enough for the test to evict a hanging pod before its timeout, even on a loaded machine
    doc = training_run(run, pg_url, timeoutSeconds=15, maxAttempts=1, groupSize=2, concurrency=4)
    doc["spec"]["harness"]["tasks"]["inline"] = [
        {"id": "bad", "image": IMAGE_PULL_BACKOFF_IMAGE},
        {"id": "hang"},
    ]
    harnesses = Harnesses(kube, ns, run, pg_url, lambda rollout, attempt: (None, None))  # every harness hangs
    with operator(kube, ns, monkeypatch):
        kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
        wait_for(
            "the Running phase", lambda: get(kube, ns, "tr", run).get("status", {}).get("phase") == "Running"
        )
        harnesses.start()
        try:
            store = TraceStore.connect(pg_url)

            def both_ended() -> list[str] | None:
                reasons = [a.reason or "" for a in store.list_attempts(run)]
                pulled = any(r.startswith("HarnessFailed: ImagePullBackOff") for r in reasons)
                timed_out = any(r.startswith("Timeout:") for r in reasons)
                return reasons if pulled and timed_out else None

            reasons = wait_for("an image-pull failure and a timeout", both_ended)
            assert any(r.startswith("HarnessFailed: ImagePullBackOff") for r in reasons), reasons
            assert any(r.startswith("Timeout: ran past harness.timeoutSeconds=15") for r in reasons), reasons

            # Evict a running pod the way the kubelet does: the attempt fails with the eviction's reason. The
            # newest running pod, which has the most time left before its timeout; another one if it went.
            def evict_one() -> dict[str, Any] | None:
                running = [
                    p
                    for p in harness_pods(kube, ns, run)
                    if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
                ]
                if not running:
                    return None
                pod = max(running, key=lambda p: p["metadata"]["creationTimestamp"])
                evicted = copy.deepcopy(pod["status"])
                evicted.update(
                    phase="Failed", reason="Evicted", message="The node was low on resource: memory."
                )
                patched = kube.kubectl(
                    "patch",
                    "pod",
                    pod["metadata"]["name"],
                    "-n",
                    ns,
                    "--subresource=status",
                    "--type=merge",
                    "-p",
                    json.dumps({"status": evicted}),
                    check=False,
                )
                return pod if patched.returncode == 0 else None

            pod = wait_for("a running hang pod, evicted", evict_one)
            rollout = pod["metadata"]["annotations"][ROLLOUT_ANNOTATION]
            attempt = int(pod["metadata"]["annotations"][ATTEMPT_ANNOTATION])
            record = wait_for(
                "the eviction to fail the attempt",
                lambda: (
                    a if (a := store.get_attempt(rollout, attempt)).state is RolloutState.FAILED else None
                ),
            )
            assert record.reason == "HarnessFailed: Evicted: The node was low on resource: memory."
            store.close()
        finally:
            harnesses.close()
        kube.kubectl("delete", "tr", run, "-n", ns, "--wait=true", "--timeout=60s")


def test_suspend_resume_and_changed_concurrency_and_replicas_act_on_the_running_run(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, run = kube_namespace, "pausable"
    doc = training_run(run, pg_url)
    doc["spec"]["suspend"] = True
    with operator(kube, ns, monkeypatch):
        kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
        wait_for(
            "the Suspended phase",
            lambda: get(kube, ns, "tr", run).get("status", {}).get("phase") == "Suspended",
        )
        time.sleep(3)
        assert harness_pods(kube, ns, run) == []
        kube.kubectl("patch", "tr", run, "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": false}}')
        wait_for("pods after resume", lambda: len(harness_pods(kube, ns, run)) == 4)
        assert get(kube, ns, "tr", run)["status"]["phase"] == "Running"
        # The changeable fields act on the running run: two more harness pods, a second vLLM replica.
        change = {"spec": {"harness": {"concurrency": 6}, "rollout": {"replicas": 2}}}
        kube.kubectl("patch", "tr", run, "-n", ns, "--type=merge", "-p", json.dumps(change))
        wait_for("pods after raising concurrency", lambda: len(harness_pods(kube, ns, run)) == 6)
        wait_for(
            "a second vLLM replica",
            lambda: get(kube, ns, "deployment", f"{run}-rollout")["spec"]["replicas"] == 2,
        )
        time.sleep(2)
        assert len(harness_pods(kube, ns, run)) == 6
        kube.kubectl("delete", "tr", run, "-n", ns, "--wait=true", "--timeout=60s")


def test_a_restarted_operator_creates_no_duplicate_and_loses_no_rollout(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, run = kube_namespace, "restart"
    hold = threading.Event()
    harnesses = Harnesses(
        kube, ns, run, pg_url, lambda rollout, attempt: (1.0, 0) if hold.is_set() else (1.0, None)
    )
    with operator(kube, ns, monkeypatch):
        kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(training_run(run, pg_url)))
        harnesses.start()
        running = wait_for(
            "4 running harness pods",
            lambda: (
                p
                if len(p := [x for x in harness_pods(kube, ns, run) if x["status"].get("phase") == "Running"])
                == 4
                else None
            ),
        )
    before = sorted(p["metadata"]["name"] for p in running)
    store = TraceStore.connect(pg_url)
    assert store.count_attempts(run)[RolloutState.RUNNING] == 4
    with operator(kube, ns, monkeypatch):
        time.sleep(5)  # several reconciles of the restarted operator
        assert sorted(p["metadata"]["name"] for p in harness_pods(kube, ns, run)) == before
        assert store.count_attempts(run)[RolloutState.RUNNING] == 4  # none declared lost
        hold.set()
        harnesses.seen.clear()  # the same pods now finish
        wait_for(
            "the held rollouts to succeed",
            lambda: all(
                store.get_attempt(name.rsplit("-a", 1)[0], 0).state is RolloutState.SUCCEEDED
                for name in before
            ),
        )
        harnesses.close()
        kube.kubectl("delete", "tr", run, "-n", ns, "--wait=true", "--timeout=60s")
    store.close()


def test_a_missing_secret_is_reported_naming_the_field_and_the_run_waits_for_it(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, run = kube_namespace, "nosecret"
    doc = training_run(run, pg_url)
    doc["spec"]["store"] = {"postgres": {"secretRef": {"name": "db", "key": "url"}}}
    with operator(kube, ns, monkeypatch):
        kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
        status = wait_for(
            "the InvalidSpec reason",
            lambda: (
                s
                if (s := get(kube, ns, "tr", run).get("status", {})).get("reason") == "InvalidSpec"
                else None
            ),
        )
        assert status["phase"] == "Pending"
        assert status["message"].startswith(
            "spec.store.postgres.secretRef: Secret 'db' not found in namespace"
        )
        events = get(kube, ns, "events", "--field-selector", f"involvedObject.name={run}")["items"]
        assert any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in events)
        kube.kubectl("create", "secret", "generic", "db", "-n", ns, "--from-literal=uri=wrong-key")
        wait_for(
            "the missing key named",
            lambda: get(kube, ns, "tr", run).get("status", {}).get("message", "").startswith(
                "spec.store.postgres.secretRef: Secret 'db' has no key 'url' — add the key or point "
                "spec.store.postgres.secretRef.key at the key that holds it"
            ),
        )
        kube.kubectl("delete", "secret", "db", "-n", ns)
        kube.kubectl("create", "secret", "generic", "db", "-n", ns, f"--from-literal=url={pg_url}")
        wait_for(
            "the run to proceed once the Secret exists",
            lambda: get(kube, ns, "tr", run).get("status", {}).get("phase") == "Running",
        )
        kube.kubectl("delete", "tr", run, "-n", ns, "--wait=true", "--timeout=60s")


def test_a_run_whose_name_another_namespace_uses_in_the_store_fails_naming_it(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store names runs by name alone: a run of a name another namespace's TrainingRun holds in the same
    store fails (InvalidSpec, metadata.name), and that run's rows stay as they were."""
    ns, run = kube_namespace, f"owned-{kube_namespace[-6:]}"
    store = TraceStore.connect(pg_url)
    store.upgrade()
    store.ensure_run(run, {"theirs": True}, owner=f"elsewhere/{run}")
    with operator(kube, ns, monkeypatch):
        kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(training_run(run, pg_url)))
        status = wait_for("the run to fail", lambda: s if (
            s := get(kube, ns, "tr", run).get("status", {})).get("phase") == "Failed" else None)
        assert status["reason"] == "InvalidSpec", status
        assert status["message"].startswith(
            f"metadata.name: the trace store already holds a run '{run}' of TrainingRun elsewhere/{run}"), status
        assert not harness_pods(kube, ns, run)
        kube.kubectl("delete", "tr", run, "-n", ns, "--wait=true", "--timeout=60s")
    with store.engine.connect() as conn:
        assert conn.execute(select(Run.owner, Run.spec).where(Run.name == run)).one() == (
            f"elsewhere/{run}", {"theirs": True})
    store.close()


def test_a_run_with_a_verifier_gets_one_reward_token_that_the_harness_never_sees(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, run = kube_namespace, "verified"
    doc = training_run(run, pg_url, verifier={"command": ["python", "-m", "verify"]})
    with operator(kube, ns, monkeypatch):
        kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
        pods = wait_for("harness pods", lambda: harness_pods(kube, ns, run))
        secret = get(kube, ns, "secret", f"{run}-reward")
        token = secret["data"]["token"]
        assert len(token) > 40 and secret["metadata"]["ownerReferences"][0]["name"] == run
        spec = pods[0]["spec"]
        assert [c["name"] for c in spec["initContainers"]] == ["proxy", "harness"]
        assert [c["name"] for c in spec["containers"]] == ["verifier"]
        holders = {
            c["name"]
            for c in [*spec["initContainers"], *spec["containers"]]
            for var in c.get("env", [])
            if var["name"] == "HARNESSRL_REWARD_TOKEN"
        }
        assert holders == {"proxy", "verifier"}
        # Children are applied again after a change; the token stays what it was.
        kube.kubectl(
            "patch", "tr", run, "-n", ns, "--type=merge", "-p", '{"spec": {"harness": {"concurrency": 3}}}'
        )
        wait_for(
            "the change observed",
            lambda: get(kube, ns, "tr", run).get("status", {}).get("observedGeneration") == 2,
        )
        assert get(kube, ns, "secret", f"{run}-reward")["data"]["token"] == token
        kube.kubectl("delete", "tr", run, "-n", ns, "--wait=true", "--timeout=60s")


def test_vllm_pods_that_cannot_run_are_reported_naming_the_field(
    kube: Cluster, kube_namespace: str, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real scheduler finds no node with 64 GPUs; kwok's kubelet cannot pull the image: each run stays
    Provisioning with the reason, a message naming the field, and a Warning Event."""
    ns = kube_namespace
    greedy = training_run("greedy", pg_url)
    greedy["spec"]["rollout"]["gpusPerReplica"] = 64
    unpullable = training_run("unpullable", pg_url)
    unpullable["spec"]["rollout"]["image"] = IMAGE_PULL_BACKOFF_IMAGE
    with operator(kube, ns, monkeypatch):
        for doc in (greedy, unpullable):
            kube.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))
        for run, reason, field in (
            ("greedy", "Unschedulable", "spec.rollout.gpusPerReplica"),
            ("unpullable", "ImagePullFailed", "spec.rollout.image"),
        ):
            status = wait_for(
                f"{run}: reason {reason}",
                lambda run=run, reason=reason: (
                    s if (s := get(kube, ns, "tr", run).get("status", {})).get("reason") == reason else None
                ),
            )
            assert status["phase"] == "Provisioning" and field in status["message"], status
            rollout = {c["type"]: c for c in status["conditions"]}["RolloutReady"]
            assert rollout["status"] == "False" and field in rollout["message"]
            events = get(kube, ns, "events", "--field-selector", f"involvedObject.name={run}")["items"]
            assert any(e["reason"] == reason and e["type"] == "Warning" for e in events), events
            assert harness_pods(kube, ns, run) == []  # no harness pod while no replica serves
        for run in ("greedy", "unpullable"):
            kube.kubectl("delete", "tr", run, "-n", ns, "--wait=true", "--timeout=60s")
