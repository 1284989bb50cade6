"""JobService: the client API, served by the scheduler (contract §11).

Validation happens first, before anything is stored (`requests.py`, contract §19):
a rejected request changes nothing. Every job a caller names must exist and be
theirs, unless they see every job (contract §14). Domain errors become status
codes through `rpc_errors`. A watch's protocol is in `watch.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from managedjobs.v1 import job_service_pb2 as pb
from managedjobs.v1 import job_service_pb2_grpc
from services.common.errors import InvalidArgument, NotFound, rpc_errors
from services.common.security.access import current_principal, require_owner, require_user
from services.common.statuses import ScheduleState
from services.scheduler import queries, requests
from services.scheduler.admission import Admission
from services.scheduler.cancels import Cancels, Targets
from services.scheduler.events import EventBus
from services.scheduler.intake import Intake
from services.scheduler.ownership import OwnedJobs
from services.scheduler.spec.cache import SpecCache
from services.scheduler.store import Store
from services.scheduler.submissions import NewJob
from services.scheduler.watch import not_ahead, watch


class JobApi(job_service_pb2_grpc.JobServiceServicer):
    """The client API; every job a caller names must exist and be theirs (or they admin)."""

    def __init__(
        self,
        store: Store,
        bus: EventBus,
        admission: Admission,
        cancels: Cancels,
        on_pending_deadline: Callable[[], None] = lambda: None,
    ) -> None:
        # Told when a job with max_pending was stored: its deadline may be the nearest.
        self._on_pending_deadline = on_pending_deadline
        self.specs = SpecCache()
        self.store = store
        self.bus = bus
        self.admission = admission
        self.cancels = cancels
        self.intake = Intake(store)

    async def _owned(self, job_ids: Sequence[int]) -> None:
        """Raises NotFound for ids that name no job, PermissionDenied for another's job."""
        owners = await self.store.read(queries.job_owners, job_ids)
        missing = sorted(set(job_ids) - set(owners))
        if missing:
            shown = ", ".join(map(str, missing[:20]))
            raise NotFound(f"job_ids: no job {shown}", reason="JOB_NOT_FOUND", job_ids=shown)
        principal = current_principal()
        for job_id, owner in owners.items():
            require_owner(principal, owner, f"job {job_id}")

    @rpc_errors
    async def SubmitJob(
        self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SubmitJobResponse:
        requests.no_nul(request)
        [job_id] = await self._submit(
            [requests.new_job(request, self.specs, self.admission.regions())]
        )
        return pb.SubmitJobResponse(job_id=job_id)

    async def _submit(self, jobs: list[NewJob]) -> list[int]:
        answers = await self.intake.submit_many(jobs)
        if any(job.timeouts and job.timeouts.HasField("max_pending_seconds") for job in jobs):
            self._on_pending_deadline()
        return [job_id for job_id, _ in answers]

    @rpc_errors
    async def SubmitJobs(
        self, request: pb.SubmitJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SubmitJobsResponse:
        if not request.jobs:
            raise InvalidArgument("jobs: give at least one job")
        if len(request.jobs) > requests.MAX_BATCH:
            raise InvalidArgument(
                f"jobs: at most {requests.MAX_BATCH} per call, got {len(request.jobs)}"
            )
        requests.no_nul(request)
        regions = self.admission.regions()
        jobs = [
            requests.new_job(job, self.specs, regions, f"jobs[{i}].")
            for i, job in enumerate(request.jobs)
        ]
        return pb.SubmitJobsResponse(job_ids=await self._submit(jobs))

    @rpc_errors
    async def GetJob(
        self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetJobResponse:
        if request.job_id <= 0:
            raise InvalidArgument("job_id: must be positive")
        job = await self.store.read(queries.job, request.job_id)
        if job is None:
            raise NotFound(
                f"job {request.job_id} does not exist",
                reason="JOB_NOT_FOUND",
                job_id=str(request.job_id),
            )
        require_owner(current_principal(), job.user, f"job {job.job_id}")
        if job.schedule_state == ScheduleState.WAITING:
            ahead = await self.store.read(queries.ahead_of, job.job_id, job.priority)
            job.wait_reason = (
                f"waiting for higher-priority jobs ({ahead} ahead)"
                if ahead
                else "waiting for a launch slot"
            )
        elif job.schedule_state == ScheduleState.ALIVE_WAITING and not job.wait_reason:
            job.wait_reason = "waiting for a launch slot"
        return pb.GetJobResponse(job=job)

    @rpc_errors
    async def ListJobs(
        self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListJobsResponse:
        if request.page_size < 0:
            raise InvalidArgument("page_size: must not be negative")
        requests.no_nul(request)
        size = min(request.page_size or requests.DEFAULT_PAGE_SIZE, requests.MAX_PAGE_SIZE)
        statuses = requests.statuses(request.statuses)
        jobs = await self.store.read(
            queries.list_jobs,
            statuses,
            user=require_user(current_principal(), request.user),
            name=request.name,
            limit=size + 1,
            before_id=requests.parse_page_token(request.page_token),
            job_ids=requests.job_ids(request.job_ids),
        )
        token = requests.page_token(jobs[size - 1].job_id) if len(jobs) > size else ""
        return pb.ListJobsResponse(jobs=jobs[:size], next_page_token=token)

    @rpc_errors
    async def CancelJobs(
        self, request: pb.CancelJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CancelJobsResponse:
        ways = sum([bool(request.job_ids), bool(request.name), request.all])
        if ways != 1:
            raise InvalidArgument("give exactly one of job_ids, name or all")
        requests.no_nul(request)
        job_ids = requests.job_ids(request.job_ids)
        principal = current_principal()
        user = require_user(principal, request.user)
        if request.all and not user:
            raise InvalidArgument("user: required with all")
        if job_ids:
            await self._owned(job_ids)
        targets = Targets(job_ids=job_ids, name=request.name, user=user)
        cancelled = await self.cancels.cancel(targets)
        return pb.CancelJobsResponse(cancelled_job_ids=cancelled)

    @rpc_errors
    async def WatchJobs(
        self, request: pb.WatchJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.WatchJobsResponse]:
        if request.after_event_id < 0:
            raise InvalidArgument("after_event_id: must not be negative", field="after_event_id")
        job_ids = requests.job_ids(request.job_ids)
        principal = current_principal()
        if job_ids:
            await self._owned(job_ids)
        await not_ahead(self.store, request.after_event_id)
        # A user's watch of every job shows their own jobs only.
        owned = None
        if not job_ids and not principal.sees_every_job:
            owned = OwnedJobs(self.store, principal.user)
        responses = watch(self.store, self.bus, request, job_ids, owned)
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response
