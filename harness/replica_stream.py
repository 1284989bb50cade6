"""A raw replica stream against a real scheduler: a replica that holds a real job
(a two-task chain) and sends whatever reports it is given (`Fuzzer` draws them
from the proto descriptors). For the replica's own `Link` in tests: its `hello`,
and `IGNORED`, instructions that do nothing (replace the ones a test watches)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import grpc
from hypothesis import strategies as st

from harness.fuzzing import messages
from managedjobs.v1 import job_service_pb2 as jpb
from managedjobs.v1 import job_service_pb2_grpc, scheduler_service_pb2_grpc
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.channels import MAX_MESSAGE_BYTES
from services.common.statuses import TERMINAL, JobStatus, ScheduleState
from services.controller.messages import Instructions, unbatched
from services.scheduler.main import SchedulerApp

CHAIN = "name: fuzzed\n---\nrun: first\n---\nrun: second\n"
REPLICA = "controller-1"
EXAMPLES = 150
BUDGET = 10.0


@dataclasses.dataclass
class Held:
    job_id: int
    epoch: int


class Replica:
    """A raw replica stream: sends what it is given, routes what comes back."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.outbox: asyncio.Queue[pb.ConnectControllerRequest] = asyncio.Queue()
        self.acks: dict[int, asyncio.Future[pb.ReportAck]] = {}
        self.held: Held | None = None
        self.assigned = asyncio.Event()
        # Every message the scheduler sent, in order (a batch's one by one).
        self.received: list[pb.ConnectControllerResponse] = []
        self.seq = 1
        stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
        self.call = stub.ConnectController(self._requests())
        self.reader: asyncio.Task[None] | None = None

    async def _requests(self) -> AsyncIterator[pb.ConnectControllerRequest]:
        while True:
            yield await self.outbox.get()

    async def start(self, hello: pb.ControllerHello) -> pb.ConnectControllerResponse:
        self.outbox.put_nowait(pb.ConnectControllerRequest(seq=self._next(), hello=hello))
        first = await asyncio.wait_for(self.call.read(), 5)
        assert first is not grpc.aio.EOF
        self.received.append(first)
        self.reader = asyncio.create_task(self._read())
        return first

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    async def _read(self) -> None:
        while (response := await self.call.read()) is not grpc.aio.EOF:
            assert isinstance(response, pb.ConnectControllerResponse)
            for message in unbatched(response):
                self.received.append(message)
                kind = message.WhichOneof("message")
                if kind == "assignment":
                    self.held = Held(message.assignment.job.job_id, message.assignment.epoch)
                    self.assigned.set()
                elif kind == "ack" and message.ack.ack_seq in self.acks:
                    self.acks.pop(message.ack.ack_seq).set_result(message.ack)

    async def report(self, request: pb.ConnectControllerRequest) -> pb.ReportAck:
        """Sends one report; returns its ack."""
        request.seq = self._next()
        ack = asyncio.get_running_loop().create_future()
        self.acks[request.seq] = ack
        self.outbox.put_nowait(request)
        return await asyncio.wait_for(ack, 10)

    def close(self) -> None:
        self.call.cancel()


@dataclasses.dataclass(frozen=True)
class Aimed:
    """A report, and whether to aim it at the held job (its id, epoch, a real task and a
    known status, so that the rules past the epoch check are reached)."""

    request: pb.ConnectControllerRequest
    aim: bool
    task_id: int
    status: int

    def at(self, held: Held) -> pb.ConnectControllerRequest:
        request = pb.ConnectControllerRequest()
        request.CopyFrom(self.request)
        kind = request.WhichOneof("message")
        if not self.aim or kind is None:
            return request
        inner = getattr(request, kind)
        fields = inner.DESCRIPTOR.fields_by_name
        if "job_id" in fields:
            inner.job_id, inner.epoch = held.job_id, held.epoch
        if "task_id" in fields:
            inner.task_id = self.task_id
        if "status" in fields and self.status >= 0:
            inner.status = self.status
        if kind == "job_handback":
            inner.jobs.insert(0, pb.HeldJob(job_id=held.job_id, epoch=held.epoch))
        return request


