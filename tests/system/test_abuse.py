"""Abuse and memory (contract §19): bursts of bad requests and abandoned streams leave no trace.

The whole stack runs as real processes (`services.launcher.stack.Stack` on the sim cloud:
the cloud, the scheduler, the logs service and one controller replica), so memory
is each process's RSS as the operating system counts it (psutil), not an estimate
from inside. One round of abuse, against every server at once:

- 1,000 invalid requests of every kind: bytes that do not decode, unknown tokens,
  and fields out of range, 32 in flight at a time;
- 200 streams opened and abandoned: WatchJobs, ReadLogs with follow, and the
  cloud's WatchEvents, a third each; half cancelled by the client, half dropped
  with their connection.

Every answer is the expected refusal. After each round every server is SERVING,
and the scheduler's WatchJobs subscriptions (GetSchedulerState.watch_streams,
which the logs service's followers hold too) fall back to zero: abandoned streams
are cleaned up server-side.

Memory: a first round warms what a server keeps by design (connection buffers,
allocator arenas, caches); the RSS after it is the baseline, and after a second,
identical round each process's RSS must be within 10% of it. A leak of a few KiB
per request or stream shows as far more than that.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.e2e import clean_env
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as spb_grpc
from managedjobs.v1 import job_service_pb2 as jpb
from managedjobs.v1 import (
    job_service_pb2_grpc,
    log_service_pb2,
    log_service_pb2_grpc,
    scheduler_service_pb2,
    scheduler_service_pb2_grpc,
)
from services.common.channels import ClientSecurity, open_channel
from services.launcher.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

INVALID = 1000
STREAMS = 200
IN_FLIGHT = 32
GROWTH = 0.10
# A job that runs for a day on the sim cloud: its logs can be followed all along.
LONG_JOB = "name: abused\nrun: sleep\nsim:\n  runtime_seconds: 86400\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(tmp_path_factory.mktemp("abuse"), replicas=1, simcloud_args=[], env=clean_env())
    running.start()
    try:
        yield running
    finally:
        running.stop()


def rss(stack: Stack) -> dict[str, int]:
    """Each service's resident memory, in bytes."""
    out = {}
    for service in stack.services:
        assert service.process is not None and service.running, service.name
        out[service.name] = psutil.Process(service.process.pid).memory_info().rss
    return out


