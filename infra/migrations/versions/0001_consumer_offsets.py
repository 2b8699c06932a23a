"""Create consumer_offsets: the input positions of workers that consume in Kafka assign mode.

Revision ID: 0001
Revises:
Create Date: 2025-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Spelled out rather than imported from infra.db: a migration is a snapshot and must not change when the model does.
    op.create_table(
        "consumer_offsets",
        sa.Column("worker", sa.String(128), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("log_id", sa.String(64), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("worker", "topic", "partition", name="pk_consumer_offsets"),
    )


def downgrade() -> None:
    op.drop_table("consumer_offsets")
