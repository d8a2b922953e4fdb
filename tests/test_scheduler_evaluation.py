"""Evaluation rollouts, a rollout kind of the one scheduler, against real harness processes and a real store.

The harness is the scheduler tests' own (a Python process that reports the reward its task names, or crashes).
Checked through the store: an evaluation round is created once per due version with its kind and the version
it evaluates, launched before queued training rollouts, never claimed by the learner, outside the staleness
bound, and scored per version (mean reward, pass rate, unbiased pass@k, failures).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
from test_scheduler import active, harness, make  # noqa: F401 - harness is a fixture

from harnessrl.rollout_ids import is_evaluation
from harnessrl.scheduler import EvaluationSchedule, RolloutScheduler
from harnessrl.spec.evaluation import Evaluation
from harnessrl.store import TraceStore
from harnessrl.store.evaluations import best_version, evaluation_results, pass_at_k
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.store.schema import EVALUATION, Rollout

TRAIN_TASKS = [{"id": f"t{i}", "behaviour": "ok", "reward": 0.5} for i in range(4)]
EVAL_TASKS = [
    {"id": "e-pass", "behaviour": "ok", "reward": 1.0},
    {"id": "e-low", "behaviour": "ok", "reward": 0.25},
    {"id": "e-crash", "behaviour": "crash"},
]


def scheduler_with_evaluation(store, store_url, harness_path, tmp_path, every_steps=2, samples=2,
                              **overrides) -> RolloutScheduler:
    """The scheduler tests' ``make`` with an evaluation (a training-only scheduler builds the backend)."""
    plain, backend = make(store, store_url, harness_path, tmp_path, TRAIN_TASKS, **overrides)
    settings = dataclasses.replace(plain.settings, evaluation=EvaluationSchedule(every_steps, True, samples))
    return RolloutScheduler(store, settings, backend, TRAIN_TASKS, evaluation_tasks=EVAL_TASKS)


def drive(scheduler: RolloutScheduler, version: int, done, *, finishing: bool = False, rounds: int = 3000):
    for _ in range(rounds):
        scheduler.reconcile(version, finishing=finishing)
        if done():
            return
        time.sleep(0.02)
    raise AssertionError("the scheduler did not reach the expected state")


def evaluation_rows(store: TraceStore) -> list:
    from sqlalchemy import select

    with store.engine.connect() as conn:
        return conn.execute(
            select(Rollout.rollout_id, Rollout.task_id, Rollout.evaluated_version)
            .where(Rollout.run == "sched", Rollout.kind == EVALUATION).order_by(Rollout.rollout_id)
        ).all()


def test_due_versions() -> None:
    schedule = EvaluationSchedule(every_steps=3, at_start=True, samples_per_task=1)
    assert schedule.due(0, set()) and not schedule.due(0, {0})
    assert not schedule.due(1, {0}) and not schedule.due(2, {0})
    assert schedule.due(3, {0}) and not schedule.due(3, {0, 3}) and not schedule.due(4, {0, 3})
    assert schedule.due(7, {0, 3})  # 6 was never served (a skipped sync): the newest version stands in
    assert not schedule.due(8, {0, 3, 7})
    assert not EvaluationSchedule(3, False, 1).due(0, set())
    assert not EvaluationSchedule(3, True, 1).due(2, set())  # the baseline only while v0 is serving


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the pass rate
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_evaluation_rounds_run_first_are_scored_and_never_trained_on(
    store: TraceStore, store_url: str, harness: Path, tmp_path: Path  # noqa: F811
) -> None:
    scheduler = scheduler_with_evaluation(store, store_url, harness, tmp_path, concurrency=2)
    launched_first = []
    original = scheduler.backend.launch
    scheduler.backend.launch = lambda launch: (launched_first.append(launch.rollout_id), original(launch))[1]

    # Version 0 (atStart): one round of 3 tasks x 2 samples, launched before any training rollout.
    drive(scheduler, 0, lambda: len(evaluation_results(store, "sched")) == 1
          and evaluation_results(store, "sched")[0].complete)
    assert all(is_evaluation(r) for r in launched_first[:6]), launched_first[:8]
    rows = evaluation_rows(store)
    assert [(r.task_id, r.evaluated_version) for r in rows] == [
        (f"eval:{task}", 0) for task in ("e-pass", "e-pass", "e-low", "e-low", "e-crash", "e-crash")
    ]
    # The staleness bound counts training groups only: (maxStaleness 0 + 1) x tasksPerStep 2 groups.
    drive(scheduler, 0, lambda: active(store) == 0)
    training = [a for a in store.list_attempts("sched") if not is_evaluation(a.rollout_id)]
    assert len(training) == 2 * 2

    evaluation = Evaluation.model_validate({"tasks": {"inline": [{"id": "x"}]}, "samplesPerTask": 2,
                                            "temperature": 1.0, "passReward": 0.5})
    [result] = evaluation_results(store, "sched", evaluation)
    assert (result.version, result.rollouts, result.ended, result.succeeded) == (0, 6, 6, 4)
    assert (result.failed, result.timed_out) == (2, 0)
    assert result.reward_mean == pytest.approx((1.0 + 1.0 + 0.25 + 0.25) / 4)
    assert result.pass_rate == pytest.approx(2 / 6)  # a crashed rollout never passes
    assert result.k == 2 and result.pass_at_k == pytest.approx((1.0 + 0.0 + 0.0) / 3)

    # The learner claims training groups only, whatever it is asked for.
    ledger = LearnerLedger(store, "sched")
    claim = ledger.claim(tasks_per_step=2, group_size=2)
    assert claim is not None and not any(is_evaluation(a.rollout_id) for a in claim.attempts)
    assert ledger.claim(tasks_per_step=3, group_size=2) is None  # the evaluation "groups" are not groups
    ledger.commit(1, str(tmp_path / "v1"), {}, claim.keys)
    assert all(a.consumed_by_step is None for a in store.list_attempts("sched") if is_evaluation(a.rollout_id))

    # Version 1 is not due (everySteps 2); version 2 is, once; the same pass never creates it twice.
    assert scheduler.reconcile(1).evaluation_rollouts_created == 0
    assert scheduler.reconcile(2).evaluation_rollouts_created == 6
    assert scheduler.reconcile(2).evaluation_rollouts_created == 0
    drive(scheduler, 2, lambda: all(r.complete for r in evaluation_results(store, "sched")))
    assert [r.version for r in evaluation_results(store, "sched")] == [0, 2]


