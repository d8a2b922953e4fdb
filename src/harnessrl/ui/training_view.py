"""A rollout's training rows exactly as the learner builds them, for the token view.

Nothing here decides anything about training: the rows come from the learner's ``merge_calls_into_rows`` with
the settings ``LearnerSettings.from_spec`` derives from the run's stored spec, the trained tokens from the
learner's ``decision_mask`` (forced tokens are context), the constrained positions from its
``row_allowed_sets`` and the advantage from ``compute_advantages`` over the rollout's group as the step that
consumed it saw it (groups are independent, so the group alone gives the step's value). Each row says why it
began (``Row.split_reason``, ``Row.split_at``: the row builder's own split decision). A test compares this view
with the batch ``Learner._build_batch`` builds for the same step.

The learner's own log-probs are what it computed and stored at that step (``learner_logprobs``, written with the
step's commit): they cannot be rebuilt later, since the weights that produced them moved on. An attempt consumed
by a learner before schema revision 0008, or not yet consumed, has none, and the view says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Engine, select

from harnessrl.store.records import RolloutState
from harnessrl.store.schema import LearnerLogprobs, LearnerStep, Rollout, RolloutAttempt, Run
from harnessrl.store.trace_store import TraceStore
from harnessrl.trainer.advantages import RolloutOutcome, compute_advantages
from harnessrl.trainer.learner import LearnerSettings, decision_mask, row_allowed_sets
from harnessrl.trainer.rows import Row, RowsResult, RowStats, merge_calls_into_rows

@dataclass(frozen=True)
class RowView:
    """One training row: per token its id, whether the learner trains it, and the behaviour log-prob."""

    index: int
    input_ids: np.ndarray
    generated: np.ndarray  # the row's loss mask: tokens the policy produced
    trained: np.ndarray  # decision_mask: generated tokens that carry loss (forced ones do not)
    constrained: dict[int, int]  # position -> size of the grammar's allowed set there
    rollout_logprobs: np.ndarray
    spans: list[tuple[str, int, int, int]]  # (call_id, start, end, policy version) of each kept completion
    split_reason: str | None  # why the row began (None: the attempt's first row)
    split_at: int | None  # where its prompt leaves the row it split from
    learner_logprobs: np.ndarray | None  # float32 per position, NaN where not trained; None: not stored

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def counts(self) -> dict[str, int]:
        return {"tokens": self.num_tokens, "context": int((self.trained == 0).sum()),
                "trained": int(self.trained.sum()), "forced": int(self.generated.sum() - self.trained.sum()),
                "constrained": len(self.constrained)}


@dataclass(frozen=True)
class TrainingView:
    rows: list[RowView]
    stats: RowStats
    settings: dict[str, Any]
    advantage: float | None
    advantage_note: str
    step_metrics: dict[str, Any] = field(default_factory=dict)


def learner_settings(engine: Engine, run: str) -> tuple[LearnerSettings, bool]:
    """The learner's settings from the run's stored spec (the learner's own mapping), and whether a spec was
    stored (a standalone proxy's run has none: the learner's defaults then)."""
    from harnessrl.spec.problems import parse_training_run

    with engine.connect() as conn:
        document = conn.scalar(select(Run.spec).where(Run.name == run))
    if not document:
        return LearnerSettings(run=run, model_dir=Path("."), output_dir=Path(".")), False
    spec = parse_training_run(document).spec
    return LearnerSettings.from_spec(spec, run=run, model_dir=Path("."), output_dir=Path(".")), True


def build_rows(store: TraceStore, settings: LearnerSettings, rollout_id: str, attempt: int) -> RowsResult:
    """The attempt's rows as ``Learner._build_batch`` builds them."""
    calls = store.rollout_calls(rollout_id, attempt)
    return merge_calls_into_rows(calls, mode=settings.row_mode, max_prompt_tokens=settings.max_prompt_tokens,
                                 max_row_tokens=settings.max_row_tokens)


def training_view(engine: Engine, run: str, rollout_id: str, attempt: int) -> TrainingView:
    store = TraceStore(engine)
    settings, from_spec = learner_settings(engine, run)
    built = build_rows(store, settings, rollout_id, attempt)
    rows, stats = built.rows, built.stats
    sets = store.allowed_token_ids(rollout_id, attempt)
    stored = _stored_learner_logprobs(engine, rollout_id, attempt)
    views = []
    for index, row in enumerate(rows):
        allowed = row_allowed_sets(row, sets) if sets else {}
        trained = decision_mask(row.loss_mask, row.rollout_logprobs)
        views.append(RowView(
            index=index, input_ids=row.input_ids, generated=row.loss_mask, trained=trained,
            constrained={int(p): int(ids.shape[0]) for p, ids in allowed.items()},
            rollout_logprobs=row.rollout_logprobs,
            spans=[(c, s, e, v) for c, (s, e), v in zip(row.call_ids, row.completion_spans, row.policy_versions,
                                                        strict=True)],
            split_reason=row.split_reason, split_at=row.split_at,
            learner_logprobs=_placed(trained, stored.get(index)),
        ))
    advantage, note, metrics = _advantage(engine, store, settings, run, rollout_id, attempt, rows)
    shown = {"row mode": settings.row_mode, "max prompt tokens": settings.max_prompt_tokens,
             "max row tokens": settings.max_row_tokens, "advantage": settings.advantage.estimator,
             "max staleness": settings.advantage.max_staleness,
             "source": "the run's stored spec" if from_spec else "learner defaults (no spec stored)"}
    return TrainingView(views, stats, shown, advantage, note, metrics)


def _stored_learner_logprobs(engine: Engine, rollout_id: str, attempt: int) -> dict[int, np.ndarray]:
    with engine.connect() as conn:
        found = conn.execute(select(LearnerLogprobs.row_index, LearnerLogprobs.logprobs)
                             .where(LearnerLogprobs.rollout_id == rollout_id, LearnerLogprobs.attempt == attempt))
        return {r.row_index: np.frombuffer(r.logprobs, dtype="<f4") for r in found}


def _placed(trained: np.ndarray, values: np.ndarray | None) -> np.ndarray | None:
    """The stored values on the positions the learner trained (its targets: the decision mask past position 0);
    None when none were stored or they do not fit the row (rows built under other settings than the step's)."""
    positions = np.flatnonzero(trained[1:]) + 1
    if values is None or values.shape[0] != positions.shape[0]:
        return None
    out = np.full(trained.shape[0], np.nan, dtype=np.float32)
    out[positions] = values
    return out


def _advantage(engine: Engine, store: TraceStore, settings: LearnerSettings, run: str, rollout_id: str,
               attempt: int, rows: list[Row]) -> tuple[float | None, str, dict[str, Any]]:
    """The attempt's advantage as the step that consumed it computed it, and a note saying where it comes from
    (or why there is none)."""
    with engine.connect() as conn:
        head = conn.execute(select(RolloutAttempt.consumed_by_step, Rollout.task_id, Rollout.kind)
                            .join(Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id)
                            .where(RolloutAttempt.rollout_id == rollout_id, RolloutAttempt.attempt == attempt)).one()
        if head.kind != "train":
            return None, "evaluation rollout: never trained on", {}
        if head.consumed_by_step is None:
            return None, "no learner step has consumed this attempt yet", {}
        step = head.consumed_by_step
        record = conn.execute(select(LearnerStep.policy_version, LearnerStep.metrics)
                              .where(LearnerStep.run == run, LearnerStep.step == step)).one()
        members = conn.execute(
            select(RolloutAttempt.rollout_id, RolloutAttempt.attempt, RolloutAttempt.state, RolloutAttempt.reward,
                   RolloutAttempt.policy_version_start)
            .join(Rollout, Rollout.rollout_id == RolloutAttempt.rollout_id)
            .where(RolloutAttempt.run == run, RolloutAttempt.consumed_by_step == step,
                   Rollout.task_id == head.task_id)
            .order_by(RolloutAttempt.rollout_id, RolloutAttempt.attempt)).all()
    metrics = record.metrics or {}
    # the learner's version while it built this step: a step that trained made the next one
    current = record.policy_version - (0 if metrics.get("empty_step") else 1)
    outcomes = []
    for m in members:
        built = rows if (m.rollout_id, m.attempt) == (rollout_id, attempt) else build_rows(
            store, settings, m.rollout_id, m.attempt).rows
        versions = [r.min_policy_version for r in built]
        oldest = min(versions) if versions else (m.policy_version_start if m.policy_version_start is not None
                                                 else current)
        outcomes.append(RolloutOutcome(m.rollout_id, m.attempt, head.task_id, RolloutState(m.state), m.reward,
                                       oldest))
    result = compute_advantages(outcomes, settings.advantage, current_version=current)
    value = result.advantages.get((rollout_id, attempt))
    if value is not None:
        return value, f"step {step}, group of {len(members)} (task {head.task_id}), learner at v{current}", metrics
    excluded = ", ".join(f"{getattr(reason, 'value', reason)} {n}" for reason, n in result.stats.excluded.items() if n) or "none"
    return None, f"step {step} trained nothing of this rollout (group exclusions: {excluded})", metrics
