"""The rollout scheduler: keeps a TrainingRun's harness runs going, level-based, on any backend.

The local runner (processes) and the operator (pods) both call ``RolloutScheduler.reconcile``; only the
``RolloutBackend`` differs. Every reconcile compares what the store says (attempt states, rewards) with what
the backend observes (live harnesses, exits) and acts. The only in-memory state is the launch expectations
(as in KubeRay's ``expectations/``): an attempt just launched may not be visible to the backend yet (a pod's
watch event lags), and must not be declared lost in that window. A restarted scheduler loses nothing else.

Async RL bound: rollouts generated under policy version v are only trained on while the learner is at most
``max_staleness`` versions ahead, so the scheduler keeps at most ``(max_staleness + 1) * tasks_per_step``
groups outstanding (created but not yet consumed by a learner step). More would only be thrown away.

Evaluation (``spec.evaluation``) is a second rollout kind of the same loop: when the serving policy version
reaches a multiple of ``everySteps`` (and at version 0 with ``atStart``), the scheduler creates one round of
evaluation rollouts for that version (``samplesPerTask`` per held-out task), launched before queued training
rollouts so the version they score is still the one serving. They are stored with their kind and the version
they evaluate, never claimed by the learner, and not counted against the staleness bound.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from harnessrl.rollout_ids import evaluation_rollout_id, is_evaluation, training_rollout_id
from harnessrl.spec.models import TrainingRunSpec
from harnessrl.store import AttemptRecord, RolloutState, TraceStore
from harnessrl.store.evaluations import best_version, evaluated_versions, evaluation_results, evaluation_settings
from harnessrl.store.scheduler_reads import ActiveAttempt, active_attempts, group_counts, latest_ended
from harnessrl.store.schema import EVALUATION, TRAIN
from harnessrl.store.states import Move

log = logging.getLogger(__name__)

EVALUATION_TASK_PREFIX = "eval:"  # stored evaluation task ids: never the same row as a training task's


@dataclass(frozen=True)
class EvaluationSchedule:
    """When to evaluate and how many rollouts per held-out task (``spec.evaluation``)."""

    every_steps: int
    at_start: bool
    samples_per_task: int

    def due(self, version: int, rounds: set[int]) -> bool:
        """Whether serving ``version`` calls for a new round: the newest multiple of ``every_steps`` at or
        below it has no round yet (version 0 only with ``at_start``, and only while it is the one serving)."""
        multiple = version - version % self.every_steps
        if multiple == 0:
            return self.at_start and version == 0 and 0 not in rounds
        return not any(multiple <= done <= version for done in rounds)


@dataclass(frozen=True)
class SchedulerSettings:
    """The parts of a TrainingRun spec the scheduler needs (built from the spec by its caller)."""

    run: str
    group_size: int
    concurrency: int
    timeout_s: float
    tasks_per_step: int
    max_staleness: int
    max_attempts: int = 1
    seed: int = 0
    lost_grace_s: float = 30.0  # how long a launched harness may stay invisible to the backend
    evaluation: EvaluationSchedule | None = None

    def __post_init__(self) -> None:
        for name in ("group_size", "concurrency", "tasks_per_step", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    @classmethod
    def from_spec(cls, run: str, spec: TrainingRunSpec) -> SchedulerSettings:
        """The settings of a TrainingRun's spec: the local runner and the operator read them the same way."""
        harness, learner, evaluation = spec.harness, spec.learner, spec.evaluation
        return cls(
            run=run, group_size=harness.group_size, concurrency=harness.concurrency,
            timeout_s=float(harness.timeout_seconds), tasks_per_step=learner.tasks_per_step,
            max_staleness=learner.max_staleness, max_attempts=harness.max_attempts,
            evaluation=None if evaluation is None else EvaluationSchedule(
                evaluation.every_steps, evaluation.at_start, evaluation.samples_per_task
            ),
        )

    @property
    def max_outstanding_groups(self) -> int:
        return (self.max_staleness + 1) * self.tasks_per_step


@dataclass(frozen=True)
class Launch:
    """Everything a backend needs to start one harness run (a process or a pod)."""

    run: str
    rollout_id: str
    attempt: int
    task_id: str
    task: dict[str, Any]
    policy_version: int
    timeout_s: float


