"""Rows read as plain values and written back (`rows.py`): what changed is written, in
one statement per table and set of changed columns, and nothing else."""

from __future__ import annotations

import pytest
from sqlalchemy import event, select

from harness.store import new_job
from services.common.statuses import JobStatus
from services.scheduler.db.models import ATTEMPTS, JOBS, AttemptRow, JobRow
from services.scheduler.db.rows import Tracked, values_of
from services.scheduler.store import Store
from services.scheduler.txn import Txn

S = JobStatus


def test_a_tracked_row_knows_what_changed_and_refuses_unknown_columns() -> None:
    row = Tracked(JOBS, {"id": 1, "status": S.PENDING, "epoch": 3})
    row.status = S.PENDING  # the same value: no change
    assert row._changed == set()
    row.epoch = 4
    row.status = S.STARTING
    assert row._changed == {"epoch", "status"} and (row.epoch, row.status) == (4, S.STARTING)
    with pytest.raises(AttributeError, match="jobs has no column 'epochs'"):
        row.epochs = 5
    with pytest.raises(AttributeError, match="jobs has no column 'nope'"):
        _ = row.nope
    fresh = Tracked.new(ATTEMPTS, job_id=1, task_id=0, attempt=1)
    assert (fresh.cluster_name, fresh.exit_code, fresh.outcome) == ("", None, "")


async def test_write_back_runs_one_statement_per_table_and_columns(sqlite_store: Store) -> None:
    ids = [job_id for job_id, _ in await sqlite_store.submit_many([new_job() for _ in range(4)])]
    statements: list[tuple[str, bool]] = []

    def record(_c: object, _cur: object, sql: str, _p: object, _ctx: object, many: bool) -> None:
        statements.append((sql.split()[0], many))

    engine = sqlite_store.db.write_engine

    def body(txn: Txn) -> None:
        rows = values_of(txn.conn.execute(select(JOBS).where(JOBS.c.id.in_(ids))))
        jobs = {row["id"]: txn.track(JOBS, row) for row in rows}
        for job_id in ids[:3]:
            jobs[job_id].wait_reason = f"w{job_id}"  # three rows, one column
        jobs[ids[3]].epoch = 9  # another column
        txn.track_new(ATTEMPTS, job_id=ids[0], task_id=0, attempt=1, outcome="x")
        statements.clear()

    event.listen(engine, "before_cursor_execute", record)
    try:
        await sqlite_store.transaction(body)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    # The insert, then the two UPDATEs (the first for three rows at once).
    assert statements == [("INSERT", False), ("UPDATE", True), ("UPDATE", False)]
    got = await sqlite_store.read(
        lambda conn: conn.execute(select(JobRow.id, JobRow.wait_reason, JobRow.epoch)).all()
    )
    attempts = await sqlite_store.read(
        lambda conn: conn.execute(select(AttemptRow.outcome)).scalars().all()
    )
    assert sorted(got) == [(ids[0], f"w{ids[0]}", 0), (ids[1], f"w{ids[1]}", 0),
                           (ids[2], f"w{ids[2]}", 0), (ids[3], "", 9)]  # fmt: skip
    assert attempts == ["x"]
