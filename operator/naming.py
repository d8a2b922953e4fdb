"""Names, labels and ownership of everything the operator creates for a TrainingRun.

One place, so the renderers, the pod backend's watch and the tests agree. Label values are limited to 63
characters: a run name (at most 52) fits, a rollout id (``<run>-g000001-r003``) may not, so a harness pod
carries its rollout and attempt as annotations and its run and component as labels (what selectors need).
"""

from __future__ import annotations

from typing import Any

from harnessrl.spec.models import API_VERSION, KIND

RUN_LABEL = "harnessrl.io/run"
COMPONENT_LABEL = "harnessrl.io/component"
ROLLOUT_ANNOTATION = "harnessrl.io/rollout"
ATTEMPT_ANNOTATION = "harnessrl.io/attempt"
TASK_ANNOTATION = "harnessrl.io/task"
POLICY_VERSION_ANNOTATION = "harnessrl.io/policy-version"
MANAGED_BY = ("app.kubernetes.io/managed-by", "harnessrl-operator")

ROLLOUT = "rollout"
LEARNER = "learner"
HARNESS = "harness"

VLLM_PORT = 8000
"""A vLLM pod's public port (its gate, ``harnessrl vllm-gate``): vLLM's OpenAI paths, what proxies reach."""
VLLM_CONTROL_PORT = 8001
"""The same pod's control port: every path, pause and weight loading included; only the run's learner reaches it."""
VLLM_SERVER_PORT = 8002
"""Where vLLM itself listens, on the pod's loopback only: nothing outside the pod reaches it but through the gate."""


def rollout_name(run: str) -> str:
    """The vLLM Deployment and its Service (``http://<name>:8000`` spreads calls over the replicas)."""
    return f"{run}-rollout"


def rollout_pods_name(run: str) -> str:
    """The headless Service whose DNS names each vLLM replica, so a proxy can pin a rollout to one."""
    return f"{run}-rollout-pods"


def learner_name(run: str) -> str:
    """The learner Job and its headless Service (rendezvous: ``<name>-0.<name>`` is rank 0)."""
    return f"{run}-learner"


def harness_network_policy_name(run: str) -> str:
    return f"{run}-harness"


def harness_pod_name(rollout_id: str, attempt: int) -> str:
    """One pod per attempt; the name makes a repeated create of the same attempt a conflict, not a copy."""
    return f"{rollout_id}-a{attempt}"


def labels(run: str, component: str) -> dict[str, str]:
    return {RUN_LABEL: run, COMPONENT_LABEL: component, MANAGED_BY[0]: MANAGED_BY[1]}


def selector(run: str, component: str) -> dict[str, str]:
    """The labels a selector matches on (the managed-by label is informational)."""
    return {RUN_LABEL: run, COMPONENT_LABEL: component}


def owner_reference(run_name: str, run_uid: str) -> dict[str, Any]:
    """Makes the TrainingRun the controller of a child: the garbage collector deletes the child with it."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": run_name,
        "uid": run_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(name: str, namespace: str, run_name: str, run_uid: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": labels(run_name, component),
        "ownerReferences": [owner_reference(run_name, run_uid)],
    }
