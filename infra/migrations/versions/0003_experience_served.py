"""Create the bank's usage tables: experience_served (retrieval counter), extraction_events and extractor_batches
(training counter).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Spelled out rather than imported from infra.db: a migration is a snapshot and must not change when the model does.
    op.create_table(
        "experience_served",
        sa.Column("trajectory_id", sa.String(256), nullable=False),
        sa.Column("experience_id", sa.String(256), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("generation_id", sa.String(256), nullable=False),
        sa.Column("bank_offset", sa.BigInteger(), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("success", sa.Boolean(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("trajectory_id", "experience_id", name="pk_experience_served"),
    )
    op.create_table(
        "extraction_events",
        sa.Column("event_id", sa.String(64), nullable=False),
        sa.Column("generation_id", sa.String(256), nullable=False),
        sa.PrimaryKeyConstraint("event_id", name="pk_extraction_events"),
    )
    op.create_table(
        "extractor_batches",
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("event_id", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("step", "event_id", name="pk_extractor_batches"),
    )


def downgrade() -> None:
    op.drop_table("extractor_batches")
    op.drop_table("extraction_events")
    op.drop_table("experience_served")
