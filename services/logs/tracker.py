"""The latest snapshot of one followed job, refreshed whenever the job has an event.

A follower needs to know when a task starts, moves to a new cluster or finishes,
and when the job is over. Events carry statuses but not cluster names, so the
tracker only notes that *something* changed and re-reads the whole job before the
follower looks at it again; a burst of events costs one GetJob.

Invariants:
- The watch starts before the first snapshot is read, and it replays the job's
  events from the first, so no change between the two is missed.
- `wait` refreshes the snapshot whenever an event arrived, and also after
  `resync_interval` without any wake-up: a lost watch slows a follower down but
  never strands it.
- When the service drains, every `wait` raises UNAVAILABLE so clients reconnect
  to another instance instead of seeing their stream end as if the job had.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from managedjobs.v1 import job_pb2
from services.common.background import Background
from services.common.errors import Unavailable
from services.logs.directory import JobDirectory, job_over

log = logging.getLogger(__name__)


class JobTracker:
    """Follows one job through the directory: `job` is its latest snapshot."""

    def __init__(
        self,
        directory: JobDirectory,
        job_id: int,
        *,
        stopping: asyncio.Event,
        resync_interval: float = 5.0,
    ) -> None:
        self.job_id = job_id
        self.job = job_pb2.Job(job_id=job_id)
        self._directory = directory
        self._stopping = stopping
        self._resync_interval = resync_interval
        self._dirty = asyncio.Event()
        self._gone = False
        self._watch = Background(f"watch-job-{job_id}", self._consume)

    @property
    def over(self) -> bool:
        """Whether the job is over (DONE), or vanished from the scheduler."""
        return self._gone or job_over(self.job)

    async def start(self) -> job_pb2.Job | None:
        """Starts watching and reads the first snapshot; None when the job is unknown."""
        self._watch.start()
        job = await self._directory.get_job(self.job_id)
        if job is None:
            return None
        self.job = job
        return job

    async def close(self) -> None:
        await self._watch.stop()

    async def wait(self, *wakers: asyncio.Event | asyncio.Future[Any]) -> None:
        """Waits for a job event or any of `wakers` (or the resync interval), then refreshes.

        Futures among `wakers` are left running for the caller to collect.

        Raises:
            Unavailable: the service is draining.
        """
        self._check_stopping()
        events = [self._dirty, self._stopping, *(w for w in wakers if isinstance(w, asyncio.Event))]
        helpers = [asyncio.create_task(event.wait()) for event in events]
        futures = [w for w in wakers if isinstance(w, asyncio.Future)]
        try:
            done, _ = await asyncio.wait(
                [*helpers, *futures],
                timeout=self._resync_interval,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for helper in helpers:
                helper.cancel()
        self._check_stopping()
        if self._dirty.is_set() or not done:
            await self.refresh()

    async def refresh(self) -> None:
        """Re-reads the job; keeps the previous snapshot while the scheduler is unreachable."""
        self._dirty.clear()
        try:
            job = await self._directory.get_job(self.job_id)
        except Unavailable as exc:
            log.info("cannot refresh job", extra={"job_id": self.job_id, "error": exc.message})
            return
        if job is None:
            self._gone = True
        else:
            self.job = job

    def _check_stopping(self) -> None:
        if self._stopping.is_set():
            raise Unavailable("the logs service is shutting down; reconnect to follow on")

    async def _consume(self) -> None:
        try:
            async for _ in self._directory.watch(self.job_id):
                self._dirty.set()
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as refused:
            # The scheduler refused the watch (a job it does not know, or not the
            # caller's): the snapshot says so to the follower; nothing to report here.
            log.info(
                "job watch refused",
                extra={"job_id": self.job_id, "code": refused.code().name},
            )
        except Exception:
            # Followers keep going on the resync interval.
            log.warning("job watch failed", extra={"job_id": self.job_id}, exc_info=True)
