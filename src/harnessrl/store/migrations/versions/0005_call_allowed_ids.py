"""the token ids a structured-output grammar allowed, per completion token of a constrained call

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04

Adds ``llm_calls.allowed_ids`` (binary, nullable). vLLM's processed log-probs of a grammar-constrained call
(a forced tool call, a JSON schema) are those of the masked distribution the token was drawn from; the learner
needs the mask to score the token the same way (log pi(a) - logsumexp over the allowed ids). The proxy records
it where vLLM's top log-probs show the whole allowed set. Every other call, and every call stored before this
revision, keeps NULL (scored over the whole vocabulary).

Runs on PostgreSQL and SQLite: alter tables inside ``op.batch_alter_table`` (SQLite recreates the table,
PostgreSQL alters it in place).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("llm_calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("allowed_ids", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("llm_calls", schema=None) as batch_op:
        batch_op.drop_column("allowed_ids")
