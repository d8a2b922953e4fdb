"""The scheduler's hot-path store reads, on SQLite and PostgreSQL: the same answers as the slow reads they
replace, and the outstanding-group count that a retried rollout no longer leaks into."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from harnessrl.rollout_ids import evaluation_rollout_id, group_of, training_rollout_id
from harnessrl.store import RolloutState, TraceStore
from harnessrl.store import attempt_budget
from harnessrl.store.attempt_budget import INFRASTRUCTURE, MAX_INFRA_RETRIES
from harnessrl.store.learner_ledger import LearnerLedger, _final
from harnessrl.store.scheduler_reads import active_attempts, group_counts, latest_ended, training_group_key
from harnessrl.store.schema import Rollout, RolloutAttempt
from harnessrl.store.states import Move

S = RolloutState


def _run(store: TraceStore, tasks: int = 3) -> list[str]:
    store.ensure_run("run")
    return store.add_tasks("run", [{"id": f"t{i}"} for i in range(tasks)])


def _group(store: TraceStore, task: str, group: int, size: int) -> list[str]:
    return store.create_rollouts("run", task, [(training_rollout_id("run", group, i), i) for i in range(size)])


def _end(store: TraceStore, rollout_id: str, attempt: int, to: RolloutState, reward: float | None = None) -> None:
    store.try_transition(rollout_id, attempt, S.QUEUED, S.RUNNING)
    if reward is not None:
        store.set_reward(rollout_id, attempt, reward)
    store.try_transition(rollout_id, attempt, S.RUNNING, to, "test")


def test_group_key_in_sql_is_group_of(store: TraceStore) -> None:
    [task] = _run(store, 1)
    indices = [0, 7, 999, 1000, 12345]
    store.create_rollouts("run", task, [(training_rollout_id("run", 3, i), i) for i in indices])
    with store.engine.connect() as conn:
        keys = dict(conn.execute(select(Rollout.rollout_id, training_group_key())).all())
    assert keys == {rollout_id: group_of(rollout_id) for rollout_id in keys}
    assert set(keys.values()) == {"run-g000003"}


def test_active_attempts_match_the_full_records(store: TraceStore) -> None:
    tasks = _run(store)
    ids = _group(store, tasks[0], 0, 4) + _group(store, tasks[1], 1, 4)
    store.try_transition(ids[1], 0, S.QUEUED, S.RUNNING, policy_version=2)
    _end(store, ids[2], 0, S.FAILED)
    full = store.list_attempts("run", states=(S.QUEUED, S.RUNNING))
    slim = active_attempts(store, "run")
    assert [(a.rollout_id, a.attempt, a.state, a.task_id, a.started_at) for a in full] == list(slim)
    assert len(slim) == 7 and slim[1].state is S.RUNNING and slim[1].started_at is not None
    assert [a.rollout_id for a in active_attempts(store, "run", (S.QUEUED,))] == [i for i in ids if i not in ids[1:3]]


def test_outstanding_groups_count_rollouts_not_attempts(store: TraceStore) -> None:
    """A rollout whose retry was consumed is done: its first, failed attempt is never marked consumed, and
    counting unconsumed attempts kept the group outstanding for ever (the run then stalled at the bound)."""
    tasks = _run(store)
    first = _group(store, tasks[0], 0, 2)
    _group(store, tasks[1], 1, 2)
    assert group_counts(store, "run") == (4, 2)
    _end(store, first[0], 0, S.FAILED)
    assert store.new_attempt(first[0]) == 1
    _end(store, first[0], 1, S.SUCCEEDED, reward=1.0)
    _end(store, first[1], 0, S.SUCCEEDED, reward=0.0)
    claim = LearnerLedger(store, "run").claim(tasks_per_step=1, group_size=2, max_attempts=2)
    assert claim is not None and {(a.rollout_id, a.attempt) for a in claim.attempts} == {(first[0], 1), (first[1], 0)}
    LearnerLedger(store, "run").commit(1, "/ckpt/1", {}, [(a.rollout_id, a.attempt) for a in claim.attempts])
    assert group_counts(store, "run") == (4, 1)


def test_evaluation_and_taskless_rollouts_are_not_groups(store: TraceStore) -> None:
    tasks = _run(store)
    _group(store, tasks[0], 0, 2)
    store.create_rollout("run", tasks[1], 0, rollout_id=evaluation_rollout_id("run", 0, 0, 0), evaluated_version=0)
    store.finish_attempt("proxy-made", 0, S.FAILED, "no task", run="run")  # a standalone proxy's rollout
    assert group_counts(store, "run") == (2, 1)


def test_latest_ended_reads_only_what_may_get_a_new_attempt(store: TraceStore) -> None:
    tasks = _run(store)
    ids = _group(store, tasks[0], 0, 4)
    _end(store, ids[0], 0, S.FAILED)
    _end(store, ids[1], 0, S.TIMED_OUT)
    _end(store, ids[2], 0, S.FAILED)
    store.new_attempt(ids[2])  # retried: its attempt 0 is no longer a candidate
    _end(store, ids[3], 0, S.CANCELLED)
    evaluation = store.create_rollout("run", tasks[1], 0, rollout_id=evaluation_rollout_id("run", 0, 1, 0),
                                      evaluated_version=0)
    _end(store, evaluation, 0, S.CANCELLED)
    assert latest_ended(store, "run", (S.FAILED, S.TIMED_OUT)) == [(ids[0], 0), (ids[1], 0)]
    _end(store, ids[2], 1, S.FAILED)
    assert (ids[2], 1) in latest_ended(store, "run", (S.FAILED,))
    assert latest_ended(store, "run", (S.FAILED,), max_attempts=2) == [(ids[0], 0)]  # attempt 1 used its last
    assert latest_ended(store, "run", (S.CANCELLED,), kind="evaluation") == [(evaluation, 0)]
    assert latest_ended(store, "run", (S.CANCELLED,)) == [(ids[3], 0), (evaluation, 0)]


# ------------------------------------------------------------------- upstream failures and harness.maxAttempts


def test_scheduler_and_learner_count_attempts_by_one_rule(store: TraceStore) -> None:
    """The scheduler's SQL (latest_ended) and the learner's Python (_final) agree on every row: a failed attempt
    the one retries is exactly one the other does not call final."""
    [task] = _run(store, 1)
    shapes = [(attempt, infra, flagged) for attempt in (0, 1, 2, MAX_INFRA_RETRIES, MAX_INFRA_RETRIES + 1)
              for infra in sorted({0, 1, attempt - 1, MAX_INFRA_RETRIES}) if 0 <= infra <= attempt
              for flagged in (False, True)]
    ids = _group(store, task, 0, len(shapes))
    for rollout_id, (attempt, infra, flagged) in zip(ids, shapes):
        _end(store, rollout_id, 0, S.FAILED)
        with store.engine.begin() as conn:  # the attempt as the n-th of a rollout, straight in the row
            conn.execute(update(RolloutAttempt).where(RolloutAttempt.rollout_id == rollout_id)
                         .values(attempt=attempt, infra_retries=infra, upstream_failed=flagged))
    rows = {(a.rollout_id, a.attempt): a for a in store.list_attempts("run")}
    for max_attempts in (1, 2, 3):
        sql = set(latest_ended(store, "run", (S.FAILED,), max_attempts=max_attempts))
        python = {key for key, row in rows.items() if not _final(row, max_attempts)}
        assert sql == python, max_attempts
        assert 0 < len(sql) < len(rows)  # neither side is trivially all or nothing
    by_shape = {shape: (rollout_id, shape[0]) for rollout_id, shape in zip(ids, shapes)}
    retried = set(latest_ended(store, "run", (S.FAILED,), max_attempts=2))
    assert by_shape[(1, 1, False)] in retried  # one free retry before it: attempt 1 is its first harness attempt
    assert by_shape[(1, 0, False)] not in retried  # two harness attempts used
    assert by_shape[(2, 1, True)] in retried  # the upstream failed: free, whatever was used
    cap = MAX_INFRA_RETRIES
    assert by_shape[(cap, cap, True)] in retried  # past the bound it counts: its first harness attempt, one left
    assert by_shape[(cap + 1, cap, True)] not in retried  # past the bound, and its second harness attempt


def test_a_retry_carries_the_free_retries_forward_up_to_the_bound(store: TraceStore, monkeypatch) -> None:
    monkeypatch.setattr(attempt_budget, "MAX_INFRA_RETRIES", 2)
    [task] = _run(store, 1)
    [rollout, cancelled] = _group(store, task, 0, 2)
    flags = [True, False, True, True, True]  # upstream failed, harness failed, then three upstream failures
    for attempt, flagged in enumerate(flags):
        if flagged:
            store.mark_upstream_failed(rollout, attempt)
        _end(store, rollout, attempt, S.FAILED)
        assert store.new_attempt(rollout) == attempt + 1
    assert [a.infra_retries for a in store.list_attempts("run") if a.rollout_id == rollout] == [0, 1, 1, 2, 2, 2]
    store.mark_upstream_failed(cancelled, 0)  # a stop's retry is not the upstream's: it adds nothing
    _end(store, cancelled, 0, S.CANCELLED)
    store.new_attempt(cancelled)
    assert store.get_attempt(cancelled, 1).infra_retries == 0


@pytest.mark.parametrize("mark_first", [True, False])
def test_a_failure_the_upstream_caused_says_so_in_its_reason(store: TraceStore, mark_first: bool) -> None:
    """Marked before the scheduler settles the attempt, or after (the mark lingered or was spooled): either way
    the failure's reason gets the prefix once, and only a failure's."""
    [task] = _run(store, 1)
    [failed, succeeded] = _group(store, task, 0, 2)
    if mark_first:
        store.mark_upstream_failed(failed, 0)
    store.try_transition(failed, 0, S.QUEUED, S.RUNNING)
    store.try_transitions([Move(failed, 0, S.RUNNING, S.FAILED, "HarnessFailed: exit code 1")])
    store.mark_upstream_failed(failed, 0)
    store.mark_upstream_failed(failed, 0)  # a replay, or the next failed call: nothing changes
    attempt = store.get_attempt(failed, 0)
    assert attempt.upstream_failed and attempt.reason == INFRASTRUCTURE + "HarnessFailed: exit code 1"
    _end(store, succeeded, 0, S.SUCCEEDED, reward=1.0)
    store.mark_upstream_failed(succeeded, 0)
    assert store.get_attempt(succeeded, 0).reason == "test" and store.get_attempt(succeeded, 0).upstream_failed
    store.mark_upstream_failed("r-new", 0, run="run")  # an attempt no call reached yet is created, as calls do
    assert store.get_attempt("r-new", 0).upstream_failed
