"""max_pending for jobs no replica took yet (contract §18).

A job with `max_pending` gets a deadline at submission (`jobs.pending_deadline`).
While it is WAITING, the scheduler owns it, so the scheduler enforces it: one
task sleeps until the earliest deadline among WAITING jobs (woken early when a
submission may bring an earlier one), then ends every WAITING job past its
deadline in one transaction: its first task FAILED_NO_RESOURCE with the reason
it was waiting, the rest CANCELLED, each task with an event, the job DONE.
Nothing polls. A job admitted to a replica is past this module: its lifecycle
stops launching at the same deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable

from sqlalchemy import and_, func, select

from services.common.background import Background
from services.common.event_messages import MAX_PENDING_EXCEEDED
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler.db.models import JobRow
from services.scheduler.endings import end_unstarted
from services.scheduler.store import Store
from services.scheduler.txn import Txn

log = logging.getLogger(__name__)
S = JobStatus
St = ScheduleState
# Sleep at most this long: a clock step or a missed wake-up costs no more.
LONGEST_SLEEP = 60.0


class PendingDeadlines:
    def __init__(self, store: Store, waiting_reason: Callable[[], str]) -> None:
        self.store = store
        # Why WAITING jobs wait now, e.g. "no replica has room" (from admission).
        self._waiting_reason = waiting_reason
        self._wake = asyncio.Event()
        self._runner = Background("pending-deadlines", self._run)
        self.expired = 0

    def start(self) -> None:
        self._runner.start()

    def soon(self) -> None:
        """A submission may have brought an earlier deadline."""
        self._wake.set()

    async def stop(self) -> None:
        await self._runner.stop()

    async def _run(self) -> None:
        while True:
            try:
                await self.expire()
                nearest = await self._nearest()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("expiring pending jobs failed")
                nearest = None
            wait = LONGEST_SLEEP
            if nearest is not None:
                wait = min(wait, max(0.0, (nearest - self.store.clock()).total_seconds()))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def _nearest(self) -> dt.datetime | None:
        query = select(func.min(JobRow.pending_deadline)).where(JobRow.schedule_state == St.WAITING)
        nearest = await self.store.read(lambda conn: conn.scalar(query))
        if nearest is not None and nearest.tzinfo is None:
            nearest = nearest.replace(tzinfo=dt.UTC)
        return nearest

    async def expire(self) -> list[int]:
        """Ends every WAITING job past its max_pending; returns their ids."""
        why = self._waiting_reason()
        ids = await self.store.transaction(lambda txn: _expire(txn, why))
        if ids:
            self.expired += len(ids)
            log.info("jobs past max_pending", extra={"jobs": ids[:20], "count": len(ids)})
        return ids


def _expire(txn: Txn, why: str) -> list[int]:
    reason = f"{MAX_PENDING_EXCEEDED} while {why}"
    past = and_(JobRow.schedule_state == St.WAITING, JobRow.pending_deadline <= txn.now)
    # The first task could not start; later tasks never will.
    return end_unstarted(txn, past, S.FAILED_NO_RESOURCE, reason, failure_reason=reason)
