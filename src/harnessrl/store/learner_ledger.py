"""The learner's bookkeeping in the trace store: which rollouts a step takes, and the step's commit.

A step's effects are (a) a new policy version with its checkpoint path, (b) the step record with its
metrics, (c) the rollout attempts it trained on marked consumed. :meth:`LearnerLedger.commit` writes all three
in **one** transaction and refuses, writing nothing, when the version or step already exists or any attempt
is already consumed. That is what makes a learner killed at any point safe to restart: before the commit
nothing counts (the checkpoint on disk is a leftover and the attempts are still unconsumed, so the step is
redone); after it everything counts and is never redone. Version 0 is the base model (or a LoRA run's fresh
adapter).

With the step, the learner records what it made of each consumed attempt (:class:`StepRows`): how many
training rows it built (``rollout_attempts.train_rows``) and, per trained row, its own log-probs of the trained
tokens (``learner_logprobs``), so the trace explorer can filter by rows per rollout and show the learner's
log-prob beside the serving engine's, token by token.

A step that trains nothing (every group had equal rewards, or no row had a generated token) makes no policy
version: :meth:`LearnerLedger.consume` writes (b) and (c) alone, and the step record keeps the version the
policy stays at. So steps and versions are numbered apart: ``learner_steps.policy_version`` is the version
the policy is at after each step, and a version number always means new weights.

Claiming does not lock: exactly one learner runs per TrainingRun, and a second one that raced would have
its commit refused instead of double-training.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, bindparam, exists, func, insert, select, tuple_, update
from sqlalchemy.orm import aliased
from sqlalchemy.exc import IntegrityError

from harnessrl.store import attempt_budget, consumed_totals, run_counters
from harnessrl.store.engine import WRITE_OPTION
from harnessrl.store.records import RolloutState, utcnow
from harnessrl.store.schema import TRAIN, LearnerLogprobs, LearnerStep, PolicyVersion, Rollout, RolloutAttempt, Run
from harnessrl.store.trace_store import TraceStore

TERMINAL_STATES = tuple(s.value for s in RolloutState if s.terminal)
CHUNK = 500


class CommitRefused(RuntimeError):
    """The step cannot be committed (already committed, or an attempt was consumed by another step)."""


@dataclass(frozen=True)
class ClaimedAttempt:
    """The latest attempt of one rollout of a claimed task group."""

    rollout_id: str
    attempt: int
    task_id: str
    group_index: int | None
    state: RolloutState
    reward: float | None
    policy_version_start: int | None

    @property
    def key(self) -> tuple[str, int]:
        return (self.rollout_id, self.attempt)


@dataclass(frozen=True)
class StepClaim:
    """The task groups one step trains on, oldest completed group first."""

    tasks: tuple[str, ...]
    attempts: tuple[ClaimedAttempt, ...]

    @property
    def keys(self) -> list[tuple[str, int]]:
        return [a.key for a in self.attempts]


@dataclass(frozen=True)
class StepRows:
    """What a step made of its attempts: ``counts[(rollout, attempt)]`` rows built (trained or not), and
    ``logprobs[(rollout, attempt, row index)]`` the learner's log-probs of that row's trained tokens."""

    counts: dict[tuple[str, int], int] = field(default_factory=dict)
    logprobs: dict[tuple[str, int, int], np.ndarray] = field(default_factory=dict)

    def write(self, conn: Connection, run: str, step: int, consumed: set[tuple[str, int]]) -> None:
        """Inside the step's transaction, after the consumed marks (``consumed``: the step's attempts)."""
        stray = ({key for key in self.counts} | {key[:2] for key in self.logprobs}) - consumed
        if stray:
            raise ValueError(f"rows: {len(stray)} attempts (e.g. {sorted(stray)[0]}) are not among the step's "
                             "consumed attempts; pass rows only for the attempts the step consumes")
        if self.counts:
            conn.execute(update(RolloutAttempt)
                         .where(RolloutAttempt.rollout_id == bindparam("k_rollout"),
                                RolloutAttempt.attempt == bindparam("k_attempt"))
                         .values(train_rows=bindparam("k_rows")),
                         [{"k_rollout": r, "k_attempt": a, "k_rows": n} for (r, a), n in self.counts.items()])
        if self.logprobs:
            conn.execute(insert(LearnerLogprobs), [
                {"rollout_id": r, "attempt": a, "row_index": i, "run": run, "step": step,
                 "logprobs": np.asarray(values, dtype="<f4").tobytes()}
                for (r, a, i), values in self.logprobs.items()])


@dataclass(frozen=True)
class VersionInfo:
    version: int
    checkpoint_path: str
    synced: bool


class LearnerLedger:
    """Learner-side operations of one run over a :class:`TraceStore`'s database."""

    def __init__(self, store: TraceStore, run: str) -> None:
        self.store = store
        self.run = run
        self._engine: Engine = store.engine
        self._writer = store.engine.execution_options(**{WRITE_OPTION: True})

    # -- versions ----------------------------------------------------------------------------------------------

    def ensure_base_version(self, checkpoint_path: str, synced: bool = True) -> None:
        """Record version 0 if it is missing: the base model, which replicas start from (hence synced), or a
        LoRA run's initial adapter, which they still have to load (``synced=False``)."""
        with self._writer.begin() as conn:
            if conn.scalar(select(Run.name).where(Run.name == self.run)) is None:
                conn.execute(insert(Run).values(name=self.run, created_at=utcnow()))
            exists = conn.scalar(
                select(PolicyVersion.version).where(PolicyVersion.run == self.run, PolicyVersion.version == 0)
            )
            if exists is None:
                now = utcnow()
                conn.execute(insert(PolicyVersion).values(
                    run=self.run, version=0, checkpoint_path=checkpoint_path, created_at=now, synced=synced,
                    synced_at=now if synced else None,
                ))

    def committed_step(self) -> int:
        """The newest learner step the store counts, trained or not (0 when none was committed)."""
        with self._engine.connect() as conn:
            value = conn.scalar(select(func.max(LearnerStep.step)).where(LearnerStep.run == self.run))
        return int(value or 0)

    def committed_version(self) -> int:
        """The newest policy version the store counts (0 when no step was committed)."""
        with self._engine.connect() as conn:
            value = conn.scalar(select(func.max(PolicyVersion.version)).where(PolicyVersion.run == self.run))
        return int(value or 0)

    def version(self, version: int) -> VersionInfo | None:
        with self._engine.connect() as conn:
            row = conn.execute(
                select(PolicyVersion.version, PolicyVersion.checkpoint_path, PolicyVersion.synced)
                .where(PolicyVersion.run == self.run, PolicyVersion.version == version)
            ).first()
        return VersionInfo(row.version, row.checkpoint_path, bool(row.synced)) if row else None

    def versions(self) -> list[VersionInfo]:
        with self._engine.connect() as conn:
            rows = conn.execute(
                select(PolicyVersion.version, PolicyVersion.checkpoint_path, PolicyVersion.synced)
                .where(PolicyVersion.run == self.run).order_by(PolicyVersion.version)
            ).all()
        return [VersionInfo(r.version, r.checkpoint_path, bool(r.synced)) for r in rows]

    def mark_synced(self, version: int) -> None:
        self.store.mark_policy_synced(self.run, version)

    def step_metrics(self, step: int) -> dict[str, Any] | None:
        with self._engine.connect() as conn:
            return conn.scalar(select(LearnerStep.metrics).where(LearnerStep.run == self.run, LearnerStep.step == step))

    # -- claiming ----------------------------------------------------------------------------------------------

    def claim(self, tasks_per_step: int, group_size: int, max_attempts: int = 1) -> StepClaim | None:
        """The oldest ``tasks_per_step`` complete task groups, or None while fewer are complete.

        A task's group is its rollouts whose latest attempt no step consumed yet; it is complete when it has
        at least ``group_size`` of them and every one is in a terminal state (succeeded, failed, timed out: the
        advantage code decides which train; not cancelled, see ``_final``). Groups are ordered by when their
        last member finished. Rollouts without a task (made by a standalone proxy) have no group and are never
        claimed, nor are evaluation rollouts (``rollouts.kind``): an evaluation is never trained on.
        A failed or timed-out attempt the scheduler retries (attempts left, or an upstream failure within its
        bound: ``attempt_budget.retried``) is not final: the scheduler is about to queue its retry, and
        claiming the group now would train without it.
        """
        if tasks_per_step < 1 or group_size < 1:
            raise ValueError(f"tasks_per_step ({tasks_per_step}) and group_size ({group_size}) must be >= 1")
        newer = aliased(RolloutAttempt)
        query = (  # the latest attempt of every rollout with a task, if no step consumed it yet: open attempts
            select(  # only (ix_rollout_attempts_open), so a poll costs what is unconsumed, not the whole run
                RolloutAttempt.rollout_id, RolloutAttempt.attempt, RolloutAttempt.state, RolloutAttempt.reward,
                RolloutAttempt.policy_version_start, RolloutAttempt.finished_at, RolloutAttempt.updated_at,
                RolloutAttempt.upstream_failed, RolloutAttempt.infra_retries, Rollout.task_id, Rollout.group_index,
            )
            .join(Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id)
            .where(RolloutAttempt.run == self.run, RolloutAttempt.consumed_by_step.is_(None),
                   Rollout.task_id.is_not(None), Rollout.kind == TRAIN,
                   ~exists().where(newer.rollout_id == RolloutAttempt.rollout_id,
                                   newer.attempt > RolloutAttempt.attempt))
        )
        with self._engine.connect() as conn:
            rows = conn.execute(query).all()
        groups: dict[str, list[Any]] = defaultdict(list)
        for row in rows:
            groups[row.task_id].append(row)
        complete: list[tuple[Any, str, list[Any]]] = []
        for task_id, members in groups.items():
            if len(members) >= group_size and all(_final(m, max_attempts) for m in members):
                done_at = max((m.finished_at or m.updated_at) for m in members)
                complete.append((done_at, task_id, members))
        if len(complete) < tasks_per_step:
            return None
        complete.sort(key=lambda item: (item[0], item[1]))
        chosen = complete[:tasks_per_step]
        attempts = tuple(
            ClaimedAttempt(m.rollout_id, m.attempt, task_id, m.group_index, RolloutState(m.state), m.reward,
                           m.policy_version_start)
            for _, task_id, members in chosen
            for m in sorted(members, key=lambda m: (m.group_index if m.group_index is not None else -1, m.rollout_id))
        )
        return StepClaim(tuple(task_id for _, task_id, _ in chosen), attempts)

    # -- committing --------------------------------------------------------------------------------------------

    def commit(self, step: int, checkpoint_path: str, metrics: dict[str, Any] | None,
               consumed: list[tuple[str, int]], version: int | None = None, rows: StepRows | None = None) -> int:
        """Insert policy ``version`` + the step record and mark ``consumed`` (with ``rows``, what the step made
        of them), in one transaction; returns the version. ``version`` None: the next one after the newest (the
        learner passes the one it saved).

        Raises :class:`CommitRefused` (and writes nothing) when the version or step ``step`` exists already,
        or an attempt does not exist in this run or was consumed by another step.
        """
        with self._recording(step, consumed, rows) as conn:
            if version is None:
                newest = conn.scalar(select(func.max(PolicyVersion.version)).where(PolicyVersion.run == self.run))
                version = int(newest or 0) + 1
            if version < 1:
                raise ValueError(f"version: {version} must be >= 1 (version 0 is the base model)")
            conn.execute(insert(PolicyVersion).values(
                run=self.run, version=version, checkpoint_path=checkpoint_path, created_at=utcnow(), synced=False,
            ))
            conn.execute(insert(LearnerStep).values(
                run=self.run, step=step, policy_version=version, metrics=metrics, created_at=utcnow(),
            ))
        return version

    def consume(self, step: int, metrics: dict[str, Any] | None, consumed: list[tuple[str, int]],
                rows: StepRows | None = None) -> int:
        """Record a step that trained nothing: its record (at the version the policy stays at, which is
        returned) and its attempts marked consumed, in one transaction, with no new policy version.

        The rollouts are consumed all the same, so the scheduler's bound on outstanding groups moves on and no
        later step claims them. Refusals as :meth:`commit`.
        """
        with self._recording(step, consumed, rows) as conn:
            newest = conn.scalar(select(func.max(PolicyVersion.version)).where(PolicyVersion.run == self.run))
            version = int(newest or 0)
            conn.execute(insert(LearnerStep).values(
                run=self.run, step=step, policy_version=version, metrics=metrics, created_at=utcnow(),
            ))
        return version

    @contextmanager
    def _recording(self, step: int, consumed: list[tuple[str, int]], rows: StepRows | None
                   ) -> Iterator[Connection]:
        """One transaction for a step's record (written by the caller) and its consumed marks (written here,
        after it: they refer to the step record). Anything that fails rolls all of it back."""
        if step < 1:
            raise ValueError(f"step: {step} must be >= 1")
        pairs = sorted(set(consumed))
        now = utcnow()
        try:
            with self._writer.begin() as conn:
                yield conn
                states: list[str] = []
                for start in range(0, len(pairs), CHUNK):
                    chunk = pairs[start:start + CHUNK]
                    states += conn.execute(
                        update(RolloutAttempt)
                        .where(
                            tuple_(RolloutAttempt.rollout_id, RolloutAttempt.attempt).in_(chunk),
                            RolloutAttempt.run == self.run,
                            RolloutAttempt.consumed_by_step.is_(None),
                        )
                        .values(consumed_by_step=step, updated_at=now)
                        .returning(RolloutAttempt.state)
                    ).scalars().all()
                if len(states) != len(pairs):  # raising inside the block rolls the whole commit back
                    raise CommitRefused(
                        f"step {step} of run {self.run!r}: {len(pairs) - len(states)} of {len(pairs)} attempts do "
                        "not exist in this run or were consumed by another step; nothing was recorded"
                    )
                run_counters.add_consumed(conn, self.run, states)
                consumed_totals.record(conn, self.run, step)
                if rows is not None:
                    rows.write(conn, self.run, step, set(pairs))
        except IntegrityError:
            raise CommitRefused(
                f"step {step} of run {self.run!r}: the step or its policy version is already committed "
                "(is another learner running for this run?); nothing was recorded"
            ) from None

    def consumed_by(self, step: int) -> list[tuple[str, int]]:
        with self._engine.connect() as conn:
            rows = conn.execute(
                select(RolloutAttempt.rollout_id, RolloutAttempt.attempt)
                .where(RolloutAttempt.run == self.run, RolloutAttempt.consumed_by_step == step)
                .order_by(RolloutAttempt.rollout_id, RolloutAttempt.attempt)
            ).all()
        return [(r.rollout_id, r.attempt) for r in rows]


def _final(row: Any, max_attempts: int) -> bool:
    """Whether an attempt (a row with its state, number, upstream_failed and infra_retries) is its rollout's last
    word: terminal, and not about to be retried (``attempt_budget.retried``, the scheduler's own rule). A
    cancelled attempt never is: a stop (Ctrl-C or SIGTERM to ``harnessrl run``) cancelled it, and the scheduler
    queues the rollout again when the run goes on, so a stop never turns the groups it interrupted into a step
    trained on nothing."""
    if row.state == RolloutState.CANCELLED.value:
        return False
    if row.state in attempt_budget.RETRIED_STATES:
        return not attempt_budget.retried(row.attempt, bool(row.upstream_failed), row.infra_retries, max_attempts)
    return row.state in TERMINAL_STATES
