"""Runs, tasks, rollouts, rewards and policy versions: what the scheduler and the learner rely on."""

from __future__ import annotations

import pytest
from sqlalchemy import insert, select

from harnessrl.store import AttemptSettled, NotFound, RolloutState, RunOwnedElsewhere, TraceStore
from harnessrl.store.records import utcnow
from harnessrl.store.schema import PolicyVersion, Run

S = RolloutState


def test_tasks_are_idempotent_and_ids_are_stable(store: TraceStore) -> None:
    tasks = [{"id": 7, "prompt": "a"}, {"prompt": "b"}, {"prompt": "c", "nested": {"x": [1, 2]}}]
    ids = store.add_tasks("run", tasks)
    assert ids[0] == "7" and len(set(ids)) == 3
    assert store.add_tasks("run", tasks) == ids  # a restarted scheduler loading the same file adds nothing
    assert [store.get_task("run", i) for i in ids] == tasks
    assert store.add_tasks("other-run", tasks) == ids  # ids are per run: no clash
    with pytest.raises(ValueError, match=r"tasks\[1\] is not storable JSON"):
        store.add_tasks("run", [{"ok": 1}, {"bad": float("inf")}])
    with pytest.raises(NotFound, match="add_tasks"):
        store.get_task("run", "missing")


def test_create_rollout_is_idempotent_and_refuses_conflicts(store: TraceStore) -> None:
    [task] = store.add_tasks("run", [{"id": "t"}])
    rollout_id = store.create_rollout("run", task, 3, rollout_id="run-t-3")
    assert store.create_rollout("run", task, 3, rollout_id="run-t-3") == rollout_id
    attempt = store.get_attempt(rollout_id, 0)
    assert (attempt.state, attempt.task_id, attempt.group_index, attempt.run) == (S.QUEUED, "t", 3, "run")
    with pytest.raises(ValueError, match="already exists"):
        store.create_rollout("run", task, 4, rollout_id="run-t-3")
    with pytest.raises(NotFound, match="task 'nope'"):
        store.create_rollout("run", "nope", 0)
    generated = store.create_rollout("run", task, 0)
    assert generated != rollout_id and store.get_attempt(generated, 0).state is S.QUEUED


def test_missing_reward_is_none_and_last_reward_wins(store: TraceStore) -> None:
    [task] = store.add_tasks("run", [{"id": "t"}])
    rollout_id = store.create_rollout("run", task, 0)
    assert store.get_attempt(rollout_id, 0).reward is None  # never a silent zero
    store.transition(rollout_id, 0, S.RUNNING)
    assert store.get_attempt(rollout_id, 0).reward is None
    store.set_reward(rollout_id, 0, 0.0, {"verifier": "tests", "passed": 0})
    first = store.get_attempt(rollout_id, 0)
    assert (first.reward, first.reward_info) == (0.0, {"verifier": "tests", "passed": 0})
    store.set_reward(rollout_id, 0, -1.25)  # a later report replaces the earlier one, info included
    last = store.get_attempt(rollout_id, 0)
    assert (last.reward, last.reward_info) == (-1.25, None)
    for bad in (float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="finite number"):
            store.set_reward(rollout_id, 0, bad)  # type: ignore[arg-type]
    assert store.get_attempt(rollout_id, 0).reward == -1.25
    with pytest.raises(NotFound, match="reward not stored"):
        store.set_reward(rollout_id, 5, 1.0)


@pytest.mark.parametrize("end", [S.SUCCEEDED, S.FAILED, S.TIMED_OUT, S.CANCELLED])
def test_a_reward_for_a_settled_attempt_is_refused_and_the_stored_one_kept(store: TraceStore, end) -> None:
    """The scheduler decided the outcome; a late reward must not rewrite it (nor the reward it was judged on)."""
    [task] = store.add_tasks("run", [{"id": "t"}])
    rollout_id = store.create_rollout("run", task, 0)
    store.transition(rollout_id, 0, S.RUNNING)
    store.set_reward(rollout_id, 0, 0.5, {"n": 1})
    store.finish_attempt(rollout_id, 0, end, "settled by the test")
    with pytest.raises(AttemptSettled, match=rf"rollout {rollout_id} attempt 0 is already {end.value}") as info:
        store.set_reward(rollout_id, 0, 1.0, {"n": 2}, run="run")
    assert (info.value.rollout_id, info.value.attempt, info.value.state) == (rollout_id, 0, end)
    kept = store.get_attempt(rollout_id, 0)
    assert (kept.state, kept.reward, kept.reward_info) == (end, 0.5, {"n": 1})


def test_reward_and_finish_with_a_run_create_an_attempt_no_call_reached(store: TraceStore) -> None:
    store.set_reward("quiet", 2, 0.5, {"k": 1}, run="run")
    created = store.get_attempt("quiet", 2)
    assert (created.run, created.state, created.reward, created.reward_info) == (
        "run",
        S.RUNNING,
        0.5,
        {"k": 1},
    )
    store.finish_attempt("quiet", 2, S.FAILED, "no call", run="run")
    assert store.get_attempt("quiet", 2).state is S.FAILED
    store.finish_attempt("ended", 0, S.CANCELLED, run="run")  # a finish alone creates it too
    assert store.get_attempt("ended", 0).state is S.CANCELLED
    # an attempt the scheduler made is used as it is, never replaced
    [task] = store.add_tasks("run", [{"id": "t"}])
    queued = store.create_rollout("run", task, 0)
    store.set_reward(queued, 0, 1.0, run="run")
    kept = store.get_attempt(queued, 0)
    assert (kept.state, kept.task_id, kept.reward) == (S.QUEUED, "t", 1.0)
    with pytest.raises(ValueError, match="run must be"):
        store.set_reward("x", 0, 1.0, run="")


