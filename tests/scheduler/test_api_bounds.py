"""The scheduler's bounds on what a request may name and where a watch may resume (contract §19).

Real scheduler, real gRPC, on SQLite and PostgreSQL: at most 1,000 job ids per
request (more is INVALID_ARGUMENT naming the limit, never a database error passed
off as UNAVAILABLE), positive ids only, a status filter of any length; a watch
resumed past the newest event is OUT_OF_RANGE at once; a watcher that falls too
far behind is cut off with RESOURCE_EXHAUSTED and the event id to resume after,
and resuming there loses nothing. Every ended watch leaves no subscription behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from harness.fuzzing import error_info
from managedjobs.v1 import job_service_pb2 as pb
from managedjobs.v1 import job_service_pb2_grpc
from services.common.security.edge import ServerSecurity
from services.common.statuses import JobStatus
from services.scheduler import queries
from services.scheduler.admission import Limits
from services.scheduler.main import SchedulerApp
from services.scheduler.requests import MAX_JOB_IDS
from services.scheduler.transitions import set_task_statuses

SPEC = "name: bounded\nrun: echo hi\n"
QUEUE_LIMIT = 5


@pytest.fixture
async def app(database_url: str) -> AsyncIterator[SchedulerApp]:
    scheduler = SchedulerApp(
        database_url,
        Limits(),
        security=ServerSecurity.without_auth(),
        watch_queue_limit=QUEUE_LIMIT,
    )
    await scheduler.start()
    yield scheduler
    await scheduler.close()


@pytest.fixture
async def client(app: SchedulerApp) -> AsyncIterator[job_service_pb2_grpc.JobServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.server.port}") as channel:
        yield job_service_pb2_grpc.JobServiceStub(channel)


async def submit(client: job_service_pb2_grpc.JobServiceStub, count: int) -> list[int]:
    jobs = [pb.SubmitJobRequest(spec_yaml=SPEC, user="alice") for _ in range(count)]
    reply = await client.SubmitJobs(pb.SubmitJobsRequest(jobs=jobs))
    return list(reply.job_ids)


async def refusal(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call  # type: ignore[misc]
    return caught.value


async def test_more_job_ids_than_the_limit_are_refused_naming_it(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    [job_id] = await submit(client, 1)
    many = [job_id] * 40_000
    for error in (
        await refusal(client.CancelJobs(pb.CancelJobsRequest(job_ids=many))),
        await refusal(client.WatchJobs(pb.WatchJobsRequest(job_ids=many), timeout=5)),
    ):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {MAX_JOB_IDS} job ids" in (error.details() or "")
        info = error_info(error.trailing_metadata())
        assert info is not None and info.reason == "TOO_MANY_JOB_IDS"
        assert info.metadata["limit"] == str(MAX_JOB_IDS)
    # Nothing was cancelled, and exactly the limit is still fine.
    job = (await client.GetJob(pb.GetJobRequest(job_id=job_id))).job
    assert not job.cancel_requested
    reply = await client.CancelJobs(pb.CancelJobsRequest(job_ids=[job_id] * MAX_JOB_IDS))
    assert list(reply.cancelled_job_ids) == [job_id]


async def test_job_ids_must_be_positive_and_huge_ones_are_not_found(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    [job_id] = await submit(client, 1)
    for bad in (0, -1, -(2**63)):
        error = await refusal(client.CancelJobs(pb.CancelJobsRequest(job_ids=[job_id, bad])))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = error_info(error.trailing_metadata())
        assert info is not None and info.metadata["field"] == "job_ids[1]"
        error = await refusal(client.GetJob(pb.GetJobRequest(job_id=bad)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = await refusal(client.GetJob(pb.GetJobRequest(job_id=2**63 - 1)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    error = await refusal(client.CancelJobs(pb.CancelJobsRequest(job_ids=[2**63 - 1])))
    assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_a_nul_character_in_any_text_is_refused_naming_the_field(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    """PostgreSQL stores no NUL character: the request is refused, not the write failed."""
    [job_id] = await submit(client, 1)
    for call, field in (
        (client.SubmitJob(pb.SubmitJobRequest(spec_yaml=SPEC, idempotency_key="k\x00")), None),
        (client.SubmitJob(pb.SubmitJobRequest(spec_yaml=SPEC, envs={"A": "\x00"})), None),
        (client.ListJobs(pb.ListJobsRequest(name="a\x00b")), "name"),
        (client.CancelJobs(pb.CancelJobsRequest(name="\x00")), "name"),
        (client.CancelJobs(pb.CancelJobsRequest(all=True, user="a\x00")), "user"),
    ):
        error = await refusal(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = error_info(error.trailing_metadata())
        assert info is not None and info.reason == "NUL_CHARACTER"
        assert field is None or info.metadata["field"] == field
    listed = await client.ListJobs(pb.ListJobsRequest())
    assert [job.job_id for job in listed.jobs] == [job_id]


async def test_a_status_filter_of_any_length_lists_jobs(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    [job_id] = await submit(client, 1)
    pending = int(JobStatus.PENDING)
    listed = await client.ListJobs(pb.ListJobsRequest(statuses=[pending] * 40_000))
    assert [job.job_id for job in listed.jobs] == [job_id]
    error = await refusal(client.ListJobs(pb.ListJobsRequest(statuses=[pending, 9999])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "statuses[1]" in (error.details() or "")


async def test_a_watch_resumed_past_the_newest_event_is_out_of_range_at_once(
    app: SchedulerApp, client: job_service_pb2_grpc.JobServiceStub
) -> None:
    await submit(client, 2)
    head = await app.store.read(queries.last_event_id)
    for after in (head + 1, 2**63 - 1):
        watch = client.WatchJobs(pb.WatchJobsRequest(after_event_id=after), timeout=5)
        error = await refusal(watch)
        assert error.code() == grpc.StatusCode.OUT_OF_RANGE
        info = error_info(error.trailing_metadata())
        assert info is not None and info.reason == "EVENTS_AHEAD"
        assert info.metadata["head_event_id"] == str(head)
    # Resuming at the head itself is fine: it waits for what comes next.
    watch = client.WatchJobs(pb.WatchJobsRequest(after_event_id=head))
    [later] = await submit(client, 1)
    event = await asyncio.wait_for(watch.read(), 5)
    assert event.event.job_id == later and event.event.event_id > head
    watch.cancel()
    await wait_for_no_subscription(app)


async def test_a_watcher_that_falls_behind_is_told_where_to_resume_and_loses_nothing(
    app: SchedulerApp, client: job_service_pb2_grpc.JobServiceStub
) -> None:
    [first] = await submit(client, 1)
    watch = client.WatchJobs(pb.WatchJobsRequest())
    assert (await asyncio.wait_for(watch.read(), 5)).event.job_id == first
    # One transaction publishes many more events than the watcher may queue, in one go.
    later = await submit(client, QUEUE_LIMIT * 4)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        while True:
            assert await asyncio.wait_for(watch.read(), 5) is not grpc.aio.EOF
    error = caught.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(error.trailing_metadata())
    assert info is not None and info.reason == "WATCHER_OVERFLOW"
    resume = int(info.metadata["resume_after_event_id"])
    # Resuming there replays what was not sent: every later job's event is there.
    seen: list[int] = []
    again = client.WatchJobs(pb.WatchJobsRequest(after_event_id=resume))
    while not set(later) <= set(seen):
        seen.append((await asyncio.wait_for(again.read(), 5)).event.job_id)
    again.cancel()
    await wait_for_no_subscription(app)


async def wait_for_no_subscription(app: SchedulerApp) -> None:
    """Waits (at most 5 s) for the ended watch streams' handlers to unsubscribe."""
    for _ in range(500):
        if not app.bus.subscriptions:
            return
        await asyncio.sleep(0.01)
    assert app.bus.subscriptions == 0


async def test_status_moves_of_more_jobs_than_one_statement_takes(app: SchedulerApp) -> None:
    """A cancel by name or a release may move the tasks of tens of thousands of jobs:
    PostgreSQL takes at most 32,767 parameters per statement, so ids go in chunks."""
    moved = await app.store.transaction(
        lambda txn: set_task_statuses(
            txn, list(range(1, 40_001)), [JobStatus.PENDING], JobStatus.CANCELLED
        )
    )
    assert moved == []
