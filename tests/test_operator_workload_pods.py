"""vLLM and learner pods that cannot run, as the scheduler and kubelet report them, and the reason and message
(naming the spec field to change) the run shows for them. Pod bodies here are the API's shapes; the scenario
on the real control plane is in test_operator_cluster.py."""

from __future__ import annotations

from typing import Any

import pytest

from harnessrl.operator.naming import COMPONENT_LABEL, RUN_LABEL
from harnessrl.operator.volume_events import VolumeEvents
from harnessrl.operator.workload_pods import (
    WorkloadPod,
    kubelet_reason,
    summarize_workload_pod,
    with_volume_problems,
    workload_problem,
)
from harnessrl.spec.status import Reason


def body(component: str, **status: Any) -> dict[str, Any]:
    labels = {RUN_LABEL: "swe", COMPONENT_LABEL: component}
    return {"metadata": {"name": f"swe-{component}-x", "labels": labels}, "status": status}


UNSCHEDULABLE = {
    "phase": "Pending",
    "conditions": [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        }
    ],
}


def test_pods_of_other_components_are_not_workload_pods() -> None:
    assert summarize_workload_pod(body("harness", **UNSCHEDULABLE)) is None
    assert summarize_workload_pod({"metadata": {"name": "x"}}) is None
    assert summarize_workload_pod(body("rollout", phase="Running")) == WorkloadPod("swe-rollout-x", "rollout")


@pytest.mark.parametrize(
    ("component", "status", "reason", "says"),
    [
        (
            "rollout",
            UNSCHEDULABLE,
            Reason.UNSCHEDULABLE,
            ["Insufficient nvidia.com/gpu", "spec.rollout.gpusPerReplica"],
        ),
        ("learner", UNSCHEDULABLE, Reason.UNSCHEDULABLE, ["spec.learner.gpusPerNode"]),
        (
            "rollout",
            {
                "containerStatuses": [
                    {
                        "name": "vllm",
                        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling"}},
                    }
                ]
            },
            Reason.IMAGE_PULL_FAILED,
            ["container vllm: Back-off pulling", "spec.rollout.image"],
        ),
        (
            "learner",
            {
                "initContainerStatuses": [
                    {
                        "name": "db-upgrade",
                        "state": {
                            "waiting": {
                                "reason": "CreateContainerConfigError",
                                "message": 'secret "db" not found',
                            }
                        },
                    }
                ]
            },
            Reason.INVALID_SPEC,
            ['secret "db" not found', "spec.store.postgres.secretRef"],
        ),
        (
            "rollout",
            {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                             "message": '0/3 nodes are available: persistentvolumeclaim "models" not found.'}]},
            Reason.INVALID_SPEC,
            ['persistentvolumeclaim "models" not found', "spec.model.volume"],
        ),
    ],
    ids=["rollout-unschedulable", "learner-unschedulable", "rollout-image", "learner-missing-secret", "no-claim"],
)
def test_a_troubled_pod_becomes_the_runs_reason_naming_the_field(
    component: str, status: dict, reason: Reason, says: list[str]
) -> None:
    pods = (summarize_workload_pod(body(component, **status)),)
    problem = workload_problem(pods, component)
    assert problem is not None and problem[0] is reason
    assert all(text in problem[1] for text in says), problem[1]
    other = "learner" if component == "rollout" else "rollout"
    assert workload_problem(pods, other) is None


def crash_loop(container: str, ended: dict) -> dict:
    return {"phase": "Running", "containerStatuses": [{
        "name": container, "restartCount": 4, "ready": False, "started": False,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s restarting failed container"}},
        "lastState": {"terminated": ended},
    }]}  # fmt: skip


@pytest.mark.parametrize(
    ("component", "status", "kubelet", "reason", "says"),
    [
        ("rollout", crash_loop("vllm", {"reason": "OOMKilled", "exitCode": 137}), "OOMKilled",
         Reason.ROLLOUT_UNAVAILABLE, ["4 restarts", "ended OOMKilled with exit code 137", "limits.memory"]),
        ("learner", crash_loop("learner", {"reason": "Error", "exitCode": 1, "message": "CUDA error: no device"}),
         "CrashLoopBackOff", Reason.LEARNER_CRASHED, ["ended Error with exit code 1: CUDA error", "--previous"]),
        ("rollout", {"phase": "Running", "containerStatuses": [
            {"name": "vllm", "ready": False, "started": True, "state": {"running": {}}}]},
         "NotReady", Reason.ROLLOUT_UNAVAILABLE, ["fails its readiness probe"]),
    ],
    ids=["vllm-oom", "learner-crash-loop", "vllm-not-ready"],
)
def test_crash_loops_oom_kills_and_failing_probes_are_named_with_the_kubelets_reason(
    component: str, status: dict, kubelet: str, reason: Reason, says: list[str]
) -> None:
    pods = (summarize_workload_pod(body(component, **status)),)
    assert kubelet_reason(pods, component) == kubelet
    problem = workload_problem(pods, component)
    assert problem is not None and problem[0] is reason
    assert all(text in problem[1] for text in says), problem[1]


def test_a_replica_still_loading_its_model_is_no_problem() -> None:
    loading = {"phase": "Running", "containerStatuses": [
        {"name": "vllm", "ready": False, "started": False, "state": {"running": {}}}]}
    pods = (summarize_workload_pod(body("rollout", **loading)),)
    assert workload_problem(pods, "rollout") is None and kubelet_reason(pods, "rollout") is None


CREATING = {"phase": "Pending", "containerStatuses": [
    {"name": "learner", "ready": False, "started": False, "state": {"waiting": {"reason": "ContainerCreating"}}},
]}  # fmt: skip
MOUNT = ("FailedMount", 'MountVolume.SetUp failed for volume "checkpoints": mount.nfs: access denied by server')


def test_a_pod_waiting_on_its_volume_is_named_with_the_events_reason() -> None:
    """ContainerCreating is all the pod says; the volume error comes from its Events (volume_events.py)."""
    waiting = summarize_workload_pod(body("learner", **CREATING))
    assert waiting == WorkloadPod("swe-learner-x", "learner", creating=True)
    assert workload_problem((waiting,), "learner") is None  # no Event (yet): still provisioning
    joined = with_volume_problems((waiting,), {"swe-learner-x": MOUNT}.get)
    reason, message = workload_problem(joined, "learner")
    assert reason is Reason.LEARNER_CRASHED and "access denied by server" in message
    assert "spec.learner.checkpointVolume" in message and kubelet_reason(joined, "learner") == "FailedMount"
    # a pod past ContainerCreating keeps its own state, whatever an old Event said
    running = summarize_workload_pod(body("learner", phase="Running"))
    assert with_volume_problems((running,), {"swe-learner-x": MOUNT}.get) == (running,)


def test_volume_events_keep_each_pods_newest_volume_error() -> None:
    events = VolumeEvents(core_v1=None, namespace="team-a")

    def event(pod: str, reason: str, message: str) -> dict[str, Any]:  # as the watch sends it
        return {"kind": "Event", "involvedObject": {"kind": "Pod", "name": pod}, "reason": reason,
                "message": message, "type": "Warning"}

    events.note("ADDED", event("a", "FailedAttachVolume", "Multi-Attach error for volume x"))
    events.note("MODIFIED", event("a", "FailedMount", "timed out waiting for the condition "))
    events.note("ADDED", event("b", "BackOff", "Back-off restarting failed container"))  # not a volume error
    events.note("DELETED", event("c", "FailedMount", "gone"))
    assert events.problem("a") == ("FailedMount", "timed out waiting for the condition")
    assert events.problem("b") is None and events.problem("c") is None
