"""A TrainingRun's status, computed from what one reconcile observed: a pure function, so the phase rules are
tested without a cluster and the status is the same whoever (or whichever restart) computes it.

The phase answers "where is the run", the reason "why" (a closed set, ``harnessrl.spec.status.Reason``), and
the conditions the four questions users ask: is the store reachable, is vLLM serving, is the learner up, is
the run progressing. A condition's ``lastTransitionTime`` moves only when its status does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from harnessrl.spec.status import EVALUATED_VERSIONS_SHOWN, ConditionType, Phase, Reason
from harnessrl.store import RolloutState
from harnessrl.store.evaluations import EvaluationResult, best_version

REWARD_DIGITS = 4
"""Decimals of ``status.rewardMean``, the REWARD column of ``kubectl get tr``."""


@dataclass
class Observed:
    """What one reconcile saw. ``problem`` is a failure that names the field and the fix."""

    generation: int
    phase: Phase
    reason: Reason
    message: str = ""
    store_ready: bool | None = None
    store_message: str = ""
    rollout_ready: bool | None = None
    rollout_message: str = ""
    learner_ready: bool | None = None
    learner_message: str = ""
    rollout_problem: tuple[Reason, str] | None = None  # what keeps vLLM pods from running (workload_pods.py)
    learner_problem: tuple[Reason, str] | None = None
    rollout_kubelet_reason: str | None = None  # CrashLoopBackOff, OOMKilled, ... (RolloutReady's reason)
    learner_kubelet_reason: str | None = None
    checkpoints_shared: tuple[bool, str, str] | None = None  # (shared, reason, message); None: no vLLM of ours
    policy_version: int | None = None
    step: int | None = None
    counts: dict[RolloutState, int] = field(default_factory=dict)
    reward_mean: float | None = None
    evaluation: list[EvaluationResult] = field(default_factory=list)  # per evaluated version (spec.evaluation)
    start_time: str | None = None
    completion_time: str | None = None
    learner_job: LearnerJobRecord | None = None  # status.learner: the operator's count of learner Job restarts


@dataclass(frozen=True)
class LearnerJobRecord:
    """``status.learner``: kept in the run's status so a restarted operator counts on from it."""

    restarts: int = 0
    job_uid: str | None = None
    since_step: int | None = None

    @classmethod
    def from_status(cls, status: dict[str, Any] | None) -> LearnerJobRecord:
        status = status or {}
        return cls(int(status.get("restarts") or 0), status.get("jobUid"), status.get("sinceStep"))

    def to_status(self) -> dict[str, Any]:
        fields = {"restarts": self.restarts, "jobUid": self.job_uid, "sinceStep": self.since_step}
        return {key: value for key, value in fields.items() if value is not None}


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def epoch(stamp: Any) -> float | None:
    """Seconds since the epoch of a Kubernetes timestamp (the API's RFC 3339 text, or a parsed datetime)."""
    if not stamp:
        return None
    if isinstance(stamp, datetime):
        return stamp.timestamp()
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()


