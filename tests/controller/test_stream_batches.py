"""Batches on a replica's stream: several envelopes in one gRPC message.

Whatever queued while the last message was being written goes as one batch, in
both directions (`services/common/batches.py`). Here: the queue-side bounds; a
real scheduler answering a batch's requests one by one, exactly as if each had
come alone; a batch over the bound refused whole; and the scheduler batching what
it sends (an admission pass's assignments).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from harness.replica_stream import IGNORED, Replica, hello, holding_a_job
from managedjobs.v1 import job_service_pb2 as jpb
from managedjobs.v1 import job_service_pb2_grpc
from managedjobs.v1 import scheduler_service_pb2 as pb
from managedjobs.v1.scheduler_service_pb2_grpc import SchedulerServiceStub
from services.common.batches import MAX_BATCH_MESSAGES, Batches
from services.common.statuses import ScheduleState
from services.controller.link import Link
from services.controller.messages import unbatched
from services.scheduler.main import SchedulerApp


def ack(seq: int) -> pb.ConnectControllerResponse:
    return pb.ConnectControllerResponse(ack=pb.ReportAck(ack_seq=seq, accepted=True))


async def test_a_batch_is_what_waits_now_in_order_within_its_bounds() -> None:
    queue: asyncio.Queue[pb.ConnectControllerResponse | None] = asyncio.Queue()
    batches = Batches(queue, max_messages=3, max_bytes=10_000)
    for seq in range(1, 6):
        queue.put_nowait(ack(seq))
    assert [m.ack.ack_seq for m in await batches.next()] == [1, 2, 3]
    assert [m.ack.ack_seq for m in await batches.next()] == [4, 5]
    # Nothing waits: the next message goes alone, as soon as it comes.
    later = asyncio.get_running_loop().call_later(0.01, queue.put_nowait, ack(6))
    assert [m.ack.ack_seq for m in await batches.next()] == [6]
    later.cancel()
    # Messages before the close are delivered; then every call says closed.
    queue.put_nowait(ack(7))
    queue.put_nowait(None)
    queue.put_nowait(ack(8))
    assert [m.ack.ack_seq for m in await batches.next()] == [7]
    assert await batches.next() == []
    assert await batches.next() == []


async def test_a_batch_stays_under_its_bytes_and_a_big_message_goes_alone() -> None:
    queue: asyncio.Queue[pb.ConnectControllerResponse | None] = asyncio.Queue()
    big = pb.ConnectControllerResponse(ack=pb.ReportAck(ack_seq=2, reason="x" * 5000))
    for message in (ack(1), big, ack(3), ack(4)):
        queue.put_nowait(message)
    batches = Batches(queue, max_bytes=4000)
    # The big one does not fit beside the first: it is carried to the next batch,
    # where it goes alone although it is over the bound itself.
    assert [m.ack.ack_seq for m in await batches.next()] == [1]
    assert [m.ack.ack_seq for m in await batches.next()] == [2]
    assert [m.ack.ack_seq for m in await batches.next()] == [3, 4]


def send_batch(
    replica: Replica, requests: list[pb.ConnectControllerRequest]
) -> list[asyncio.Future[pb.ReportAck]]:
    """Sends the requests as one batch; returns their acks to come."""
    loop = asyncio.get_running_loop()
    acks = []
    for request in requests:
        request.seq = replica._next()
        acks.append(replica.acks.setdefault(request.seq, loop.create_future()))
    replica.outbox.put_nowait(pb.ConnectControllerRequest(batch=pb.RequestBatch(requests=requests)))
    return acks


async def test_each_request_of_a_batch_is_answered_as_if_it_had_come_alone(
    app: SchedulerApp,
) -> None:
    async with holding_a_job(app) as (replica, fuzzer, held):
        job_id, epoch = held.job_id, held.epoch
        requests = [
            pb.ConnectControllerRequest(heartbeat=pb.ControllerHeartbeat()),
            pb.ConnectControllerRequest(
                launch_slot_release=pb.LaunchSlotRelease(job_id=job_id, epoch=epoch)
            ),
            pb.ConnectControllerRequest(hello=hello()),
            pb.ConnectControllerRequest(batch=pb.RequestBatch()),
            pb.ConnectControllerRequest(
                launch_slot_request=pb.LaunchSlotRequest(job_id=job_id, epoch=epoch + 1)
            ),
        ]
        acks = [await asyncio.wait_for(a, 10) for a in send_batch(replica, requests)]
        assert [a.accepted for a in acks] == [True, True, False, False, False]
        assert [a.refusal for a in acks[2:]] == [
            pb.REPORT_REFUSAL_INVALID,
            pb.REPORT_REFUSAL_INVALID,
            pb.REPORT_REFUSAL_STALE_EPOCH,
        ]
        assert "hello" in acks[2].reason and "batch" in acks[3].reason
        # The release in the middle was applied: the job no longer holds a launch slot.
        job = await fuzzer.job(job_id)
        assert job.schedule_state == ScheduleState.ALIVE
        # The stream stayed up: a report alone is still answered.
        again = pb.LaunchSlotRequest(job_id=job_id, epoch=epoch)
        answer = await replica.report(pb.ConnectControllerRequest(launch_slot_request=again))
        assert answer.accepted


async def test_a_batch_over_the_bound_ends_the_stream_and_changes_nothing(
    app: SchedulerApp,
) -> None:
    async with holding_a_job(app) as (replica, fuzzer, held):
        before = await fuzzer.job(held.job_id)
        release = pb.LaunchSlotRelease(job_id=held.job_id, epoch=held.epoch)
        requests = [pb.ConnectControllerRequest(launch_slot_release=release)] + [
            pb.ConnectControllerRequest(heartbeat=pb.ControllerHeartbeat())
            for _ in range(MAX_BATCH_MESSAGES)
        ]
        acks = send_batch(replica, requests)
        assert replica.reader is not None
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(replica.reader, 10)
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"batch.requests: at most {MAX_BATCH_MESSAGES}" in (ended.value.details() or "")
        assert not any(a.done() for a in acks)
        assert await fuzzer.job(held.job_id) == before
        assert await app.counters.reconcile() == {}


async def test_the_assignments_of_one_admission_pass_share_messages(app: SchedulerApp) -> None:
    """Twenty jobs submitted in one call are admitted in one pass: their assignments
    reach the replica in fewer messages than jobs, each assignment exactly once."""

    async def requests() -> AsyncIterator[pb.ConnectControllerRequest]:
        yield pb.ConnectControllerRequest(seq=1, hello=hello())
        await asyncio.Event().wait()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.server.port}") as channel:
        call = SchedulerServiceStub(channel).ConnectController(requests())
        welcome = await asyncio.wait_for(call.read(), 10)
        assert welcome is not grpc.aio.EOF and welcome.HasField("welcome")
        submit = jpb.SubmitJobRequest(spec_yaml="run: x\n")
        jobs = job_service_pb2_grpc.JobServiceStub(channel)
        await jobs.SubmitJobs(jpb.SubmitJobsRequest(jobs=[submit] * 20), timeout=10)
        assigned: list[int] = []
        messages = 0
        while len(assigned) < 20:
            response = await asyncio.wait_for(call.read(), 10)
            assert response is not grpc.aio.EOF
            messages += 1
            assigned += [
                m.assignment.job.job_id for m in unbatched(response) if m.HasField("assignment")
            ]
        assert len(set(assigned)) == len(assigned) == 20
        assert messages < 20
        call.cancel()


async def test_written_returns_once_what_was_sent_is_on_the_stream(app: SchedulerApp) -> None:
    """A drain waits for its handback to be written before it floods the event loop by
    stopping every runner: `written` returns once the requests sent so far left (their
    acks come later), and at once while the stream is down (they go on the next)."""

    async def nothing() -> None:
        return None

    link = Link(f"127.0.0.1:{app.server.port}", hello, IGNORED, nothing)
    outbox = link.outbox
    early = outbox.post(pb.ControllerHeartbeat())
    await asyncio.wait_for(outbox.written(), 1)  # not connected: nothing to wait for
    running = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.connected.wait(), 10)
        await asyncio.wait_for(early, 10)  # sent again on the stream, answered
        answers = [outbox.post(pb.ControllerHeartbeat()) for _ in range(3)]
        assert not outbox._queue.empty()
        await asyncio.wait_for(outbox.written(), 10)
        assert outbox._queue.empty()
        acks = [await asyncio.wait_for(answer, 10) for answer in answers]
        assert all(ack.accepted for ack in acks)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
