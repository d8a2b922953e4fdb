"""The TrainingRun resource: the single source of truth for the API, the CRD and validation messages.

A tiny spec runs as written: a model path, a harness command and its tasks; every other field has a default
that works on one machine (`harnessrl run`) and on a cluster.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.spec.base import SpecModel
from harnessrl.spec.evaluation import Evaluation
from harnessrl.spec.harness import Harness
from harnessrl.spec.kube import (
    PATH_MAX,
    RUN_NAME,
    RUN_NAME_MAX,
    EnvVar,
    HttpUrl,
    KeyRef,
    Resources,
    Scheduling,
    Volume,
)
from harnessrl.spec.learner import Learner
from harnessrl.spec.rules import Rule, exactly_one, path_inside, path_inside_cel
from harnessrl.spec.status import TrainingRunStatus

GROUP = "harnessrl.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingRun"

DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"

POSTGRES_URL = r"^postgres(ql)?(\+[a-z0-9]+)?://"


class HubModel(SpecModel):
    """A model downloaded from a model hub when the pods start."""

    id: str = Field(min_length=1)
    """Repository id, e.g. Qwen/Qwen3-8B."""
    revision: str | None = Field(default=None, min_length=1)
    """Branch, tag or commit; pin one for reproducible runs."""
    token_secret: KeyRef | None = None
    """Secret key holding the hub token, for gated or private models."""


class Model(SpecModel):
    """The policy model: a path (on a volume in a cluster) or a hub id; exactly one."""

    path: str | None = Field(default=None, min_length=1, max_length=PATH_MAX)
    """A directory with the model's config, weights and tokenizer."""
    hub: HubModel | None = None
    """Download from a hub instead."""
    volume: Volume | None = None
    """The claim holding path; path must lie inside its mountPath."""
    tokenizer: str | None = Field(default=None, min_length=1)
    """A tokenizer directory, when it is not next to the weights."""

    cluster_only: ClassVar[frozenset[str]] = frozenset({"volume"})

    rules = (
        exactly_one(
            "the model",
            {"path": "path", "hub": "hub"},
            fix="set path (a directory) or hub (a hub id), not both",
        ),
        Rule(
            field="volume",
            cel="!has(self.volume) || (has(self.path) && "
            + path_inside_cel("self.path", "self.volume.mountPath")
            + ")",
            holds=lambda m: (
                m.volume is None or (m.path is not None and path_inside(m.path, m.volume.mount_path))
            ),
            problem="model.path is not inside volume.mountPath",
            explain=lambda m: f"path {m.path!r} is not inside volume.mountPath {m.volume.mount_path!r}",
            fix="set path to the model's directory under the volume's mountPath",
        ),
    )


class Rollout(SpecModel):
    """The vLLM servers that generate rollouts, and the sampling the proxy enforces on every call."""

    replicas: int = Field(default=1, ge=1)
    """vLLM server replicas; the proxy spreads calls over them."""
    gpus_per_replica: int = Field(default=1, ge=0)
    """Accelerators per replica; 0 runs vLLM on the CPU (small models, tests)."""
    tensor_parallel: int = Field(default=1, ge=1)
    """Tensor-parallel size of each replica."""
    max_model_len: int = Field(default=32768, ge=1)
    """Longest prompt + completion a replica accepts (vLLM --max-model-len)."""
    image: str | None = Field(default=None, min_length=1)
    """vLLM server image; unset: vllm/vllm-openai:v0.32.0 (CUDA only) when gpusPerReplica is above 0, the
    operator's CPU build of the same vLLM (ghcr.io/harnessrl/vllm-cpu:<version>) when it is 0."""
    args: list[str] = Field(default_factory=list)
    """Extra vLLM command-line arguments."""
    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables for the vLLM container."""
    resources: Resources = Field(default_factory=Resources)
    """Requests and limits of each replica (accelerators come from gpusPerReplica)."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature forced on every call; the learner trains softmax(logits / temperature), and vLLM
    reports that distribution's log-probs. Above 0 to train (0 is greedy: no distribution)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling forced on every call; below 1 the learner trains the same renormalised nucleus (vLLM
    reports its log-probs), so the samples stay on-policy. Other sampling fields a harness sends (top_k, min_p,
    penalties, logit_bias) are replaced by neutral values."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Cap on completion tokens per call; unset leaves each call's own limit."""
    upstreams: list[HttpUrl] | None = Field(default=None, min_length=1)
    """Use these running OpenAI-compatible servers (base URLs ending in /v1) instead of starting replicas."""
    scheduling: Scheduling = Field(default_factory=Scheduling)
    """Node selector, tolerations, affinity, priority class, pull secrets and ServiceAccount of the vLLM pods."""

    changeable: ClassVar[frozenset[str] | None] = frozenset({"replicas"})
    cluster_only: ClassVar[frozenset[str]] = frozenset(
        {"replicas", "gpus_per_replica", "tensor_parallel", "image", "env", "resources", "scheduling"}
    )

    rules = (
        Rule(
            field="tensorParallel",
            cel="self.gpusPerReplica == 0 ? self.tensorParallel == 1 "
            ": self.gpusPerReplica % self.tensorParallel == 0",
            holds=lambda r: (
                r.tensor_parallel == 1
                if r.gpus_per_replica == 0
                else r.gpus_per_replica % r.tensor_parallel == 0
            ),
            problem="gpusPerReplica is not a multiple of tensorParallel",
            explain=lambda r: (
                f"tensorParallel {r.tensor_parallel} needs accelerators, but gpusPerReplica is 0"
                if r.gpus_per_replica == 0
                else f"gpusPerReplica {r.gpus_per_replica} is not a multiple of "
                f"tensorParallel {r.tensor_parallel}"
            ),
            fix="make gpusPerReplica a multiple of tensorParallel",
        ),
        Rule(
            field="maxTokens",
            cel="!has(self.maxTokens) || self.maxTokens < self.maxModelLen",
            holds=lambda r: r.max_tokens is None or r.max_tokens < r.max_model_len,
            problem="maxTokens leaves no room for a prompt within maxModelLen",
            explain=lambda r: f"maxTokens {r.max_tokens} is not below maxModelLen {r.max_model_len}",
            fix="lower maxTokens or raise maxModelLen",
        ),
    )