@dataclass(frozen=True)
class HarnessExit:
    """A harness run the backend saw end: its exit code, or why it never ran (e.g. ImagePullBackOff)."""

    rollout_id: str
    attempt: int
    exit_code: int | None
    detail: str | None = None


class RolloutBackend(Protocol):
    """Where a harness runs. Implementations: local processes, Kubernetes pods."""

    def launch_budget(self) -> int | None:
        """How many harnesses may start in this pass (None: as many as there are free slots). A pod backend
        bounds its creation rate and returns 0 while the run is suspended."""

    def launch(self, launch: Launch) -> None:
        """Start the harness; must be idempotent for the same (rollout_id, attempt)."""

    def alive(self) -> set[tuple[str, int]]:
        """Attempts whose harness is currently running."""

    def exits(self) -> list[HarnessExit]:
        """Harness runs that ended and were not yet ``release``d."""

    def stop(self, rollout_id: str, attempt: int, reason: str) -> None:
        """Kill a running harness (timeout, cancel); its exit is then reported by ``exits``."""

    def release(self, rollout_id: str, attempt: int) -> None:
        """Forget an ended harness run (delete the pod, reap the process, remove its files)."""


@dataclass
class SchedulerStatus:
    """What one reconcile saw and did; the runner's progress line and the operator's status read this."""

    counts: dict[RolloutState, int] = field(default_factory=dict)
    launched: int = 0
    finished: int = 0
    timed_out: int = 0
    retried: int = 0
    groups_created: int = 0
    outstanding_groups: int = 0
    evaluation_rollouts_created: int = 0


