"""One harness pod per rollout attempt: the harness container, with the capture proxy as a native sidecar.

The harness gets exactly the contract of ``harnessrl run`` (``LocalRun._contract`` and ``ProcessBackend``):
``OPENAI_BASE_URL`` of its proxy, the reward endpoint under it, the served model name, its task and its
attribution. The proxy (``harnessrl proxy`` configured entirely by ``HARNESSRL_*`` variables, sidecar mode
because ``HARNESSRL_ROLLOUT_ID`` is set) is started as ``LocalRun._start_proxy`` starts it: the run's sampling
forced on every call, the policy version the attempt was launched under, its pause behaviour.

The task reaches the pod through the pod's own annotation, as a file (downwardAPI volume) and as an env var
(fieldRef): one create request per attempt, no ConfigMap per rollout to create and clean up. Annotations are
limited to 256 KiB in all, so a task's JSON must stay below that (large inputs belong in the image or on a
volume, named by the task).
"""

from __future__ import annotations

import json
import math
from pathlib import PurePosixPath
from typing import Any

from harnessrl.operator import naming
from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.render_common import (
    SERVED_MODEL_NAME,
    container_resources,
    env,
    env_from_field,
    merge_env,
    pod_scheduling,
    replica_targets,
    restricted_security,
    spec_env,
)
from harnessrl.operator.render_secret import reward_token_env, store_url_env
from harnessrl.proxy.spec_env import spec_environment
from harnessrl.scheduler import Launch
from harnessrl.spec.evaluation import evaluation_sampling
from harnessrl.spec.models import TrainingRun
from harnessrl.store.engine import POOL_SIZE_ENV
from harnessrl.task_contract import task_fits_in_env

HARNESS_CONTAINER = "harness"
PROXY_CONTAINER = "proxy"
VERIFIER_CONTAINER = "verifier"
WORKSPACE_DIR = "/workspace"
"""Where the harness leaves its work for the verifier (an emptyDir both mount; ``HARNESSRL_WORKSPACE``)."""
VERIFIER_TMP = "verifier-tmp"
"""The verifier's own /tmp volume: nothing the harness wrote outside the workspace reaches the verifier."""
TASK_DIR = "/etc/harnessrl"
TASK_FILE = f"{TASK_DIR}/task.json"
SPOOL_DIR = "/var/spool/harnessrl"
PROXY_UID = 65532
"""The unprivileged user the proxy sidecar runs as (the "nonroot" user of distroless images, as in the proxy
image); the harness and verifier run as ``spec.harness.sandbox.runAsUser``."""
ANNOTATIONS_LIMIT = 256 * 1024
"""The API server's limit on the total size of an object's annotations (keys and values)."""
PROXY_FLUSH_SECONDS = 300
"""How long a proxy whose harness has ended keeps trying to store what it captured (its queue and its spool)
while the store does not answer (a database restart) before it exits (``HARNESSRL_SHUTDOWN_TIMEOUT_S``). The
operator releases (deletes) a harness pod only once every container of it ended, so a pod whose harness ended
during an outage stays until its proxy stored everything: its spool is an emptyDir that dies with the pod."""
TERMINATION_GRACE_SECONDS = PROXY_FLUSH_SECONDS + 60
"""The kubelet stops the proxy sidecar with SIGTERM once the harness has exited, and kills it after this: the
proxy's flush, and a minute for in-flight calls. A proxy with nothing left to store exits at once."""
PROXY_METRICS_PORT_NAME = "proxy-metrics"
"""The proxy sidecar's metrics port, by the name the chart's harness PodMonitor scrapes."""
PROXY_REQUESTS = {"cpu": "100m", "memory": "128Mi"}
"""What the proxy needs at rest (about 1 ms of CPU per call), unless ``spec.proxy.resources`` says otherwise.
No limits by default: a request body may be up to spec.proxy.maxRequestBodyBytes, and an OOM kill would lose
captured calls."""


def task_json(launch: Launch) -> str:
    return json.dumps(launch.task, separators=(",", ":"), ensure_ascii=False)


def harness_image(run: TrainingRun, launch: Launch) -> str:
    """The task's own image when it names one, else ``spec.harness.image``."""
    image = launch.task.get("image") or run.spec.harness.image
    if not image:
        raise ValueError(
            f"spec.harness.image: harness pods need an image, and neither the spec nor task "
            f"{launch.task_id!r} names one — set spec.harness.image (or an image on every task); only "
            "`harnessrl run` starts harnesses without one"
        )
    return image


