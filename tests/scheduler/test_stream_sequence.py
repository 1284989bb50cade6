"""Sequence numbers on a replica's stream (contract §11; `services/common/sequence.py`).

Against a real scheduler (SQLite and PostgreSQL), with raw streams playing the
replica: the scheduler numbers its messages from the welcome; a request out of
sequence ends the stream and is not applied; a report sent again after it was
applied (its answer lost when the scheduler stopped) is acknowledged as a replay
and applied once, as the new scheduler knows from the database.

Against a scheduler the test scripts (a real gRPC server whose messages the test
writes), the replica's `Link`: a message received twice is handed on once, one
past the next makes it reconnect for a fresh stream, and requests sent again keep
their numbers, before the new ones; its first heartbeat goes at once, and the
lease counts from its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from sqlalchemy import select

from harness.replica_stream import IGNORED, Fuzzer, Replica, hello
from harness.waiting import reached, wait_for
from managedjobs.v1 import job_service_pb2 as jpb
from managedjobs.v1 import job_service_pb2_grpc, scheduler_service_pb2_grpc
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.security.edge import ServerSecurity
from services.common.sequence import InOrder, OutOfSequence
from services.common.statuses import JobStatus
from services.controller.link import Link
from services.scheduler.admission import Limits
from services.scheduler.db.models import EventRow
from services.scheduler.main import SchedulerApp


@contextlib.asynccontextmanager
async def scheduler(database_url: str) -> AsyncIterator[SchedulerApp]:
    app = SchedulerApp(database_url, Limits(), security=ServerSecurity.without_auth())
    await app.start()
    try:
        yield app
    finally:
        await app.close()


def test_in_order_takes_the_next_passes_replays_and_refuses_gaps() -> None:
    from_the_scheduler = InOrder()
    taken = [from_the_scheduler.check(seq) for seq in (1, 2, 2, 1, 3)]
    assert taken == [True, True, False, False, True]
    with pytest.raises(OutOfSequence, match="expected 4, got 5"):
        from_the_scheduler.check(5)
    # A replica's stream after a hello numbered 10: what is sent again (below 10,
    # increasing, holes allowed), then 11, 12, ...
    from_a_replica = InOrder(resent_below=10)
    assert [from_a_replica.check(seq) for seq in (4, 7, 11, 12)] == [True] * 4
    assert not from_a_replica.check(7)  # a resend after the new ones: out of order
    with pytest.raises(OutOfSequence, match="expected 13, got 14"):
        from_a_replica.check(14)


async def test_the_schedulers_messages_are_numbered_from_the_welcome(database_url: str) -> None:
    async with (
        scheduler(database_url) as app,
        grpc.aio.insecure_channel(f"127.0.0.1:{app.server.port}") as channel,
    ):
        replica = Replica(channel)
        await replica.start(hello())
        await Fuzzer(replica, job_service_pb2_grpc.JobServiceStub(channel)).hold_a_job()
        await replica.report(pb.ConnectControllerRequest(heartbeat=pb.ControllerHeartbeat()))
        replica.close()
    kinds = [m.WhichOneof("message") for m in replica.received]
    assert kinds[0] == "welcome" and "assignment" in kinds and "ack" in kinds
    assert [m.seq for m in replica.received] == list(range(1, len(replica.received) + 1))


@pytest.mark.parametrize("skew", [1, -1], ids=["a gap", "a repeat"])
async def test_a_request_out_of_sequence_ends_the_stream_and_is_not_applied(
    database_url: str, skew: int
) -> None:
    async with (
        scheduler(database_url) as app,
        grpc.aio.insecure_channel(f"127.0.0.1:{app.server.port}") as channel,
    ):
        replica = Replica(channel)
        await replica.start(hello())
        jobs = job_service_pb2_grpc.JobServiceStub(channel)
        held = await Fuzzer(replica, jobs).hold_a_job()
        before = (await jobs.GetJob(jpb.GetJobRequest(job_id=held.job_id))).job
        release = pb.LaunchSlotRelease(job_id=held.job_id, epoch=held.epoch)
        replica.seq += skew  # the next request skips a number, or repeats the last one
        replica.outbox.put_nowait(
            pb.ConnectControllerRequest(seq=replica._next(), launch_slot_release=release)
        )
        assert replica.reader is not None
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await reached(replica.reader, what="the stream to end")
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "seq: expected" in (ended.value.details() or "")
        after = (await jobs.GetJob(jpb.GetJobRequest(job_id=held.job_id))).job
        assert after == before
        # The scheduler ended the stream: the lease stays for the replica to reconnect to.
        assert app.leases.expired == []


async def test_a_report_applied_before_its_answer_was_lost_is_a_replay_applied_once(
    database_url: str,
) -> None:
    """The scheduler stops after committing a report and before its answer left; the
    replica sends the report again, with its number, to the next scheduler."""
    async with (
        scheduler(database_url) as first,
        grpc.aio.insecure_channel(f"127.0.0.1:{first.server.port}") as channel,
    ):
        replica = Replica(channel)
        await replica.start(hello())
        held = await Fuzzer(replica, job_service_pb2_grpc.JobServiceStub(channel)).hold_a_job()
        starting = pb.TaskTransition(
            job_id=held.job_id, epoch=held.epoch, status=JobStatus.STARTING, message="up"
        )
        report = pb.ConnectControllerRequest(transition=starting)
        assert (await replica.report(report)).accepted
        await first.close()  # before the replica's side: its jobs stay assigned
    async with (
        scheduler(database_url) as second,
        grpc.aio.insecure_channel(f"127.0.0.1:{second.server.port}") as channel,
    ):
        again = Replica(channel)
        again.seq = report.seq + 5  # the replica's numbers go on
        holding = [pb.HeldJob(job_id=held.job_id, epoch=held.epoch)]
        await again.start(hello(held_jobs=holding))
        resent = pb.ConnectControllerRequest()
        resent.CopyFrom(report)
        answer = asyncio.get_running_loop().create_future()
        again.acks[resent.seq] = answer
        again.outbox.put_nowait(resent)
        ack = await reached(answer, what="the replay's answer")
        assert (ack.accepted, ack.replay, ack.ack_seq) == (True, True, report.seq)
        # A new report is applied as usual.
        running = pb.TaskTransition(
            job_id=held.job_id, epoch=held.epoch, status=JobStatus.RUNNING, attempt=1
        )
        fresh = await again.report(pb.ConnectControllerRequest(transition=running))
        assert fresh.accepted and not fresh.replay
        query = select(EventRow.message).where(EventRow.job_id == held.job_id)
        messages = await second.store.read(lambda conn: conn.execute(query).scalars().all())
        assert messages.count("up") == 1
        state = await scheduler_service_pb2_grpc.SchedulerServiceStub(channel).GetSchedulerState(
            pb.GetSchedulerStateRequest()
        )
        assert state.replayed_reports == 1
        again.close()


# --- the replica's side -----------------------------------------------------------------------

Script = list[pb.ConnectControllerResponse | asyncio.Event | None]


class Scripted(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    """A scheduler whose messages the test writes. Each stream, once its hello came, sends
    its script's messages in order (an event: waits for it; None: ends the stream) and then
    stays open; what each stream carried is kept, batches unpacked."""

    def __init__(self, *scripts: Script) -> None:
        self.scripts = list(scripts)
        self.streams: list[list[pb.ConnectControllerRequest]] = []

    async def ConnectController(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[pb.ConnectControllerRequest],
        context: grpc.aio.ServicerContext[object, object],
    ) -> AsyncIterator[pb.ConnectControllerResponse]:
        received: list[pb.ConnectControllerRequest] = []
        self.streams.append(received)
        script = self.scripts.pop(0) if self.scripts else []
        hello = asyncio.Event()

        async def read() -> None:
            async for envelope in request_iterator:
                batch = envelope.batch.requests if envelope.HasField("batch") else [envelope]
                received.extend(batch)
                hello.set()

        reader = asyncio.create_task(read())
        try:
            await hello.wait()
            for step in script:
                if step is None:
                    return
                if isinstance(step, asyncio.Event):
                    await step.wait()
                else:
                    yield step
            await reader
        finally:
            reader.cancel()


def welcome() -> pb.ConnectControllerResponse:
    # Heartbeats an hour apart: the first one only (it goes at once).
    return pb.ConnectControllerResponse(
        seq=1,
        welcome=pb.ControllerWelcome(lease_ttl_seconds=3600, heartbeat_interval_seconds=3600),
    )


def cancel(seq: int, job_id: int) -> pb.ConnectControllerResponse:
    return pb.ConnectControllerResponse(seq=seq, cancel=pb.JobCancel(job_id=job_id, epoch=1))


@contextlib.asynccontextmanager
async def linked(
    scripted: Scripted,
) -> AsyncIterator[tuple[Link, list[pb.JobCancel]]]:
    """A replica's link to the scripted scheduler, and the cancels it handed on."""
    server = grpc.aio.server()
    scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server(scripted, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    handed: list[pb.JobCancel] = []

    async def nothing() -> None:
        return None

    instructions = dataclasses.replace(IGNORED, cancel=handed.append)
    link = Link(f"127.0.0.1:{port}", hello, instructions, nothing, reconnect_max_wait=0.2)
    running = asyncio.create_task(link.run())
    try:
        yield link, handed
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await server.stop(0)


async def test_the_link_drops_a_replay_and_reconnects_past_a_missing_message() -> None:
    scripted = Scripted(
        [welcome(), cancel(2, 7), cancel(2, 7), cancel(4, 8)],  # 3 never comes
        [welcome(), cancel(2, 9)],
    )
    async with linked(scripted) as (_, handed):
        await wait_for_value(lambda: len(handed) >= 2, "the second stream's cancel")
        assert [c.job_id for c in handed] == [7, 9]
        assert len(scripted.streams) == 2


async def test_requests_sent_again_keep_their_numbers_and_come_before_new_ones() -> None:
    end_first = asyncio.Event()
    scripted = Scripted([welcome(), end_first, None], [welcome()])
    async with linked(scripted) as (link, _):
        await reached(link.connected.wait(), what="the first stream")
        unanswered = link.outbox.post(pb.LaunchSlotRelease(job_id=3, epoch=1))
        await wait_for_value(
            lambda: any(r.HasField("launch_slot_release") for r in scripted.streams[0]),
            "the release on the first stream",
        )
        end_first.set()
        await wait_for_value(lambda: len(scripted.streams) == 2, "the second stream")
        later = link.outbox.post(pb.LaunchSlotRelease(job_id=4, epoch=1))
        await wait_for_value(
            lambda: sum(r.HasField("launch_slot_release") for r in scripted.streams[1]) == 2,
            "both releases on the second stream",
        )
        first, second = scripted.streams
        numbers = {
            r.launch_slot_release.job_id: r.seq for r in second if r.HasField("launch_slot_release")
        }
        [sent_first] = [r.seq for r in first if r.HasField("launch_slot_release")]
        hello_seq = second[0].seq
        assert second[0].HasField("hello") and numbers[3] == sent_first < hello_seq < numbers[4]
        order = InOrder(resent_below=hello_seq)
        assert all(order.check(r.seq) for r in second[1:])
        unanswered.cancel()
        later.cancel()


async def test_the_first_heartbeat_goes_at_once_and_the_lease_counts_from_its_answer(
    app: SchedulerApp,
) -> None:
    """The replica's sleep between heartbeats never ends: only the first, sent as the
    stream is welcomed, can make the lease count."""

    async def never(_: float) -> None:
        await asyncio.Event().wait()

    async def nothing() -> None:
        return None

    link = Link(f"127.0.0.1:{app.server.port}", hello, IGNORED, nothing, sleep=never)
    running = asyncio.create_task(link.run())
    try:
        await reached(link.connected.wait(), what="the stream")
        assert await reached(link.lease.wait(), what="the lease")
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def wait_for_value(probe: Callable[[], bool], what: str) -> None:
    async def check() -> bool:
        return probe()

    await wait_for(check, what=what)
