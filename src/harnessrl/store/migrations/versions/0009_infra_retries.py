"""attempts that failed because the LLM upstream did: a flag, and the free retries a rollout has had

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05

Adds ``rollout_attempts.upstream_failed`` (boolean, default false: the proxy answered one of the attempt's calls
with upstream_unavailable or upstream_timeout) and ``rollout_attempts.infra_retries`` (integer, default 0: how
many earlier attempts of the rollout were retried for that reason without using one of ``harness.maxAttempts``;
``harnessrl.store.attempt_budget`` says how both count). Existing attempts read as never failed by the upstream.

Runs on PostgreSQL and SQLite.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # NOT NULL with a constant default: a plain ALTER TABLE on both databases (no SQLite table rebuild)
    op.add_column("rollout_attempts",
                  sa.Column("upstream_failed", sa.Boolean(), server_default=sa.false(), nullable=False))
    op.add_column("rollout_attempts",
                  sa.Column("infra_retries", sa.Integer(), server_default=sa.text("0"), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("rollout_attempts", schema=None) as batch_op:
        batch_op.drop_column("infra_retries")
        batch_op.drop_column("upstream_failed")
