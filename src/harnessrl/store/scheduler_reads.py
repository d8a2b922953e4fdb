"""The store reads a scheduler pass makes, shaped for its hot path.

An operator pass at concurrency 200 runs back to back with the next one, and what it reads grows with the run:
py-spy on ``bench/operator_scale.py`` (2,000 rollouts at concurrency 200) put 18% of the operator's CPU in
building full ``AttemptRecord`` objects for the ~400 active attempts (fifteen columns, four timestamps each)
and 11% in reading every unconsumed rollout id to count groups in Python. These reads return only what the
scheduler uses, and let the database count. Every read names ``consumed_by_step IS NULL``, the condition of the partial index
``ix_rollout_attempts_open``, so a pass walks the open attempts only, and totals over rows a pass can no longer
change come from ``run_counters``: a pass costs the same at 2,000 and at 200,000 finished rollouts.

Outstanding groups are counted per rollout, not per attempt: a rollout whose retry a learner step consumed is
done, although its earlier failed attempt is never marked consumed (the learner consumes each rollout's latest
attempt). Counting unconsumed attempts, as before, kept such a group outstanding forever, so with
``harness.maxAttempts`` > 1 every retried group shrank the staleness bound until the scheduler created no group
at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import String, case, cast, distinct, exists, func, literal, select
from sqlalchemy.orm import aliased

from harnessrl.store import attempt_budget, run_counters
from harnessrl.store.records import RolloutState
from harnessrl.store.schema import TRAIN, Rollout, RolloutAttempt
from harnessrl.store.trace_store import TraceStore

ACTIVE = (RolloutState.QUEUED, RolloutState.RUNNING)
_STATES = {state.value: state for state in RolloutState}


class ActiveAttempt(NamedTuple):
    """What a pass needs of a queued or running attempt."""

    rollout_id: str
    attempt: int
    state: RolloutState
    task_id: str | None
    started_at: datetime | None


class GroupCounts(NamedTuple):
    training_rollouts: int  # created by the scheduler (with a task), every group of the run
    outstanding_groups: int  # groups with a rollout no learner step consumed yet


def active_attempts(
    store: TraceStore, run: str, states: Iterable[RolloutState] = ACTIVE
) -> list[ActiveAttempt]:
    """The run's attempts in ``states``, oldest first (creation time, then id): the order they launch in."""
    query = (
        select(RolloutAttempt.rollout_id, RolloutAttempt.attempt, RolloutAttempt.state, Rollout.task_id,
               RolloutAttempt.started_at)
        .join(Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id)
        # active attempts are never consumed: naming it lets the database walk the open-attempts index
        .where(RolloutAttempt.run == run, RolloutAttempt.state.in_([RolloutState(s).value for s in states]),
               RolloutAttempt.consumed_by_step.is_(None))
        .order_by(RolloutAttempt.created_at, RolloutAttempt.rollout_id, RolloutAttempt.attempt)
    )
    with store.engine.connect() as conn:
        return [ActiveAttempt(row[0], row[1], _STATES[row[2]], row[3], row[4]) for row in conn.execute(query)]


def group_counts(store: TraceStore, run: str) -> GroupCounts:
    """How many training rollouts the scheduler created, and how many of their groups are outstanding.

    The first is a running total (``run_counters``); the second walks the open attempts only: a rollout with
    no consumed attempt has all its attempts open.
    """
    other = aliased(RolloutAttempt)
    consumed = exists().where(other.rollout_id == RolloutAttempt.rollout_id, other.consumed_by_step.is_not(None))
    query = (
        select(func.count(distinct(training_group_key())))
        .select_from(RolloutAttempt)
        .join(Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id)
        .where(RolloutAttempt.run == run, RolloutAttempt.consumed_by_step.is_(None), Rollout.task_id.is_not(None),
               Rollout.kind == TRAIN, ~consumed)
    )
    with store.engine.connect() as conn:
        outstanding = conn.scalar(query)
        created = run_counters.read(conn, run).get(run_counters.TRAINING_ROLLOUTS, 0)
    return GroupCounts(int(created), int(outstanding or 0))


def latest_ended(
    store: TraceStore, run: str, states: Iterable[RolloutState], *, max_attempts: int | None = None,
    kind: str | None = None,
) -> list[tuple[str, int]]:
    """(rollout_id, attempt) of each unconsumed rollout whose latest attempt ended in ``states``: what may get a
    new attempt. ``max_attempts``: only attempts ``attempt_budget.retried`` retries under that
    harness.maxAttempts (attempts left, or an upstream failure within its bound); ``kind``: only training or
    evaluation rollouts. Earlier attempts of a retried rollout are never read again."""
    newer = aliased(RolloutAttempt)
    query = (
        select(RolloutAttempt.rollout_id, RolloutAttempt.attempt)
        .join(Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id)
        .where(
            RolloutAttempt.run == run,
            RolloutAttempt.state.in_([RolloutState(s).value for s in states]),
            RolloutAttempt.consumed_by_step.is_(None),
            ~exists().where(newer.rollout_id == RolloutAttempt.rollout_id, newer.attempt > RolloutAttempt.attempt),
        )
        .order_by(RolloutAttempt.created_at, RolloutAttempt.rollout_id)
    )
    if max_attempts is not None:
        query = query.where(attempt_budget.retried(
            RolloutAttempt.attempt, RolloutAttempt.upstream_failed, RolloutAttempt.infra_retries, max_attempts
        ))
    if kind is not None:
        query = query.where(Rollout.kind == kind)
    with store.engine.connect() as conn:
        return [(row[0], row[1]) for row in conn.execute(query)]


def training_group_key() -> object:
    """``rollout_ids.group_of`` in SQL, for the rollouts ``training_rollout_id`` names: the id without its
    ``-r<index>`` suffix, the index written with at least three digits (the rollout's ``group_index``)."""
    digits = case(
        (Rollout.group_index < 1000, literal(3)), else_=func.length(cast(Rollout.group_index, String))
    )
    return func.substr(Rollout.rollout_id, 1, func.length(Rollout.rollout_id) - 2 - digits)
