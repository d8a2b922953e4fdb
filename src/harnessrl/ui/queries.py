"""The UI's reads: runs at a glance and the rollout list, filtered, sorted and paged in the database.

The rollout list must stay fast with millions of calls, so everything it filters or sorts on is a column of
``rollout_attempts`` (or of ``rollouts``, one primary-key join away) behind an index that starts with ``run``
(migrations 0007 and 0008 add the ones the list sorts by); calls are counted only for the rows of the page shown.
Per-step figures are not computed here: the overview reuses ``harnessrl status``'s summary
(``local.report.summarize``) and ``store.evaluations``, so the UI and the terminal always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, Select, and_, func, select

from harnessrl.store.records import RolloutState
from harnessrl.store.schema import (
    EVALUATION,
    TRAIN,
    LearnerStep,
    LlmCall,
    PolicyVersion,
    Rollout,
    RolloutAttempt,
    Run,
)

PAGE_SIZE = 50
MAX_PAGE_SIZE = 500


class BadQuery(ValueError):
    """A filter the user typed cannot be used; the message names the parameter and what it takes."""


@dataclass(frozen=True)
class RunRow:
    name: str
    created_at: datetime
    target_steps: int | None
    step: int
    version: int
    counts: dict[str, int]
    last_reward: float | None
    last_evaluation: dict[str, Any] | None

    @property
    def phase(self) -> str:
        """Done once the learner committed every step the spec asks for; active while attempts are open."""
        if self.target_steps is not None and self.step >= self.target_steps:
            return "done"
        if self.counts.get(RolloutState.RUNNING.value) or self.counts.get(RolloutState.QUEUED.value):
            return "active"
        return "idle"


def list_runs(engine: Engine) -> list[RunRow]:
    """Every run, newest first, with the few figures the runs page shows."""
    from harnessrl.store.evaluations import evaluation_results
    from harnessrl.store.trace_store import TraceStore

    rows: list[RunRow] = []
    with engine.connect() as conn:
        runs = conn.execute(select(Run.name, Run.created_at, Run.spec).order_by(Run.created_at.desc())).all()
        for run in runs:
            step = conn.scalar(select(func.max(LearnerStep.step)).where(LearnerStep.run == run.name)) or 0
            version = conn.scalar(select(func.max(PolicyVersion.version)).where(PolicyVersion.run == run.name)) or 0
            metrics = conn.scalar(select(LearnerStep.metrics).where(LearnerStep.run == run.name,
                                                                    LearnerStep.step == step)) or {}
            counts = dict(conn.execute(select(RolloutAttempt.state, func.count()).where(
                RolloutAttempt.run == run.name).group_by(RolloutAttempt.state)).all())
            target = (((run.spec or {}).get("spec") or {}).get("learner") or {}).get("steps")
            rows.append(RunRow(run.name, run.created_at, target, step, version, counts,
                               metrics.get("reward_mean"), None))
    store = TraceStore(engine)
    for i, row in enumerate(rows):
        results = evaluation_results(store, row.name)
        if results:
            rows[i] = RunRow(**{**row.__dict__, "last_evaluation": results[-1].as_dict()})
    return rows


def run_exists(engine: Engine, run: str) -> bool:
    with engine.connect() as conn:
        return conn.scalar(select(Run.name).where(Run.name == run)) is not None


def parse_number(query: dict[str, str], name: str, kind: type = int, low: float | None = None) -> Any:
    """``query[name]`` as ``kind`` (None when absent or empty); ``BadQuery`` naming it when it is not one."""
    text = (query.get(name) or "").strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        raise BadQuery(f"{name}={text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if low is not None and value < low:
        raise BadQuery(f"{name}={text!r} must be at least {low}")
    return value


SORTS = {  # ?sort= name -> column; all but task are the second column of an index on (run, ...)
    "created": RolloutAttempt.created_at,
    "reward": RolloutAttempt.reward,
    "step": RolloutAttempt.consumed_by_step,
    "version": RolloutAttempt.policy_version_start,
    "rows": RolloutAttempt.train_rows,
    "state": RolloutAttempt.state,
    "reason": RolloutAttempt.reason,
    "task": Rollout.task_id,  # the joined rollout's: sorted, not walked (bench/ui.py measures it)
}


@dataclass(frozen=True)
class RolloutFilter:
    """The rollout list's query parameters, checked; ``params()`` gives them back for links."""

    kind: str | None = None
    state: str | None = None
    step: int | None = None
    version: int | None = None
    task: str | None = None
    reason: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    rows_min: int | None = None  # training rows the learner built from the attempt
    rows_max: int | None = None
    sort: str = "created"
    order: str = "desc"
    page: int = 1
    per_page: int = PAGE_SIZE

    @classmethod
    def parse(cls, query: dict[str, str]) -> RolloutFilter:
        def number(name: str, kind: type, low: float | None = None) -> Any:
            return parse_number(query, name, kind, low)

        def choice(name: str, allowed: list[str], default: str | None = None) -> str | None:
            value = (query.get(name) or "").strip() or default
            if value is not None and value not in allowed:
                raise BadQuery(f"{name}={value!r} is not one of {', '.join(allowed)}")
            return value

        def text(name: str) -> str | None:
            return (query.get(name) or "").strip() or None

        return cls(
            kind=choice("kind", [TRAIN, EVALUATION]),
            state=choice("state", [s.value for s in RolloutState]),
            step=number("step", int, 0), version=number("version", int, 0), task=text("task"),
            reason=text("reason"), reward_min=number("reward_min", float), reward_max=number("reward_max", float),
            rows_min=number("rows_min", int, 0), rows_max=number("rows_max", int, 0),
            sort=choice("sort", list(SORTS), "created") or "created",
            order=choice("order", ["asc", "desc"], "desc") or "desc",
            page=number("page", int, 1) or 1,
            per_page=min(number("per_page", int, 1) or PAGE_SIZE, MAX_PAGE_SIZE),
        )

    def params(self, **changes: Any) -> dict[str, str]:
        """Non-default parameters (with ``changes``), for the links of sorting and paging."""
        values = {**self.__dict__, **changes}
        defaults = RolloutFilter().__dict__
        return {k: str(v) for k, v in values.items() if v is not None and v != defaults[k]}

    def where(self, run: str) -> list[Any]:
        clauses: list[Any] = [RolloutAttempt.run == run]
        if self.kind is not None:
            clauses.append(Rollout.kind == self.kind)
        if self.state is not None:
            clauses.append(RolloutAttempt.state == self.state)
        if self.step is not None:
            clauses.append(RolloutAttempt.consumed_by_step == self.step)
        if self.version is not None:
            clauses.append(RolloutAttempt.policy_version_start == self.version)
        if self.task is not None:
            clauses.append(Rollout.task_id == self.task)
        if self.reason is not None:
            clauses.append(RolloutAttempt.reason.contains(self.reason, autoescape=True))
        if self.reward_min is not None:
            clauses.append(RolloutAttempt.reward >= self.reward_min)
        if self.reward_max is not None:
            clauses.append(RolloutAttempt.reward <= self.reward_max)
        if self.rows_min is not None:
            clauses.append(RolloutAttempt.train_rows >= self.rows_min)
        if self.rows_max is not None:
            clauses.append(RolloutAttempt.train_rows <= self.rows_max)
        return clauses


