"""A run's attempt figures as consumed totals + what is still open, so reading them costs the run's steps.

``harnessrl status`` and the trace explorer's overview and failures page show per-step rewards, the mean
reward per policy version, the throughput and how many attempts failed. Counted over every attempt, each cost
the whole run (at 100,000 attempts, most of a page's 0.7-1.5 s). Consumed attempts are final (a learner step
claims only settled ones, and nothing moves a settled attempt or its reward), so the step that consumes them
totals them once, in its own transaction (``record``: one row per rollout kind and starting version in
``consumed_totals``), and a read adds those rows to the open attempts counted over ``ix_rollout_attempts_open``.
Each figure is the one a scan of every attempt gives (sums may differ from it in the last bit: the database adds
in another order).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, case, func, literal, select, text
from sqlalchemy.sql.elements import TextClause

from harnessrl.store.records import RolloutState
from harnessrl.store.schema import FAILING_ATTEMPTS, TRAIN, ConsumedTotals, Rollout, RolloutAttempt

FAILING: TextClause = text(f"({FAILING_ATTEMPTS})")  # the very text of ix_rollout_attempts_failing's condition
_REWARDED = (RolloutAttempt.state == RolloutState.SUCCEEDED.value) & RolloutAttempt.reward.is_not(None)
_ENDED = (RolloutAttempt.state.in_([s.value for s in RolloutState if s.terminal])
          & RolloutAttempt.finished_at.is_not(None))
_VERSION = func.coalesce(RolloutAttempt.policy_version_start, 0)


def _figures() -> list[ColumnElement[Any]]:
    """attempts, rewarded, reward_sum, reward_squares, failing, ended, first_finished, last_finished: the
    columns of ``consumed_totals`` over a selection of attempts."""
    reward = case((_REWARDED, RolloutAttempt.reward))  # NULL (left out of sums and counts) unless rewarded
    finished = case((_ENDED, RolloutAttempt.finished_at))
    return [func.count(), func.count(reward), func.sum(reward), func.sum(reward * reward),
            func.count(case((FAILING, 1))), func.count(finished), func.min(finished), func.max(finished)]


def record(conn: Connection, run: str, step: int) -> None:
    """Total what ``step`` consumed, inside the transaction that marks it consumed (after the marks)."""
    columns = ["run", "step", "kind", "version", "attempts", "rewarded", "reward_sum", "reward_squares", "failing",
               "ended", "first_finished", "last_finished"]
    totals = (select(literal(run), literal(step), Rollout.kind, _VERSION, *_figures())
              .select_from(RolloutAttempt).join(Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id)
              .where(RolloutAttempt.run == run, RolloutAttempt.consumed_by_step == step)
              .group_by(Rollout.kind, _VERSION))
    conn.execute(ConsumedTotals.__table__.insert().from_select(columns, totals))


@dataclass(frozen=True)
class StepTotals:
    step: int
    attempts: int
    rewarded: int
    reward_sum: float | None
    reward_squares: float | None


def steps(conn: Connection, run: str) -> list[StepTotals]:
    """Per learner step (in order), what it consumed: attempts, rewarded ones and their rewards' sums."""
    rows = conn.execute(
        select(ConsumedTotals.step, func.sum(ConsumedTotals.attempts), func.sum(ConsumedTotals.rewarded),
               func.sum(ConsumedTotals.reward_sum), func.sum(ConsumedTotals.reward_squares))
        .where(ConsumedTotals.run == run).group_by(ConsumedTotals.step).order_by(ConsumedTotals.step))
    return [StepTotals(int(s), int(n), int(k), total, squares) for s, n, k, total, squares in rows]


def _open(run: str) -> list[ColumnElement[bool]]:
    return [RolloutAttempt.run == run, RolloutAttempt.consumed_by_step.is_(None)]  # ix_rollout_attempts_open


def reward_by_version(conn: Connection, run: str) -> dict[int, float]:
    """The mean reward of the rewarded training attempts per starting policy version (none counted as 0)."""
    sums: dict[int, list[float]] = {}
    consumed = conn.execute(
        select(ConsumedTotals.version, func.sum(ConsumedTotals.rewarded), func.sum(ConsumedTotals.reward_sum))
        .where(ConsumedTotals.run == run, ConsumedTotals.kind == TRAIN, ConsumedTotals.rewarded > 0)
        .group_by(ConsumedTotals.version))
    still_open = conn.execute(
        select(_VERSION, func.count(), func.sum(RolloutAttempt.reward))
        .join(Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id)
        .where(*_open(run), _REWARDED, Rollout.kind == TRAIN).group_by(_VERSION))
    for version, n, total in [*consumed, *still_open]:
        entry = sums.setdefault(int(version), [0, 0.0])
        entry[0] += int(n)
        entry[1] += float(total)
    return {version: total / n for version, (n, total) in sorted(sums.items())}


def ended(conn: Connection, run: str) -> tuple[int, datetime | None, datetime | None]:
    """How many attempts ended (terminal, with a finish time), the first and the last finish time."""
    consumed = conn.execute(
        select(func.sum(ConsumedTotals.ended), func.min(ConsumedTotals.first_finished),
               func.max(ConsumedTotals.last_finished)).where(ConsumedTotals.run == run)).one()
    finished = RolloutAttempt.finished_at
    still_open = conn.execute(
        select(func.count(), func.min(finished), func.max(finished)).where(*_open(run), _ENDED)).one()
    firsts = [t for t in (consumed[1], still_open[1]) if t is not None]
    lasts = [t for t in (consumed[2], still_open[2]) if t is not None]
    return (int(consumed[0] or 0) + int(still_open[0]), min(firsts) if firsts else None,
            max(lasts) if lasts else None)


def failing(conn: Connection, run: str) -> int:
    """How many attempts failed, timed out or succeeded with a reward of 0 or none (``FAILING_ATTEMPTS``)."""
    consumed = conn.scalar(select(func.sum(ConsumedTotals.failing)).where(ConsumedTotals.run == run))
    still_open = conn.scalar(select(func.count()).where(*_open(run), FAILING))
    return int(consumed or 0) + int(still_open or 0)
