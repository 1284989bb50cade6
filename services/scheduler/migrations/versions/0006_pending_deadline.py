"""the deadline of a job's max_pending

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("pending_deadline", sa.DateTime(timezone=True), nullable=True)
        )
        batch_op.create_index(
            "ix_jobs_pending_deadline", ["schedule_state", "pending_deadline"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_pending_deadline")
        batch_op.drop_column("pending_deadline")
