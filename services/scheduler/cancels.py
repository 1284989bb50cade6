"""Cancellation (contract §8): durable first, then told to whoever holds the job.

A cancel is state, not a message. `cancel` marks every target in one
transaction with conditional UPDATEs, whatever their number:
- a job no replica took yet (INACTIVE, WAITING) is CANCELLED and DONE at once,
  each of its tasks CANCELLED with an event of its own;
- any other unfinished job gets `cancel_requested`, and its current holder
  (read from the same UPDATE's RETURNING, after the row lock, so it cannot miss
  an assignment that committed first) is sent a `JobCancel`.

Every assignment carries `cancel_requested` as committed with the move, and a
replica remembers a cancel for a job whose assignment has not reached it yet,
so a cancel that races an assignment or a re-assignment is never lost. Repeating
a cancel re-sends it: idempotent.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from sqlalchemy import ColumnElement, and_, select, true, update

from services.common.event_messages import CANCEL_REQUESTED, CANCELLED_BEFORE_START
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler import metrics
from services.scheduler.db.id_lists import in_ids
from services.scheduler.db.models import JOBS, JobRow
from services.scheduler.endings import end_unstarted
from services.scheduler.outbox import Outbox
from services.scheduler.store import Store
from services.scheduler.txn import Txn

S = JobStatus
St = ScheduleState


@dataclasses.dataclass(frozen=True)
class Targets:
    """Which jobs to cancel: by ids, by name, or all; always within `user` when given."""

    job_ids: Sequence[int] = ()
    name: str = ""
    user: str = ""

    def where(self) -> ColumnElement[bool]:
        clauses: list[ColumnElement[bool]] = [JobRow.schedule_state != St.DONE]
        if self.job_ids:
            clauses.append(in_ids(JOBS.c.id, values=list(self.job_ids)))
        if self.name:
            clauses.append(JobRow.name == self.name)
        if self.user:
            clauses.append(JobRow.user == self.user)
        return and_(true(), *clauses)


class Cancels:
    def __init__(self, store: Store, outbox: Outbox) -> None:
        self.store = store
        self.outbox = outbox

    async def cancel(self, targets: Targets) -> list[int]:
        """Cancels the unfinished jobs matching `targets`; returns their ids, ascending."""
        return await self.store.transaction(
            functools.partial(self._cancel, targets=targets), client=True
        )

    def _cancel(self, txn: Txn, targets: Targets) -> list[int]:
        conn = txn.conn
        ids = end_unstarted(
            txn, targets.where(), S.CANCELLED, CANCELLED_BEFORE_START, cancel_requested=True
        )
        cancelled = list(ids)
        newly = conn.execute(
            update(JobRow)
            .where(targets.where(), JobRow.cancel_requested.is_(False))
            .values(cancel_requested=True)
            .returning(JobRow.id, JobRow.status, JobRow.schedule_state, JobRow.current_task),
        ).all()
        for job_id, status, state, task in newly:
            txn.event(job_id, task, status, state, CANCEL_REQUESTED)
        # Every live target (new or repeated) is told again: a lost message is harmless.
        live = conn.execute(
            select(JobRow.id, JobRow.controller_id, JobRow.epoch).where(targets.where())
        ).all()
        notices: list[tuple[str, int, int]] = []
        for job_id, controller_id, epoch in live:
            cancelled.append(int(job_id))
            if controller_id is not None:
                notices.append((controller_id, int(job_id), int(epoch)))
        newly_ids = [int(r[0]) for r in newly]
        txn.after.append(lambda: metrics.cancel_requested(ids + newly_ids, ids))
        txn.after.append(lambda: self._tell(notices))
        return sorted(set(cancelled))

    def _tell(self, notices: Sequence[tuple[str, int, int]]) -> None:
        for controller_id, job_id, epoch in notices:
            self.outbox.cancel(controller_id, job_id, epoch)
