"""The logs service over real gRPC, for its tests: a small in-memory JobService plays the
scheduler and an in-memory backend plays the clusters, so each test scripts exactly when
logs appear, clusters vanish and jobs change.

`running_system` runs without authentication unless given the tokens of
`identities.make_identities`, in which case the logs service checks tokens and
replicas' holds on jobs as in production (its scheduler client sends the service's
token; the fake scheduler answers anyone).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from harness.identities import Identities
from managedjobs.v1 import (
    job_pb2,
    job_service_pb2,
    job_service_pb2_grpc,
    log_service_pb2,
    log_service_pb2_grpc,
)
from services.backends.base import (
    Backend,
    BackendError,
    ClusterHandle,
    ClusterStatus,
    LaunchPlan,
    Observation,
    TaskStatus,
)
from services.common.channels import ClientSecurity, open_channel
from services.common.security.edge import ServerSecurity
from services.common.server import Server
from services.logs import JobDirectory, LogServicer, LogStore
from services.logs.holders import Holders

DEADLINE = 5.0
PENDING = job_pb2.JOB_STATUS_PENDING
RUNNING = job_pb2.JOB_STATUS_RUNNING
RECOVERING = job_pb2.JOB_STATUS_RECOVERING
SUCCEEDED = job_pb2.JOB_STATUS_SUCCEEDED
ALIVE = job_pb2.SCHEDULE_STATE_ALIVE
DONE = job_pb2.SCHEDULE_STATE_DONE


class FakeJobService(job_service_pb2_grpc.JobServiceServicer):
    """GetJob, ListJobs by ids and WatchJobs over an in-memory dict; tests change jobs
    with `update`."""

    def __init__(self) -> None:
        self.jobs: dict[int, job_pb2.Job] = {}
        # GetJob and ListJobs calls answered, to see what the logs service's cache saves;
        # `answered` is set by the next one.
        self.get_calls = 0
        self.list_calls = 0
        self.answered = asyncio.Event()
        self.events: list[job_pb2.JobEvent] = []
        self._subscribers: set[asyncio.Queue[job_pb2.JobEvent]] = set()

    def add(
        self, job_id: int, tasks: int = 1, controller_id: str = "", epoch: int = 0
    ) -> job_pb2.Job:
        job = job_pb2.Job(
            job_id=job_id,
            schedule_state=ALIVE,
            status=PENDING,
            controller_id=controller_id,
            epoch=epoch,
        )
        for task_id in range(tasks):
            job.tasks.add(task_id=task_id, status=PENDING)
        self.jobs[job_id] = job
        return job

    def update(
        self,
        job_id: int,
        task_id: int = 0,
        *,
        status: job_pb2.JobStatus.ValueType | None = None,
        cluster_name: str | None = None,
        recovery_count: int | None = None,
        restart_count: int | None = None,
        schedule_state: job_pb2.ScheduleState.ValueType | None = None,
    ) -> None:
        job = self.jobs[job_id]
        task = job.tasks[task_id]
        if status is not None:
            task.status = status
            job.status = status
            job.current_task_id = task_id
        if cluster_name is not None:
            task.cluster_name = cluster_name
        if recovery_count is not None:
            task.recovery_count = recovery_count
        if restart_count is not None:
            task.restart_count = restart_count
        if schedule_state is not None:
            job.schedule_state = schedule_state
        event = job_pb2.JobEvent(
            event_id=len(self.events) + 1,
            job_id=job_id,
            task_id=task_id,
            status=task.status,
            schedule_state=job.schedule_state,
        )
        self.events.append(event)
        for queue in self._subscribers:
            queue.put_nowait(event)

    async def GetJob(
        self, request: job_service_pb2.GetJobRequest, context: Any
    ) -> job_service_pb2.GetJobResponse:
        self.get_calls += 1
        self.answered.set()
        self.answered = asyncio.Event()
        job = self.jobs.get(request.job_id)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such job")
        return job_service_pb2.GetJobResponse(job=job)

    async def SubmitJob(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this fake")

    @property
    def questions(self) -> int:
        """GetJob and ListJobs calls answered."""
        return self.get_calls + self.list_calls

    async def ListJobs(
        self, request: job_service_pb2.ListJobsRequest, context: Any
    ) -> job_service_pb2.ListJobsResponse:
        if not request.job_ids:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "only by job ids in this fake")
        self.list_calls += 1
        self.answered.set()
        self.answered = asyncio.Event()
        found = [self.jobs[i] for i in sorted(set(request.job_ids), reverse=True) if i in self.jobs]
        return job_service_pb2.ListJobsResponse(jobs=found)

    async def CancelJobs(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this fake")

    async def WatchJobs(
        self, request: job_service_pb2.WatchJobsRequest, context: Any
    ) -> AsyncIterator[job_service_pb2.WatchJobsResponse]:
        queue: asyncio.Queue[job_pb2.JobEvent] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            wanted = set(request.job_ids)
            after = request.after_event_id
            for event in [*self.events]:
                if event.event_id > after and (not wanted or event.job_id in wanted):
                    after = event.event_id
                    yield job_service_pb2.WatchJobsResponse(event=event)
            while True:
                event = await queue.get()
                if event.event_id > after and (not wanted or event.job_id in wanted):
                    yield job_service_pb2.WatchJobsResponse(event=event)
        finally:
            self._subscribers.discard(queue)


class MemoryBackend(Backend):
    """Clusters as byte strings in memory; tests write logs, finish and break clusters."""

    name = "memory"

    def __init__(self) -> None:
        self.logs: dict[str, bytearray] = {}
        self.finished: set[str] = set()
        self.gone: set[str] = set()
        self.broken: set[str] = set()
        # Bumped by each relaunch under a name: tails of an earlier cluster end.
        self.generation: dict[str, int] = {}
        self._changed = asyncio.Event()

    def _touch(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def write(self, cluster: str, data: bytes) -> None:
        self.logs.setdefault(cluster, bytearray()).extend(data)
        self._touch()

    def finish(self, cluster: str) -> None:
        self.finished.add(cluster)
        self._touch()

    def vanish(self, cluster: str) -> None:
        """The cluster is preempted: live reads and tails fail from now on."""
        self.gone.add(cluster)
        self._touch()

    def relaunch(self, cluster: str) -> None:
        """A new cluster under the same name (the task's next attempt), with an empty log."""
        self.logs[cluster] = bytearray()
        self.finished.discard(cluster)
        self.gone.discard(cluster)
        self.broken.discard(cluster)
        self.generation[cluster] = self.generation.get(cluster, 0) + 1
        self._touch()

    def break_tails(self, cluster: str) -> None:
        """Live tails of the cluster fail (e.g. a network blip); reads still work."""
        self.broken.add(cluster)
        self._touch()

    def handle_for(self, cluster_name: str) -> ClusterHandle:
        return ClusterHandle(cluster_name, backend=self.name)

    async def read_logs(self, handle: ClusterHandle) -> bytes:
        if handle.cluster_name in self.gone:
            raise BackendError(f"cluster {handle.cluster_name} is gone")
        return bytes(self.logs.get(handle.cluster_name, b""))

    async def tail_logs(self, handle: ClusterHandle) -> AsyncIterator[bytes]:
        name = handle.cluster_name
        generation = self.generation.get(name, 0)
        sent = 0
        while True:
            changed = self._changed
            if (
                name in self.gone
                or name in self.broken
                or self.generation.get(name, 0) != generation
            ):
                raise BackendError(f"cluster {name} is gone")
            data = bytes(self.logs.get(name, b""))
            if len(data) > sent:
                yield data[sent:]
                sent = len(data)
            elif name in self.finished:
                return
            else:
                await changed.wait()

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        return self.handle_for(plan.cluster_name)

    async def observe(self, handle: ClusterHandle) -> Observation:
        if handle.cluster_name in self.gone:
            return Observation(ClusterStatus.DOWN)
        finished = handle.cluster_name in self.finished
        return Observation(
            ClusterStatus.UP, TaskStatus.SUCCEEDED if finished else TaskStatus.RUNNING
        )

    async def notify_preemption(self, handle: ClusterHandle, epoch: int, deadline: float) -> None:
        raise AssertionError("no preemption notices in these tests")

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        self.gone.add(handle.cluster_name)
        return True

    async def cluster_exists(self, cluster_name: str) -> bool:
        return cluster_name in self.logs and cluster_name not in self.gone

    async def reachable(self) -> bool:
        return True


@dataclasses.dataclass
class System:
    scheduler: FakeJobService
    backend: Any
    store: LogStore
    stub: log_service_pb2_grpc.LogServiceAsyncStub
    data_dir: Path
    servicer: LogServicer
    scheduler_server: Server

    async def fetch(
        self, job_id: int, task_id: int, attempt: int = 1, handle: ClusterHandle | None = None
    ) -> int:
        """What a replica does before a teardown: copy the attempt's logs off its cluster."""
        cluster = f"mj-{job_id}-{task_id}"
        handle_json = (handle or self.backend.handle_for(cluster)).to_json()
        request = log_service_pb2.FetchTaskLogsRequest(
            job_id=job_id, task_id=task_id, handle_json=handle_json, attempt=attempt
        )
        return (await self.stub.FetchTaskLogs(request)).bytes_stored

    async def append(self, job_id: int, *lines: str) -> None:
        request = log_service_pb2.AppendControllerLogsRequest(
            lines=[log_service_pb2.ControllerLogLine(job_id=job_id, line=line) for line in lines]
        )
        await self.stub.AppendControllerLogs(request)

    async def read(self, **fields: Any) -> bytes:
        responses = self.stub.ReadLogs(log_service_pb2.ReadLogsRequest(**fields))
        async with asyncio.timeout(DEADLINE):
            return b"".join([response.data async for response in responses])


class Follow:
    """A ReadLogs stream read step by step, each step under a deadline."""

    def __init__(self, system: System, **fields: Any) -> None:
        self.call = system.stub.ReadLogs(log_service_pb2.ReadLogsRequest(follow=True, **fields))
        self.data = bytearray()
        self.task_ids: list[int] = []
        self.ended = False

    async def _next(self) -> bool:
        response = await self.call.read()
        if response is grpc.aio.EOF:
            self.ended = True
            return False
        assert isinstance(response, log_service_pb2.ReadLogsResponse)
        self.data += response.data
        self.task_ids.append(response.task_id)
        return True

    async def until(self, expected: bytes) -> None:
        async with asyncio.timeout(DEADLINE):
            while not self.data.endswith(expected):
                assert await self._next(), f"stream ended with {bytes(self.data)!r}"

    async def to_end(self) -> bytes:
        async with asyncio.timeout(DEADLINE):
            while await self._next():
                pass
        return bytes(self.data)


@contextlib.asynccontextmanager
async def running_system(
    data_dir: Path,
    backend: Backend,
    ids: Identities | None = None,
    caller: str = "controller",
    clock: Callable[[], float] | None = None,
) -> AsyncIterator[System]:
    """A fake scheduler and a real logs service, both on port 0.

    With `ids` the logs service authenticates, and the stub calls it as `caller`;
    `clock` drives the cache of replicas' holds on jobs (which then lasts 5 seconds).
    """
    scheduler = FakeJobService()
    scheduler_server = Server("127.0.0.1", 0, security=ServerSecurity.without_auth())
    scheduler_server.add(
        job_service_pb2_grpc.add_JobServiceServicer_to_server,
        scheduler,
        "managedjobs.v1.JobService",
    )
    scheduler_port = await scheduler_server.start()
    service_token = ids.client("service", False) if ids else ClientSecurity()
    directory = JobDirectory(f"127.0.0.1:{scheduler_port}", service_token)
    store = LogStore(data_dir / "logs")
    holders = Holders(directory, ttl=5.0, clock=clock) if clock else None
    servicer = LogServicer(store, directory, backend, holders=holders)
    security = ids.server("logs", False) if ids else ServerSecurity.without_auth()
    logs_server = Server("127.0.0.1", 0, security=security)
    logs_server.add(
        log_service_pb2_grpc.add_LogServiceServicer_to_server,
        servicer,
        "managedjobs.v1.LogService",
    )
    logs_port = await logs_server.start()
    channel = open_channel(
        f"127.0.0.1:{logs_port}", ids.client(caller, False) if ids else ClientSecurity()
    )
    try:
        stub = log_service_pb2_grpc.LogServiceStub(channel)
        system = System(scheduler, backend, store, stub, data_dir, servicer, scheduler_server)
        yield system
    finally:
        await channel.close()
        await logs_server.stop(0)
        await system.scheduler_server.stop(0)
        await directory.close()
        store.close()
