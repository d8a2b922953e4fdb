"""``spec.harness``: the agent program, the tasks it runs and the sandbox its pods run in."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, WithJsonSchema, field_validator

from harnessrl.spec.base import SpecModel
from harnessrl.spec.kube import PATH_MAX, Cidr, EnvVar, ObjectName, Resources, Scheduling, Volume, user_error
from harnessrl.spec.rules import Rule, exactly_one, path_inside, path_inside_cel

FreeFormObject = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]


class Task(SpecModel):
    """One task, given to the harness as JSON (the same shape as one line of a tasks file)."""

    id: str = Field(min_length=1)
    """Unique within the run; the rollouts of one task form one advantage group."""
    image: str | None = Field(default=None, min_length=1)
    """Run this task's harness pods from this image instead of harness.image."""
    data: FreeFormObject = Field(default_factory=dict)
    """Anything the harness needs: the problem statement, a repository, tests to run."""


class ConfigMapSource(SpecModel):
    """Tasks as JSON Lines in one key of a ConfigMap."""

    name: ObjectName
    """The ConfigMap, in the run's namespace."""
    key: str = Field(default="tasks.jsonl", min_length=1)
    """The key holding one JSON task per line."""


class FileSource(SpecModel):
    """Tasks as a JSON Lines file: a local path for `harnessrl run`, or a path on a volume in a cluster."""

    path: str = Field(min_length=1, max_length=PATH_MAX)
    """The JSONL file, one task per line."""
    volume: Volume | None = None
    """The claim holding the file; path must lie inside its mountPath."""

    rules = (
        Rule(
            field="path",
            cel="!has(self.volume) || " + path_inside_cel("self.path", "self.volume.mountPath"),
            holds=lambda f: f.volume is None or path_inside(f.path, f.volume.mount_path),
            problem="the tasks file is not inside the volume's mountPath",
            explain=lambda f: f"{f.path!r} is not inside volume.mountPath {f.volume.mount_path!r}",
            fix="put the file under the volume's mountPath",
        ),
    )


class Tasks(SpecModel):
    """Where tasks come from: exactly one of configMap, file or inline."""

    config_map: ConfigMapSource | None = None
    """A ConfigMap key with JSON Lines."""
    file: FileSource | None = None
    """A JSON Lines file."""
    inline: list[Task] | None = Field(
        default=None,
        min_length=1,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"]},
    )
    """Tasks written in the TrainingRun itself (small sets only: the whole object must stay under 1 MiB)."""

    rules = (
        exactly_one(
            "the task list",
            {"configMap": "config_map", "file": "file", "inline": "inline"},
            fix="set one of them, and only one",
        ),
    )

    @field_validator("inline")
    @classmethod
    def _unique_ids(cls, tasks: list[Task] | None) -> list[Task] | None:
        """Task ids key advantage groups; the CRD enforces the same with a map-type list keyed by id."""
        if tasks is not None:
            first_index: dict[str, int] = {}
            for index, task in enumerate(tasks):
                if task.id in first_index:
                    raise user_error(
                        "duplicate_task_id",
                        f"task id {task.id!r} is used by inline[{first_index[task.id]}] and inline[{index}] "
                        "— give every task its own id",
                    )
                first_index[task.id] = index
        return tasks


class EgressRule(SpecModel):
    """A destination harness pods may reach besides the proxy."""

    cidr: Cidr
    """Addresses, e.g. 10.0.0.0/8."""
    ports: list[Annotated[int, Field(ge=1, le=65535)]] = Field(default_factory=list)
    """TCP ports; empty means all ports."""


class Sandbox(SpecModel):
    """Isolation of harness pods. Pods always run as non-root, with no service-account token, all capabilities
    dropped and the RuntimeDefault seccomp profile."""

    runtime_class_name: str | None = Field(default=None, min_length=1)
    """A RuntimeClass such as gvisor or kata for stronger isolation."""
    network_policy: Literal["proxy-only", "none", "custom"] = "proxy-only"
    """proxy-only: pods reach only the proxy and the rollout servers; custom: that plus egress; none: no
    NetworkPolicy is created (the namespace's own policies apply)."""
    egress: list[EgressRule] = Field(default_factory=list)
    """Extra destinations, only with networkPolicy custom."""
    run_as_user: int = Field(default=65532, ge=1)
    """The uid (and gid) the harness and verifier run as, whatever their image says; never root. 65532 is the
    distroless "nonroot" user; set your image's own user where files in the image belong to it."""
    read_only_root_filesystem: bool = False
    """Mount the harness's and verifier's root filesystems read-only (they still write /tmp and the
    workspace). Off by default: most harnesses install packages or check out code where they like."""

    rules = (
        Rule(
            field="egress",
            cel="self.networkPolicy == 'custom' ? size(self.egress) > 0 : size(self.egress) == 0",
            holds=lambda s: (len(s.egress) > 0) == (s.network_policy == "custom"),
            problem="egress goes with networkPolicy custom, and custom needs egress",
            explain=lambda s: (
                "networkPolicy custom needs at least one egress rule"
                if s.network_policy == "custom"
                else f"egress is set but networkPolicy is {s.network_policy}"
            ),
            fix="set networkPolicy to custom and list the egress rules, or remove egress",
        ),
    )


