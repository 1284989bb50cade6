"""The running system the fuzzer calls, and what it checks around each call.

`fuzzing_system` starts the four servers of `inprocess` with job 1 alice's; a
`Fuzzer` sends each `fuzzing.Attempt` on a channel of its caller (`Channels`) and
lists what the answer breaks (`fuzzing.problems`), plus, for a method that writes,
any change a refused call made to what it would write (`guards`). After each
operator call it ends the faults it may have injected, so the cloud API stays
reachable for the calls that follow. The fuzz test and `bench/fuzz.py` share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.fuzzing import Attempt, Outcome, call, problems
from harness.identities import Identities
from harness.inprocess import System, running_system
from harness.rpcs import JOB_SPEC
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as spb_grpc
from managedjobs.v1 import job_service_pb2, job_service_pb2_grpc
from services.common.channels import open_channel, open_sync_channel
from services.common.security.access import service_of


class Channels:
    """One open channel per (server, caller), for the whole run."""

    def __init__(self, system: System, ids: Identities) -> None:
        self.system = system
        self.ids = ids
        self._stack = contextlib.AsyncExitStack()
        self._open: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._sync: dict[tuple[str, str], grpc.Channel] = {}

    async def get(self, method: str, caller: str) -> grpc.aio.Channel:
        address = self.system.address(service_of(method))
        key = (address, caller)
        if key not in self._open:
            channel = open_channel(address, self.ids.client(caller, False))
            self._open[key] = await self._stack.enter_async_context(channel)
        return self._open[key]

    def blocking(self, method: str, caller: str) -> grpc.Channel:
        """A blocking channel, for client streams (see `fuzzing.call`)."""
        key = (self.system.address(service_of(method)), caller)
        if key not in self._sync:
            self._sync[key] = open_sync_channel(key[0], self.ids.client(caller, False))
        return self._sync[key]

    async def close(self) -> None:
        for channel in self._sync.values():
            channel.close()
        await self._stack.aclose()


# --- what a refused request must leave alone --------------------------------------------------

Snapshot = Callable[[Channels], Awaitable[Any]]


async def jobs(channels: Channels) -> dict[int, tuple[bool, int]]:
    """Every job, with its cancel flag and status."""
    channel = await channels.get("/managedjobs.v1.JobService/ListJobs", "admin")
    reply = await job_service_pb2_grpc.JobServiceStub(channel).ListJobs(
        job_service_pb2.ListJobsRequest(page_size=1000), timeout=10
    )
    return {job.job_id: (job.cancel_requested, job.status) for job in reply.jobs}


async def cloud(channels: Channels) -> tuple[int, list[tuple[Any, ...]]]:
    """The cloud's inventory size and each region's settings (not its usage)."""
    channel = await channels.get(
        "/managedjobs.simcloud.v1.SimOperatorService/GetCloudState", "admin"
    )
    state = await spb_grpc.SimOperatorServiceStub(channel).GetCloudState(
        spb.GetCloudStateRequest(), timeout=10
    )
    regions = [
        (r.name, r.spot_capacity, r.on_demand_capacity, r.launch_latency_seconds,
         r.preemptions_per_hour, r.failing_launches, r.notice_seconds)
        for r in state.regions
    ]  # fmt: skip
    return state.launched_total, regions


def files(folder: Path) -> Snapshot:
    """The files under `folder` and their sizes."""

    def read() -> dict[str, int]:
        return {str(p): p.stat().st_size for p in folder.rglob("*") if p.is_file()}

    async def sizes(channels: Channels) -> dict[str, int]:
        return await asyncio.to_thread(read)

    return sizes


def guards(folder: Path) -> dict[str, Snapshot]:
    """For each method that writes: what it writes, read the same way before and after."""
    job_service = "/managedjobs.v1.JobService/"
    sim_cloud = "/managedjobs.simcloud.v1.SimCloudService/"
    operator = "/managedjobs.simcloud.v1.SimOperatorService/"
    logs = files(folder / "logs")
    return {
        job_service + "SubmitJob": jobs,
        job_service + "SubmitJobs": jobs,
        job_service + "CancelJobs": jobs,
        sim_cloud + "Launch": cloud,
        sim_cloud + "LaunchClusters": cloud,
        operator + "SetCapacity": cloud,
        operator + "InjectFaults": cloud,
        "/managedjobs.v1.LogService/FetchTaskLogs": logs,
        "/managedjobs.v1.LogService/AppendControllerLogs": logs,
    }


@dataclasses.dataclass
class Fuzzer:
    system: System
    channels: Channels
    guards: dict[str, Snapshot]
    outcomes: dict[str, list[Outcome]] = dataclasses.field(default_factory=dict)

    async def check(self, attempt: Attempt) -> list[str]:
        guard = self.guards.get(attempt.method)
        before = await guard(self.channels) if guard else None
        channel = await self.channels.get(attempt.method, attempt.caller)
        outcome = await call(
            channel, attempt, self.channels.blocking(attempt.method, attempt.caller)
        )
        self.outcomes.setdefault(attempt.method, []).append(outcome)
        found = problems(attempt, outcome)
        if guard and not outcome.ok and await guard(self.channels) != before:
            found.append(f"refused with {outcome.code.name}, yet it changed what it would write")
        if service_of(attempt.method).endswith("SimOperatorService"):
            await self.reset_cloud()
        return found

    async def reset_cloud(self) -> None:
        """Undoes an operator's chaos (an outage, failing launches), so the cloud API stays
        reachable for the examples that follow."""
        channel = await self.channels.get(
            "/managedjobs.simcloud.v1.SimOperatorService/ResetFaults", "admin"
        )
        stub = spb_grpc.SimOperatorServiceStub(channel)
        await stub.ResetFaults(spb.ResetFaultsRequest(), timeout=10)


@contextlib.asynccontextmanager
async def fuzzing_system(ids: Identities, folder: Path, database_url: str) -> AsyncIterator[Fuzzer]:
    """The four servers, with job 1 alice's (so requests naming it reach past "not found")."""
    async with running_system(ids, False, folder, database_url) as system:
        channels = Channels(system, ids)
        try:
            channel = await channels.get("/managedjobs.v1.JobService/SubmitJob", "user")
            await job_service_pb2_grpc.JobServiceStub(channel).SubmitJob(
                job_service_pb2.SubmitJobRequest(spec_yaml=JOB_SPEC), timeout=10
            )
            yield Fuzzer(system, channels, guards(folder))
        finally:
            await channels.close()


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    return int(reply.status)
