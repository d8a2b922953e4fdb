"""indexes the trace explorer's rollout list sorts and filters by

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05

``harnessrl ui`` pages a run's rollout attempts in the database, sorted by creation time (the default),
reward, policy version or learner step, and filtered by any of these. Each sort key gets an index on
(run, key), so a page is an index walk that stops after its rows instead of a sort of every attempt of the
run; (run, consumed_by_step) also serves "the attempts step N trained on".
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = {
    "ix_rollout_attempts_run_created_at": ["run", "created_at"],
    "ix_rollout_attempts_run_reward": ["run", "reward"],
    "ix_rollout_attempts_run_policy_version_start": ["run", "policy_version_start"],
    "ix_rollout_attempts_run_consumed_by_step": ["run", "consumed_by_step"],
}


def upgrade() -> None:
    for name, columns in INDEXES.items():
        op.create_index(name, "rollout_attempts", columns, unique=False)


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, table_name="rollout_attempts")
