"""What keeps a run's vLLM or learner pods from running, in the words of the spec field that causes it.

A Deployment or Job only says "0 available"; the reason is on its pods: the scheduler's ``PodScheduled``
condition (``Unschedulable``: no node has the GPUs, memory or CPU asked for) and the kubelet's waiting reasons
(an image that cannot be pulled, a Secret or ConfigMap an env var names that does not exist). The operator
sees these pods through the same informer as the harness pods, and turns the first problem into the run's
reason and a message naming the field to change. A volume that cannot be attached or mounted shows on the pod
only as ContainerCreating; its reason is in the pod's Events (``volume_events.py``), joined in by
:func:`with_volume_problems`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from harnessrl.operator.naming import COMPONENT_LABEL, LEARNER, ROLLOUT
from harnessrl.spec.status import Reason

IMAGE_PULL = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"})
CONFIG = frozenset({"CreateContainerConfigError"})
CRASHED = frozenset({"CrashLoopBackOff", "OOMKilled"})
VOLUME = frozenset({"FailedAttachVolume", "FailedMount"})  # Event reasons (volume_events.py)
NOT_READY = "NotReady"
"""A container that started but fails its readiness probe (the kubelet's ready flag; a vLLM still loading its
model has not started yet, which is provisioning, not a problem)."""


@dataclass(frozen=True)
class WorkloadPod:
    """A vLLM or learner pod, with what the scheduler or kubelet reports against it (None: nothing)."""

    name: str
    component: str
    problem: str | None = None  # Unschedulable, ImagePullBackOff, CreateContainerConfigError, FailedMount, ...
    message: str | None = None
    creating: bool = False
    """A container waits in ContainerCreating: where a pod whose volume cannot be attached or mounted stays."""


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
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    for container in containers:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_PULL | CONFIG:
            message = f"container {container.get('name')}: {waiting.get('message') or waiting['reason']}"
            return WorkloadPod(name, component, waiting["reason"], message)
        if waiting.get("reason") == "CrashLoopBackOff":
            return _crash_loop(name, component, container)
    for container in status.get("containerStatuses") or []:
        running = (container.get("state") or {}).get("running")
        if running is not None and container.get("started") and container.get("ready") is False:
            message = f"container {container.get('name')} runs but fails its readiness probe"
            return WorkloadPod(name, component, NOT_READY, message)
    creating = any(((c.get("state") or {}).get("waiting") or {}).get("reason") == "ContainerCreating"
                   for c in containers)
    return WorkloadPod(name, component, creating=creating)


def with_volume_problems(
    pods: tuple[WorkloadPod, ...], volume_problem: Callable[[str], tuple[str, str] | None]
) -> tuple[WorkloadPod, ...]:
    """``pods`` with the volume error of each one still in ContainerCreating (``volume_problem(name)``: the
    reason and message of its newest FailedAttachVolume or FailedMount Event) as its problem."""
    joined = []
    for pod in pods:
        found = volume_problem(pod.name) if pod.creating and pod.problem is None else None
        joined.append(replace(pod, problem=found[0], message=found[1]) if found else pod)
    return tuple(joined)


def _crash_loop(name: str, component: str, container: dict[str, Any]) -> WorkloadPod:
    """A container the kubelet restarts again and again, with how its last run ended (OOMKilled is named as
    the problem itself: its fix is memory, not code)."""
    ended = (container.get("lastState") or {}).get("terminated") or {}
    why = ended.get("reason") or "exited"
    message = f"container {container.get('name')} restarts in a loop ({container.get('restartCount', 0)} restarts)"
    if ended:
        message += f"; its last run ended {why} with exit code {ended.get('exitCode')}"
        if ended.get("message"):
            message += f": {str(ended['message']).strip()[:500]}"
    return WorkloadPod(name, component, "OOMKilled" if why == "OOMKilled" else "CrashLoopBackOff", message)


# What to change, per component and problem.
_FIXES = {
    (ROLLOUT, "Unschedulable"): "lower spec.rollout.gpusPerReplica or spec.rollout.resources, let "
    "spec.rollout.scheduling (nodeSelector, tolerations, affinity) match nodes that have them, or add such "
    "nodes",
    (LEARNER, "Unschedulable"): "lower spec.learner.gpusPerNode, spec.learner.nodes or "
    "spec.learner.resources, let spec.learner.scheduling (nodeSelector, tolerations, affinity) match nodes "
    "that have them, or add such nodes",
    (ROLLOUT, "image"): "fix spec.rollout.image (container vllm) or spec.proxy.image (container gate, default: "
    "the operator's HARNESSRL_OPERATOR_PROXY_IMAGE), or name a pull secret in "
    "spec.rollout.scheduling.imagePullSecrets",
    (LEARNER, "image"): "fix spec.learner.image (default: the operator's HARNESSRL_OPERATOR_LEARNER_IMAGE), "
    "or name a pull secret in spec.learner.scheduling.imagePullSecrets",
    (ROLLOUT, "claim"): "create the PersistentVolumeClaim, or fix spec.model.volume",
    (LEARNER, "claim"): "create the PersistentVolumeClaim, or fix spec.learner.checkpointVolume or "
    "spec.model.volume",
    (ROLLOUT, "config"): "create the Secret or ConfigMap it names, or fix spec.rollout.env / "
    "spec.model.hub.tokenSecret",
    (LEARNER, "config"): "create the Secret it names, or fix spec.store.postgres.secretRef",
    (ROLLOUT, "OOMKilled"): "raise spec.rollout.resources.limits.memory, or lower spec.rollout.maxModelLen",
    (LEARNER, "OOMKilled"): "raise spec.learner.resources.limits.memory, or lower spec.learner.microBatchTokens "
    "or offload less (spec.learner.deepspeed.offload)",
    (ROLLOUT, "CrashLoopBackOff"): "see `kubectl logs --previous` of the pod's vllm container (often the model "
    "path, spec.rollout.args or too little memory)",
    (LEARNER, "CrashLoopBackOff"): "see `kubectl logs --previous` of the pod's learner container",
    (ROLLOUT, NOT_READY): "see `kubectl describe` of the pod for the probe's answer, and the vllm container's log",
    (ROLLOUT, "volume"): "check the claims it mounts (spec.model.volume, spec.learner.checkpointVolume): a "
    "ReadWriteOnce claim attaches to one node at a time, and `kubectl describe pvc` shows the storage's error",
    (LEARNER, "volume"): "check the claims it mounts (spec.learner.checkpointVolume, spec.model.volume): a "
    "ReadWriteOnce claim attaches to one node at a time, and `kubectl describe pvc` shows the storage's error",
    (LEARNER, NOT_READY): "see `kubectl describe` of the pod for the probe's answer",
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
        elif pod.problem in CRASHED or pod.problem == NOT_READY or pod.problem in VOLUME:
            reason = Reason.ROLLOUT_UNAVAILABLE if component == ROLLOUT else Reason.LEARNER_CRASHED
            fix = _FIXES[(component, "volume" if pod.problem in VOLUME else pod.problem)]
            said = ("is not serving" if component == ROLLOUT else "is not running") + f" ({pod.problem})"
        else:
            reason, fix = Reason.INVALID_SPEC, _FIXES[(component, "config")]
            said = f"cannot start ({pod.problem})"
        return reason, f"{_WHAT[component]} pod {pod.name} {said}: {pod.message} — {fix}"
    return None


def kubelet_reason(pods: list[WorkloadPod] | tuple[WorkloadPod, ...], component: str) -> str | None:
    """The scheduler's or kubelet's own word for the first troubled pod of ``component`` (CrashLoopBackOff,
    OOMKilled, ImagePullBackOff, Unschedulable, ...), for the component's condition."""
    return next((pod.problem for pod in pods if pod.component == component and pod.problem), None)
