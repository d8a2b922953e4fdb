"""The learner: an Indexed Job of ``spec.learner.nodes`` pods, and the headless Service they rendezvous on.

Each pod runs ``torchrun`` with static rendezvous: node rank = the pod's completion index, rank 0's address =
``<run>-learner-0.<run>-learner`` (an Indexed Job names each pod's host ``<job>-<index>``; the pod's
``subdomain`` and the headless Service make that name resolve). ``torchrun`` starts one ``harnessrl learn``
process per accelerator and gives each the RANK, LOCAL_RANK and WORLD_SIZE that ``init_distributed`` reads.
The command line mirrors ``harnessrl run``'s ``_start_learner``: the TrainingRun from a file (``--spec``,
mounted from the run's Secret), the base model, the checkpoint directory, the steps and the replicas to sync.
"""

from __future__ import annotations

import posixpath
from typing import Any

from harnessrl.operator import naming
from harnessrl.operator.config import OperatorConfig
from harnessrl.operator.render_common import (
    cache_env,
    claim_volumes,
    container_resources,
    env,
    env_from_field,
    env_from_secret,
    merge_env,
    pod_scheduling,
    read_only_root,
    replica_targets,
    run_claims,
    writable_paths,
)
from harnessrl.operator.render_secret import SPEC_KEY, run_secret_name, store_url_env
from harnessrl.spec.models import TrainingRun

MASTER_PORT = 29500
METRICS_PORT = 9400
"""The learner's /metrics (global rank 0 serves it, so pod 0 of the Job: the chart's PodMonitor scrapes that pod)."""
WORK_DIR = "/var/lib/harnessrl"
"""The learner's working directory (an emptyDir): relative paths of the spec land here, as they land in the
run directory of ``harnessrl run``."""
SPEC_DIR = "/etc/harnessrl/run"
HUB_MODEL_DIR = f"{WORK_DIR}/model"
LEARNER_GID = 65532
"""The learner image's group: claims are made writable for it (``fsGroup``), whatever uid owns a fresh volume."""
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
RESTARTS_PER_NODE = 3
HUB_DOWNLOAD = (
    "import os\n"
    "from huggingface_hub import snapshot_download\n"
    "snapshot_download(repo_id=os.environ['HARNESSRL_HUB_ID'], "
    "revision=os.environ.get('HARNESSRL_HUB_REVISION') or None, local_dir=os.environ['HARNESSRL_MODEL_DIR'])\n"
)
"""The hub download, as a script reading its inputs from the environment (no value is pasted into code)."""


def learner_image(run: TrainingRun, config: OperatorConfig) -> str:
    return run.spec.learner.image or config.learner_image


def model_dir(run: TrainingRun) -> str:
    """``harnessrl learn --model`` needs a directory; a hub model is downloaded into one first."""
    model = run.spec.model
    return HUB_MODEL_DIR if model.hub is not None else model.path


def checkpoint_dir(run: TrainingRun) -> str:
    directory = run.spec.learner.checkpoint_dir
    return directory if directory.startswith("/") else posixpath.join(WORK_DIR, directory)


def learner_command(run: TrainingRun, config: OperatorConfig) -> list[str]:
    """``torchrun`` around ``harnessrl learn``. The store URL is not a flag: ``--store`` reads
    ``HARNESSRL_STORE_URL``, which keeps a password off the command line. The learner waits for a vLLM replica
    as long as the operator waits for vLLM to serve (its provisioning timeout) before its first sync."""
    learner = run.spec.learner
    command = [
        "torchrun",
        "--nnodes=$(NNODES)",
        "--nproc-per-node=$(NPROC_PER_NODE)",
        "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "-m", "harnessrl.cli", "learn",
        "--spec", f"{SPEC_DIR}/{SPEC_KEY}",  # its metadata.name is the run: no --run, which torchrun's
        # parser takes for an abbreviation of its own --run-path and refuses as ambiguous (seen on the real node)
        "--model", model_dir(run),
        "--output", checkpoint_dir(run),
        "--steps", str(learner.steps),
        "--metrics-port", str(METRICS_PORT),
    ]  # fmt: skip
    targets = replica_targets(run, naming.VLLM_CONTROL_PORT)
    for target in targets:  # pause and reload: the gate's control port
        command += ["--replica", target]
    if targets:
        command += ["--replica-wait", str(config.provisioning_timeout_seconds)]
    return command


def learner_env(run: TrainingRun, config: OperatorConfig) -> list[dict[str, Any]]:
    name = run.metadata.name
    learner = run.spec.learner
    return cache_env() + [
        env("MASTER_ADDR", f"{naming.learner_name(name)}-0.{naming.learner_name(name)}"),
        env("MASTER_PORT", str(MASTER_PORT)),
        env("NNODES", str(learner.nodes)),
        env("NPROC_PER_NODE", str(max(1, learner.gpus_per_node))),
        env_from_field("NODE_RANK", COMPLETION_INDEX),
        store_url_env(run, config),
    ]


