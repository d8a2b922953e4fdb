"""Evaluation results per policy version, computed from the store's evaluation rollouts.

Nothing is cached elsewhere: ``harnessrl status``, the run's summary and PNG, the TrainingRun's
``status.evaluation``, the metrics and ``harnessrl export --version best`` all read the same rollouts
(``rollouts.kind = 'evaluation'``, their ``evaluated_version`` and their latest attempt's state and reward),
so they always agree, and a resumed run reports the same history.

A rollout's outcome is its latest attempt's. It passes when it succeeded with a reward of at least
``spec.evaluation.passReward``; a failed, timed-out or cancelled rollout never passes and has no reward, so the
mean reward is over the rollouts that succeeded, while the pass rate is over every rollout that ended.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from harnessrl.spec.evaluation import Evaluation
from harnessrl.store.records import RolloutState
from harnessrl.store.schema import EVALUATION, LearnerStep, Rollout, RolloutAttempt, Run
from harnessrl.store.trace_store import TraceStore


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator (Chen et al. 2021): the chance that k of the n samples, drawn without
    replacement, include one of the c that passed: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class EvaluationResult:
    """One evaluated policy version."""

    version: int
    rollouts: int
    """Evaluation rollouts of this version (tasks x samplesPerTask once all are created)."""
    ended: int
    """Rollouts whose latest attempt ended (succeeded, failed, timed out or cancelled)."""
    succeeded: int
    failed: int
    """Failed or cancelled rollouts (no reward)."""
    timed_out: int
    reward_mean: float | None
    """Mean reward of the rollouts that succeeded; None while none did."""
    pass_rate: float | None
    """Passes over ended rollouts; None while none ended."""
    k: int
    """samplesPerTask: the k of pass@k."""
    pass_at_k: float | None
    """Mean over tasks of the unbiased pass@k, once every rollout ended and k > 1; None otherwise."""
    step: int | None = None
    """The learner step that made this version (0 for the base model; None when the store has no such step):
    where the evaluation sits on a per-step curve."""

    @property
    def complete(self) -> bool:
        return self.rollouts > 0 and self.ended == self.rollouts

    @property
    def score(self) -> tuple[float, float]:
        """What ``--version best`` ranks by: the pass rate, then the mean reward."""
        return (self.pass_rate or 0.0, self.reward_mean if self.reward_mean is not None else -math.inf)

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "rollouts": self.rollouts, "ended": self.ended, "succeeded": self.succeeded,
            "failed": self.failed, "timed_out": self.timed_out, "reward_mean": self.reward_mean,
            "pass_rate": self.pass_rate, "k": self.k, "pass_at_k": self.pass_at_k, "step": self.step,
        }


def evaluation_settings(store: TraceStore, run: str) -> Evaluation | None:
    """The run's ``spec.evaluation`` as stored with the run (None: the run has none, or no stored spec)."""
    with store.engine.connect() as conn:
        document = conn.scalar(select(Run.spec).where(Run.name == run))
    section = ((document or {}).get("spec") or {}).get("evaluation")
    return Evaluation.model_validate(section, strict=False) if section else None


def evaluation_results(store: TraceStore, run: str, evaluation: Evaluation | None = None) -> list[EvaluationResult]:
    """Results per evaluated version, oldest first; ``evaluation`` defaults to the run's stored spec."""
    evaluation = evaluation or evaluation_settings(store, run)
    pass_reward = evaluation.pass_reward if evaluation else Evaluation.model_fields["pass_reward"].default
    k = evaluation.samples_per_task if evaluation else 1
    query = (
        select(Rollout.rollout_id, Rollout.task_id, Rollout.evaluated_version, RolloutAttempt.attempt,
               RolloutAttempt.state, RolloutAttempt.reward)
        .join(RolloutAttempt, RolloutAttempt.rollout_id == Rollout.rollout_id)
        .where(Rollout.run == run, Rollout.kind == EVALUATION)
    )
    latest: dict[str, Any] = {}
    with store.engine.connect() as conn:
        for row in conn.execute(query):
            if row.rollout_id not in latest or row.attempt > latest[row.rollout_id].attempt:
                latest[row.rollout_id] = row
    by_version: dict[int, list[Any]] = defaultdict(list)
    for row in latest.values():
        by_version[int(row.evaluated_version)].append(row)
    steps = _steps_making(store, run, set(by_version))
    return [_result(version, rows, pass_reward, k, steps.get(version))
            for version, rows in sorted(by_version.items())]


def _steps_making(store: TraceStore, run: str, versions: set[int]) -> dict[int, int]:
    """The first learner step at each version (a step that trains nothing keeps the version it had)."""
    made = {0: 0} if 0 in versions else {}
    query = (select(LearnerStep.policy_version, func.min(LearnerStep.step))
             .where(LearnerStep.run == run).group_by(LearnerStep.policy_version))
    with store.engine.connect() as conn:
        made.update({int(v): int(step) for v, step in conn.execute(query) if v in versions and v != 0})
    return made


def _result(version: int, rows: list[Any], pass_reward: float, k: int, step: int | None) -> EvaluationResult:
    states = [RolloutState(row.state) for row in rows]
    ended = [row for row, state in zip(rows, states, strict=True) if state.terminal]
    rewards = [row.reward for row, state in zip(rows, states, strict=True)
               if state is RolloutState.SUCCEEDED and row.reward is not None]
    passed = {row.rollout_id for row in ended if _passed(row, pass_reward)}
    per_task: dict[str, list[bool]] = defaultdict(list)
    for row in ended:
        per_task[row.task_id].append(row.rollout_id in passed)
    complete = len(ended) == len(rows)
    at_k = None
    if complete and k > 1 and all(len(v) >= k for v in per_task.values()):
        at_k = sum(pass_at_k(len(v), sum(v), k) for v in per_task.values()) / len(per_task)
    return EvaluationResult(
        version=version, rollouts=len(rows), ended=len(ended),
        succeeded=sum(state is RolloutState.SUCCEEDED for state in states),
        failed=sum(state in (RolloutState.FAILED, RolloutState.CANCELLED) for state in states),
        timed_out=sum(state is RolloutState.TIMED_OUT for state in states),
        reward_mean=sum(rewards) / len(rewards) if rewards else None,
        pass_rate=len(passed) / len(ended) if ended else None,
        k=k, pass_at_k=at_k, step=step,
    )


def _passed(row: Any, pass_reward: float) -> bool:
    return row.state == RolloutState.SUCCEEDED.value and row.reward is not None and row.reward >= pass_reward


def evaluated_versions(store: TraceStore, run: str) -> set[int]:
    """Versions with evaluation rollouts created (the scheduler creates each version's round once)."""
    query = select(Rollout.evaluated_version).where(Rollout.run == run, Rollout.kind == EVALUATION).distinct()
    with store.engine.connect() as conn:
        return {int(v) for v in conn.scalars(query)}


def best_version(results: list[EvaluationResult], exportable: set[int] | None = None) -> int | None:
    """The best complete evaluation (by :attr:`EvaluationResult.score`, a tie to the newer version), among
    ``exportable`` versions when given."""
    ranked = [r for r in results if r.complete and (exportable is None or r.version in exportable)]
    return max(ranked, key=lambda r: (r.score, r.version)).version if ranked else None
