"""The vLLM servers that generate rollouts: a Deployment, two Services and the NetworkPolicy in front of them.

The server is started as ``harnessrl run`` starts it (``local/vllm_server.py``; the served names and the LoRA
flags from ``harnessrl.policy_serving``, one mapping for both): ``VLLM_SERVER_DEV_MODE=1`` so the learner can
reload weights in place through ``/collective_rpc``, usage statistics off. What a cluster adds: the model from a
claim or a hub, the learner's checkpoint claim mounted read-only at the learner's own path (weight sync hands vLLM
the path the learner wrote), and probes that tell "loading the model" (up to
``OperatorConfig.provisioning_timeout_seconds``) from "hung".

vLLM serves its control paths (pause, weight reload, LoRA loading, sleep) beside its OpenAI API on one port,
unauthenticated, and a harness reaches whatever its proxy sidecar reaches. So vLLM listens on the pod's loopback
only, and the gate (``harnessrl vllm-gate``, from the proxy image) is the pod's listener: the public port
``naming.VLLM_PORT`` forwards the OpenAI paths alone, the control port ``naming.VLLM_CONTROL_PORT`` everything,
and the rollout NetworkPolicy admits only the run's learner pods to the control port.
"""

from __future__ import annotations

import math
from typing import Any

from harnessrl.operator import naming
from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.render_common import (
    CACHE_DIR,
    cache_env,
    claim_volumes,
    container_resources,
    env,
    env_from_secret,
    merge_env,
    pod_scheduling,
    read_only_root,
    restricted_security,
    run_claims,
    spec_env,
    writable_paths,
)
from harnessrl.local.vllm_server import CPU_ARGS
from harnessrl.operator.render_learner import checkpoint_dir
from harnessrl.policy_serving import SERVED_MODEL_NAME, continuity_flags, is_lora, lora_flags, served_model_name
from harnessrl.proxy.vllm_gate import READY_PATH
from harnessrl.served_marker import marker_path
from harnessrl.spec.models import DEFAULT_VLLM_IMAGE, TrainingRun

VLLM_CACHE_ENV = {
    "VLLM_CACHE_ROOT": f"{CACHE_DIR}/vllm",
    "VLLM_CONFIG_ROOT": f"{CACHE_DIR}/vllm-config",
    "NUMBA_CACHE_DIR": f"{CACHE_DIR}/numba",
}
"""vLLM's own cache and config roots (torch.compile artefacts, usage-stats files) and numba's, beside the ones
every renderer sets (``render_common.CACHE_ENV``); hub downloads land in ``HF_HOME`` there too, an emptyDir,
so a replica downloads once per pod and the node's disk is returned when the pod goes."""
PROBE_PERIOD_SECONDS = 10


def model_argument(run: TrainingRun) -> str:
    """What ``vllm serve`` loads: the directory (inside the claim when there is one) or the hub id."""
    model = run.spec.model
    return model.hub.id if model.hub is not None else model.path


def vllm_image(run: TrainingRun, config: OperatorConfig) -> str:
    """spec.rollout.image, else vLLM's CUDA image for replicas with accelerators and the operator's CPU build
    for replicas without (vLLM's own image cannot serve on the CPU)."""
    rollout = run.spec.rollout
    if rollout.image:
        return rollout.image
    return DEFAULT_VLLM_IMAGE if rollout.gpus_per_replica > 0 else config.vllm_cpu_image


def vllm_args(run: TrainingRun) -> list[str]:
    spec = run.spec
    rollout = spec.rollout
    args = [
        model_argument(run),
        "--host", "127.0.0.1",  # the gate is the pod's only way in (this module's docstring)
        "--port", str(naming.VLLM_SERVER_PORT),
        "--served-model-name", served_model_name(spec),  # the base model's name under a LoRA policy
        "--max-model-len", str(rollout.max_model_len),
        "--tensor-parallel-size", str(rollout.tensor_parallel),
        "--logprobs-mode", "processed_logprobs",  # log-probs of the distribution sampled (temperature included)
    ]  # fmt: skip
    if spec.model.hub is not None and spec.model.hub.revision:
        args += ["--revision", spec.model.hub.revision]
    if spec.model.tokenizer:
        args += ["--tokenizer", spec.model.tokenizer]
    if rollout.gpus_per_replica == 0:
        args += CPU_ARGS
    return args + lora_flags(spec) + list(rollout.args) + continuity_flags(rollout.args)