def _condition(
    kind: ConditionType,
    ok: bool | None,
    reason: str,
    message: str,
    generation: int,
    previous: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    before = previous.get(kind.value)
    moved = before is None or before.get("status") != status
    return {
        "type": kind.value,
        "status": status,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": now_iso() if moved else before["lastTransitionTime"],
        "observedGeneration": generation,
    }


def unavailable_since(status: dict[str, Any], started: float, now: float) -> float:
    """When the run's vLLM replicas stopped serving, from the status it already wrote (so an operator restart
    keeps the count): never served yet (no RolloutReady condition, or not True since the start) counts from the
    run's start, a replica that served until this pass from now, an outage already seen from its
    RolloutReady transition. The provisioning timeout is measured from here, not from the run's start: a
    replica restarted after hours of training gets the same time to come back as the first one had."""
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = conditions.get(ConditionType.ROLLOUT_READY.value)
    if ready is None:
        return started
    if ready.get("status") == "True":
        return now
    since = epoch(ready.get("lastTransitionTime"))
    return max(started, since) if since is not None else started


def build_status(observed: Observed, previous: dict[str, Any] | None) -> dict[str, Any]:
    """The ``status`` to write; ``previous`` is the object's current status (for transition times)."""
    previous = previous or {}
    before = {c["type"]: c for c in previous.get("conditions") or [] if "type" in c}
    g = observed.generation
    progressing = observed.phase in (Phase.PENDING, Phase.PROVISIONING, Phase.RUNNING)
    conditions = [
        _condition(
            ConditionType.STORE_READY,
            observed.store_ready,
            "Connected" if observed.store_ready else "StoreUnavailable",
            observed.store_message,
            g,
            before,
        ),
        _condition(
            ConditionType.ROLLOUT_READY,
            observed.rollout_ready,
            "Serving" if observed.rollout_ready else (observed.rollout_kubelet_reason or "NotServing"),
            observed.rollout_message,
            g,
            before,
        ),
        _condition(
            ConditionType.LEARNER_READY,
            observed.learner_ready,
            "Running" if observed.learner_ready else (observed.learner_kubelet_reason or "NotRunning"),
            observed.learner_message,
            g,
            before,
        ),
        _condition(
            ConditionType.PROGRESSING, progressing, observed.reason.value, observed.message, g, before
        ),
    ]
    if observed.checkpoints_shared is not None:
        shared, reason, message = observed.checkpoints_shared
        conditions.append(_condition(ConditionType.CHECKPOINTS_SHARED, shared, reason, message, g, before))
    counts = observed.counts
    status: dict[str, Any] = {
        "phase": observed.phase.value,
        "reason": observed.reason.value,
        "message": observed.message,
        "conditions": conditions,
        "observedGeneration": g,
        "rollouts": {
            "queued": counts.get(RolloutState.QUEUED, 0),
            "running": counts.get(RolloutState.RUNNING, 0),
            "succeeded": counts.get(RolloutState.SUCCEEDED, 0),
            "failed": counts.get(RolloutState.FAILED, 0),
            "timedOut": counts.get(RolloutState.TIMED_OUT, 0),
        },
    }
    for key, value in (
        ("policyVersion", observed.policy_version),
        ("step", observed.step),
        # Rounded: `kubectl get tr` prints the number as stored (0.19433710522465142 made a REWARD column of 19
        # characters); the exact mean is in the store, the learner's metrics and `harnessrl status`.
        ("rewardMean", None if observed.reward_mean is None else round(observed.reward_mean, REWARD_DIGITS)),
        ("startTime", observed.start_time or previous.get("startTime")),
        ("completionTime", observed.completion_time or previous.get("completionTime")),
    ):
        if value is not None:
            status[key] = value
    if observed.evaluation:
        status["evaluation"] = evaluation_status(observed.evaluation)
    learner = observed.learner_job or LearnerJobRecord.from_status(previous.get("learner"))
    if learner != LearnerJobRecord():
        status["learner"] = learner.to_status()
    return status


def evaluation_status(results: list[EvaluationResult]) -> dict[str, Any]:
    """``status.evaluation``: a row per evaluated version (the baseline, the best and the newest
    ``EVALUATED_VERSIONS_SHOWN``; the store has all), and the best complete one."""
    best = best_version(results)
    newest = {r.version for r in results[-EVALUATED_VERSIONS_SHOWN:]}
    shown = [r for i, r in enumerate(results) if i == 0 or r.version in newest or r.version == best]
    versions = []
    for r in shown:
        row = {"version": r.version, "rollouts": r.rollouts, "ended": r.ended, "rewardMean": r.reward_mean,
               "passRate": r.pass_rate, "passAtK": r.pass_at_k, "failed": r.failed, "timedOut": r.timed_out}
        versions.append({key: value for key, value in row.items() if value is not None})
    status: dict[str, Any] = {"versions": versions}
    if len(shown) < len(results):
        status["versionsOmitted"] = len(results) - len(shown)
    if best is not None:
        status["bestVersion"] = best
    return status


def same_status(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Equal but for condition transition times (which only move with a status change anyway)."""
    if a is None:
        return False

    def strip(status: dict[str, Any]) -> dict[str, Any]:
        out = dict(status)
        out["conditions"] = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []
        ]
        return out

    return strip(a) == strip(b)
