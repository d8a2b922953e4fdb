"""The learner's store operations, on SQLite and PostgreSQL: claiming complete groups, the one-transaction commit."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import func, select

from harnessrl.store import CallRecord, RolloutState, TraceStore
from harnessrl.store.learner_ledger import CommitRefused, LearnerLedger, StepRows
from harnessrl.store.schema import LearnerLogprobs, LearnerStep, PolicyVersion, RolloutAttempt

RUN = "run-a"


def make_group(store: TraceStore, task: str, size: int, finished: int | None = None,
               state: RolloutState = RolloutState.SUCCEEDED) -> list[str]:
    """A task with ``size`` rollouts, the first ``finished`` of them (default all) finished with a reward."""
    store.add_tasks(RUN, [{"id": task}])
    finished = size if finished is None else finished
    rollouts = []
    for i in range(size):
        rollout = store.create_rollout(RUN, task, i, rollout_id=f"{task}-{i}")
        store.transition(rollout, 0, RolloutState.RUNNING, policy_version=0)
        store.add_calls([CallRecord(f"{rollout}-c0", RUN, rollout, 0, 0, "completions", {"prompt": "x"}, None,
                                    [1, 2], [3], [-0.5], 0)])
        if i < finished:
            store.set_reward(rollout, 0, float(i))
            store.finish_attempt(rollout, 0, state)
        rollouts.append(rollout)
    return rollouts


@pytest.fixture
def ledger(store: TraceStore) -> LearnerLedger:
    ledger = LearnerLedger(store, RUN)
    ledger.ensure_base_version("/models/base")
    return ledger


def test_claims_only_complete_groups_oldest_first_and_waits_for_enough(store: TraceStore, ledger: LearnerLedger):
    make_group(store, "t-old", 3)
    make_group(store, "t-running", 3, finished=2)  # one rollout still running: not complete
    make_group(store, "t-small", 2)  # fewer rollouts than the group size
    assert ledger.claim(tasks_per_step=2, group_size=3) is None  # only one complete group so far
    make_group(store, "t-new", 3, state=RolloutState.FAILED)  # failed rollouts are finished too

    claim = ledger.claim(tasks_per_step=2, group_size=3)
    assert claim is not None
    assert claim.tasks == ("t-old", "t-new")
    assert [a.rollout_id for a in claim.attempts] == ["t-old-0", "t-old-1", "t-old-2", "t-new-0", "t-new-1", "t-new-2"]
    assert {a.state for a in claim.attempts[3:]} == {RolloutState.FAILED}
    assert [a.reward for a in claim.attempts[:3]] == [0.0, 1.0, 2.0]
    assert ledger.claim(tasks_per_step=1, group_size=3).tasks == ("t-old",)


def test_a_retried_rollout_counts_with_its_latest_attempt(store: TraceStore, ledger: LearnerLedger):
    make_group(store, "t", 2, state=RolloutState.FAILED)
    again = store.new_attempt("t-1")  # the scheduler retries one rollout: the group is open again
    assert ledger.claim(1, 2) is None
    store.transition("t-1", again, RolloutState.RUNNING)
    store.set_reward("t-1", again, 5.0)
    store.finish_attempt("t-1", again, RolloutState.SUCCEEDED)
    claim = ledger.claim(1, 2)
    assert claim is not None and claim.keys == [("t-0", 0), ("t-1", again)]
    ledger.commit(1, "/ckpt/v000001", None, claim.keys)
    assert ledger.claim(1, 1) is None  # the superseded attempt 0 of t-1 stays unconsumed and is never claimed


def test_commit_writes_version_step_and_consumed_marks_together(store: TraceStore, ledger: LearnerLedger):
    make_group(store, "t1", 2)
    make_group(store, "t2", 2)
    claim = ledger.claim(1, 2)
    ledger.commit(1, "/ckpt/v000001", {"loss": 0.5}, claim.keys)

    assert ledger.committed_version() == 1
    assert [(v.version, v.synced) for v in ledger.versions()] == [(0, True), (1, False)]
    assert ledger.step_metrics(1) == {"loss": 0.5}
    assert ledger.consumed_by(1) == claim.keys
    assert ledger.claim(1, 2).tasks == ("t2",)  # consumed groups are never claimed again
    ledger.mark_synced(1)
    assert ledger.version(1).synced


def test_commit_refuses_a_consumed_attempt_and_writes_nothing(store: TraceStore, ledger: LearnerLedger):
    make_group(store, "t1", 2)
    make_group(store, "t2", 2)
    first = ledger.claim(1, 2)
    ledger.commit(1, "/ckpt/v000001", None, first.keys)
    second = ledger.claim(1, 2)
    with pytest.raises(CommitRefused, match="consumed by another step"):
        ledger.commit(2, "/ckpt/v000002", None, second.keys + first.keys[:1])
    with store.engine.connect() as conn:  # the version and step inserted before the refusal are rolled back
        assert conn.scalar(select(func.count()).select_from(PolicyVersion).where(PolicyVersion.version == 2)) == 0
        assert conn.scalar(select(func.count()).select_from(LearnerStep).where(LearnerStep.step == 2)) == 0
    assert ledger.consumed_by(2) == []
    assert ledger.committed_version() == 1
    ledger.commit(2, "/ckpt/v000002", None, second.keys)  # the honest commit still goes through
    assert ledger.consumed_by(2) == second.keys


def test_commit_refuses_the_same_version_twice(store: TraceStore, ledger: LearnerLedger):
    make_group(store, "t1", 2)
    make_group(store, "t2", 2)
    ledger.commit(1, "/ckpt/v000001", None, ledger.claim(1, 2).keys)
    other = ledger.claim(1, 2)
    with pytest.raises(CommitRefused, match="already committed"):
        ledger.commit(1, "/elsewhere/v000001", None, other.keys)
    assert ledger.version(1).checkpoint_path == "/ckpt/v000001"
    assert ledger.consumed_by(1) == [("t1-0", 0), ("t1-1", 0)]
    assert ledger.claim(1, 2).keys == other.keys  # still unconsumed


def test_an_empty_step_consumes_its_rollouts_without_a_policy_version(store: TraceStore, ledger: LearnerLedger):
    """A step that trained nothing is recorded (steps count it) and its rollouts are consumed, but no version
    is made: the step record keeps the version the policy stays at, and the next trained step makes the next
    version, so version numbers always mean new weights."""
    for task in ("t1", "t2", "t3"):
        make_group(store, task, 2)
    ledger.commit(1, "/ckpt/v000001", None, ledger.claim(1, 2).keys)
    empty = ledger.claim(1, 2)
    assert ledger.consume(2, {"empty_step": 1}, empty.keys) == 1
    assert ledger.committed_step() == 2 and ledger.committed_version() == 1
    assert [v.version for v in ledger.versions()] == [0, 1]
    assert ledger.consumed_by(2) == empty.keys and ledger.step_metrics(2) == {"empty_step": 1}
    with store.engine.connect() as conn:
        assert conn.scalar(select(LearnerStep.policy_version).where(LearnerStep.step == 2)) == 1
    with pytest.raises(CommitRefused, match="consumed by another step"):  # refused like a commit, nothing written
        ledger.consume(3, None, empty.keys)
    assert ledger.committed_step() == 2
    assert ledger.commit(3, "/ckpt/v000002", None, ledger.claim(1, 2).keys) == 2  # the next version, no gap
    assert ledger.committed_step() == 3 and [v.version for v in ledger.versions()] == [0, 1, 2]


def test_a_step_records_each_attempts_row_count_and_the_learners_log_probs_with_its_commit(
        store: TraceStore, ledger: LearnerLedger):
    for task in ("t1", "t2"):
        make_group(store, task, 2)
    first = ledger.claim(1, 2)
    (a, b) = first.keys
    values = np.array([-0.25, -1.5, -3.125], dtype=np.float32)
    rows = StepRows(counts={a: 2, b: 1}, logprobs={(*a, 1): values})

    def recorded() -> tuple[dict, dict]:
        with store.engine.connect() as conn:
            counts = dict(conn.execute(select(RolloutAttempt.rollout_id, RolloutAttempt.train_rows)).all())
            stored = {(r.rollout_id, r.attempt, r.row_index, r.step): np.frombuffer(r.logprobs, "<f4").tolist()
                      for r in conn.execute(select(LearnerLogprobs))}
        return counts, stored

    with pytest.raises(ValueError, match="not among the step's consumed attempts"):  # nothing written
        ledger.commit(1, "/ckpt/v000001", None, [a], rows=rows)
    assert ledger.committed_step() == 0 and set(recorded()[0].values()) == {None} and recorded()[1] == {}
    ledger.commit(1, "/ckpt/v000001", None, first.keys, rows=rows)
    counts, stored = recorded()
    assert counts[a[0]] == 2 and counts[b[0]] == 1
    assert stored == {(a[0], 0, 1, 1): [-0.25, -1.5, -3.125]}
    second = ledger.claim(1, 2)
    with pytest.raises(CommitRefused):  # a refused commit writes no rows either
        ledger.commit(2, "/ckpt/v000002", None, second.keys + [a], rows=StepRows(counts={a: 5}))
    assert recorded() == (counts, stored)
    ledger.consume(2, None, second.keys, rows=StepRows(counts=dict.fromkeys(second.keys, 3)))
    assert [recorded()[0][k[0]] for k in second.keys] == [3, 3]


def test_base_version_is_recorded_once(store: TraceStore):
    ledger = LearnerLedger(store, RUN)
    ledger.ensure_base_version("/models/a")
    ledger.ensure_base_version("/models/b")
    assert [(v.version, v.checkpoint_path, v.synced) for v in ledger.versions()] == [(0, "/models/a", True)]
    assert ledger.committed_version() == 0


def test_a_failure_with_attempts_left_keeps_the_group_open(store: TraceStore, ledger: LearnerLedger):
    make_group(store, "t", 2, state=RolloutState.FAILED)
    assert ledger.claim(1, 2, max_attempts=2) is None  # the scheduler will retry both: not final yet
    assert ledger.claim(1, 2, max_attempts=1) is not None  # no retries: the failures are the group's last word
    again = store.new_attempt("t-0")
    store.transition("t-0", again, RolloutState.RUNNING)
    store.finish_attempt("t-0", again, RolloutState.TIMED_OUT, "Timeout")
    store.new_attempt("t-1")
    assert ledger.claim(1, 2, max_attempts=2) is None  # t-1's retry is still queued
    store.transition("t-1", 1, RolloutState.RUNNING)
    store.finish_attempt("t-1", 1, RolloutState.FAILED, "HarnessFailed: exit code 1")
    claim = ledger.claim(1, 2, max_attempts=2)  # both used their last attempt
    assert claim is not None and claim.keys == [("t-0", 1), ("t-1", 1)]