def test_list_and_count_attempts(store: TraceStore) -> None:
    store.add_tasks("run", [{"id": "t"}])
    ids = [store.create_rollout("run", "t", i, rollout_id=f"r{i}") for i in range(4)]
    store.transition(ids[0], 0, S.RUNNING)
    store.transition(ids[1], 0, S.RUNNING)
    store.finish_attempt(ids[1], 0, S.FAILED)
    store.new_attempt(ids[1])
    store.transition(ids[2], 0, S.CANCELLED)
    counts = store.count_attempts("run")
    assert counts == {S.QUEUED: 2, S.RUNNING: 1, S.SUCCEEDED: 0, S.FAILED: 1, S.TIMED_OUT: 0, S.CANCELLED: 1}
    queued = store.list_attempts("run", states=[S.QUEUED])
    assert sorted((a.rollout_id, a.attempt) for a in queued) == [("r1", 1), ("r3", 0)]
    assert len(store.list_attempts("run")) == 5
    assert store.list_attempts("other") == []
    assert all(a.consumed_by_step is None for a in store.list_attempts("run", unconsumed=True))


def test_policy_versions_synced_flag(store: TraceStore) -> None:
    store.ensure_run("run", {"model": {"path": "/m"}})
    store.ensure_run("run", {"model": {"path": "/m2"}})  # a new spec replaces the old
    with store.engine.begin() as conn:
        assert conn.scalar(select(Run.spec).where(Run.name == "run")) == {"model": {"path": "/m2"}}
        for version in (0, 1, 2):
            conn.execute(insert(PolicyVersion).values(
                run="run", version=version, checkpoint_path=f"/ckpt/{version}", created_at=utcnow(),
                synced=version == 0,
            ))  # fmt: skip
    assert store.latest_policy_version("run") == 0
    assert store.latest_policy_version("run", synced_only=False) == 2
    store.mark_policy_synced("run", 2)
    assert store.latest_policy_version("run") == 2
    assert store.latest_policy_version("nobody") is None
    with pytest.raises(NotFound):
        store.mark_policy_synced("run", 9)


def test_a_run_name_belongs_to_one_trainingrun(store: TraceStore) -> None:
    """Two namespaces' runs of one name on one store: the second is refused and changes nothing; a run stored
    without an owner (harnessrl run, an older operator) is claimed by the first operator to use it."""
    def row() -> tuple[str | None, dict | None]:
        with store.engine.connect() as conn:
            return tuple(conn.execute(select(Run.owner, Run.spec).where(Run.name == "vowels")).one())

    store.ensure_run("vowels", {"v": 0})  # no owner
    store.ensure_run("vowels", {"v": 1}, owner="team-a/vowels")
    assert row() == ("team-a/vowels", {"v": 1})
    store.ensure_run("vowels", {"v": 2}, owner="team-a/vowels")  # its own operator again (a restart)
    with pytest.raises(RunOwnedElsewhere) as refused:
        store.ensure_run("vowels", {"v": 3}, owner="team-b/vowels")
    assert refused.value.owner == "team-a/vowels"
    assert row() == ("team-a/vowels", {"v": 2})
    store.ensure_run("vowels")  # what writers do (create if missing) leaves the owner alone
    assert row() == ("team-a/vowels", {"v": 2})
    store.ensure_run("other", owner="team-b/other")  # a new run, owned from its first row
    with store.engine.connect() as conn:
        assert conn.scalar(select(Run.owner).where(Run.name == "other")) == "team-b/other"


def test_a_group_is_created_in_one_call_and_again_is_a_no_op(store: TraceStore) -> None:
    store.add_tasks("run", [{"id": "t"}])
    ids = store.create_rollouts("run", "t", [("g0-0", 0), ("g0-1", 1)])
    assert ids == ["g0-0", "g0-1"]
    assert store.create_rollouts("run", "t", [("g0-0", 0), ("g0-1", 1)]) == ids  # a repeated pass
    attempts = store.list_attempts("run")
    assert [(a.rollout_id, a.group_index, a.attempt, a.state) for a in attempts] == [
        ("g0-0", 0, 0, RolloutState.QUEUED),
        ("g0-1", 1, 0, RolloutState.QUEUED),
    ]
    with pytest.raises(ValueError, match="rollout 'g0-1' already exists for run 'run', task 't', group index 1"):
        store.create_rollouts("run", "t", [("g0-2", 0), ("g0-1", 5)])
    assert len(store.list_attempts("run")) == 2  # nothing of the refused call was kept
    with pytest.raises(NotFound, match="task 'nope'"):
        store.create_rollouts("run", "nope", [("x", 0)])
