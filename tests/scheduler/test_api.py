"""JobService through a real gRPC server: bad input is refused and changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from managedjobs.v1 import job_service_pb2 as pb
from managedjobs.v1 import job_service_pb2_grpc
from services.common.bounds import MAX_SPEC_BYTES
from services.common.security.edge import ServerSecurity
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler.admission import Limits
from services.scheduler.main import SchedulerApp


@pytest.fixture
async def client(database_url: str) -> AsyncIterator[job_service_pb2_grpc.JobServiceStub]:
    app = SchedulerApp(database_url, Limits(), security=ServerSecurity.without_auth())
    port = await app.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield job_service_pb2_grpc.JobServiceStub(channel)
    await app.close()


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            info = error_details_pb2.ErrorInfo()
            status.details[0].Unpack(info)
            return info
    raise AssertionError("no error details")


BAD_SPECS = [
    ("malformed yaml", "name: x\nrun: [unclosed\n", "spec_yaml"),
    ("unknown field", "name: x\nrun: echo\nresources:\n  gpus: 1\n", "resources.gpus"),
    ("bad name", "name: Bad_Name\nrun: echo\n", "name"),
    ("empty chain", "", "tasks"),
    ("name only", "name: lonely\n", "tasks"),
    (
        "bad type in a chain",
        "name: c\n---\nrun: a\n---\nrun: b\nnum_nodes: many\n",
        "tasks[1].num_nodes",
    ),
    (
        "sim task that traps SIGTERM, badly",
        "name: x\nrun: a\nsim: {sigterm_exit_seconds: forever}\n",
        "sim.sigterm_exit_seconds",
    ),
]


@pytest.mark.parametrize(("case", "spec", "field"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
async def test_bad_spec_is_invalid_argument_naming_the_field_and_stores_nothing(
    client: job_service_pb2_grpc.JobServiceStub, case: str, spec: str, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, user="alice"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (caught.value.details() or "")
    info = error_info(caught.value)
    assert info.reason == "SPEC_INVALID" and info.metadata["field"] == field
    listed = await client.ListJobs(pb.ListJobsRequest())
    assert list(listed.jobs) == []


async def test_oversized_spec_is_invalid_argument_and_stores_nothing(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    spec = "name: big\nrun: " + "x" * MAX_SPEC_BYTES + "\n"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"larger than {MAX_SPEC_BYTES} bytes" in (caught.value.details() or "")
    info = error_info(caught.value)
    assert info.reason == "SPEC_INVALID" and info.metadata["field"] == "spec_yaml"
    listed = await client.ListJobs(pb.ListJobsRequest())
    assert list(listed.jobs) == []


async def test_submit_get_list_and_cancel_waiting_job(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    submitted = await client.SubmitJob(
        pb.SubmitJobRequest(spec_yaml="name: hi\nrun: echo hi\n", user="alice", priority=5)
    )
    job = (await client.GetJob(pb.GetJobRequest(job_id=submitted.job_id))).job
    assert (job.name, job.user, job.priority) == ("hi", "alice", 5)
    assert job.schedule_state == ScheduleState.WAITING  # no replica connected
    cancelled = await client.CancelJobs(pb.CancelJobsRequest(job_ids=[submitted.job_id]))
    assert list(cancelled.cancelled_job_ids) == [submitted.job_id]
    job = (await client.GetJob(pb.GetJobRequest(job_id=submitted.job_id))).job
    assert job.status == JobStatus.CANCELLED and job.schedule_state == ScheduleState.DONE
    again = await client.CancelJobs(pb.CancelJobsRequest(job_ids=[submitted.job_id]))
    assert list(again.cancelled_job_ids) == []


async def test_get_job_shows_each_tasks_max_duration_but_not_its_spec(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    spec = "name: chain\n---\nname: a\nrun: x\nmax_duration: 2h\n---\nname: b\nrun: y\n"
    job_id = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec))).job_id
    job = (await client.GetJob(pb.GetJobRequest(job_id=job_id))).job
    first, second = job.tasks
    assert first.HasField("max_duration_seconds") and first.max_duration_seconds == 7200
    assert not second.HasField("max_duration_seconds")
    assert not first.HasField("spec") and not second.HasField("spec")
    assert (job.controller_id, job.epoch) == ("", 0)  # never assigned


async def test_submit_jobs_stores_all_in_order_or_none(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    good = [pb.SubmitJobRequest(spec_yaml=f"name: j{i}\nrun: echo\n") for i in range(5)]
    reply = await client.SubmitJobs(pb.SubmitJobsRequest(jobs=good))
    assert len(reply.job_ids) == 5 and list(reply.job_ids) == sorted(reply.job_ids)
    names = {(await client.GetJob(pb.GetJobRequest(job_id=i))).job.name for i in reply.job_ids}
    assert names == {f"j{i}" for i in range(5)}
    bad = [*good[:2], pb.SubmitJobRequest(spec_yaml="run: x\nresources: {gpus: 1}\n")]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.SubmitJobs(pb.SubmitJobsRequest(jobs=bad))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "jobs[2]." in caught.value.details()
    listed = await client.ListJobs(pb.ListJobsRequest())
    assert len(listed.jobs) == 5  # nothing of the refused batch was stored
    for jobs in ([], [good[0]] * 1001):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.SubmitJobs(pb.SubmitJobsRequest(jobs=jobs))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_idempotent_submit(client: job_service_pb2_grpc.JobServiceStub) -> None:
    request = pb.SubmitJobRequest(spec_yaml="run: echo\n", user="a", idempotency_key="k")
    first = await client.SubmitJob(request)
    second = await client.SubmitJob(request)
    assert first.job_id == second.job_id


@pytest.mark.parametrize(
    ("call", "request_message", "code"),
    [
        ("GetJob", pb.GetJobRequest(job_id=0), grpc.StatusCode.INVALID_ARGUMENT),
        ("GetJob", pb.GetJobRequest(job_id=999), grpc.StatusCode.NOT_FOUND),
        ("ListJobs", pb.ListJobsRequest(page_size=-1), grpc.StatusCode.INVALID_ARGUMENT),
        ("ListJobs", pb.ListJobsRequest(page_token="garbage!"), grpc.StatusCode.INVALID_ARGUMENT),
        ("ListJobs", pb.ListJobsRequest(statuses=[99]), grpc.StatusCode.INVALID_ARGUMENT),
        ("CancelJobs", pb.CancelJobsRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        (
            "CancelJobs",
            pb.CancelJobsRequest(job_ids=[5], all=True),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ("CancelJobs", pb.CancelJobsRequest(all=True), grpc.StatusCode.INVALID_ARGUMENT),
        ("CancelJobs", pb.CancelJobsRequest(job_ids=[12345]), grpc.StatusCode.NOT_FOUND),
        (
            "SubmitJob",
            pb.SubmitJobRequest(spec_yaml="run: x", priority=5000),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
)
async def test_bad_requests_get_the_right_code(
    client: job_service_pb2_grpc.JobServiceStub,
    call: str,
    request_message: object,
    code: grpc.StatusCode,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await getattr(client, call)(request_message)
    assert caught.value.code() == code
    assert caught.value.details()


async def test_list_pages_through_every_job(client: job_service_pb2_grpc.JobServiceStub) -> None:
    ids = [
        (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml="run: x\n", user="u"))).job_id
        for _ in range(7)
    ]
    seen: list[int] = []
    token = ""
    while True:
        page = await client.ListJobs(pb.ListJobsRequest(page_size=3, page_token=token))
        seen += [j.job_id for j in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert seen == ids[::-1]


async def test_watch_streams_backlog_then_live_events(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    job_id = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml="run: x\n"))).job_id
    stream = client.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]))
    first = await stream.read()
    assert first.event.message == "submitted"
    await client.CancelJobs(pb.CancelJobsRequest(job_ids=[job_id]))
    second = await stream.read()
    assert second.event.status == JobStatus.CANCELLED
    assert second.event.event_id > first.event.event_id
    stream.cancel()


async def test_a_watch_sees_each_task_of_a_chain_cancelled_before_start(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    spec = "name: c\n---\nrun: a\n---\nrun: b\n---\nrun: c\n"
    job_id = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec))).job_id
    stream = client.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]))
    assert (await stream.read()).event.message == "submitted"
    await client.CancelJobs(pb.CancelJobsRequest(job_ids=[job_id]))
    seen = []
    while not seen or seen[-1][2] != ScheduleState.DONE:
        event = (await stream.read()).event
        seen.append((event.task_id, event.status, event.schedule_state))
    stream.cancel()
    cancelled = JobStatus.CANCELLED
    assert seen == [
        (1, cancelled, ScheduleState.WAITING),
        (2, cancelled, ScheduleState.WAITING),
        (0, cancelled, ScheduleState.DONE),
    ]


async def test_a_batched_watch_sends_every_event_ready_at_once_in_one_response(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    before = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml="run: x\n"))).job_id
    stream = client.WatchJobs(pb.WatchJobsRequest(batched=True))
    backlog = await stream.read()
    assert [e.job_id for e in backlog.events] == [before] and not backlog.HasField("event")
    request = pb.SubmitJobsRequest(jobs=[pb.SubmitJobRequest(spec_yaml="run: x\n")] * 5)
    ids = list((await client.SubmitJobs(request)).job_ids)
    # One transaction's five events reach the watcher together, in order.
    live = await stream.read()
    assert [(e.job_id, e.message) for e in live.events] == [(i, "submitted") for i in ids]
    await client.CancelJobs(pb.CancelJobsRequest(job_ids=ids))
    cancelled = await stream.read()
    assert [(e.job_id, e.status) for e in cancelled.events] == [
        (i, JobStatus.CANCELLED) for i in ids
    ]
    stream.cancel()
    # An unbatched watch of the same events gets them one per response.
    plain = client.WatchJobs(pb.WatchJobsRequest(after_event_id=backlog.events[0].event_id))
    singles = [await plain.read() for _ in range(10)]
    plain.cancel()
    assert [r.event.event_id for r in singles] == [
        e.event_id for e in (*live.events, *cancelled.events)
    ]
    assert all(not r.events for r in singles)


async def test_waiting_jobs_say_why(client: job_service_pb2_grpc.JobServiceStub) -> None:
    low = await client.SubmitJob(pb.SubmitJobRequest(spec_yaml="run: x\n", priority=-5))
    high = await client.SubmitJob(pb.SubmitJobRequest(spec_yaml="run: x\n", priority=10))
    first = (await client.GetJob(pb.GetJobRequest(job_id=high.job_id))).job
    assert first.wait_reason == "waiting for a launch slot"
    second = (await client.GetJob(pb.GetJobRequest(job_id=low.job_id))).job
    assert second.wait_reason == "waiting for higher-priority jobs (1 ahead)"


def test_sent_events_skips_repeats_in_any_order() -> None:
    from services.scheduler.watch import SentEvents

    sent = SentEvents()
    assert sent.add(7) and sent.add(5) and sent.add(6)
    assert not sent.add(5) and not sent.add(7)


async def test_secrets_are_stored_apart_and_never_read_back(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    spec = "name: s\nrun: echo\nsecrets: {API_KEY: sk-spec-0123}\n"
    request = pb.SubmitJobRequest(spec_yaml=spec, secrets={"TOKEN": "sk-request-4567"})
    job_id = (await client.SubmitJob(request)).job_id
    answers = [
        await client.GetJob(pb.GetJobRequest(job_id=job_id)),
        await client.ListJobs(pb.ListJobsRequest()),
    ]
    stream = client.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]))
    answers.append(await stream.read())
    stream.cancel()
    for answer in answers:
        wire = answer.SerializeToString()
        assert b"sk-spec-0123" not in wire and b"sk-request-4567" not in wire
    assert answers[0].job.name == "s"


async def test_a_secret_clashing_with_an_env_is_refused(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    spec = "name: s\nrun: echo\nenvs: {KEY: a}\n"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, secrets={"KEY": "b"}))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_huge_bad_page_token_is_refused_quoting_at_most_200_characters(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.ListJobs(pb.ListJobsRequest(page_token="é" * 1_000_000))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).reason == "PAGE_TOKEN_INVALID"
    details = caught.value.details() or ""
    assert details.count("é") == 200
    assert details.endswith("(1,000,000 characters) is not a token this server issued")


async def test_a_waiting_job_past_its_max_pending_fails_with_why_it_waited(
    client: job_service_pb2_grpc.JobServiceStub,
) -> None:
    patient = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml="run: x\n"))).job_id
    spec = "name: hurry\nmax_pending: 0.3\n---\nrun: a\n---\nrun: b\n"
    job_id = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec))).job_id
    stream = client.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]))
    async for response in stream:
        if response.event.schedule_state == ScheduleState.DONE:
            break
    stream.cancel()
    job = (await client.GetJob(pb.GetJobRequest(job_id=job_id))).job
    assert job.status == JobStatus.FAILED_NO_RESOURCE
    assert job.failure_reason.startswith("max_pending exceeded while waiting")
    assert "controller replica" in job.failure_reason  # none is connected here
    assert [t.status for t in job.tasks] == [JobStatus.FAILED_NO_RESOURCE, JobStatus.CANCELLED]
    other = (await client.GetJob(pb.GetJobRequest(job_id=patient))).job
    assert other.schedule_state == ScheduleState.WAITING