class Pause(SpecModel):
    """What the proxy does with new calls while weights are being swapped."""

    mode: Literal["wait", "reject"] = "wait"
    """wait: hold new calls until the new weights serve (the harness only sees latency); reject: answer 503
    with Retry-After (for harnesses that retry by themselves; SDKs give up after a few retries)."""
    retry_after_seconds: int = Field(default=2, ge=1)
    """Retry-After value in reject mode."""


class Proxy(SpecModel):
    """The capture proxy between each harness and vLLM."""

    image: str | None = Field(default=None, min_length=1)
    """Proxy image; default: the proxy image of the installed harnessrl version."""
    port: int = Field(default=8080, ge=1, le=65535)
    """Port the harness reaches the proxy on (OPENAI_BASE_URL=http://127.0.0.1:<port>/v1)."""
    queue_size: int = Field(default=256, ge=1)
    """Captured calls, rewards and rollout ends held in memory until the store has them; while the queue is
    full, new calls wait before they are sent upstream (the harness sees latency, nothing is lost)."""
    queue_max_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    """The same bound in bytes (each call estimated from its request and its token count), so a few huge
    prompts cannot fill the proxy's memory below queueSize."""
    spool_dir: str = Field(default="spool", min_length=1)
    """Where captured calls wait when the store is unreachable, so none is lost. harnessrl run: relative to
    the run's directory (runs/<name>/spool); on a cluster the sidecar spools to a volume of its own pod."""
    spool_max_bytes: int = Field(default=1024 * 1024 * 1024, ge=1)
    """Largest spool file; once full, captured calls wait in memory (then new calls wait) and the proxy's
    /healthz answers 503 saying so, until the store is back."""
    max_request_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    """Largest request body accepted; larger ones get 413."""
    resources: Resources = Field(default_factory=Resources)
    """Requests and limits of the proxy sidecar; unset: 100m CPU and 128Mi requested, no limits (the proxy
    needs about 1 ms of CPU per call, and an OOM kill would lose the calls it holds)."""
    pause: Pause = Field(default_factory=Pause)
    """Behaviour during a weight sync."""

    cluster_only: ClassVar[frozenset[str]] = frozenset({"image", "port", "resources"})


class WeightSync(SpecModel):
    """How new weights reach the vLLM servers."""

    method: Literal["reload", "lora"] = "reload"
    """reload: vLLM reloads the whole checkpoint in place; lora: vLLM loads the new adapter (needs lora)."""
    timeout_seconds: int = Field(default=600, ge=1)
    """Limit for one sync across all replicas: no retry starts after it, no request waits longer."""
    retries: int = Field(default=3, ge=0)
    """Retries of a failed sync before the run fails (the learner stops; restarted, it syncs that version first)."""


class SqliteStore(SpecModel):
    """An embedded SQLite trace store, for `harnessrl run` on one machine."""

    path: str = Field(default="trace.sqlite", min_length=1)
    """Database file; relative paths are inside the run's directory."""


class PostgresStore(SpecModel):
    """A PostgreSQL trace store; exactly one of secretRef or url."""

    secret_ref: KeyRef | None = None
    """Secret key holding the connection URL (keeps the password out of the TrainingRun)."""
    url: str | None = Field(default=None, pattern=POSTGRES_URL)
    """Connection URL, e.g. postgresql+psycopg://user@db/harnessrl; anyone who can read the run sees it."""

    rules = (
        exactly_one(
            "postgres",
            {"secretRef": "secret_ref", "url": "url"},
            fix="set secretRef (preferred) or url, not both",
        ),
    )


