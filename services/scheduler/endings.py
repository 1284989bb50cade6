"""The end of a job: DONE, with every task in one terminal status and an event for each.

A job ends in one of two ways. Its replica finishes the lifecycle (`finish`, a
`JobFinished` report, or admission failing a job it cannot send): any task the
lifecycle left unfinished is closed here, along `TASK_TRANSITIONS`. Or it ends
before any replica took it (`end_unstarted`: cancelled, or past its
max_pending): its first task takes the job's status, the others are CANCELLED.

Either way every task the end moves writes its own event, then the job's end
(`end_events`): contract §4, every change is an event, and a replay of the log
shows each task's last status.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import ColumnElement, update

from services.common.statuses import TERMINAL, JobStatus, ScheduleState, schedule_transition
from services.scheduler import batch_rows
from services.scheduler.db.models import JobRow
from services.scheduler.transitions import follow_current_task, set_task_status, set_task_statuses
from services.scheduler.txn import Move, Txn

S = JobStatus
St = ScheduleState
NO_FINAL_STATUS = "the lifecycle ended without a final status"
UNSTARTED = (St.INACTIVE, St.WAITING)


def end_events(
    txn: Txn,
    ended: Iterable[tuple[int, int, JobStatus]],
    ends: Iterable[tuple[int, int, JobStatus]],
    before: ScheduleState,
    message: str,
    epoch: int = 0,
) -> None:
    """The events of jobs that end in `txn`.

    `ended`: (job_id, task_id, new status) of each task the end moved; `ends`: (job_id,
    the task the job shows, the job's status) of each job. Per job, in task order, an
    event for each task it moved other than the one it shows, with the job still in
    `before`; then its end, naming the task it shows: its one event in DONE, and its last.
    """
    moved: dict[int, list[tuple[int, JobStatus]]] = {}
    for job_id, task_id, status in ended:
        moved.setdefault(job_id, []).append((task_id, status))
    for job_id, shown, status in ends:
        for task_id, new in sorted(moved.get(job_id, ())):
            if task_id != shown:
                txn.event(job_id, task_id, new, before, message, epoch)
        txn.event(job_id, shown, status, St.DONE, message, epoch)


def end_unstarted(
    txn: Txn,
    where: ColumnElement[bool],
    status: JobStatus,
    message: str,
    failure_reason: str = "",
    **job_values: Any,
) -> list[int]:
    """Ends the jobs matching `where` that no replica took yet (INACTIVE or WAITING: every
    task still PENDING), in one conditional UPDATE: DONE in `status` (with `job_values`).
    Their first task becomes `status` too, the others CANCELLED, each with its event,
    then the job's end (`end_events`); `failure_reason` is the job's and its first task's.

    Returns the ids of the jobs ended.
    """
    reason = {"failure_reason": failure_reason} if failure_reason else {}
    rows = txn.conn.execute(
        update(JobRow)
        .where(where, JobRow.schedule_state.in_(UNSTARTED))
        .values(
            schedule_state=St.DONE,
            status=status,
            end_time=txn.now,
            wait_reason="",
            **reason,
            **job_values,
        )
        .returning(JobRow.id)
    ).all()
    job_ids = [int(row[0]) for row in rows]
    ended: list[tuple[int, int, JobStatus]] = []
    if status != S.CANCELLED:
        moved = set_task_statuses(
            txn, job_ids, [S.PENDING], status, task_id=0, end_time=txn.now, **reason
        )
        ended += [(job_id, task_id, status) for job_id, task_id in moved]
    moved = set_task_statuses(txn, job_ids, [S.PENDING], S.CANCELLED, end_time=txn.now)
    ended += [(job_id, task_id, S.CANCELLED) for job_id, task_id in moved]
    end_events(txn, ended, [(job_id, 0, status) for job_id in job_ids], St.WAITING, message)
    # Only WAITING is counted: a job is INACTIVE only inside the transaction storing it.
    txn.moves += [Move(job_id, None, None, 0, St.WAITING, St.DONE) for job_id in job_ids]
    return job_ids


def finish(txn: Txn, cid: str, job_id: int, epoch: int, reason: str = "") -> None:
    """The replica finished the lifecycle: the job is DONE.

    A task the lifecycle left unfinished would break "every job ends in one
    terminal status", so it is closed here, along `TASK_TRANSITIONS`: a task being
    cancelled, and tasks after the current one, end CANCELLED; the current task
    and any other in flight end FAILED_CONTROLLER with the reason (with no reason,
    a current task that never started ends CANCELLED too).

    Raises:
        StaleReport: `cid` does not hold the job at `epoch`.
    """
    job = batch_rows.held_job(txn, job_id, epoch, cid, applying=True)
    if job.schedule_state == St.DONE:
        return
    ended: list[tuple[int, int, JobStatus]] = []
    for task in sorted(batch_rows.unfinished_tasks(txn, job_id), key=lambda t: t.task_id):
        if task.status in TERMINAL:
            continue  # finished earlier in this batch (the query saw the stored status)
        never_started = task.status == S.PENDING
        if task.status == S.CANCELLING or (
            never_started and not (reason and task.task_id == job.current_task)
        ):
            set_task_status(task, S.CANCELLED)
        else:
            set_task_status(task, S.FAILED_CONTROLLER)
            task.failure_reason = reason or NO_FINAL_STATUS
        task.end_time = txn.now
        ended.append((job_id, task.task_id, S(task.status)))
        follow_current_task(txn, job, task)
    prior = St(job.schedule_state)
    job.schedule_state = schedule_transition(prior, St.DONE)
    job.end_time = txn.now
    job.wait_reason = ""
    end_events(txn, ended, [(job_id, job.current_task, S(job.status))], prior, "done", epoch)
    txn.moves.append(Move(job_id, cid, cid, epoch, prior, St.DONE))
