"""``TrainingRun.status``: what harnessrl observed, in the shape `kubectl get` and dashboards read."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from harnessrl.spec.base import StatusModel

CONDITION_REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class Phase(StrEnum):
    """Where a run is in its life."""

    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class Reason(StrEnum):
    """Why the run is in its phase; a closed set so alerts and tests can match on it."""

    CREATED = "Created"
    PROVISIONING = "Provisioning"
    RUNNING = "Running"
    COMPLETED = "Completed"
    SUSPENDED = "Suspended"
    INVALID_SPEC = "InvalidSpec"
    IMAGE_PULL_FAILED = "ImagePullFailed"
    UNSCHEDULABLE = "Unschedulable"
    LEARNER_CRASHED = "LearnerCrashed"
    ROLLOUT_UNAVAILABLE = "RolloutUnavailable"
    WEIGHT_SYNC_FAILED = "WeightSyncFailed"
    STORE_UNAVAILABLE = "StoreUnavailable"
    DEADLINE_EXCEEDED = "DeadlineExceeded"


class ConditionType(StrEnum):
    """The conditions a run reports."""

    ROLLOUT_READY = "RolloutReady"
    LEARNER_READY = "LearnerReady"
    STORE_READY = "StoreReady"
    PROGRESSING = "Progressing"
    CHECKPOINTS_SHARED = "CheckpointsShared"
    """Whether the checkpoint claim can be mounted by the learner and vLLM on different nodes (its access
    modes); only on runs whose vLLM the operator runs."""


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(StatusModel):
    """A Kubernetes condition (the metav1.Condition shape)."""

    type: ConditionType
    """What the condition is about."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = Field(min_length=1, max_length=1024, pattern=CONDITION_REASON)
    """A CamelCase word for why."""
    message: str = Field(default="", max_length=32768)
    """Details for people."""
    last_transition_time: datetime
    """When status last changed."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The spec generation this condition describes."""


class RolloutCounts(StatusModel):
    """Rollouts by state, over the whole run."""

    queued: int = Field(default=0, ge=0)
    running: int = Field(default=0, ge=0)
    succeeded: int = Field(default=0, ge=0)
    failed: int = Field(default=0, ge=0)
    timed_out: int = Field(default=0, ge=0)


class EvaluatedVersion(StatusModel):
    """The evaluation of one policy version on spec.evaluation.tasks (read from the trace store)."""

    version: int = Field(ge=0)
    """The policy version evaluated (0: the base model, the baseline)."""
    rollouts: int = Field(default=0, ge=0)
    """Evaluation rollouts of this version."""
    ended: int = Field(default=0, ge=0)
    """How many of them ended; fewer than rollouts while the round runs."""
    reward_mean: float | None = None
    """Mean reward of the rollouts that succeeded."""
    pass_rate: float | None = None
    """Rollouts with reward >= spec.evaluation.passReward over those that ended."""
    pass_at_k: float | None = None
    """Unbiased pass@k with k = spec.evaluation.samplesPerTask (set when it is above 1)."""
    failed: int = Field(default=0, ge=0)
    """Failed or cancelled rollouts."""
    timed_out: int = Field(default=0, ge=0)
    """Rollouts that ran past harness.timeoutSeconds."""


EVALUATED_VERSIONS_SHOWN = 20


class EvaluationStatus(StatusModel):
    """Evaluation results per version (spec.evaluation)."""

    versions: list[EvaluatedVersion] = Field(default_factory=list, max_length=EVALUATED_VERSIONS_SHOWN + 2)
    """Evaluated versions, oldest first: the baseline (the first), the best, and the newest
    EVALUATED_VERSIONS_SHOWN, so a long run's status stays small (an object is capped at 1.5 MiB); `harnessrl
    status` and the dashboards read every version from the store."""
    versions_omitted: int = Field(default=0, ge=0)
    """Evaluated versions left out of versions."""
    best_version: int | None = Field(default=None, ge=0)
    """The best complete evaluation (pass rate, then mean reward): what harnessrl export --version best writes
    and checkpoint pruning keeps."""


class LearnerJobStatus(StatusModel):
    """The learner Job's failures as the operator counts them: a Job's ``backoffLimit`` bounds one streak of
    failures, not the run's lifetime, so a Job that fails past it after committing steps is recreated."""

    restarts: int = Field(default=0, ge=0)
    """Times the operator recreated the learner Job, each after it failed past its backoffLimit having
    committed steps since it was created; it resumed from the newest committed checkpoint."""
    job_uid: str | None = None
    """The learner Job that sinceStep counts from."""
    since_step: int | None = Field(default=None, ge=0)
    """The committed step when the operator first saw that Job. A Job that fails past its backoffLimit without
    committing a step beyond it fails the run (LearnerCrashed)."""


class TrainingRunStatus(StatusModel):
    """Observed state of a run."""

    phase: Phase | None = None
    """Pending, Provisioning, Running, Succeeded, Failed or Suspended."""
    reason: Reason | None = None
    """Why the run is in its phase."""
    message: str | None = None
    """Details for people; for InvalidSpec, every problem `harnessrl validate` would print."""
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """RolloutReady, LearnerReady, StoreReady, Progressing."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The spec generation this status describes."""
    policy_version: int | None = Field(default=None, ge=0)
    """The policy version vLLM serves now."""
    step: int | None = Field(default=None, ge=0)
    """Optimizer steps taken."""
    rollouts: RolloutCounts | None = None
    """Rollouts by state."""
    reward_mean: float | None = None
    """Mean reward of the rollouts in the latest step."""
    evaluation: EvaluationStatus | None = None
    """Evaluation on held-out tasks, per policy version (spec.evaluation)."""
    learner: LearnerJobStatus | None = None
    """The learner Job's failures and restarts."""
    start_time: datetime | None = None
    """When the run started running."""
    completion_time: datetime | None = None
    """When the run succeeded or failed."""
