"""What keeps a run's vLLM or learner pods from running, in the words of the spec field that causes it.

A Deployment or Job only says "0 available"; the reason is on its pods: the scheduler's ``PodScheduled``
condition (``Unschedulable``: no node has the GPUs, memory or CPU asked for) and the kubelet's waiting reasons
(an image that cannot be pulled, a Secret or ConfigMap an env var names that does not exist). The operator
sees these pods through the same informer as the harness pods, and turns the first problem into the run's
reason and a message naming the field to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harnessrl.operator.naming import COMPONENT_LABEL, LEARNER, ROLLOUT
from harnessrl.spec.status import Reason

IMAGE_PULL = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"})
CONFIG = frozenset({"CreateContainerConfigError"})


@dataclass(frozen=True)
class WorkloadPod:
    """A vLLM or learner pod, with what the scheduler or kubelet reports against it (None: nothing)."""

    name: str
    component: str
    problem: str | None = None  # Unschedulable, ImagePullBackOff, CreateContainerConfigError
    message: str | None = None


def summarize_workload_pod(body: dict[str, Any]) -> WorkloadPod | None:
    """The summary of a rollout or learner pod; None for any other pod."""
    meta = body.get("metadata") or {}
    component = (meta.get("labels") or {}).get(COMPONENT_LABEL)
    if component not in (ROLLOUT, LEARNER):
        return None
    status = body.get("status") or {}
    name = meta.get("name", "")
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return WorkloadPod(name, component, "Unschedulable", condition.get("message"))
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_PULL | CONFIG:
            message = f"container {container.get('name')}: {waiting.get('message') or waiting['reason']}"
            return WorkloadPod(name, component, waiting["reason"], message)
    return WorkloadPod(name, component)


# What to change, per component and problem.
_FIXES = {
    (ROLLOUT, "Unschedulable"): "lower spec.rollout.gpusPerReplica or spec.rollout.resources, let "
    "spec.rollout.scheduling (nodeSelector, tolerations, affinity) match nodes that have them, or add such "
    "nodes",
    (LEARNER, "Unschedulable"): "lower spec.learner.gpusPerNode, spec.learner.nodes or "
    "spec.learner.resources, let spec.learner.scheduling (nodeSelector, tolerations, affinity) match nodes "
    "that have them, or add such nodes",
    (ROLLOUT, "image"): "fix spec.rollout.image, or name a pull secret in "
    "spec.rollout.scheduling.imagePullSecrets",
    (LEARNER, "image"): "fix spec.learner.image (default: the operator's HARNESSRL_OPERATOR_LEARNER_IMAGE), "
    "or name a pull secret in spec.learner.scheduling.imagePullSecrets",
    (ROLLOUT, "claim"): "create the PersistentVolumeClaim, or fix spec.model.volume",
    (LEARNER, "claim"): "create the PersistentVolumeClaim, or fix spec.learner.checkpointVolume or "
    "spec.model.volume",
    (ROLLOUT, "config"): "create the Secret or ConfigMap it names, or fix spec.rollout.env / "
    "spec.model.hub.tokenSecret",
    (LEARNER, "config"): "create the Secret it names, or fix spec.store.postgres.secretRef",
}
_WHAT = {ROLLOUT: "vLLM", LEARNER: "learner"}


def workload_problem(
    pods: list[WorkloadPod] | tuple[WorkloadPod, ...], component: str
) -> tuple[Reason, str] | None:
    """The run's reason and message for the first troubled pod of ``component`` (None: none is troubled)."""
    for pod in pods:
        if pod.component != component or pod.problem is None:
            continue
        if pod.problem == "Unschedulable" and "persistentvolumeclaim" in (pod.message or "").lower():
            reason, fix = Reason.INVALID_SPEC, _FIXES[(component, "claim")]
            said = "cannot be scheduled"
        elif pod.problem == "Unschedulable":
            reason, fix = Reason.UNSCHEDULABLE, _FIXES[(component, "Unschedulable")]
            said = "cannot be scheduled"
        elif pod.problem in IMAGE_PULL:
            reason, fix = Reason.IMAGE_PULL_FAILED, _FIXES[(component, "image")]
            said = f"cannot pull its image ({pod.problem})"
        else:
            reason, fix = Reason.INVALID_SPEC, _FIXES[(component, "config")]
            said = f"cannot start ({pod.problem})"
        return reason, f"{_WHAT[component]} pod {pod.name} {said}: {pod.message} — {fix}"
    return None