def proxy_env(run: TrainingRun, config: OperatorConfig, launch: Launch) -> list[dict[str, Any]]:
    """The sidecar's settings (``proxy/config.py``). ``HARNESSRL_PROXY_HOST`` is loopback: the harness in
    the same network namespace is the proxy's only client, and nothing else may attribute calls or rewards
    to this attempt. The admin API is off: the harness shares the network namespace and must not pause the
    proxy or set its version; the version of each call is the weight label of the replica that served it
    (``HARNESSRL_REPLICA_VERSIONS``), so a sync never has to reach hundreds of sidecars. During a sync the
    replicas themselves are paused and calls wait (``spec.proxy.pause`` only acts on a proxy the learner pauses:
    ``harnessrl run``'s). ``spec.proxy``'s settings reach it through the mapping ``harnessrl run`` uses."""
    spec = run.spec
    rollout, proxy = spec.rollout, spec.proxy
    sampling: dict[str, Any] = {"temperature": rollout.temperature, "top_p": rollout.top_p}
    if rollout.max_tokens is not None:
        sampling["max_tokens"] = rollout.max_tokens
    return [
        env("HARNESSRL_UPSTREAMS", ",".join(replica_targets(run))),
        env("HARNESSRL_REPLICA_VERSIONS", "true"),
        env("HARNESSRL_ADMIN", "false"),
        store_url_env(run, config),
        env(POOL_SIZE_ENV, "1"),  # one writer thread: one connection per pod, so hundreds of pods fit the database
        env("HARNESSRL_RUN", run.metadata.name),
        env("HARNESSRL_ROLLOUT_ID", launch.rollout_id),
        env("HARNESSRL_ATTEMPT", str(launch.attempt)),
        env("HARNESSRL_PROXY_HOST", "127.0.0.1"),
        env("HARNESSRL_PROXY_PORT", str(proxy.port)),
        *([env("HARNESSRL_METRICS_PORT", str(config.proxy_metrics_port))] if config.proxy_metrics_port else []),
        env("HARNESSRL_SHUTDOWN_TIMEOUT_S", str(PROXY_FLUSH_SECONDS)),
        env("HARNESSRL_POLICY_VERSION", str(launch.policy_version)),
        env("HARNESSRL_MODEL_NAME", SERVED_MODEL_NAME),
        env("HARNESSRL_SAMPLING", json.dumps(sampling)),
        *(
            [env("HARNESSRL_EVALUATION_SAMPLING", json.dumps(evaluation_sampling(spec.evaluation)))]
            if spec.evaluation is not None
            else []
        ),
        *(
            env(name, value)
            for name, value in spec_environment(proxy, PurePosixPath(SPOOL_DIR, "proxy.spool")).items()
        ),
        *([reward_token_env(run)] if spec.harness.verifier is not None else []),
    ]