class Verifier(SpecModel):
    """A program that scores the harness's work after the harness has exited, so the policy cannot forge
    its own reward: in a coding task the model's shell commands run with the harness's rights and could
    report any reward. Only the verifier gets the token the proxy requires on ``/v1/reward``
    (``HARNESSRL_REWARD_TOKEN``); the harness gets no reward URL. Both see the same workspace directory
    (``HARNESSRL_WORKSPACE``: an emptyDir in a pod, the attempt's directory in ``harnessrl run``). A harness
    that exits non-zero is not verified: its attempt fails as without a verifier."""

    image: str | None = Field(default=None, min_length=1)
    """Container image of the verifier; default: the harness's image (the task's, when it names one)."""
    command: list[str] = Field(min_length=1)
    """The verifier program, e.g. [python, -m, run_tests]; it POSTs the reward to HARNESSRL_REWARD_URL with
    the header Authorization: Bearer $HARNESSRL_REWARD_TOKEN."""
    args: list[str] = Field(default_factory=list)
    """Arguments after command."""
    env: list[EnvVar] = Field(default_factory=list)
    """Environment variables; the task, the reward URL and token and the workspace are set by harnessrl."""
    resources: Resources = Field(default_factory=Resources)
    """Requests and limits of the verifier container."""

    cluster_only: ClassVar[frozenset[str]] = frozenset({"image", "resources"})


class Harness(SpecModel):
    """The agent harness: a container that runs one rollout of one task and reports a reward (or leaves its
    work for ``verifier`` to score)."""

    image: str | None = Field(default=None, min_length=1)
    """Container image for harness pods (a task may override it); `harnessrl run` runs the command locally."""
    command: list[str] = Field(min_length=1)
    """The harness program, e.g. [python, -m, my_harness]."""
    args: list[str] = Field(default_factory=list)
    """Arguments after command."""
    env: list[EnvVar] = Field(default_factory=list)
    """Environment variables; OPENAI_BASE_URL and the task are set by harnessrl."""
    working_dir: str | None = Field(default=None, min_length=1)
    """Working directory of the harness process."""
    tasks: Tasks
    """Where the tasks come from."""
    group_size: int = Field(default=8, ge=1)
    """Rollouts per task: the group a group-relative advantage compares within."""
    concurrency: int = Field(default=16, ge=1)
    """Harness pods (or local processes) running at once."""
    timeout_seconds: int = Field(default=1800, ge=1)
    """Wall-clock limit for one rollout attempt; it then counts as timed out."""
    max_attempts: int = Field(default=2, ge=1)
    """Attempts per rollout: a failed or timed-out attempt is retried until this many ran.
    A failure the LLM upstream caused (upstream_unavailable, upstream_timeout) uses none, up to 10 per rollout."""
    sandbox: Sandbox = Field(default_factory=Sandbox)
    """Isolation settings."""
    resources: Resources = Field(default_factory=Resources)
    """Requests and limits of each harness container."""
    verifier: Verifier | None = None
    """Score each attempt with a separate program after the harness, which alone may report the reward.
    Unset: the harness reports its own reward."""
    scheduling: Scheduling = Field(default_factory=Scheduling)
    """Node selector, tolerations, affinity, priority class, pull secrets and ServiceAccount of the harness
    pods (the verifier runs in the same pod); a change reaches the pods started after it."""

    changeable: ClassVar[frozenset[str] | None] = frozenset(
        {"concurrency", "timeout_seconds", "max_attempts", "scheduling"}
    )
    cluster_only: ClassVar[frozenset[str]] = frozenset({"image", "resources", "sandbox", "scheduling"})