def test_a_finishing_run_evaluates_its_final_version_and_starts_no_training(
    store: TraceStore, store_url: str, harness: Path, tmp_path: Path  # noqa: F811
) -> None:
    scheduler = scheduler_with_evaluation(store, store_url, harness, tmp_path, every_steps=10, samples=1)
    drive(scheduler, 0, lambda: active(store) == 0 and len(store.list_attempts("sched")) > 3)
    before = {a.rollout_id for a in store.list_attempts("sched") if not is_evaluation(a.rollout_id)}
    status = scheduler.reconcile(3, finishing=True)
    assert status.evaluation_rollouts_created == 3 and status.groups_created == 0
    drive(scheduler, 3, lambda: not scheduler.evaluation_pending(), finishing=True)
    after = {a.rollout_id for a in store.list_attempts("sched") if not is_evaluation(a.rollout_id)}
    assert after == before
    results = evaluation_results(store, "sched")
    assert [(r.version, r.complete) for r in results] == [(0, True), (3, True)]
    assert best_version(results) == 3  # equal scores: the newer version
    assert best_version(results, exportable={0}) == 0


def test_evaluation_without_tasks_is_refused(store: TraceStore, store_url: str, harness: Path,  # noqa: F811
                                             tmp_path: Path) -> None:
    scheduler, backend = make(store, store_url, harness, tmp_path, TRAIN_TASKS)
    settings = dataclasses.replace(scheduler.settings, evaluation=EvaluationSchedule(1, True, 1))
    with pytest.raises(ValueError, match="spec.evaluation.tasks"):
        RolloutScheduler(store, settings, backend, TRAIN_TASKS)
    assert evaluation_rows(store) == []


def test_a_round_cancelled_by_a_stop_runs_again_when_the_run_goes_on(
    store: TraceStore, store_url: str, harness: Path, tmp_path: Path  # noqa: F811
) -> None:
    scheduler = scheduler_with_evaluation(store, store_url, harness, tmp_path, samples=1, concurrency=1)
    scheduler.reconcile(0)
    assert scheduler.stop_all() >= 3  # Ctrl-C: the round's rollouts (and training ones) are cancelled
    [cancelled] = evaluation_results(store, "sched")
    assert cancelled.complete and cancelled.failed == 3
    # the next start: a new scheduler over the same store re-queues the round and scores it in full
    again = scheduler_with_evaluation(store, store_url, harness, tmp_path / "again", samples=1, concurrency=2)
    drive(again, 0, lambda: (r := evaluation_results(store, "sched")[0]).complete and r.succeeded == 2
          and r.failed == 1)
    [result] = evaluation_results(store, "sched")
    assert (result.rollouts, result.ended, result.succeeded, result.failed) == (3, 3, 2, 1)  # e-crash crashes


def test_evaluation_added_to_a_running_scheduler_is_scheduled_without_a_restart(
    store: TraceStore, store_url: str, harness: Path, tmp_path: Path  # noqa: F811
) -> None:
    """spec.evaluation may be added to a running operator run: the operator hands the scheduler it already
    has the new tasks (set_evaluation_tasks) and settings, and the baseline round starts at the next pass."""
    scheduler, _ = make(store, store_url, harness, tmp_path, TRAIN_TASKS)
    scheduler.reconcile(0)
    assert evaluation_rows(store) == []
    scheduler.settings = dataclasses.replace(scheduler.settings, evaluation=EvaluationSchedule(2, True, 1))
    scheduler.set_evaluation_tasks(EVAL_TASKS)
    drive(scheduler, 0, lambda: len(evaluation_rows(store)) == len(EVAL_TASKS))
    assert sorted(task for _, task, _ in evaluation_rows(store)) == sorted(f"eval:{t['id']}" for t in EVAL_TASKS)
    assert {version for _, _, version in evaluation_rows(store)} == {0}
