"""Group-relative advantages: one scalar per rollout attempt, baselined against the other rollouts of its task.

There is no value model: the rollouts of one task (its GRPO group) are each other's baseline. GRPO subtracts
the group mean, RLOO the mean of the *other* rollouts (``n / (n - 1) * (r - mean)``, unbiased for the policy
gradient); both may divide by the group's sample standard deviation (``ddof=1``, as ``torch.std`` does in the
common GRPO implementations) plus ``eps``. The advantage then applies to every generated token of every row of
the rollout, whatever number of rows it was split into.

What is left out, and counted: rollouts that did not succeed (unless ``failed_reward`` is set, which then
stands in for their reward; cancelled ones and those still running are never used), succeeded ones without a
reward (a missing reward is unknown, not zero), rollouts whose oldest tokens came from a policy more than
``max_staleness`` versions behind the learner, and whole groups whose remaining rewards are all equal (their
advantages are exactly zero: they would cost a forward/backward pass and move nothing) or that have a single
rollout left (no baseline).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from harnessrl.store.records import RolloutState
from harnessrl.trainer.rows import Row

if TYPE_CHECKING:
    from harnessrl.spec.learner import Learner

Estimator = Literal["grpo", "rloo"]
RolloutKey = tuple[str, int]  # (rollout_id, attempt)


@dataclass(frozen=True)
class RolloutOutcome:
    """What the advantage needs to know about one finished rollout attempt."""

    rollout_id: str
    attempt: int
    group: str  # the task id: rollouts of one task share a baseline
    state: RolloutState
    reward: float | None
    policy_version: int  # the oldest policy version behind any of its generated tokens

    @property
    def key(self) -> RolloutKey:
        return (self.rollout_id, self.attempt)


@dataclass(frozen=True)
class AdvantageConfig:
    estimator: Estimator = "grpo"
    std_normalize: bool = True
    eps: float = 1e-6
    failed_reward: float | None = None  # reward for failed/timed-out rollouts; None leaves them out
    max_staleness: int | None = None  # None: any age is fine

    def __post_init__(self) -> None:
        if self.estimator not in ("grpo", "rloo"):
            raise ValueError(f"estimator: {self.estimator!r} is not known; use 'grpo' or 'rloo'")
        if self.eps < 0:
            raise ValueError(f"eps: {self.eps} is negative; use a small positive number such as 1e-6")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness: {self.max_staleness} is negative; use 0 or more, or None")

    @classmethod
    def from_spec(cls, learner: Learner) -> AdvantageConfig:
        algorithm = learner.algorithm
        return cls(
            estimator=algorithm.advantage,
            std_normalize=algorithm.std_normalize,
            failed_reward=algorithm.failed_rollout_reward,
            max_staleness=learner.max_staleness,
        )


class Exclusion:
    """Reasons a rollout gets no advantage (keys of ``AdvantageStats.excluded``)."""

    NOT_FINISHED = "not_finished"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    MISSING_REWARD = "missing_reward"
    STALE = "stale"
    ZERO_VARIANCE = "zero_variance"
    SINGLE_ROLLOUT = "single_rollout"
    ALL = (NOT_FINISHED, FAILED, TIMED_OUT, CANCELLED, MISSING_REWARD, STALE, ZERO_VARIANCE, SINGLE_ROLLOUT)


@dataclass
class AdvantageStats:
    rollouts: int = 0
    used: int = 0
    filled_failed: int = 0  # failed/timed-out rollouts that got ``failed_reward``
    groups: int = 0  # groups with at least one rollout left after the per-rollout exclusions
    used_groups: int = 0
    zero_variance_groups: int = 0
    single_rollout_groups: int = 0
    excluded: Counter[str] = field(default_factory=Counter)  # rollouts, by reason
    reward_mean: float = float("nan")  # over rollouts that reached a group
    reward_std: float = float("nan")
    advantage_mean: float = float("nan")  # over used rollouts
    advantage_std: float = float("nan")
    advantage_abs_mean: float = float("nan")
    staleness_mean: float = float("nan")  # over rollouts that reached a group
    staleness_max: int = 0

    def as_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            name: float(getattr(self, name))
            for name in ("rollouts", "used", "filled_failed", "groups", "used_groups", "zero_variance_groups",
                         "single_rollout_groups", "reward_mean", "reward_std", "advantage_mean",
                         "advantage_std", "advantage_abs_mean", "staleness_mean", "staleness_max")
        }
        for reason in Exclusion.ALL:
            out[f"excluded_{reason}"] = float(self.excluded.get(reason, 0))
        return out


@dataclass
class AdvantageResult:
    advantages: dict[RolloutKey, float]  # only rollouts to train on
    stats: AdvantageStats


def compute_advantages(
    outcomes: Sequence[RolloutOutcome], config: AdvantageConfig, current_version: int
) -> AdvantageResult:
    """Advantage per rollout attempt for one learner step, ``current_version`` being the learner's policy."""
    stats = AdvantageStats(rollouts=len(outcomes))
    seen: set[RolloutKey] = set()
    groups: dict[str, list[tuple[RolloutOutcome, float]]] = defaultdict(list)
    for index, outcome in enumerate(outcomes):
        if outcome.key in seen:
            raise ValueError(
                f"outcomes[{index}]: rollout {outcome.rollout_id!r} attempt {outcome.attempt} appears twice; "
                "pass each rollout attempt once"
            )
        seen.add(outcome.key)
        reward = _usable_reward(outcome, config, stats)
        if reward is None:
            continue
        if config.max_staleness is not None and current_version - outcome.policy_version > config.max_staleness:
            stats.excluded[Exclusion.STALE] += 1
            continue
        groups[outcome.group].append((outcome, reward))

    stats.groups = len(groups)
    advantages: dict[RolloutKey, float] = {}
    rewards_seen: list[float] = []
    staleness: list[int] = []
    for members in groups.values():
        rewards = np.array([reward for _, reward in members], dtype=np.float64)
        rewards_seen.extend(rewards.tolist())
        staleness.extend(current_version - outcome.policy_version for outcome, _ in members)
        n = rewards.size
        if n == 1:
            stats.single_rollout_groups += 1
            stats.excluded[Exclusion.SINGLE_ROLLOUT] += 1
            continue
        if rewards.max() == rewards.min():
            stats.zero_variance_groups += 1
            stats.excluded[Exclusion.ZERO_VARIANCE] += n
            continue
        mean = rewards.mean()
        values = rewards - mean if config.estimator == "grpo" else (rewards - mean) * (n / (n - 1))
        if config.std_normalize:
            values = values / (rewards.std(ddof=1) + config.eps)
        stats.used_groups += 1
        for (outcome, _), value in zip(members, values.tolist()):
            advantages[outcome.key] = value

    stats.used = len(advantages)
    if rewards_seen:
        stats.reward_mean = float(np.mean(rewards_seen))
        stats.reward_std = float(np.std(rewards_seen))
        stats.staleness_mean = float(np.mean(staleness))
        stats.staleness_max = int(max(staleness))
    if advantages:
        values = np.array(list(advantages.values()))
        stats.advantage_mean = float(values.mean())
        stats.advantage_std = float(values.std())
        stats.advantage_abs_mean = float(np.abs(values).mean())
    return AdvantageResult(advantages, stats)


