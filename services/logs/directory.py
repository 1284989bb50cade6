"""Where the logs service learns about jobs: the scheduler's JobService.

The scheduler is the only source of truth about jobs (contract §2); the logs service
keeps no job state of its own. It asks for a job's current snapshot (`get_job`)
and listens to the job's events (`watch`) to know when a task starts, moves to a
new cluster, finishes, and when the job is over.

A job is over when its schedule state is DONE: by then every task is terminal, the
controller has fetched the logs it could, and every cluster is torn down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from managedjobs.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc
from services.common.channels import ClientSecurity, open_channel
from services.common.errors import Unavailable, error_info
from services.common.statuses import ACTIVE, TERMINAL, JobStatus

log = logging.getLogger(__name__)

__all__ = ["ACTIVE", "TERMINAL", "JobDirectory", "job_over", "task_status"]

_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Job ids per ListJobs call (the scheduler's bound on a request's ids).
MAX_JOB_IDS = 1000


def task_status(task: job_pb2.Task) -> JobStatus | None:
    """The task's status, or None when unspecified."""
    try:
        return JobStatus(task.status)
    except ValueError:
        return None


def job_over(job: job_pb2.Job) -> bool:
    """Whether nothing more will happen to the job (schedule state DONE)."""
    return job.schedule_state == job_pb2.SCHEDULE_STATE_DONE


class JobDirectory:
    """A client of the scheduler's JobService: job snapshots and job events."""

    def __init__(
        self,
        address: str,
        security: ClientSecurity,
        *,
        timeout: float = 10.0,
        max_backoff: float = 5.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._channel = open_channel(address, security)
        self._stub = job_service_pb2_grpc.JobServiceStub(self._channel)
        self._timeout = timeout
        self._max_backoff = max_backoff
        self._sleep = sleep

    async def get_job(self, job_id: int) -> job_pb2.Job | None:
        """The job's current snapshot, or None when the scheduler does not know it.

        Raises:
            Unavailable: the scheduler cannot be reached.
        """
        request = job_service_pb2.GetJobRequest(job_id=job_id)
        try:
            response = await self._stub.GetJob(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            if exc.code() in _UNREACHABLE:
                raise Unavailable(f"scheduler unreachable: {exc.details()}") from exc
            raise
        return response.job

    async def get_jobs(self, job_ids: Sequence[int]) -> dict[int, job_pb2.Job]:
        """The snapshots of those of `job_ids` the scheduler knows, in one ListJobs call
        per `MAX_JOB_IDS` of them.

        Raises:
            Unavailable: the scheduler cannot be reached.
        """
        found: dict[int, job_pb2.Job] = {}
        ids = list(dict.fromkeys(job_ids))
        for start in range(0, len(ids), MAX_JOB_IDS):
            chunk = ids[start : start + MAX_JOB_IDS]
            request = job_service_pb2.ListJobsRequest(job_ids=chunk, page_size=len(chunk))
            try:
                response = await self._stub.ListJobs(request, timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _UNREACHABLE:
                    raise Unavailable(f"scheduler unreachable: {exc.details()}") from exc
                raise
            found.update((job.job_id, job) for job in response.jobs)
        return found

    async def watch(self, job_id: int) -> AsyncIterator[job_pb2.JobEvent]:
        """Every event of the job, from its first, reconnecting while the scheduler is away.

        After a reconnect the stream resumes after the last event seen, so no event
        is lost or repeated; a watch cut off for falling behind resumes where the
        scheduler says, and one resumed past the newest event (a replaced database)
        starts again from the first. Never ends on its own; the caller stops iterating.

        Raises:
            grpc.aio.AioRpcError: any other refusal, e.g. NOT_FOUND for a job the
                scheduler does not know.
        """
        after = 0
        failures = 0
        while True:
            request = job_service_pb2.WatchJobsRequest(job_ids=[job_id], after_event_id=after)
            call = self._stub.WatchJobs(request)
            try:
                async for response in call:
                    failures = 0
                    after = max(after, response.event.event_id)
                    yield response.event
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    resume = error_info(exc).metadata.get("resume_after_event_id", "")
                    if not resume.isdigit():
                        raise
                    after = int(resume)  # fell behind: resume where nothing is lost
                elif code == grpc.StatusCode.OUT_OF_RANGE:
                    after = 0  # past the newest event: the events were replaced
                elif code != grpc.StatusCode.UNAVAILABLE:
                    raise
                log.info("job watch interrupted", extra={"job_id": job_id, "error": exc.details()})
            finally:
                # At once, not when the call is collected: the scheduler holds a
                # subscription for as long as the call lives.
                call.cancel()
            # The stream ended or the scheduler went away: back off, then resume.
            await self._sleep(min(self._max_backoff, 0.1 * 2**failures))
            failures = min(failures + 1, 16)

    async def close(self) -> None:
        await self._channel.close()
