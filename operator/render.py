"""From a TrainingRun to the Kubernetes objects that run it: pure functions, no API calls.

One module per child (as KubeRay's ``common/pod.go``, ``service.go``, ``job.go``): ``render_secret``,
``render_rollout``, ``render_learner``, ``render_harness``, ``render_network``. The same run and arguments
always give the same objects, so the controller can server-side apply them on every new generation and the
golden tests can pin them.

Every function raises ``ValueError`` with the field and the fix for what the spec allows but a cluster
cannot run (no harness image, a task too large for its pod, two claims at one path).
"""

from __future__ import annotations

from typing import Any

from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.render_harness import render_harness_pod
from harnessrl.operator.render_learner import render_learner_job, render_learner_service
from harnessrl.operator.render_network import render_network_policy, render_rollout_network_policy
from harnessrl.operator.render_rollout import (
    render_rollout_deployment,
    render_rollout_pods_service,
    render_rollout_service,
)
from harnessrl.operator.render_secret import render_run_secret
from harnessrl.spec.models import TrainingRun

__all__ = ["render_harness_pod", "render_run_children"]


def render_run_children(
    run: TrainingRun, namespace: str, uid: str, config: OperatorConfig, store_url: str | None = None
) -> list[dict[str, Any]]:
    """The run's persistent children, in apply order: what others refer to (the Secret, the Services)
    before what refers to them. No vLLM objects (nor their NetworkPolicy) when ``spec.rollout.upstreams`` names
    running servers; no harness NetworkPolicy for ``networkPolicy: none``. Harness pods come one per attempt from
    :func:`render_harness_pod`. ``store_url``: the store's URL as the operator resolved it (from a Secret),
    for the NetworkPolicy's store port."""
    children = [render_run_secret(run, namespace, uid, config)]
    if not run.spec.rollout.upstreams:
        children += [
            render_rollout_service(run, namespace, uid),
            render_rollout_pods_service(run, namespace, uid),
        ]
    children.append(render_learner_service(run, namespace, uid))
    for policy in (render_network_policy(run, namespace, uid, config, store_url),
                   render_rollout_network_policy(run, namespace, uid)):
        if policy is not None:
            children.append(policy)
    if not run.spec.rollout.upstreams:
        children.append(render_rollout_deployment(run, namespace, uid, config))
    children.append(render_learner_job(run, namespace, uid, config))
    return children