@dataclass(frozen=True)
class RolloutListRow:
    rollout_id: str
    attempt: int
    kind: str
    task_id: str | None
    group_index: int | None
    state: str
    reason: str | None
    reward: float | None
    version: int | None
    step: int | None
    created_at: datetime
    finished_at: datetime | None
    rows: int | None
    calls: int = 0


@dataclass(frozen=True)
class RolloutPage:
    rows: list[RolloutListRow]
    total: int
    filter: RolloutFilter
    states: dict[str, int] = field(default_factory=dict)

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.filter.per_page))


def _base(columns: list[Any], run: str, filt: RolloutFilter) -> Select[Any]:
    return (select(*columns).select_from(RolloutAttempt)
            .join(Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id)
            .where(and_(*filt.where(run))))


def rollout_page(engine: Engine, run: str, filt: RolloutFilter) -> RolloutPage:
    """One page of a run's rollout attempts under ``filt``, the matching total, and the run's counts by state."""
    column = SORTS[filt.sort]
    ordering = column.asc() if filt.order == "asc" else column.desc()
    tiebreak = [RolloutAttempt.created_at.desc(), RolloutAttempt.rollout_id, RolloutAttempt.attempt]
    query = (_base([RolloutAttempt.rollout_id, RolloutAttempt.attempt, Rollout.kind, Rollout.task_id,
                    Rollout.group_index, RolloutAttempt.state, RolloutAttempt.reason, RolloutAttempt.reward,
                    RolloutAttempt.policy_version_start, RolloutAttempt.consumed_by_step,
                    RolloutAttempt.created_at, RolloutAttempt.finished_at, RolloutAttempt.train_rows], run, filt)
             .order_by(ordering.nulls_last(), *tiebreak)
             .limit(filt.per_page).offset((filt.page - 1) * filt.per_page))
    with engine.connect() as conn:
        found = conn.execute(query).all()
        total = conn.scalar(_base([func.count()], run, filt)) or 0
        calls: dict[tuple[str, int], int] = {}
        if found:
            ids = sorted({r.rollout_id for r in found})
            counted = conn.execute(select(LlmCall.rollout_id, LlmCall.attempt, func.count())
                                   .where(LlmCall.rollout_id.in_(ids))
                                   .group_by(LlmCall.rollout_id, LlmCall.attempt))
            calls = {(r[0], r[1]): r[2] for r in counted}
        states = dict(conn.execute(select(RolloutAttempt.state, func.count())
                                   .where(RolloutAttempt.run == run).group_by(RolloutAttempt.state)).all())
    rows = [RolloutListRow(r.rollout_id, r.attempt, r.kind, r.task_id, r.group_index, r.state, r.reason, r.reward,
                           r.policy_version_start, r.consumed_by_step, r.created_at, r.finished_at, r.train_rows,
                           calls.get((r.rollout_id, r.attempt), 0)) for r in found]
    return RolloutPage(rows, total, filt, states)