class Store(SpecModel):
    """Where calls, rollouts and rewards are stored: exactly one of sqlite or postgres."""

    sqlite: SqliteStore | None = None
    """An embedded SQLite file (the default)."""
    postgres: PostgresStore | None = None
    """A PostgreSQL database."""

    rules = (
        exactly_one(
            "the store",
            {"sqlite": "sqlite", "postgres": "postgres"},
            fix="set one of them, or leave store out for the SQLite default",
        ),
    )


class TrainingRunSpec(SpecModel):
    """What to train, on which tasks, with which harness and resources."""

    model: Model
    """The policy model."""
    rollout: Rollout = Field(default_factory=Rollout)
    """vLLM servers and enforced sampling."""
    harness: Harness
    """The agent harness and its tasks."""
    proxy: Proxy = Field(default_factory=Proxy)
    """The capture proxy."""
    learner: Learner = Field(default_factory=Learner)
    """Training settings."""
    weight_sync: WeightSync = Field(default_factory=WeightSync)
    """How new weights reach vLLM."""
    store: Store = Field(default_factory=lambda: Store(sqlite=SqliteStore()))
    """The trace store."""
    evaluation: Evaluation | None = None
    """Score the policy on held-out tasks as it trains; unset: no evaluation."""
    suspend: bool = False
    """Start no new rollouts or learner steps; running work finishes and nothing is lost. false resumes."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Fail the run (DeadlineExceeded) when it has run this long."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete the run's pods and services this long after it finishes (stored traces are kept)."""

    changeable: ClassVar[frozenset[str] | None] = frozenset(
        {"rollout", "harness", "evaluation", "suspend", "active_deadline_seconds", "ttl_seconds_after_finished"}
    )
    cluster_only: ClassVar[frozenset[str]] = frozenset({"suspend", "ttl_seconds_after_finished"})

    rules = (
        Rule(
            field="harness.groupSize",
            cel="!(self.learner.algorithm.advantage in ['grpo', 'rloo']) || self.harness.groupSize >= 2",
            holds=lambda s: (
                s.learner.algorithm.advantage not in ("grpo", "rloo") or s.harness.group_size >= 2
            ),
            problem="a group-relative advantage needs groupSize of at least 2",
            explain=lambda s: (
                f"advantage {s.learner.algorithm.advantage} compares rollouts within a group, "
                f"but groupSize is {s.harness.group_size}"
            ),
            fix="set harness.groupSize to 2 or more (8 is typical)",
        ),
        Rule(
            field="learner.lora",
            cel="self.weightSync.method != 'lora' || has(self.learner.lora)",
            holds=lambda s: s.weight_sync.method != "lora" or s.learner.lora is not None,
            problem="weightSync.method lora needs learner.lora",
            fix="add learner.lora (e.g. {rank: 16}) or set weightSync.method to reload",
        ),
        Rule(
            field="learner.checkpointVolume",
            cel="has(self.rollout.upstreams) || has(self.learner.checkpointVolume)",
            holds=lambda s: s.rollout.upstreams is not None or s.learner.checkpoint_volume is not None,
            problem="the operator's vLLM pods load each new version from the learner's checkpoints, so they "
            "need a volume they share with the learner",
            fix="set learner.checkpointVolume to a ReadWriteMany claim ({pvc: checkpoints, mountPath: "
            "/checkpoints, readOnly: false}) with learner.checkpointDir inside it, or serve from "
            "rollout.upstreams",
            cluster_only=True,
        ),
    )


class ObjectMeta(BaseModel):
    """Kubernetes object metadata. Only name is read; the API server owns and adds the other fields
    (uid, resourceVersion, managedFields, ...), so unknown fields are kept rather than refused."""

    model_config = ConfigDict(
        extra="allow", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    name: str = Field(min_length=1, max_length=RUN_NAME_MAX, pattern=RUN_NAME)
    """Checked here and not in the CRD: the API server already enforces its own (looser) name format, and a
    CEL regex over an unbounded string would exceed the CRD's cost budget."""
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    generation: int | None = None


class TrainingRun(SpecModel):
    """A training run of a model through an agent harness."""

    api_version: Literal["harnessrl.io/v1alpha1"] = Field(alias="apiVersion")
    """Always harnessrl.io/v1alpha1."""
    kind: Literal["TrainingRun"]
    """Always TrainingRun."""
    metadata: ObjectMeta
    """Standard Kubernetes object metadata."""
    spec: TrainingRunSpec
    """The desired run."""
    status: TrainingRunStatus | None = None
    """Observed state, written by harnessrl."""

    def to_document(self) -> dict[str, Any]:
        """The run as a Kubernetes object (camelCase, unset optional fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