class RolloutScheduler:
    """Creates task groups, launches queued attempts up to ``concurrency`` and settles the ones that end."""

    def __init__(
        self,
        store: TraceStore,
        settings: SchedulerSettings,
        backend: RolloutBackend,
        tasks: Sequence[dict[str, Any]],
        clock: Callable[[], float] = time.time,
        evaluation_tasks: Sequence[dict[str, Any]] = (),
    ) -> None:
        if not tasks:
            raise ValueError("the run has no tasks: give harness.tasks at least one task")
        if settings.evaluation is not None and not evaluation_tasks:
            raise ValueError("the run has no evaluation tasks: give spec.evaluation.tasks at least one task")
        self.store = store
        self.settings = settings
        self.backend = backend
        self.clock = clock
        self.task_ids = store.add_tasks(settings.run, list(tasks))
        self._tasks = {tid: dict(task) for tid, task in zip(self.task_ids, tasks, strict=True)}
        self.evaluation_task_ids: list[str] = []
        self.set_evaluation_tasks(evaluation_tasks)
        self._launched_at: dict[tuple[str, int], float] = {}  # expectations: launched, maybe not yet visible

    def set_evaluation_tasks(self, evaluation_tasks: Sequence[dict[str, Any]]) -> None:
        """The evaluation's tasks, also for a running scheduler (spec.evaluation added to or changed on a
        running operator run): the next due round uses them. Stored under prefixed ids (idempotent); the
        harness gets each task exactly as written."""
        stored = [{**task, "id": f"{EVALUATION_TASK_PREFIX}{task.get('id', index)}"}
                  for index, task in enumerate(evaluation_tasks)]
        self.evaluation_task_ids = self.store.add_tasks(self.settings.run, stored) if stored else []
        self._tasks.update({tid: dict(task) for tid, task in zip(self.evaluation_task_ids, evaluation_tasks,
                                                                  strict=True)})

    # --- the loop body --------------------------------------------------------------------------------------

    def reconcile(self, policy_version: int, *, finishing: bool = False) -> SchedulerStatus:
        """One level-based pass; safe to call at any rate and after any crash.

        ``finishing``: training is over (the learner made its last step); no new training rollouts start, and
        the final ``policy_version`` gets an evaluation round if it has none (see :meth:`evaluation_pending`).
        """
        status = SchedulerStatus()
        self._settle_exits(status)
        # The active attempts are read once; the steps below keep what they change in mind (each query is a
        # round trip, and a busy operator runs passes back to back), and re-read only after creating attempts.
        active = active_attempts(self.store, self.settings.run)
        ended = self._enforce_deadlines(active, status)
        active = [attempt for attempt in active if (attempt.rollout_id, attempt.attempt) not in ended]
        self._retry_failures(status)
        self._requeue_cancelled(status, finishing)
        queued = [attempt for attempt in active if attempt.state is RolloutState.QUEUED]
        if not finishing:
            self._create_groups(status, len(queued) + status.retried)
        self._create_evaluation(policy_version, status, finishing)
        if status.retried or status.groups_created or status.evaluation_rollouts_created:
            queued = active_attempts(self.store, self.settings.run, states=(RolloutState.QUEUED,))
        running = len(active) - sum(1 for attempt in active if attempt.state is RolloutState.QUEUED)
        self._launch_queued(policy_version, status, queued, running, evaluation_only=finishing)
        status.counts = self.store.count_attempts(self.settings.run)
        return status

    def evaluation_pending(self) -> bool:
        """Whether an evaluation rollout is queued or running (what a finishing run waits for)."""
        return any(is_evaluation(attempt.rollout_id) for attempt in active_attempts(self.store, self.settings.run))

    def stop_all(self, reason: str = "Cancelled: the run is stopping") -> int:
        """Stop every live harness and cancel every active attempt (used on shutdown and suspend)."""
        active = active_attempts(self.store, self.settings.run)
        for attempt in active:
            if attempt.state is RolloutState.RUNNING:
                self.backend.stop(attempt.rollout_id, attempt.attempt, reason)
        cancelled = len(
            self.store.try_transitions(
                [Move(a.rollout_id, a.attempt, a.state, RolloutState.CANCELLED, reason) for a in active]
            )
        )
        for ended in self.backend.exits():
            self.backend.release(ended.rollout_id, ended.attempt)
        self._launched_at.clear()
        return cancelled

    # --- steps ----------------------------------------------------------------------------------------------

    def _settle_exits(self, status: SchedulerStatus) -> None:
        # One read and one transaction for every harness that ended since the last pass, however many.
        ended = self.backend.exits()
        if not ended:
            return
        attempts = self.store.get_attempts((exit_.rollout_id, exit_.attempt) for exit_ in ended)
        moves = []
        for exit_ in ended:
            key = (exit_.rollout_id, exit_.attempt)
            self._launched_at.pop(key, None)
            attempt = attempts.get(key)
            if attempt is None:
                log.warning("a harness of rollout %s attempt %d ended but the store has no such attempt", *key)
            elif attempt.state is RolloutState.RUNNING:
                state, reason = outcome(attempt, exit_)
                moves.append(Move(*key, RolloutState.RUNNING, state, reason))
        status.finished += len(self.store.try_transitions(moves))
        for exit_ in ended:
            self.backend.release(exit_.rollout_id, exit_.attempt)

    def _enforce_deadlines(self, active: list[ActiveAttempt], status: SchedulerStatus) -> set[tuple[str, int]]:
        """Time out the attempts past their deadline and fail the lost ones; returns the keys it ended."""
        ended: set[tuple[str, int]] = set()
        now = self.clock()
        alive = self.backend.alive()
        # Read after `alive`: a harness that ends between the two calls shows up here, never as lost.
        alive |= {(ended.rollout_id, ended.attempt) for ended in self.backend.exits()}
        for attempt in active:
            if attempt.state is not RolloutState.RUNNING:
                continue
            key = (attempt.rollout_id, attempt.attempt)
            started = attempt.started_at.timestamp() if attempt.started_at else now
            if now - started > self.settings.timeout_s:
                reason = f"Timeout: ran past harness.timeoutSeconds={self.settings.timeout_s:g}"
                self.backend.stop(*key, reason)
                if self.store.try_transition(*key, RolloutState.RUNNING, RolloutState.TIMED_OUT, reason):
                    status.timed_out += 1
                ended.add(key)  # moved by this pass or by another writer: either way no longer running
            elif key not in alive and now - self._launched_at.get(key, started) > self.settings.lost_grace_s:
                # Running in the store, unknown to the backend past the grace period: the process or pod is
                # gone without an exit we saw (runner restart, node loss, pod deleted by hand).
                self.store.try_transition(
                    *key, RolloutState.RUNNING, RolloutState.FAILED, "Lost: the harness is gone without an exit status"
                )
                self._launched_at.pop(key, None)
                ended.add(key)
        return ended

    def _retry_failures(self, status: SchedulerStatus) -> None:
        """Queue the next attempt of each failed rollout with attempts left; one that failed because the LLM
        upstream did is retried without using one, up to ``attempt_budget.MAX_INFRA_RETRIES`` times (even under
        ``maxAttempts: 1``)."""
        failed = latest_ended(self.store, self.settings.run, (RolloutState.FAILED, RolloutState.TIMED_OUT),
                              max_attempts=self.settings.max_attempts)
        for rollout_id, _ in failed:
            self.store.new_attempt(rollout_id)
            status.retried += 1

    def _create_groups(self, status: SchedulerStatus, queued: int) -> None:
        counts = group_counts(self.store, self.settings.run)
        groups = -(-counts.training_rollouts // self.settings.group_size)
        outstanding = counts.outstanding_groups  # failed members count: a group is done once consumed
        # Keep enough queued to fill every free slot, but never more groups than the staleness bound allows.
        while queued < self.settings.concurrency and outstanding < self.settings.max_outstanding_groups:
            task_id = self._task_for_group(groups)
            self.store.create_rollouts(
                self.settings.run,
                task_id,
                [(self._rollout_id(groups, index), index) for index in range(self.settings.group_size)],
            )
            groups += 1
            outstanding += 1
            queued += self.settings.group_size
            status.groups_created += 1
        status.outstanding_groups = outstanding

    def _requeue_cancelled(self, status: SchedulerStatus, finishing: bool) -> None:
        """A rollout cancelled by a stop (Ctrl-C or SIGTERM to ``harnessrl run``) runs again once the run goes
        on: a round scores a version only once all of it ran, and a training group is trained on only once every
        member ran (the learner never claims a group with a cancelled member, ``learner_ledger._final``), so a
        stop costs the rollouts it interrupted, never a step trained on an empty or partial group. A finishing run
        starts no training rollout: only its evaluation rollouts are queued again. The new attempt counts against
        ``harness.maxAttempts`` like any other."""
        kinds = ([] if finishing else [TRAIN]) + ([EVALUATION] if self.settings.evaluation is not None else [])
        for kind in kinds:
            for rollout_id, _ in latest_ended(self.store, self.settings.run, (RolloutState.CANCELLED,), kind=kind):
                self.store.new_attempt(rollout_id)
                status.retried += 1

    def _create_evaluation(self, policy_version: int, status: SchedulerStatus, finishing: bool) -> None:
        schedule = self.settings.evaluation
        if schedule is None:
            return
        rounds = evaluated_versions(self.store, self.settings.run)
        due = policy_version not in rounds if finishing else schedule.due(policy_version, rounds)
        if not due:
            return
        for number, task_id in enumerate(self.evaluation_task_ids):
            for index in range(schedule.samples_per_task):
                rollout_id = evaluation_rollout_id(self.settings.run, policy_version, number, index)
                self.store.create_rollout(self.settings.run, task_id, index, rollout_id=rollout_id,
                                          evaluated_version=policy_version)
                status.evaluation_rollouts_created += 1

    def _launch_queued(
        self,
        policy_version: int,
        status: SchedulerStatus,
        queued: list[ActiveAttempt],
        running: int,
        evaluation_only: bool = False,
    ) -> None:
        free = self.settings.concurrency - running
        budget = self.backend.launch_budget()
        if budget is not None:
            free = min(free, budget)
        if free <= 0:
            return
        queued = list(queued)  # in the store's order: creation time, then id
        # Evaluations first (a stable sort keeps creation order within each kind): the version they score
        # is the one serving now.
        queued.sort(key=lambda attempt: not is_evaluation(attempt.rollout_id))
        if evaluation_only:
            queued = [attempt for attempt in queued if is_evaluation(attempt.rollout_id)]
        queued = queued[:free]
        # Claim first (compare-and-set, all in one transaction), launch second: two schedulers never launch
        # the same attempt.
        claimed = self.store.try_transitions(
            [
                Move(attempt.rollout_id, attempt.attempt, RolloutState.QUEUED, RolloutState.RUNNING,
                     policy_version=policy_version)
                for attempt in queued
            ]
        )
        for attempt in queued:
            key = (attempt.rollout_id, attempt.attempt)
            if key not in claimed:
                continue
            assert attempt.task_id is not None  # scheduler-created rollouts always have a task
            self._launched_at[key] = self.clock()
            self.backend.launch(
                Launch(
                    run=self.settings.run,
                    rollout_id=attempt.rollout_id,
                    attempt=attempt.attempt,
                    task_id=attempt.task_id,
                    task=self._task(attempt.task_id),
                    policy_version=policy_version,
                    timeout_s=self.settings.timeout_s,
                )
            )
            status.launched += 1

    # --- derived bookkeeping ---------------------------------------------------------------------------------

    def _task_for_group(self, group: int) -> str:
        """Epochs over the task list, each in its own seeded order, so a restart picks the same tasks."""
        epoch, position = divmod(group, len(self.task_ids))
        order = sorted(set(self.task_ids))
        random.Random(f"{self.settings.seed}:{epoch}").shuffle(order)
        return order[position % len(order)]

    def _task(self, task_id: str) -> dict[str, Any]:
        task = self._tasks.get(task_id)
        return task if task is not None else self.store.get_task(self.settings.run, task_id)

    def _rollout_id(self, group: int, index: int) -> str:
        # Deterministic: re-creating a group after a crash mid-creation is a no-op in the store.
        return training_rollout_id(self.settings.run, group, index)


def versions_to_keep(store: TraceStore, run: str) -> set[int]:
    """The checkpoints pruning spares for the evaluation (``spec.evaluation``, as stored with the run): the
    best-evaluated version (what ``harnessrl export --version best`` exports), versions whose round is not
    complete yet (one of them may become the best), and the serving version while it is due a round the
    scheduler has not created yet. The scheduler creates a round for the version it sees serving, while the
    learner prunes as it commits the next version, before syncing it: with ``keepCheckpoints`` 1, or a learner
    that many versions ahead of the scheduler's passes, that version would be gone before its round ran."""
    evaluation = evaluation_settings(store, run)
    results = evaluation_results(store, run, evaluation)
    best = best_version(results)
    keep = {result.version for result in results if not result.complete} | ({best} if best is not None else set())
    serving = store.latest_policy_version(run, synced_only=True)
    if evaluation is not None and serving is not None:
        schedule = EvaluationSchedule(evaluation.every_steps, evaluation.at_start, evaluation.samples_per_task)
        if schedule.due(serving, {result.version for result in results}):
            keep.add(serving)
    return keep


def evaluation_owed(store: TraceStore, run: str, version: int) -> bool:
    """Whether a run with ``spec.evaluation`` that trained all its steps still owes ``version`` (its final one)
    an evaluation round: none was created, or part of one is queued, running, or was cancelled by a stop (a
    finishing pass queues it again). ``harnessrl run`` stopped during its final round finishes it when run again."""
    if version not in evaluated_versions(store, run):
        return True
    if latest_ended(store, run, (RolloutState.CANCELLED,), kind=EVALUATION):
        return True
    return any(is_evaluation(attempt.rollout_id) for attempt in active_attempts(store, run))


def outcome(attempt: AttemptRecord, ended: HarnessExit) -> tuple[RolloutState, str | None]:
    """Decide how a harness run that ended counts: only a clean exit with a reward is a success."""
    if ended.exit_code == 0:
        if attempt.reward is None:
            return RolloutState.FAILED, "NoReward: the harness exited 0 without reporting a reward (POST /v1/reward)"
        return RolloutState.SUCCEEDED, None
    if ended.exit_code is None:
        return RolloutState.FAILED, f"HarnessFailed: {ended.detail or 'it never ran'}"
    detail = f" ({ended.detail})" if ended.detail else ""
    return RolloutState.FAILED, f"HarnessFailed: exit code {ended.exit_code}{detail}"
