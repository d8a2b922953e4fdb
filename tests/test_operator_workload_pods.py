"""vLLM and learner pods that cannot run, as the scheduler and kubelet report them, and the reason and message
(naming the spec field to change) the run shows for them. Pod bodies here are the API's shapes; the scenario
on the real control plane is in test_operator_cluster.py."""

from __future__ import annotations

from typing import Any

import pytest

from harnessrl.operator.naming import COMPONENT_LABEL, RUN_LABEL
from harnessrl.operator.workload_pods import WorkloadPod, summarize_workload_pod, workload_problem
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
