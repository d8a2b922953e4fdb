"""Pieces every renderer shares: env vars, resources, claim volumes and where the policy is served.

The spec's Kubernetes shapes (``harnessrl.spec.kube``) already follow the core API's spelling, so most of this
is copying them over; what is added here is the rule for the cases the spec leaves open (two volumes at one
path, accelerators next to user-given resources).
"""

from __future__ import annotations

import copy
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from harnessrl.operator import naming
from harnessrl.policy_serving import SERVED_MODEL_NAME  # noqa: F401 - re-exported for the renderers
from harnessrl.replica_targets import dns_target
from harnessrl.spec.kube import EnvVar, Resources, Scheduling, Volume
from harnessrl.spec.models import TrainingRun

GPU_RESOURCE = "nvidia.com/gpu"


def restricted_security() -> dict[str, Any]:
    """The Pod Security Standards' "restricted" profile for one container (a new object per call: a rendered
    object shares no part with another, so a caller may change one freely)."""
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def env_from_field(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def env_from_secret(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def spec_env(variables: Iterable[EnvVar]) -> list[dict[str, Any]]:
    """The spec's env vars in the container's form (the spec spells them exactly as Kubernetes does)."""
    return [var.model_dump(mode="json", by_alias=True, exclude_none=True) for var in variables]


def merge_env(first: Sequence[dict[str, Any]], then: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``first`` then ``then``, where a name in ``then`` replaces the same name in ``first``.

    Kubernetes lets the last of two same-named variables win but warns about it on every create; leaving the
    loser out keeps the object quiet and makes the winner obvious to whoever reads the pod.
    """
    overridden = {var["name"] for var in then}
    return [var for var in first if var["name"] not in overridden] + list(then)


def quantity(value: int | str) -> str:
    """Quantities as strings: the canonical form the API server returns, so applied objects compare equal."""
    return str(value)


def container_resources(resources: Resources, gpus: int) -> dict[str, Any]:
    """The spec's requests and limits plus ``gpus`` accelerators in both (extended resources need equal
    requests and limits). The spec's accelerator count wins over a ``nvidia.com/gpu`` in its resources."""
    requests = {name: quantity(value) for name, value in resources.requests.items()}
    limits = {name: quantity(value) for name, value in resources.limits.items()}
    if gpus > 0:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = dict(sorted(requests.items()))
    if limits:
        out["limits"] = dict(sorted(limits.items()))
    return out


def pod_scheduling(scheduling: Scheduling) -> dict[str, Any]:
    """The pod-spec fields of a component's ``scheduling`` (vLLM, learner and harness pods alike), only those
    set, so an unset field leaves the cluster's defaults (and the rendered object) as they were."""
    out: dict[str, Any] = {}
    if scheduling.node_selector:
        out["nodeSelector"] = dict(sorted(scheduling.node_selector.items()))
    if scheduling.tolerations:
        out["tolerations"] = [
            t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in scheduling.tolerations
        ]
    if scheduling.affinity:
        out["affinity"] = copy.deepcopy(scheduling.affinity)
    if scheduling.priority_class_name:
        out["priorityClassName"] = scheduling.priority_class_name
    if scheduling.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": ref.name} for ref in scheduling.image_pull_secrets]
    if scheduling.service_account_name:
        out["serviceAccountName"] = scheduling.service_account_name
    return out


CACHE_DIR = "/var/cache/harnessrl"
"""Where the learner's and vLLM's containers keep what their libraries cache (an emptyDir): their root
filesystems are read-only, and each library otherwise writes under ``$HOME`` or a path of its own."""
CACHE_ENV = {
    "HOME": CACHE_DIR,
    "XDG_CACHE_HOME": f"{CACHE_DIR}/xdg-cache",
    "XDG_CONFIG_HOME": f"{CACHE_DIR}/xdg-config",
    "HF_HOME": f"{CACHE_DIR}/huggingface",
    "TORCH_HOME": f"{CACHE_DIR}/torch",
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_DIR}/torchinductor",
    "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton",
    "TORCH_EXTENSIONS_DIR": f"{CACHE_DIR}/torch_extensions",  # DeepSpeed's JIT-built ops land here
    "MPLCONFIGDIR": f"{CACHE_DIR}/matplotlib",
    "TMPDIR": "/tmp",
}
"""HOME and every cache directory torch, triton, inductor, DeepSpeed, transformers and huggingface_hub read,
pointed at the cache volume; vLLM adds its own (``render_rollout.VLLM_CACHE_ENV``)."""


def writable_paths() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The emptyDirs behind ``CACHE_ENV`` (the cache and ``/tmp``), as pod volumes and container mounts."""
    volumes = [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    return volumes, mounts


def cache_env(extra: dict[str, str] | None = None) -> list[dict[str, Any]]:
    return [env(name, value) for name, value in {**CACHE_ENV, **(extra or {})}.items()]


def read_only_root() -> dict[str, Any]:
    """The learner's and vLLM's container security: a read-only root filesystem (they write only to their
    volumes) and no privilege escalation. Their images decide the user (vLLM's runs as root)."""
    return {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False}


@dataclass(frozen=True)
class Claim:
    """A PersistentVolumeClaim a container mounts; ``field`` names it in the spec for error messages."""

    name: str
    volume: Volume
    read_only: bool
    field: str


MODEL_VOLUME = "model"
CHECKPOINT_VOLUME = "checkpoints"


def run_claims(run: TrainingRun, checkpoints_read_only: bool) -> list[Claim]:
    """The model's claim (read-only) and the learner's checkpoint claim: the learner writes checkpoints,
    vLLM only reads the ones weight sync hands it."""
    spec = run.spec
    claims = []
    if spec.model.volume is not None:
        claims.append(Claim(MODEL_VOLUME, spec.model.volume, True, "spec.model.volume"))
    if spec.learner.checkpoint_volume is not None:
        claims.append(
            Claim(
                CHECKPOINT_VOLUME,
                spec.learner.checkpoint_volume,
                checkpoints_read_only,
                "spec.learner.checkpointVolume",
            )
        )
    return claims


def claim_volumes(claims: Iterable[Claim]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Pod volumes and container mounts for ``claims``.

    Two spec fields may name the same claim at the same path (a model and its checkpoints on one volume):
    they become one mount, writable if either needs to write. The same path for different claims cannot be
    mounted, and no spec rule catches it yet, so it is refused here with both field names.
    """
    by_path: dict[str, Claim] = {}
    for claim in claims:
        seen = by_path.get(claim.volume.mount_path)
        if seen is None:
            by_path[claim.volume.mount_path] = claim
            continue
        if (seen.volume.pvc, seen.volume.sub_path) != (claim.volume.pvc, claim.volume.sub_path):
            raise ValueError(
                f"{claim.field}.mountPath {claim.volume.mount_path!r} is also {seen.field}.mountPath, for "
                "another claim or subPath — mount the two volumes at different paths"
            )
        by_path[claim.volume.mount_path] = Claim(
            seen.name, seen.volume, seen.read_only and claim.read_only, seen.field
        )
    volumes, mounts = [], []
    for claim in by_path.values():
        volumes.append({"name": claim.name, "persistentVolumeClaim": {"claimName": claim.volume.pvc}})
        mount = {"name": claim.name, "mountPath": claim.volume.mount_path, "readOnly": claim.read_only}
        if claim.volume.sub_path:
            mount["subPath"] = claim.volume.sub_path
        mounts.append(mount)
    return volumes, mounts


def upstream_roots(run: TrainingRun) -> list[str]:
    """Base URLs (without ``/v1``) of the servers that generate rollouts: the run's vLLM Service, or the
    external servers of ``spec.rollout.upstreams`` (written with ``/v1``, which the proxy and the learner's
    weight sync do not want), as ``harnessrl run`` strips them."""
    upstreams = run.spec.rollout.upstreams
    if upstreams:
        return [url.rstrip("/").removesuffix("/v1") for url in upstreams]
    return [f"http://{naming.rollout_name(run.metadata.name)}:{naming.VLLM_PORT}"]


def replica_targets(run: TrainingRun, port: int = naming.VLLM_PORT) -> list[str]:
    """The vLLM replicas one by one, for the learner (it syncs every replica, on ``naming.VLLM_CONTROL_PORT``)
    and the sidecar proxies (each pins a rollout to one replica and reads that replica's weight label, on the
    public ``naming.VLLM_PORT``): the rollout's headless Service, resolved again and again (``dns://``), where the
    Service's own name would pick a replica per request. ``spec.rollout.upstreams`` are used as given."""
    if run.spec.rollout.upstreams:
        return upstream_roots(run)
    return [dns_target(naming.rollout_pods_name(run.metadata.name), port)]


@dataclass(frozen=True)
class Endpoint:
    """Where a URL points, as a NetworkPolicy can express it: a CIDR when the host is an IP literal, else
    None (a DNS name resolves to addresses a policy cannot name), and the TCP port."""

    cidr: str | None
    port: int


def endpoint(url: str, default_port: int) -> Endpoint:
    parts = urlsplit(url)
    try:
        port = parts.port or default_port
    except ValueError:
        port = default_port
    try:
        address = ipaddress.ip_address(parts.hostname or "")
    except ValueError:
        return Endpoint(None, port)
    return Endpoint(f"{address}/{address.max_prefixlen}", port)
