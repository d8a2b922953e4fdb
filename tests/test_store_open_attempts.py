"""A scheduler pass reads only open work (issue 25, part 3), on SQLite and PostgreSQL: the running totals
(``run_counters``) give the same attempt counts and group counts as counting every row, also after the
migration counts an existing run; and without a ping per call, a PostgreSQL connection the server dropped is
replaced, with nothing accepted lost."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import OperationalError

from harnessrl.rollout_ids import evaluation_rollout_id, training_rollout_id
from harnessrl.store import RolloutState, TraceStore
from harnessrl.store.engine import open_engine
from harnessrl.store.learner_ledger import LearnerLedger
from harnessrl.store.scheduler_reads import group_counts
from harnessrl.store.schema import Rollout, RolloutAttempt

S = RolloutState


def counted_over_every_row(store: TraceStore) -> tuple[dict[RolloutState, int], int]:
    with store.engine.connect() as conn:
        states = dict.fromkeys(RolloutState, 0) | {
            S(state): n for state, n in conn.execute(
                select(RolloutAttempt.state, func.count()).where(RolloutAttempt.run == "run")
                .group_by(RolloutAttempt.state))}
        training = conn.scalar(select(func.count()).where(Rollout.run == "run", Rollout.kind == "train"))
    return states, int(training)


def end(store: TraceStore, rollout_id: str, attempt: int, to: RolloutState) -> None:
    store.try_transition(rollout_id, attempt, S.QUEUED, S.RUNNING)
    store.try_transition(rollout_id, attempt, S.RUNNING, to, "test")


def a_run_with_history(store: TraceStore) -> list[str]:
    """Three groups of 3: one consumed (with a retried member and a requeued cancelled one), one finished, one still running; an
    evaluation rollout; a group created twice (a no-op)."""
    store.ensure_run("run")
    tasks = store.add_tasks("run", [{"id": f"t{i}"} for i in range(3)])
    groups = [store.create_rollouts("run", tasks[g], [(training_rollout_id("run", g, i), i) for i in range(3)])
              for g in range(3)]
    store.create_rollouts("run", tasks[2], [(training_rollout_id("run", 2, i), i) for i in range(3)])
    end(store, groups[0][0], 0, S.FAILED)
    store.new_attempt(groups[0][0])
    end(store, groups[0][0], 1, S.SUCCEEDED)
    end(store, groups[0][1], 0, S.SUCCEEDED)
    end(store, groups[0][2], 0, S.CANCELLED)  # by a stop: queued again (cancelled is never a final outcome)
    store.new_attempt(groups[0][2])
    end(store, groups[0][2], 1, S.FAILED)
    for rollout_id in groups[1]:
        end(store, rollout_id, 0, S.SUCCEEDED)
    store.try_transition(groups[2][0], 0, S.QUEUED, S.RUNNING)
    store.create_rollout("run", tasks[1], 0, rollout_id=evaluation_rollout_id("run", 0, 1, 0), evaluated_version=0)
    claim = LearnerLedger(store, "run").claim(tasks_per_step=1, group_size=3, max_attempts=2)
    assert claim is not None and claim.tasks == (tasks[0],)
    LearnerLedger(store, "run").commit(1, "/ckpt/1", {}, list(claim.keys))
    return tasks


def test_running_totals_equal_counting_every_row(store: TraceStore) -> None:
    a_run_with_history(store)
    states, training = counted_over_every_row(store)
    assert store.count_attempts("run") == states
    assert states[S.SUCCEEDED] == 5 and states[S.FAILED] == 2 and states[S.QUEUED] == 3
    assert group_counts(store, "run") == (training, 2) == (9, 2)


def test_upgrade_counts_an_existing_run(store_url: str) -> None:
    from harnessrl.store.migrate import downgrade

    with TraceStore.connect(store_url) as store:
        store.upgrade()
        a_run_with_history(store)
        before = (store.count_attempts("run"), group_counts(store, "run"))
        assert downgrade(store.engine, "0005") == "0005"
        store.upgrade()
        assert (store.count_attempts("run"), group_counts(store, "run")) == before
        assert counted_over_every_row(store) == (before[0], before[1].training_rollouts)


@pytest.mark.postgres
def test_a_dropped_connection_is_replaced(pg_url: str) -> None:
    """The server ends every connection of the store (a restart, an idle reaper, a failover). Idle past
    ``ping_idle_s``, the next call pings, finds it dead and opens another; in use, the one call that meets
    the dead connection fails, the pool is invalidated and the next call works. Nothing written is lost."""
    idle_s = 0.3
    store = TraceStore(open_engine(pg_url, ping_idle_s=idle_s))
    store.upgrade()
    store.ensure_run("run")
    [task] = store.add_tasks("run", [{"id": "t"}])
    store.create_rollouts("run", task, [(training_rollout_id("run", 0, i), i) for i in range(4)])

    def drop_every_connection() -> int:
        with open_engine(pg_url).connect() as admin:
            return admin.execute(text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()")).scalar_one()

    assert drop_every_connection() >= 1
    time.sleep(idle_s * 2)  # idle: pinged on checkout, replaced, no error
    assert store.count_attempts("run")[S.QUEUED] == 4

    store.close()

    busy = TraceStore.connect(pg_url)  # pings after 30 s idle: the next call finds the dead connection
    busy.count_attempts("run")
    assert drop_every_connection() >= 1
    with pytest.raises(OperationalError) as failed:
        busy.count_attempts("run")
    assert failed.value.connection_invalidated
    assert busy.count_attempts("run")[S.QUEUED] == 4
    assert group_counts(busy, "run") == (4, 1)
    busy.close()


@pytest.mark.postgres
def test_a_connection_dropped_under_the_call_writer_is_replaced(pg_url: str) -> None:
    """The writer's lookup runs on psycopg's own cursor (binary parameters), not through SQLAlchemy: a
    connection the server dropped still fails that one add_calls as SQLAlchemy's OperationalError with the
    pool invalidated (what the proxy's writer counts as an outage and retries), and the next call writes."""
    from synthetic_calls import chat_trajectory

    calls = chat_trajectory("drop", 6, system_tokens=30, observation_tokens=10, completion_tokens=5)
    store = TraceStore.connect(pg_url)
    store.upgrade()
    assert store.add_calls(calls[:2]) == 2
    with open_engine(pg_url).connect() as admin:
        assert admin.execute(text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()")).scalar_one() >= 1
    with pytest.raises(OperationalError) as failed:
        store.add_calls(calls[2:4])
    assert failed.value.connection_invalidated
    assert store.add_calls(calls[2:]) == 4
    assert store.read_calls("drop", 0) == calls
    store.close()
