"""The logs service's view of the scheduler: a job watch that survives the scheduler's refusals.

A fake JobService (a real gRPC server in this process) answers the watch the way
the scheduler does when a watcher falls behind (RESOURCE_EXHAUSTED, with where to
resume) or resumes past the newest event (OUT_OF_RANGE), and records where each
new watch starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from managedjobs.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc
from services.common.channels import ClientSecurity
from services.common.errors import NotFound, OutOfRange, ResourceExhausted, rpc_errors
from services.logs.directory import JobDirectory


class Refusing(job_service_pb2_grpc.JobServiceServicer):
    """WatchJobs sends one event, then ends with the next refusal of `refusals`."""

    def __init__(self, refusals: list[Exception]) -> None:
        self.refusals = refusals
        self.starts: list[int] = []
        self.next_id = 10

    @rpc_errors
    async def WatchJobs(
        self, request: job_service_pb2.WatchJobsRequest, context: Any
    ) -> AsyncIterator[job_service_pb2.WatchJobsResponse]:
        self.starts.append(request.after_event_id)
        self.next_id += 1
        yield job_service_pb2.WatchJobsResponse(
            event=job_pb2.JobEvent(event_id=self.next_id, job_id=request.job_ids[0])
        )
        if self.refusals:
            raise self.refusals.pop(0)
        await asyncio.Event().wait()


async def no_sleep(seconds: float) -> None:
    await asyncio.sleep(0)


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    servers: list[grpc.aio.Server] = []

    async def start(fake: Refusing) -> JobDirectory:
        server = grpc.aio.server()
        job_service_pb2_grpc.add_JobServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return JobDirectory(f"127.0.0.1:{port}", ClientSecurity(), sleep=no_sleep)

    yield start
    for server in servers:
        await server.stop(None)


async def test_a_watch_resumes_where_the_scheduler_says_after_falling_behind(serve: Any) -> None:
    fake = Refusing(
        [
            ResourceExhausted("fell behind", reason="WATCHER_OVERFLOW", resume_after_event_id="7"),
            OutOfRange("past the newest event", reason="EVENTS_AHEAD", head_event_id="3"),
        ]
    )
    directory = await serve(fake)
    seen = []
    async with asyncio.timeout(10):
        async for event in directory.watch(1):
            seen.append(event.event_id)
            if len(seen) == 3:
                break
    await directory.close()
    # Fell behind after event 11: resumed after 7, as told (events 8-11 come again);
    # then told it was past the newest: started over from the first.
    assert fake.starts == [0, 7, 0]
    assert seen == [11, 12, 13]


async def test_any_other_refusal_ends_the_watch(serve: Any) -> None:
    directory = await serve(Refusing([NotFound("job 1 does not exist", reason="JOB_NOT_FOUND")]))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async with asyncio.timeout(10):
            async for _ in directory.watch(1):
                pass
    await directory.close()
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
