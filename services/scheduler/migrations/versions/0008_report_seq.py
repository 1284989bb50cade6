"""the number of the last report applied to each job

Revision ID: 0008
Revises: 0007

A replica sends a report again, with the same number, when its answer was lost
with a stream; the job keeps the number of the last report it applied, in the
transaction that applied it, so that a replay is recognised and not applied twice.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("report_seq", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("report_seq")
