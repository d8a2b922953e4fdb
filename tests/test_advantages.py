"""Numerical tests for group-relative advantages; expected values are worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harnessrl.spec.learner import Algorithm, Learner
from harnessrl.store.records import CallStatus, RolloutState, StoredCall
from harnessrl.trainer.advantages import AdvantageConfig, RolloutOutcome, compute_advantages, token_advantages
from harnessrl.trainer.rows import merge_calls_into_rows

S, F, T, C, R = (RolloutState.SUCCEEDED, RolloutState.FAILED, RolloutState.TIMED_OUT, RolloutState.CANCELLED,
                 RolloutState.RUNNING)


def outcome(rollout, reward, group="task", state=S, version=5, attempt=0):
    return RolloutOutcome(rollout, attempt, group, state, reward, version)


def test_grpo_mean_baseline_with_and_without_std():
    group = [outcome("a", 1.0), outcome("b", 0.0), outcome("c", 0.0), outcome("d", 1.0)]
    plain = compute_advantages(group, AdvantageConfig(std_normalize=False), current_version=5)
    assert plain.advantages == {("a", 0): 0.5, ("b", 0): -0.5, ("c", 0): -0.5, ("d", 0): 0.5}

    # sample std of [1, 0, 0, 1]: sqrt((4 * 0.25) / 3)
    scaled = compute_advantages(group, AdvantageConfig(std_normalize=True, eps=0.0), current_version=5)
    assert scaled.advantages[("a", 0)] == pytest.approx(0.5 / math.sqrt(1 / 3))
    assert scaled.advantages[("b", 0)] == pytest.approx(-0.5 / math.sqrt(1 / 3))
    assert scaled.stats.used == 4 and scaled.stats.used_groups == 1
    assert scaled.stats.reward_mean == 0.5 and scaled.stats.advantage_mean == pytest.approx(0.0)


def test_rloo_leave_one_out_baseline():
    group = [outcome("a", 1.0), outcome("b", 2.0), outcome("c", 6.0)]
    result = compute_advantages(group, AdvantageConfig(estimator="rloo", std_normalize=False), current_version=5)
    # each reward minus the mean of the other two: 1 - 4, 2 - 3.5, 6 - 1.5
    assert result.advantages[("a", 0)] == pytest.approx(-3.0)
    assert result.advantages[("b", 0)] == pytest.approx(-1.5)
    assert result.advantages[("c", 0)] == pytest.approx(4.5)


def test_groups_are_baselined_separately():
    outcomes = [outcome("a", 1.0, "t1"), outcome("b", 3.0, "t1"), outcome("c", 10.0, "t2"), outcome("d", 20.0, "t2")]
    result = compute_advantages(outcomes, AdvantageConfig(std_normalize=False), current_version=5)
    assert result.advantages == {("a", 0): -1.0, ("b", 0): 1.0, ("c", 0): -5.0, ("d", 0): 5.0}
    assert result.stats.groups == 2 and result.stats.used_groups == 2


def test_exclusions_are_counted_and_failed_rollouts_can_get_a_fill_reward():
    outcomes = [
        outcome("ok1", 1.0), outcome("ok2", 0.0),
        outcome("failed", 0.7, state=F), outcome("timeout", None, state=T),
        outcome("cancelled", 1.0, state=C), outcome("running", None, state=R),
        outcome("no-reward", None),
        outcome("stale", 1.0, version=2),  # current 5, max staleness 2: 5 - 2 = 3 > 2
        outcome("fresh-enough", 1.0, version=3),
        outcome("same1", 1.0, "flat"), outcome("same2", 1.0, "flat"), outcome("same3", 1.0, "flat"),
        outcome("alone", 0.3, "single"),
    ]
    result = compute_advantages(outcomes, AdvantageConfig(std_normalize=False, max_staleness=2), current_version=5)
    stats = result.stats
    assert set(result.advantages) == {("ok1", 0), ("ok2", 0), ("fresh-enough", 0)}
    # group "task" now holds 1, 0, 1: mean 2/3
    assert result.advantages[("ok2", 0)] == pytest.approx(-2 / 3)
    assert dict(stats.excluded) == {"failed": 1, "timed_out": 1, "cancelled": 1, "not_finished": 1,
                                    "missing_reward": 1, "stale": 1, "zero_variance": 3, "single_rollout": 1}
    assert stats.zero_variance_groups == 1 and stats.single_rollout_groups == 1 and stats.groups == 3
    assert stats.rollouts == 13 and stats.used == 3
    assert stats.staleness_max == 2
    metrics = stats.as_metrics()
    assert metrics["excluded_stale"] == 1 and metrics["zero_variance_groups"] == 1

    filled = compute_advantages(outcomes[:4], AdvantageConfig(std_normalize=False, failed_reward=-1.0),
                                current_version=5)
    # rewards 1, 0, -1, -1 (the failed one's own 0.7 is not trusted): mean -0.25
    assert filled.advantages[("failed", 0)] == pytest.approx(-0.75)
    assert filled.advantages[("ok1", 0)] == pytest.approx(1.25)
    assert filled.stats.filled_failed == 2


def test_advantage_is_broadcast_to_every_generated_token_of_every_row():
    def call(cid, seq, prompt, completion, rollout):
        return StoredCall(cid, rollout, 0, seq, None, prompt, completion, [-0.1] * len(completion), 1, CallStatus.OK)

    # rollout r1 was split into two rows (the second prompt does not extend the first call)
    split = merge_calls_into_rows([call("a", 0, [1, 2], [3], "r1"), call("b", 1, [9], [4, 5], "r1")]).rows
    other = merge_calls_into_rows([call("c", 0, [1], [2], "r2")]).rows
    ignored = merge_calls_into_rows([call("d", 0, [1], [2], "r3")]).rows
    rows, per_token = token_advantages(split + other + ignored, {("r1", 0): 0.5, ("r2", 0): -2.0})
    assert [r.call_ids for r in rows] == [("a",), ("b",), ("c",)]
    assert [a.tolist() for a in per_token] == [[0, 0, 0.5], [0, 0.5, 0.5], [0, -2.0]]
    assert all(a.dtype == np.float32 for a in per_token)


def test_config_from_spec_and_bad_input():
    learner = Learner(algorithm=Algorithm(advantage="rloo", std_normalize=False, failed_rollout_reward=0.0),
                      max_staleness=3)
    config = AdvantageConfig.from_spec(learner)
    assert (config.estimator, config.std_normalize, config.failed_reward, config.max_staleness) == (
        "rloo", False, 0.0, 3)
    with pytest.raises(ValueError, match="appears twice"):
        compute_advantages([outcome("a", 1.0), outcome("a", 0.0)], AdvantageConfig(), current_version=1)
    with pytest.raises(ValueError, match="must be finite"):
        compute_advantages([outcome("a", float("nan"))], AdvantageConfig(), current_version=1)
    with pytest.raises(ValueError, match="estimator: 'ppo'"):
        AdvantageConfig(estimator="ppo")