def hub_download_container(run: TrainingRun, image: str, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    hub = run.spec.model.hub
    variables = [env("HARNESSRL_HUB_ID", hub.id), env("HARNESSRL_MODEL_DIR", HUB_MODEL_DIR)]
    if hub.revision:
        variables.append(env("HARNESSRL_HUB_REVISION", hub.revision))
    if hub.token_secret is not None:
        variables.append(env_from_secret("HF_TOKEN", hub.token_secret.name, hub.token_secret.key))
    return {
        "name": "model",
        "image": image,
        "command": ["python3", "-c", HUB_DOWNLOAD],
        "env": merge_env(cache_env(), variables),
        "volumeMounts": mounts,
        "securityContext": read_only_root(),
    }


def render_learner_job(run: TrainingRun, namespace: str, uid: str, config: OperatorConfig) -> dict[str, Any]:
    """The learner Job ``<run>-learner``.

    - ``restartPolicy: OnFailure``: a failed rank restarts in place, keeping its pod, hostname and address,
      and rejoins the others at rank 0 (whose collectives broke with it, so they restart too); a new pod per
      failure (``Never``) would leave the surviving ranks blocked in a collective until NCCL's timeout.
    - ``backoffLimit`` = 3 restarts per node: one incident usually restarts every rank, and each restart
      resumes from the newest committed checkpoint, so three incidents cost at most three steps. It bounds
      one streak of failures, not the run's life: a Job that fails past it after committing steps is created
      again by the operator (``RunController._recreate_learner_job``); one that committed nothing fails the
      run (LearnerCrashed) instead of holding GPUs.
    - init containers: ``harnessrl db upgrade`` so the schema exists before any rank opens the store (safe
      from several pods at once), and for a hub model the download ``--model`` needs.
    - the pod's ``fsGroup`` (with ``OnRootMismatch``) makes a fresh checkpoint claim writable for the learner
      image's user; every container's root filesystem is read-only, with HOME and the caches of torch,
      triton, inductor, DeepSpeed's JIT ops and huggingface on an emptyDir (``render_common.CACHE_ENV``).
    - the pod template is immutable once the Job exists, as ``spec.learner`` is once the run exists (the
      CRD refuses a change, see ``harnessrl.spec.changes``).
    """
    name = run.metadata.name
    learner = run.spec.learner
    image = learner_image(run, config)
    volumes, mounts = claim_volumes(run_claims(run, checkpoints_read_only=False))
    scratch_volumes, scratch = writable_paths()
    volumes += scratch_volumes + [
        {"name": "work", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {
            "name": "spec",
            "secret": {"secretName": run_secret_name(name), "items": [{"key": SPEC_KEY, "path": SPEC_KEY}]},
        },
    ]
    mounts += scratch + [
        {"name": "work", "mountPath": WORK_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
    ]
    store = store_url_env(run, config)
    init_containers = [
        {
            "name": "db-upgrade",
            "image": image,
            "command": ["harnessrl", "db", "upgrade"],
            "env": [*cache_env(), store],
            "volumeMounts": writable_paths()[1],
            "securityContext": read_only_root(),
        }
    ]
    if run.spec.model.hub is not None:
        init_containers.append(
            hub_download_container(run, image, [*writable_paths()[1], {"name": "work", "mountPath": WORK_DIR}])
        )
    container: dict[str, Any] = {
        "name": "learner",
        "image": image,
        "command": learner_command(run, config),
        "workingDir": WORK_DIR,
        "env": learner_env(run, config),
        "ports": [
            {"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "volumeMounts": mounts,
        "securityContext": read_only_root(),
    }
    resources = container_resources(learner.resources, learner.gpus_per_node)
    if resources:
        container["resources"] = resources
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": naming.child_metadata(naming.learner_name(name), namespace, name, uid, naming.LEARNER),
        "spec": {
            "completionMode": "Indexed",
            "completions": learner.nodes,
            "parallelism": learner.nodes,
            "backoffLimit": RESTARTS_PER_NODE * learner.nodes,
            "template": {
                "metadata": {"labels": naming.labels(name, naming.LEARNER)},
                "spec": {
                    "subdomain": naming.learner_name(name),
                    "restartPolicy": "OnFailure",
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    # A fresh claim belongs to root: the kubelet gives it the learner's group (only when its
                    # root's group differs, so a large checkpoint volume is not walked at every start).
                    "securityContext": {"fsGroup": LEARNER_GID, "fsGroupChangePolicy": "OnRootMismatch"},
                    "initContainers": init_containers,
                    "containers": [container],
                    "volumes": volumes,
                    **pod_scheduling(learner.scheduling),
                },
            },
        },
    }


def render_learner_service(run: TrainingRun, namespace: str, uid: str) -> dict[str, Any]:
    """Headless Service ``<run>-learner`` that gives each learner pod a DNS name. Not-ready addresses are
    published: the learner has no readiness probe, and rank 0 must resolve before any rank is past startup."""
    name = run.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.child_metadata(naming.learner_name(name), namespace, name, uid, naming.LEARNER),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": naming.selector(name, naming.LEARNER),
            "ports": [
                {"name": "rendezvous", "port": MASTER_PORT, "targetPort": "rendezvous", "protocol": "TCP"}
            ],
        },
    }