class Abuser:
    """Channels to every server as the admin, and one with a token no file lists."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.admin = ClientSecurity.of(stack.credentials.admin_token, None)
        self.stranger = ClientSecurity.of("mj_" + "0" * 43, None)

    def channel(self, address: str, stranger: bool = False) -> grpc.aio.Channel:
        return open_channel(address, self.stranger if stranger else self.admin)

    async def submit_long_job(self) -> int:
        async with self.channel(self.stack.scheduler_address) as channel:
            stub = job_service_pb2_grpc.JobServiceStub(channel)
            reply = await stub.SubmitJob(jpb.SubmitJobRequest(spec_yaml=LONG_JOB), timeout=10)
        return reply.job_id

    # --- invalid requests ---------------------------------------------------------------

    def invalid_calls(self) -> list[tuple[str, str, bytes, bool, grpc.StatusCode]]:
        """(address, method, request bytes, as a stranger, the code it must get)."""
        s = self.stack
        bad = grpc.StatusCode.INVALID_ARGUMENT
        unknown = grpc.StatusCode.UNAUTHENTICATED
        undecodable = b"\x0a\xff\xff\xff\xff\x0f"
        return [
            (s.scheduler_address, "/managedjobs.v1.JobService/GetJob", undecodable, False, bad),
            (s.scheduler_address, "/managedjobs.v1.JobService/ListJobs", b"", True, unknown),
            (
                s.scheduler_address,
                "/managedjobs.v1.JobService/SubmitJob",
                jpb.SubmitJobRequest(spec_yaml="run: [", priority=-(2**31)).SerializeToString(),
                False,
                bad,
            ),
            (
                s.scheduler_address,
                "/managedjobs.v1.JobService/CancelJobs",
                jpb.CancelJobsRequest(job_ids=[-1] * 2000).SerializeToString(),
                False,
                bad,
            ),
            (s.logs_address, "/managedjobs.v1.LogService/ReadLogs", undecodable, False, bad),
            (
                s.logs_address,
                "/managedjobs.v1.LogService/ReadLogs",
                log_service_pb2.ReadLogsRequest(job_id=-5).SerializeToString(),
                False,
                bad,
            ),
            (s.logs_address, "/managedjobs.v1.LogService/ReadLogs", b"", True, unknown),
            (
                s.controllers[0].address,
                "/managedjobs.v1.ControllerService/GetControllerState",
                undecodable,
                False,
                bad,
            ),
            (
                s.controllers[0].address,
                "/managedjobs.v1.ControllerService/GetControllerState",
                b"",
                True,
                unknown,
            ),
            (
                s.simcloud_address,
                "/managedjobs.simcloud.v1.SimCloudService/GetCluster",
                spb.GetClusterRequest(cluster_name="../" * 100).SerializeToString(),
                False,
                bad,
            ),
            (
                s.simcloud_address,
                "/managedjobs.simcloud.v1.SimOperatorService/SetCapacity",
                spb.SetCapacityRequest(region="us-east-1", spot_nodes=-1).SerializeToString(),
                False,
                bad,
            ),
            (
                s.simcloud_address,
                "/managedjobs.simcloud.v1.SimCloudService/ListRegions",
                undecodable,
                True,
                unknown,
            ),
        ]

    async def invalid_burst(self, count: int) -> Counter[str]:
        """`count` invalid requests, `IN_FLIGHT` at a time; the codes that came back wrong."""
        calls = self.invalid_calls()
        wrong: Counter[str] = Counter()
        gate = asyncio.Semaphore(IN_FLIGHT)
        channels: dict[tuple[str, bool], grpc.aio.Channel] = {}
        for address, _, _, stranger, _ in calls:
            if (address, stranger) not in channels:
                channels[(address, stranger)] = self.channel(address, stranger)

        async def one(index: int) -> None:
            address, method, data, stranger, want = calls[index % len(calls)]
            channel = channels[(address, stranger)]
            desc_stream = method.endswith("/ReadLogs")
            async with gate:
                try:
                    if desc_stream:
                        stream = channel.unary_stream(method, _same, _same)(data, timeout=10)
                        async for _ in stream:
                            pass
                    else:
                        await channel.unary_unary(method, _same, _same)(data, timeout=10)
                    got = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as error:
                    got = error.code()
            if got != want:
                wrong[f"{method} {got.name} (want {want.name})"] += 1

        try:
            await asyncio.gather(*(one(i) for i in range(count)))
        finally:
            await asyncio.gather(*(c.close() for c in channels.values()))
        return wrong

    # --- abandoned streams --------------------------------------------------------------

    async def abandon_streams(self, count: int, job_id: int) -> int:
        """Opens `count` streams, sees each started, then abandons them all. Returns how
        many WatchJobs subscriptions the scheduler held at the peak."""
        s = self.stack
        opened: list[tuple[grpc.aio.Channel, Any]] = []
        addresses = [s.scheduler_address, s.logs_address, s.simcloud_address]
        shared = [self.channel(address) for address in addresses]
        kinds: list[Callable[[grpc.aio.Channel], Any]] = [
            lambda c: job_service_pb2_grpc.JobServiceStub(c).WatchJobs(jpb.WatchJobsRequest()),
            lambda c: log_service_pb2_grpc.LogServiceStub(c).ReadLogs(
                log_service_pb2.ReadLogsRequest(job_id=job_id, follow=True, controller=True)
            ),
            lambda c: spb_grpc.SimCloudServiceStub(c).WatchEvents(spb.WatchEventsRequest()),
        ]
        for index in range(count):
            kind = index % 3
            # Half share a channel (then are cancelled), half have their own (then dropped).
            own = index % 2 == 1
            channel = self.channel(addresses[kind]) if own else shared[kind]
            call = kinds[kind](channel)
            opened.append((channel if own else None, call))
        # Each stream is live on its server: the cloud's sent its first message (the head),
        # and the scheduler holds a subscription for each WatchJobs and each follower.
        await asyncio.gather(*(asyncio.wait_for(call.read(), 10) for _, call in opened[2::3]))
        peak = await self.until_watch_streams(lambda n: n >= 2 * len(opened[0::3]))
        for own_channel, call in opened:
            if own_channel is None:
                call.cancel()
            else:
                await own_channel.close(grace=None)
        await asyncio.gather(*(c.close() for c in shared))
        return peak

    async def watch_streams(self) -> int:
        async with self.channel(self.stack.scheduler_address) as channel:
            state = await scheduler_service_pb2_grpc.SchedulerServiceStub(
                channel
            ).GetSchedulerState(scheduler_service_pb2.GetSchedulerStateRequest(), timeout=10)
        return state.watch_streams

    async def until_watch_streams(self, done: Callable[[int], bool], limit: float = 20.0) -> int:
        """Waits (at most `limit` seconds) for the scheduler's subscription count to satisfy
        `done`; returns the last count seen."""
        count = await self.watch_streams()
        for _ in range(int(limit / 0.1)):
            if done(count):
                break
            await asyncio.sleep(0.1)
            count = await self.watch_streams()
        return count

    async def all_serving(self) -> dict[str, int]:
        statuses = {}
        for service in self.stack.services:
            async with grpc.aio.insecure_channel(service.address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            statuses[service.name] = int(reply.status)
        return statuses


def _same(data: bytes) -> bytes:
    return data


async def round_of_abuse(abuser: Abuser, job_id: int) -> None:
    wrong = await abuser.invalid_burst(INVALID)
    assert wrong == Counter()
    peak = await abuser.abandon_streams(STREAMS, job_id)
    # A third are WatchJobs, a third ReadLogs followers (each watching its job).
    assert peak >= 2 * (STREAMS // 3)
    assert await abuser.until_watch_streams(lambda n: n == 0) == 0
    serving = await abuser.all_serving()
    assert set(serving.values()) == {health_pb2.HealthCheckResponse.SERVING}, serving


async def test_bursts_of_bad_requests_and_abandoned_streams_leak_nothing(stack: Stack) -> None:
    abuser = Abuser(stack)
    job_id = await abuser.submit_long_job()
    await round_of_abuse(abuser, job_id)
    baseline = rss(stack)
    await round_of_abuse(abuser, job_id)
    after = rss(stack)
    grown = {name: after[name] / baseline[name] - 1 for name in baseline}
    assert all(growth <= GROWTH for growth in grown.values()), {
        name: f"{baseline[name] >> 20} MiB -> {after[name] >> 20} MiB ({grown[name]:+.1%})"
        for name in baseline
    }