def _usable_reward(outcome: RolloutOutcome, config: AdvantageConfig, stats: AdvantageStats) -> float | None:
    state = RolloutState(outcome.state)
    if state == RolloutState.SUCCEEDED:
        if outcome.reward is None:
            stats.excluded[Exclusion.MISSING_REWARD] += 1
            return None
        if not np.isfinite(outcome.reward):
            raise ValueError(
                f"reward: rollout {outcome.rollout_id!r} attempt {outcome.attempt} has reward {outcome.reward}; "
                "rewards must be finite numbers"
            )
        return float(outcome.reward)
    if state in (RolloutState.FAILED, RolloutState.TIMED_OUT):
        if config.failed_reward is None:
            stats.excluded[Exclusion.FAILED if state == RolloutState.FAILED else Exclusion.TIMED_OUT] += 1
            return None
        stats.filled_failed += 1
        return float(config.failed_reward)
    stats.excluded[Exclusion.CANCELLED if state == RolloutState.CANCELLED else Exclusion.NOT_FINISHED] += 1
    return None


def token_advantages(
    rows: Sequence[Row], advantages: dict[RolloutKey, float]
) -> tuple[list[Row], list[np.ndarray]]:
    """Rows whose rollout has an advantage, each with it on every generated token (0 elsewhere), float32."""
    kept_rows: list[Row] = []
    per_token: list[np.ndarray] = []
    for row in rows:
        value = advantages.get((row.rollout_id, row.attempt))
        if value is None:
            continue
        kept_rows.append(row)
        per_token.append(row.loss_mask.astype(np.float32) * np.float32(value))
    return kept_rows, per_token