@dataclass(frozen=True)
class AttemptHeader:
    """One attempt with its rollout's fields, for the rollout page."""

    rollout_id: str
    attempt: int
    run: str
    kind: str
    task_id: str | None
    group_index: int | None
    evaluated_version: int | None
    state: str
    reason: str | None
    reward: float | None
    reward_info: dict[str, Any] | None
    version: int | None
    step: int | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempts: list[int]


def attempt_header(engine: Engine, run: str, rollout_id: str, attempt: int | None) -> AttemptHeader | None:
    """The attempt (the latest when ``attempt`` is None) of a rollout of ``run``; None when there is none."""
    with engine.connect() as conn:
        numbers = list(conn.scalars(select(RolloutAttempt.attempt).where(
            RolloutAttempt.rollout_id == rollout_id, RolloutAttempt.run == run).order_by(RolloutAttempt.attempt)))
        if not numbers or (attempt is not None and attempt not in numbers):
            return None
        number = numbers[-1] if attempt is None else attempt
        row = conn.execute(
            select(RolloutAttempt.__table__, Rollout.kind, Rollout.task_id, Rollout.group_index,
                   Rollout.evaluated_version)
            .join(Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id)
            .where(RolloutAttempt.rollout_id == rollout_id, RolloutAttempt.attempt == number)
        ).one()
    return AttemptHeader(row.rollout_id, row.attempt, row.run, row.kind, row.task_id, row.group_index,
                         row.evaluated_version, row.state, row.reason, row.reward, row.reward_info,
                         row.policy_version_start, row.consumed_by_step, row.created_at, row.started_at,
                         row.finished_at, numbers)