def proxy_container(run: TrainingRun, config: OperatorConfig, launch: Launch) -> dict[str, Any]:
    """The proxy as a native sidecar: an init container with ``restartPolicy: Always`` starts before the
    harness, is restarted if it dies, and is stopped once the harness has exited.

    The harness starts only after the startup probe passes. The probe runs inside the container (exec, not
    httpGet): the kubelet's HTTP probes connect to the pod's IP, where a loopback-only proxy does not listen.
    ``spec.proxy.spoolDir`` names a directory for ``harnessrl run``; here the spool is an emptyDir, the only
    path the proxy writes, so its root filesystem is read-only.
    """
    port = run.spec.proxy.port
    probe = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/healthz', timeout=2)"
    return {
        "name": PROXY_CONTAINER,
        "image": run.spec.proxy.image or config.proxy_image,
        "restartPolicy": "Always",
        "command": ["harnessrl", "proxy"],
        "env": proxy_env(run, config, launch),
        "startupProbe": {
            "exec": {"command": ["python3", "-c", probe]},
            "periodSeconds": 1,
            "timeoutSeconds": 3,
            "failureThreshold": 120,
        },
        **(
            {"ports": [{"name": PROXY_METRICS_PORT_NAME, "containerPort": config.proxy_metrics_port, "protocol": "TCP"}]}
            if config.proxy_metrics_port
            else {}
        ),
        "resources": container_resources(run.spec.proxy.resources, 0) or {"requests": dict(PROXY_REQUESTS)},
        "securityContext": {
            **restricted_security(),
            "runAsUser": PROXY_UID,
            "runAsGroup": PROXY_UID,
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": [{"name": "spool", "mountPath": SPOOL_DIR}],
    }


def _attempt_env(run: TrainingRun, launch: Launch) -> list[dict[str, Any]]:
    """The attempt's identity and task, for the harness and the verifier alike (a task too large for one
    environment variable is in the file alone: ``harnessrl.task_contract``)."""
    task_field = f"metadata.annotations['{naming.TASK_ANNOTATION}']"
    in_env = [env_from_field("HARNESSRL_TASK", task_field)] if task_fits_in_env(task_json(launch)) else []
    return [
        env("HARNESSRL_RUN", run.metadata.name),
        env("HARNESSRL_ROLLOUT_ID", launch.rollout_id),
        env("HARNESSRL_ATTEMPT", str(launch.attempt)),
        env("HARNESSRL_TASK_ID", launch.task_id),
        env("HARNESSRL_POLICY_VERSION", str(launch.policy_version)),
        env("HARNESSRL_TASK_FILE", TASK_FILE),
        *in_env,
    ]


def _with_home(user: list[dict[str, Any]], contract: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spec's env, then the contract: the contract's names are harnessrl's (the spec says so), so they
    replace a same-named variable of the spec. ``HOME`` is ``/tmp`` unless the spec sets it, because the
    sandbox user has no home directory and tools (pip, git, caches) write there."""
    defaults = [] if any(var["name"] == "HOME" for var in user) else [env("HOME", "/tmp")]
    return merge_env(defaults + user, contract)


def harness_env(run: TrainingRun, launch: Launch) -> list[dict[str, Any]]:
    """The harness's contract. With a verifier it has no reward URL (the proxy would refuse it without the
    token anyway) and a workspace to leave its work in."""
    spec = run.spec
    base = f"http://127.0.0.1:{spec.proxy.port}/v1"
    contract = [
        env("OPENAI_BASE_URL", base),
        env("OPENAI_API_KEY", "harnessrl"),
        env("HARNESSRL_MODEL_NAME", SERVED_MODEL_NAME),
    ]
    if spec.harness.verifier is None:
        contract.append(env("HARNESSRL_REWARD_URL", f"{base}/reward"))
    else:
        contract.append(env("HARNESSRL_WORKSPACE", WORKSPACE_DIR))
    return _with_home(spec_env(spec.harness.env), contract + _attempt_env(run, launch))


def verifier_container(run: TrainingRun, launch: Launch) -> dict[str, Any]:
    """The verifier: the pod's main container, started once the harness (an init container then) exited 0,
    on the workspace the harness left; the only container with the reward token."""
    verifier = run.spec.harness.verifier
    contract = [
        env("HARNESSRL_REWARD_URL", f"http://127.0.0.1:{run.spec.proxy.port}/v1/reward"),
        reward_token_env(run),
        env("HARNESSRL_WORKSPACE", WORKSPACE_DIR),
    ]
    container: dict[str, Any] = {
        "name": VERIFIER_CONTAINER,
        "image": verifier.image or harness_image(run, launch),
        "command": list(verifier.command),
    }
    if verifier.args:
        container["args"] = list(verifier.args)
    container["env"] = _with_home(spec_env(verifier.env), contract + _attempt_env(run, launch))
    resources = container_resources(verifier.resources, 0)
    if resources:
        container["resources"] = resources
    container["securityContext"] = sandbox_security(run)
    # A /tmp of its own: HOME is /tmp, and a user site-packages, a .pth file or a tool's config the harness left
    # in its /tmp would run in the process that holds the reward token. The workspace alone is shared.
    container["volumeMounts"] = _mounts(workspace=True, tmp=VERIFIER_TMP)
    return container


def sandbox_security(run: TrainingRun) -> dict[str, Any]:
    """The harness's and verifier's container security: restricted, and a read-only root filesystem where
    ``spec.harness.sandbox.readOnlyRootFilesystem`` asks for it (``/tmp`` and the workspace stay writable)."""
    security = restricted_security()
    if run.spec.harness.sandbox.read_only_root_filesystem:
        security["readOnlyRootFilesystem"] = True
    return security


def _mounts(workspace: bool, tmp: str = "tmp") -> list[dict[str, Any]]:
    mounts = [
        {"name": "task", "mountPath": TASK_DIR, "readOnly": True},
        {"name": tmp, "mountPath": "/tmp"},
    ]
    return mounts + ([{"name": "workspace", "mountPath": WORKSPACE_DIR}] if workspace else [])


def harness_container(run: TrainingRun, launch: Launch) -> dict[str, Any]:
    """The harness, as the spec describes it. Its root filesystem stays writable: harnesses install packages
    and check out repositories where they like, and the spec has no field to ask for a read-only one."""
    harness = run.spec.harness
    container: dict[str, Any] = {
        "name": HARNESS_CONTAINER,
        "image": harness_image(run, launch),
        "command": list(harness.command),
    }
    if harness.args:
        container["args"] = list(harness.args)
    if harness.working_dir:
        container["workingDir"] = harness.working_dir
    container["env"] = harness_env(run, launch)
    resources = container_resources(harness.resources, 0)
    if resources:
        container["resources"] = resources
    container["securityContext"] = sandbox_security(run)
    container["volumeMounts"] = _mounts(workspace=harness.verifier is not None)
    return container


def harness_annotations(launch: Launch) -> dict[str, str]:
    annotations = {
        naming.ROLLOUT_ANNOTATION: launch.rollout_id,
        naming.ATTEMPT_ANNOTATION: str(launch.attempt),
        naming.POLICY_VERSION_ANNOTATION: str(launch.policy_version),
        naming.TASK_ANNOTATION: task_json(launch),
    }
    size = sum(len(key.encode()) + len(value.encode()) for key, value in annotations.items())
    if size > ANNOTATIONS_LIMIT:
        raise ValueError(
            f"task {launch.task_id!r}: {size} bytes of JSON, above the 256 KiB a harness pod can carry in its "
            "annotations — keep large inputs in the harness image or on a volume and name them in task.data"
        )
    return annotations


def render_harness_pod(
    run: TrainingRun, namespace: str, uid: str, config: OperatorConfig, launch: Launch
) -> dict[str, Any]:
    """The pod of one rollout attempt, ``<rollout_id>-a<attempt>``.

    Sandbox (``spec.harness.sandbox``): every container runs as non-root with no privilege escalation, no
    capabilities and the RuntimeDefault seccomp profile; no service-account token and no service env vars.
    The pod runs as uid/gid 65532 whatever the image says: most harness images run as root by default, and
    ``runAsNonRoot`` alone would refuse to start them; the spec has no field to pick another user yet.
    ``activeDeadlineSeconds`` is the attempt's timeout (rounded up), so the kubelet ends a harness the
    operator could not stop in time. ``restartPolicy: Never``: a failed attempt is retried, if at all, as a
    new attempt in a new pod, by the scheduler.
    """
    name = run.metadata.name
    metadata = naming.child_metadata(
        naming.harness_pod_name(launch.rollout_id, launch.attempt), namespace, name, uid, naming.HARNESS
    )
    metadata["annotations"] = harness_annotations(launch)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": max(1, math.ceil(launch.timeout_s)),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": run.spec.harness.sandbox.run_as_user,
            "runAsGroup": run.spec.harness.sandbox.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [proxy_container(run, config, launch)],
        "containers": [harness_container(run, launch)],
        "volumes": [
            {
                "name": "task",
                "downwardAPI": {
                    "items": [
                        {
                            "path": "task.json",
                            "fieldRef": {"fieldPath": f"metadata.annotations['{naming.TASK_ANNOTATION}']"},
                        }
                    ]
                },
            },
            {"name": "tmp", "emptyDir": {}},
            {"name": "spool", "emptyDir": {}},
        ],
    }
    if run.spec.harness.verifier is not None:
        # The harness runs to completion as an init container (after the proxy sidecar has started), then the
        # verifier, the main container, scores what it left in the workspace.
        pod_spec["initContainers"].append(pod_spec["containers"].pop())
        pod_spec["containers"] = [verifier_container(run, launch)]
        pod_spec["volumes"] += [{"name": "workspace", "emptyDir": {}}, {"name": VERIFIER_TMP, "emptyDir": {}}]
    runtime_class = run.spec.harness.sandbox.runtime_class_name
    if runtime_class:
        pod_spec["runtimeClassName"] = runtime_class
    pod_spec.update(pod_scheduling(run.spec.harness.scheduling))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
