"""Releases: a replica's jobs taken away from it, for admission to place again (contract §9).

A replica's jobs are released when its lease ends, when its hello shows it lost
some, when it hands them back (draining), or when an admission pass committed
jobs to it after its lease had ended. A released job keeps its status and
epoch, and nobody holds it (an "orphan", placed again before any new job with
the next epoch): launch slots are freed (LAUNCHING becomes ALIVE), and a task
that was STARTING goes to RECOVERING, since its cluster's state is unknown.
Conditional UPDATEs only: a job already moved on is left alone, and each job
released writes its event with its epoch at the release.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import update

from services.common.event_messages import RELEASED
from services.common.statuses import JobStatus, ScheduleState, schedule_transition
from services.scheduler.db.id_lists import chunked, in_ids
from services.scheduler.db.models import JOBS, JobRow
from services.scheduler.store import Store
from services.scheduler.transitions import set_task_statuses
from services.scheduler.txn import Move, Txn

S = JobStatus
St = ScheduleState


def release(
    txn: Txn,
    cid: str,
    *,
    job_ids: Iterable[int] | None = None,
    pairs: Sequence[tuple[int, int]] | None = None,
    reason: str,
) -> None:
    """Takes a replica's unfinished jobs away from it (all, some ids, or (id, epoch) pairs)."""
    # Ids go in chunks (`chunked`): each statement's list stays bounded.
    scopes: list[list[Any]] = [[]]
    if job_ids is not None:
        scopes = [[in_ids(JOBS.c.id, values=chunk)] for chunk in chunked(list(job_ids))]
    if pairs is not None:
        scopes = [
            [
                in_ids(JOBS.c.id, values=[job_id for job_id, _ in chunk]),
                in_ids(JOBS.c.id, JOBS.c.epoch, values=chunk),
            ]
            for chunk in chunked(list(pairs))
        ]
    released: list[tuple[int, int, ScheduleState, ScheduleState, JobStatus, int]] = []
    for scope in scopes:
        where = [JobRow.controller_id == cid, *scope]
        for old, new in ((St.LAUNCHING, St.ALIVE), (St.ALIVE, St.ALIVE), (St.ALIVE_WAITING,) * 2):
            rows = (
                txn.conn.execute(
                    update(JobRow)
                    .where(*where, JobRow.schedule_state == old)
                    .values(controller_id=None, schedule_state=schedule_transition(old, new))
                    .returning(JobRow.id, JobRow.epoch, JobRow.status, JobRow.current_task),
                )
            ).all()
            released += [(int(i), int(e), old, new, S(s), int(t)) for i, e, s, t in rows]
    if not released:
        return
    ids = [r[0] for r in released]
    moved = set_task_statuses(txn, ids, [S.STARTING], S.RECOVERING)
    recovering = {job_id for job_id, _ in moved}
    for chunk in chunked(sorted(recovering)):
        txn.conn.execute(
            update(JobRow)
            .where(in_ids(JOBS.c.id, values=chunk), JobRow.status == S.STARTING)
            .values(status=S.RECOVERING),
        )
    for job_id, epoch, old, new, status, task in released:
        shown = S.RECOVERING if job_id in recovering and status == S.STARTING else status
        txn.event(job_id, task, shown, new, reason, epoch)
        txn.moves.append(Move(job_id, cid, None, epoch, old, new))


async def release_replica(
    store: Store,
    controller_id: str,
    job_ids: Iterable[int] | None = None,
    reason: str = "",
    pairs: Sequence[tuple[int, int]] | None = None,
) -> list[Move]:
    """Takes jobs (all, by default; or these ids, or these (id, epoch) pairs) away from
    a replica in a transaction of their own; returns the moves."""

    def body(txn: Txn) -> list[Move]:
        release(txn, controller_id, job_ids=job_ids, pairs=pairs, reason=reason or RELEASED)
        return txn.moves

    return await store.transaction(body)
