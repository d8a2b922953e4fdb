"""consumed_totals + ix_rollout_attempts_failing: the run overview and failures page cost what they show

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05

Adds the table ``consumed_totals`` (run, step, kind, version): what each learner step consumed, totalled per
rollout kind and starting policy version (attempts; rewarded ones and their rewards' sum and sum of squares;
failing ones; ended ones and their first and last finish time), which the learner writes in the step's
transaction from now on (``store.consumed_totals``). Steps committed before are totalled here, once, so a store
upgraded in the middle of a run reads the same figures as before.

Adds the partial index ``ix_rollout_attempts_failing`` (run, created_at) over the attempts the failures page
lists (failed, timed out, or succeeded with a reward of 0 or none), so its latest 200 are an index walk.

Runs on PostgreSQL and SQLite (both have partial indexes and INSERT ... SELECT).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As in harnessrl.store.schema at this revision (a migration keeps its own copy: the schema may change later).
FAILING = "state IN ('failed', 'timed_out') OR (state = 'succeeded' AND (reward = 0 OR reward IS NULL))"
REWARDED = "a.state = 'succeeded' AND a.reward IS NOT NULL"
ENDED = "a.state IN ('succeeded', 'failed', 'timed_out', 'cancelled') AND a.finished_at IS NOT NULL"


def upgrade() -> None:
    op.create_table(
        "consumed_totals",
        sa.Column("run", sa.String(length=128), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("rewarded", sa.Integer(), nullable=False),
        sa.Column("reward_sum", sa.Float(), nullable=True),
        sa.Column("reward_squares", sa.Float(), nullable=True),
        sa.Column("failing", sa.Integer(), nullable=False),
        sa.Column("ended", sa.Integer(), nullable=False),
        sa.Column("first_finished", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_finished", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["run", "step"], ["learner_steps.run", "learner_steps.step"],
                                name=op.f("fk_consumed_totals_run_learner_steps")),
        sa.PrimaryKeyConstraint("run", "step", "kind", "version", name=op.f("pk_consumed_totals")),
    )
    op.execute(
        "INSERT INTO consumed_totals (run, step, kind, version, attempts, rewarded, reward_sum, reward_squares, "
        "failing, ended, first_finished, last_finished) "
        "SELECT a.run, a.consumed_by_step, r.kind, coalesce(a.policy_version_start, 0), count(*), "
        f"count(CASE WHEN {REWARDED} THEN a.reward END), sum(CASE WHEN {REWARDED} THEN a.reward END), "
        f"sum(CASE WHEN {REWARDED} THEN a.reward * a.reward END), "
        f"count(CASE WHEN {FAILING.replace('state', 'a.state').replace('reward', 'a.reward')} THEN 1 END), "
        f"count(CASE WHEN {ENDED} THEN 1 END), min(CASE WHEN {ENDED} THEN a.finished_at END), "
        f"max(CASE WHEN {ENDED} THEN a.finished_at END) "
        "FROM rollout_attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id "
        "WHERE a.consumed_by_step IS NOT NULL "
        "GROUP BY a.run, a.consumed_by_step, r.kind, coalesce(a.policy_version_start, 0)"
    )
    condition = sa.text(FAILING)
    op.create_index("ix_rollout_attempts_failing", "rollout_attempts", ["run", "created_at"], unique=False,
                    postgresql_where=condition, sqlite_where=condition)


def downgrade() -> None:
    op.drop_index("ix_rollout_attempts_failing", table_name="rollout_attempts")
    op.drop_table("consumed_totals")
