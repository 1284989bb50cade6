"""Who may hold a replica's stream: the attacks of a stranger posing as a replica.

A real scheduler in this process, behind the edge with a tokens file; raw
ConnectController streams play the replicas. A controller token is bound to one
controller id: a hello under another id is refused, a second live stream under
the same id is refused, and the real replica keeps its jobs; every refusal is
counted in GetSchedulerState.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from harness.identities import Identities, make_identities
from managedjobs.v1 import job_service_pb2 as jpb
from managedjobs.v1 import job_service_pb2_grpc, scheduler_service_pb2_grpc
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.channels import ClientSecurity, open_channel
from services.common.security.auth import Role, add_token
from services.controller.messages import unbatched
from services.scheduler.admission import Limits
from services.scheduler.main import SchedulerApp


class Stream:
    """One replica stream, as a replica would hold it."""

    def __init__(self, channel: grpc.aio.Channel, controller_id: str, capacity: int = 10) -> None:
        self.outbox: asyncio.Queue[pb.ConnectControllerRequest] = asyncio.Queue()
        self.outbox.put_nowait(
            pb.ConnectControllerRequest(
                seq=1,
                hello=pb.ControllerHello(
                    controller_id=controller_id,
                    capacity=pb.Capacity(max_launches=capacity, max_jobs=capacity),
                ),
            )
        )
        stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
        self.call = stub.ConnectController(self._requests())
        self.assigned: list[int] = []
        self.seq = 1

    async def _requests(self) -> AsyncIterator[pb.ConnectControllerRequest]:
        while True:
            yield await self.outbox.get()

    async def welcome(self) -> pb.ControllerWelcome:
        first = await asyncio.wait_for(self.call.read(), 5)
        assert first is not grpc.aio.EOF and first.WhichOneof("message") == "welcome"
        return first.welcome

    async def heartbeat(self) -> None:
        self.seq += 1
        heartbeat = pb.ConnectControllerRequest(seq=self.seq, heartbeat=pb.ControllerHeartbeat())
        self.outbox.put_nowait(heartbeat)

    async def read_assignments(self, count: int) -> None:
        while len(self.assigned) < count:
            response = await asyncio.wait_for(self.call.read(), 5)
            assert response is not grpc.aio.EOF
            for message in unbatched(response):
                if message.WhichOneof("message") == "assignment":
                    self.assigned.append(message.assignment.job.job_id)

    def close(self) -> None:
        self.call.cancel()


@pytest.fixture
def ids(tmp_path: Path) -> Identities:
    made = make_identities(tmp_path / "ids")
    made.tokens["controller-2"] = add_token(
        made.tokens_file, "controller-2", Role.CONTROLLER, "controller-2"
    )
    return made


@pytest.fixture
async def scheduler(ids: Identities, tmp_path: Path) -> AsyncIterator[str]:
    app = SchedulerApp(
        f"sqlite:///{tmp_path / 'scheduler.db'}",
        Limits(),
        security=ids.server("scheduler", tls=False),
        heartbeat_interval=0.5,
    )
    port = await app.start()
    yield f"127.0.0.1:{port}"
    await app.close()


def channel_of(address: str, ids: Identities, caller: str) -> grpc.aio.Channel:
    return open_channel(address, ClientSecurity.of(ids.tokens[caller], None))


async def refused(stream: Stream) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.welcome()
    return caught.value.code()


async def state(address: str, ids: Identities) -> pb.GetSchedulerStateResponse:
    async with channel_of(address, ids, "admin") as channel:
        stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
        return await stub.GetSchedulerState(pb.GetSchedulerStateRequest())


async def test_a_controller_token_cannot_say_hello_as_another_replica(
    scheduler: str, ids: Identities
) -> None:
    async with channel_of(scheduler, ids, "controller") as channel:
        # Bound to controller-1: a new id, or another replica's id, is refused.
        for other in ("evil-9", "controller-2"):
            assert await refused(Stream(channel, other, capacity=10_000)) == (
                grpc.StatusCode.PERMISSION_DENIED
            )
    async with channel_of(scheduler, ids, "user") as channel:
        assert await refused(Stream(channel, "controller-1")) == grpc.StatusCode.PERMISSION_DENIED
    replicas = await state(scheduler, ids)
    assert replicas.refused_hellos == 2 and list(replicas.replicas) == []


async def test_an_impostor_racing_the_real_replica_gets_nothing(
    scheduler: str, ids: Identities
) -> None:
    async with (
        channel_of(scheduler, ids, "controller") as real_channel,
        channel_of(scheduler, ids, "controller-2") as other_channel,
        channel_of(scheduler, ids, "user") as user_channel,
    ):
        real = Stream(real_channel, "controller-1")
        await real.welcome()
        jobs = job_service_pb2_grpc.JobServiceStub(user_channel)
        ids_submitted = [
            (await jobs.SubmitJob(jpb.SubmitJobRequest(spec_yaml="run: x\n"))).job_id
            for _ in range(3)
        ]
        await real.read_assignments(3)
        # Another replica's token speaking for controller-1: refused.
        assert await refused(Stream(other_channel, "controller-1")) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        # The real token again (leaked), while the real stream is alive: refused too.
        await real.heartbeat()
        assert await refused(Stream(real_channel, "controller-1")) == (
            grpc.StatusCode.ALREADY_EXISTS
        )
        await real.heartbeat()
        replicas = await state(scheduler, ids)
        [only] = replicas.replicas
        assert (only.controller_id, only.connected, only.alive) == ("controller-1", True, 3)
        assert replicas.refused_hellos == 2
        assert sorted(real.assigned) == sorted(ids_submitted)
        real.close()