def vllm_env(run: TrainingRun) -> list[dict[str, Any]]:
    """Ours first, then the spec's: a user may tune vLLM's variables, including ours."""
    spec = run.spec
    ours = [env("VLLM_SERVER_DEV_MODE", "1"), env("VLLM_NO_USAGE_STATS", "1"), env("DO_NOT_TRACK", "1")]
    ours += cache_env(VLLM_CACHE_ENV)
    if is_lora(spec):
        ours.append(env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"))
    hub = spec.model.hub
    if hub is None:
        ours.append(env("HF_HUB_OFFLINE", "1"))
    elif hub.token_secret is not None:
        ours.append(env_from_secret("HF_TOKEN", hub.token_secret.name, hub.token_secret.key))
    return merge_env(ours, spec_env(spec.rollout.env))


def _http_probe(path: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
    """Through the gate's public port: vLLM itself listens on loopback, where the kubelet cannot connect."""
    return {
        "httpGet": {"path": path, "port": naming.VLLM_PORT},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def vllm_container(run: TrainingRun, config: OperatorConfig) -> dict[str, Any]:
    """The server container.

    Probes: ``/health`` answers as soon as the HTTP server is up, before the weights are loaded, so the
    startup probe asks ``/v1/models`` (served only once the engine is ready) for as long as the operator
    waits for provisioning. Readiness then follows ``/health``; liveness allows a minute of silence, since a
    large in-place weight reload can keep the engine busy for tens of seconds. Readiness asks the gate's
    ``/ready``: ``/health`` once the server holds the run's committed version (a restarted one is loaded first).
    """
    spec = run.spec
    _, mounts = claim_volumes(run_claims(run, checkpoints_read_only=True))
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    mounts += writable_paths()[1]
    startup_failures = math.ceil(config.provisioning_timeout_seconds / PROBE_PERIOD_SECONDS)
    container: dict[str, Any] = {
        "name": "vllm",
        "image": vllm_image(run, config),
        "command": ["vllm", "serve"],
        "args": vllm_args(run),
        "env": vllm_env(run),
        "startupProbe": _http_probe("/v1/models", PROBE_PERIOD_SECONDS, startup_failures, 5),
        "readinessProbe": _http_probe(READY_PATH, 5, 3, 5),
        "livenessProbe": _http_probe("/health", PROBE_PERIOD_SECONDS, 6, 10),
        "volumeMounts": mounts,
        "securityContext": read_only_root(),
    }
    resources = container_resources(spec.rollout.resources, spec.rollout.gpus_per_replica)
    if resources:
        container["resources"] = resources
    return container


GATE_CONTAINER = "gate"
GATE_UID = 65532  # the proxy image's user
GATE_REQUESTS = {"cpu": "250m", "memory": "128Mi"}


def gate_container(run: TrainingRun, config: OperatorConfig) -> dict[str, Any]:
    """``harnessrl vllm-gate`` in front of vLLM: the image of the run's proxies (``spec.proxy.image``, else the
    operator's), as locked down as the proxy sidecar. Its liveness is its own control port accepting connections;
    the vLLM container's probes pass through its public port, so a gate that stops forwarding takes the replica
    out of the Services as a failing vLLM would. It reads the learner's served-version marker on the checkpoint
    volume (read-only) to bring a restarted vLLM to the committed version."""
    marker = ["--served-marker", str(marker_path(checkpoint_dir(run)))]
    if run.spec.learner.checkpoint_volume is None:  # no shared checkpoints, no weight sync to restore
        marker = []
    lora = ["--lora-name", SERVED_MODEL_NAME] if is_lora(run.spec) else []
    checkpoints = [
        mount for mount in claim_volumes(run_claims(run, checkpoints_read_only=True))[1]
        if run.spec.learner.checkpoint_volume is not None
        and mount["mountPath"] == run.spec.learner.checkpoint_volume.mount_path
    ]
    return {
        "name": GATE_CONTAINER,
        "image": run.spec.proxy.image or config.proxy_image,
        "command": ["harnessrl", "vllm-gate"],
        "args": [
            "--upstream", f"http://127.0.0.1:{naming.VLLM_SERVER_PORT}",
            "--port", str(naming.VLLM_PORT),
            "--control-port", str(naming.VLLM_CONTROL_PORT),
            *marker, *lora,
        ],  # fmt: skip
        "env": cache_env(),
        "ports": [
            {"name": "http", "containerPort": naming.VLLM_PORT, "protocol": "TCP"},
            {"name": "control", "containerPort": naming.VLLM_CONTROL_PORT, "protocol": "TCP"},
        ],
        "livenessProbe": {
            "tcpSocket": {"port": "control"},
            "periodSeconds": PROBE_PERIOD_SECONDS,
            "failureThreshold": 3,
        },
        "resources": {"requests": dict(GATE_REQUESTS)},
        "volumeMounts": [*writable_paths()[1], *checkpoints],
        "securityContext": {
            **restricted_security(),
            "runAsUser": GATE_UID,
            "runAsGroup": GATE_UID,
            "readOnlyRootFilesystem": True,
        },
    }


def rollout_volumes(run: TrainingRun) -> list[dict[str, Any]]:
    spec = run.spec
    volumes, _ = claim_volumes(run_claims(run, checkpoints_read_only=True))
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    return volumes + writable_paths()[0]


def render_rollout_deployment(
    run: TrainingRun, namespace: str, uid: str, config: OperatorConfig
) -> dict[str, Any]:
    """The vLLM Deployment ``<run>-rollout``, ``spec.rollout.replicas`` servers.

    Rolling updates replace one replica at a time without a surge pod: accelerators are the scarce resource,
    and a surge replica would wait for GPUs that the old replicas hold. ``progressDeadlineSeconds`` matches
    the operator's provisioning timeout, so the Deployment's own Progressing condition agrees with the run's.
    ``/dev/shm`` is a memory-backed emptyDir because the container runtime's default 64 MiB is too small for
    the tensor-parallel workers' shared memory.
    """
    name = run.metadata.name
    pod_spec: dict[str, Any] = {
        "containers": [vllm_container(run, config), gate_container(run, config)],
        "volumes": rollout_volumes(run),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        **pod_scheduling(run.spec.rollout.scheduling),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.child_metadata(naming.rollout_name(name), namespace, name, uid, naming.ROLLOUT),
        "spec": {
            "replicas": run.spec.rollout.replicas,
            "selector": {"matchLabels": naming.selector(name, naming.ROLLOUT)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "progressDeadlineSeconds": config.provisioning_timeout_seconds,
            "template": {
                "metadata": {
                    "labels": naming.labels(name, naming.ROLLOUT),
                    # `kubectl logs` and `exec` without -c: vLLM's, not the gate's
                    "annotations": {"kubectl.kubernetes.io/default-container": "vllm"},
                },
                "spec": pod_spec,
            },
        },
    }


def _service_port() -> dict[str, Any]:
    return {"name": "http", "port": naming.VLLM_PORT, "targetPort": "http", "protocol": "TCP"}


def _control_port() -> dict[str, Any]:
    return {"name": "control", "port": naming.VLLM_CONTROL_PORT, "targetPort": "control", "protocol": "TCP"}


def render_rollout_service(run: TrainingRun, namespace: str, uid: str) -> dict[str, Any]:
    """ClusterIP Service ``<run>-rollout``: the proxies' upstream, spreading connections over ready replicas."""
    name = run.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.child_metadata(naming.rollout_name(name), namespace, name, uid, naming.ROLLOUT),
        "spec": {
            "type": "ClusterIP",
            "selector": naming.selector(name, naming.ROLLOUT),
            "ports": [_service_port()],
        },
    }


def render_rollout_pods_service(run: TrainingRun, namespace: str, uid: str) -> dict[str, Any]:
    """Headless Service ``<run>-rollout-pods``: its DNS name lists every ready replica's address, for clients
    that must reach each replica (weight sync, on the control port) or pin a rollout to one (the proxies, on
    the public port). Not-ready replicas are left out: a replica still loading the model must not get calls."""
    name = run.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.child_metadata(
            naming.rollout_pods_name(name), namespace, name, uid, naming.ROLLOUT
        ),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": naming.selector(name, naming.ROLLOUT),
            "ports": [_service_port(), _control_port()],
        },
    }