# Every message but `draining`, which would stop the scheduler sending the replica work,
# and `batch`, whose requests are each answered on their own (both have tests of their
# own); task transitions, the richest, half of the time.
ENVELOPES = messages(pb.ConnectControllerRequest.DESCRIPTOR).filter(
    lambda m: m.WhichOneof("message") not in ("draining", "batch")
)
TRANSITIONS = messages(pb.TaskTransition.DESCRIPTOR).map(
    lambda t: pb.ConnectControllerRequest(transition=t)
)
# A request over the stream's message limit never reaches the scheduler (gRPC ends the
# stream RESOURCE_EXHAUSTED before it is read; a replica's link never sends one), so a
# report drawn that large tests gRPC, not the scheduler: it is drawn again.
REPORTS = st.builds(
    Aimed,
    st.one_of(ENVELOPES, TRANSITIONS),
    st.sampled_from([True, True, True, False]),
    st.sampled_from([0, 0, 1, 2, -1]),
    st.sampled_from([-1, *(int(s) for s in JobStatus)]),
).filter(lambda aimed: aimed.request.ByteSize() < MAX_MESSAGE_BYTES - 1024)


@dataclasses.dataclass
class Fuzzer:
    replica: Replica
    jobs: job_service_pb2_grpc.JobServiceStub
    outcomes: list[str] = dataclasses.field(default_factory=list)

    async def job(self, job_id: int) -> jpb.Job:
        return (await self.jobs.GetJob(jpb.GetJobRequest(job_id=job_id), timeout=10)).job

    async def hold_a_job(self) -> Held:
        """The job the replica holds. One whose tasks are over is finished (freeing its
        slot, as a replica would); one handed back is awaited again; a new one is
        submitted once none is left."""
        held = self.replica.held
        if held is not None:
            job = await self.job(held.job_id)
            ours = job.controller_id == REPLICA and job.schedule_state != ScheduleState.DONE
            if ours and job.status not in TERMINAL:
                return held
            if ours:
                done = pb.JobFinished(job_id=held.job_id, epoch=held.epoch)
                await self.replica.report(pb.ConnectControllerRequest(job_finished=done))
            elif job.schedule_state != ScheduleState.DONE:
                # Handed back: it comes back to the only replica with the next epoch.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.replica.assigned.wait(), 2)
                    self.replica.assigned.clear()
                    return await self.hold_a_job()
        self.replica.assigned.clear()
        await self.jobs.SubmitJob(jpb.SubmitJobRequest(spec_yaml=CHAIN), timeout=10)
        await asyncio.wait_for(self.replica.assigned.wait(), 10)
        self.replica.assigned.clear()
        assert self.replica.held is not None
        return self.replica.held

    async def check(self, aimed: Aimed) -> list[str]:
        held = await self.hold_a_job()
        before = await self.job(held.job_id)
        request = aimed.at(held)
        ack = await self.replica.report(request)
        self.outcomes.append(pb.ReportRefusal.Name(ack.refusal))
        if ack.accepted:
            return []
        after = await self.job(held.job_id)
        if after != before:
            return [f"refused ({ack.reason[:200]}), yet job {held.job_id} changed"]
        return []


def _ignore(_: object) -> None:
    return None


IGNORED = Instructions(
    assignment=_ignore, launch_slot_grant=_ignore, cancel=_ignore, revoke=_ignore
)


def hello(**changes: Any) -> pb.ControllerHello:
    message = pb.ControllerHello(
        controller_id=REPLICA,
        address="127.0.0.1:1",
        capacity=pb.Capacity(max_launches=1000, max_jobs=1000),
    )
    for name, value in changes.items():
        if isinstance(value, list):
            getattr(message, name).extend(value)
        elif isinstance(value, pb.Capacity):
            message.capacity.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


@contextlib.asynccontextmanager
async def holding_a_job(app: SchedulerApp) -> AsyncIterator[tuple[Replica, Fuzzer, Held]]:
    """A raw replica stream holding a job (a two-task chain) at its epoch."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.server.port}") as channel:
        replica = Replica(channel)
        await replica.start(hello())
        fuzzer = Fuzzer(replica, job_service_pb2_grpc.JobServiceStub(channel))
        yield replica, fuzzer, await fuzzer.hold_a_job()
        replica.close()
