"""The logs service over real gRPC: a small in-memory JobService plays the scheduler
and an in-memory backend plays the clusters, so each test scripts exactly when
logs appear, clusters vanish and jobs change."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from local_clusters import open_folder

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
    Observation,
    TaskRequest,
    TaskStatus,
)
from services.backends.local import LocalBackend
from services.common.channels import ClientSecurity
from services.common.edge import ServerSecurity
from services.common.server import Server
from services.logs import RECOVERED_MARKER, JobDirectory, LogServicer, LogStore
from services.logs.main import SETTINGS
from services.logs.store import CHUNK_BYTES

DEADLINE = 5.0
PENDING = job_pb2.JOB_STATUS_PENDING
RUNNING = job_pb2.JOB_STATUS_RUNNING
RECOVERING = job_pb2.JOB_STATUS_RECOVERING
SUCCEEDED = job_pb2.JOB_STATUS_SUCCEEDED
ALIVE = job_pb2.SCHEDULE_STATE_ALIVE
DONE = job_pb2.SCHEDULE_STATE_DONE


class FakeJobService(job_service_pb2_grpc.JobServiceServicer):
    """GetJob and WatchJobs over an in-memory dict; tests change jobs with `update`."""

    def __init__(self) -> None:
        self.jobs: dict[int, job_pb2.Job] = {}
        self.events: list[job_pb2.JobEvent] = []
        self._subscribers: set[asyncio.Queue[job_pb2.JobEvent]] = set()

    def add(self, job_id: int, tasks: int = 1) -> job_pb2.Job:
        job = job_pb2.Job(job_id=job_id, schedule_state=ALIVE, status=PENDING)
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
        job = self.jobs.get(request.job_id)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such job")
        return job_service_pb2.GetJobResponse(job=job)

    async def SubmitJob(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this fake")

    async def ListJobs(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this fake")

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
        sent = 0
        while True:
            changed = self._changed
            if name in self.gone or name in self.broken:
                raise BackendError(f"cluster {name} is gone")
            data = bytes(self.logs.get(name, b""))
            if len(data) > sent:
                yield data[sent:]
                sent = len(data)
            elif name in self.finished:
                return
            else:
                await changed.wait()

    async def launch(
        self,
        request: TaskRequest,
        candidate_regions: Sequence[str] = (),
        blocked_regions: Sequence[str] = (),
    ) -> ClusterHandle:
        return self.handle_for(request.cluster_name)

    async def observe(self, handle: ClusterHandle) -> Observation:
        if handle.cluster_name in self.gone:
            return Observation(ClusterStatus.DOWN)
        finished = handle.cluster_name in self.finished
        return Observation(
            ClusterStatus.UP, TaskStatus.SUCCEEDED if finished else TaskStatus.RUNNING
        )

    async def notify_preemption(self, handle: ClusterHandle, epoch: int, deadline: float) -> None:
        raise AssertionError("no preemption notices in these tests")

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> None:
        self.gone.add(handle.cluster_name)

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
        self, job_id: int, task_id: int, cluster: str, handle: ClusterHandle | None = None
    ) -> int:
        handle_json = (handle or self.backend.handle_for(cluster)).to_json()
        request = log_service_pb2.FetchTaskLogsRequest(
            job_id=job_id, task_id=task_id, handle_json=handle_json
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
async def running_system(data_dir: Path, backend: Backend) -> AsyncIterator[System]:
    """A fake scheduler and a real logs service, both on port 0."""
    scheduler = FakeJobService()
    scheduler_server = Server("127.0.0.1", 0, security=ServerSecurity.without_auth())
    scheduler_server.add(
        job_service_pb2_grpc.add_JobServiceServicer_to_server,
        scheduler,
        "managedjobs.v1.JobService",
    )
    scheduler_port = await scheduler_server.start()
    directory = JobDirectory(f"127.0.0.1:{scheduler_port}", ClientSecurity())
    store = LogStore(data_dir / "logs")
    servicer = LogServicer(store, directory, backend)
    logs_server = Server("127.0.0.1", 0, security=ServerSecurity.without_auth())
    logs_server.add(
        log_service_pb2_grpc.add_LogServiceServicer_to_server,
        servicer,
        "managedjobs.v1.LogService",
    )
    logs_port = await logs_server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{logs_port}")
    try:
        stub = log_service_pb2_grpc.LogServiceStub(channel)
        system = System(scheduler, backend, store, stub, data_dir, servicer, scheduler_server)
        yield system
    finally:
        await channel.close()
        await logs_server.stop(0)
        await system.scheduler_server.stop(0)
        await directory.close()


@pytest.fixture
async def system(tmp_path: Path) -> AsyncIterator[System]:
    async with running_system(tmp_path, MemoryBackend()) as running:
        yield running


async def test_controller_log_append_then_read(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.add(2)
    await system.append(1, "launching", "running\n")
    await system.append(2, "other job")
    await system.append(1, "succeeded")

    assert await system.read(job_id=1, controller=True) == b"launching\nrunning\nsucceeded\n"
    assert await system.read(job_id=1, controller=True, tail_lines=2) == b"running\nsucceeded\n"
    assert await system.read(job_id=2, controller=True) == b"other job\n"
    assert (system.data_dir / "logs" / "1" / "controller.log").is_file()


async def test_controller_log_follow_wakes_on_append_and_ends_when_job_done(
    system: System,
) -> None:
    system.scheduler.add(1)
    await system.append(1, "first")
    follow = Follow(system, job_id=1, controller=True)
    await follow.until(b"first\n")

    await system.append(1, "second")
    await follow.until(b"second\n")
    system.scheduler.update(1, status=SUCCEEDED)
    await system.append(1, "cleaning up")
    await follow.until(b"cleaning up\n")
    assert not follow.ended
    system.scheduler.update(1, schedule_state=DONE)

    assert await follow.to_end() == b"first\nsecond\ncleaning up\n"


async def test_fetch_task_logs_stores_and_read_logs_serves_them(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=SUCCEEDED, cluster_name="c1")
    system.backend.write("c1", b"l1\nl2\nl3\n")

    assert await system.fetch(1, 0, "c1") == 9
    system.backend.vanish("c1")

    assert (system.data_dir / "logs" / "1" / "task-0.log").read_bytes() == b"l1\nl2\nl3\n"
    assert await system.read(job_id=1, task_id=0) == b"l1\nl2\nl3\n"
    assert await system.read(job_id=1) == b"l1\nl2\nl3\n"
    assert await system.read(job_id=1, tail_lines=2) == b"l2\nl3\n"
    assert await system.read(job_id=1, tail_lines=5) == b"l1\nl2\nl3\n"
    # A finished task's stored copy is complete: following it ends at once.
    assert await Follow(system, job_id=1, tail_lines=1).to_end() == b"l3\n"


async def test_fetch_by_cluster_name_and_refetch_replaces_not_duplicates(system: System) -> None:
    system.scheduler.add(1)
    system.backend.write("c1", b"partial\n")
    request = log_service_pb2.FetchTaskLogsRequest(job_id=1, task_id=0, cluster_name="c1")
    await system.stub.FetchTaskLogs(request)
    system.backend.write("c1", b"rest\n")

    assert (await system.stub.FetchTaskLogs(request)).bytes_stored == 13
    assert await system.read(job_id=1, task_id=0) == b"partial\nrest\n"


async def test_fetch_of_a_recovered_task_keeps_every_cluster_log(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=SUCCEEDED, cluster_name="c2")
    system.backend.write("c1", b"first try")
    system.backend.write("c2", b"second try\n")
    await system.fetch(1, 0, "c1")
    await system.fetch(1, 0, "c1")  # a retried fetch replaces its own section
    await system.fetch(1, 0, "c2")

    expected = b"first try\n" + RECOVERED_MARKER + b"second try\n"
    assert await system.read(job_id=1, task_id=0) == expected


async def test_read_without_follow_reads_a_live_cluster_once(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name="c1")
    system.backend.write("c1", b"x\ny\n")

    assert await system.read(job_id=1) == b"x\ny\n"
    assert await system.read(job_id=1, tail_lines=1) == b"y\n"


async def test_follow_of_a_running_task_sends_every_byte_once_and_ends_with_the_task(
    system: System,
) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name="c1")
    system.backend.write("c1", b"one\n")
    follow = Follow(system, job_id=1)
    await follow.until(b"one\n")

    system.backend.write("c1", b"two\n")
    await follow.until(b"two\n")
    system.backend.write("c1", b"three\n")
    system.backend.finish("c1")
    # What a controller does: SUCCEEDED first, fetch before teardown, then DONE.
    system.scheduler.update(1, status=SUCCEEDED)
    await system.fetch(1, 0, "c1")
    system.backend.vanish("c1")
    system.scheduler.update(1, schedule_state=DONE)

    assert await follow.to_end() == b"one\ntwo\nthree\n"


async def test_follow_finishes_from_the_stored_copy_after_the_tail_breaks(
    system: System,
) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name="c1")
    system.backend.write("c1", b"one\n")
    follow = Follow(system, job_id=1, task_id=0)
    await follow.until(b"one\n")

    system.backend.break_tails("c1")
    system.backend.write("c1", b"two\n")  # never reaches the live tail
    system.scheduler.update(1, status=SUCCEEDED)
    await system.fetch(1, 0, "c1")

    # Ends without DONE: the task is over and its stored copy is complete.
    assert await follow.to_end() == b"one\ntwo\n"


async def test_follow_continues_on_the_recovered_cluster_after_a_marker(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name="c1")
    system.backend.write("c1", b"a\n")
    follow = Follow(system, job_id=1)
    await follow.until(b"a\n")

    system.backend.vanish("c1")  # preempted
    system.scheduler.update(1, status=RECOVERING)
    system.backend.write("c2", b"b\n")
    system.scheduler.update(1, status=RUNNING, cluster_name="c2", recovery_count=1)
    await follow.until(RECOVERED_MARKER + b"b\n")
    system.backend.finish("c2")
    system.scheduler.update(1, status=SUCCEEDED)
    await system.fetch(1, 0, "c2")
    system.scheduler.update(1, schedule_state=DONE)

    assert await follow.to_end() == b"a\n" + RECOVERED_MARKER + b"b\n"


async def test_follow_waits_for_a_pending_task_and_goes_through_the_chain(
    system: System,
) -> None:
    system.scheduler.add(1, tasks=2)
    follow = Follow(system, job_id=1)
    for task_id, cluster in enumerate(["c0", "c1"]):
        system.backend.write(cluster, f"task {task_id}\n".encode())
        system.scheduler.update(1, task_id, status=RUNNING, cluster_name=cluster)
        await follow.until(f"task {task_id}\n".encode())
        system.backend.finish(cluster)
        system.scheduler.update(1, task_id, status=SUCCEEDED)
        await system.fetch(1, task_id, cluster)
    system.scheduler.update(1, 1, schedule_state=DONE)

    assert await follow.to_end() == b"task 0\ntask 1\n"
    assert sorted(set(follow.task_ids)) == [0, 1]
    assert follow.task_ids == sorted(follow.task_ids)


async def test_follow_of_a_task_that_never_ran_ends_when_the_job_is_done(system: System) -> None:
    system.scheduler.add(1)
    follow = Follow(system, job_id=1)
    system.scheduler.update(1, status=job_pb2.JOB_STATUS_CANCELLED, schedule_state=DONE)

    assert await follow.to_end() == b""


async def test_follow_of_a_real_local_cluster_sends_its_output_once(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "clusters", poll_interval=0.02)
    # The task runs as a uid of its own: it sees only folders open to everyone.
    with open_folder(0o755) as shared:
        go = shared / "go"
        run = f"echo one; while [ ! -e {go} ]; do sleep 0.01; done; echo two"
        request = TaskRequest(job_id=1, task_id=0, epoch=1, cluster_name="mj-1-0", run=run)
        async with running_system(tmp_path, backend) as system:
            system.scheduler.add(1)
            system.scheduler.update(1, status=job_pb2.JOB_STATUS_STARTING, cluster_name="mj-1-0")
            handle = await backend.launch(request)
            try:
                system.scheduler.update(1, status=RUNNING)
                follow = Follow(system, job_id=1)
                await follow.until(b"one\n")
                go.touch()
                await follow.until(b"two\n")
                system.scheduler.update(1, status=SUCCEEDED)
                assert await system.fetch(1, 0, "mj-1-0", handle) == len(b"one\ntwo\n")
            finally:
                await backend.terminate(handle)
            system.scheduler.update(1, schedule_state=DONE)

            assert await follow.to_end() == b"one\ntwo\n"
            assert await system.read(job_id=1) == b"one\ntwo\n"


async def test_follow_survives_a_scheduler_restart(system: System) -> None:
    system.scheduler.add(1)
    await system.append(1, "before")
    follow = Follow(system, job_id=1, controller=True)
    await follow.until(b"before\n")
    port = system.scheduler_server.port
    await system.scheduler_server.stop(0)

    restarted = Server("127.0.0.1", port, security=ServerSecurity.without_auth())
    restarted.add(
        job_service_pb2_grpc.add_JobServiceServicer_to_server,
        system.scheduler,
        "managedjobs.v1.JobService",
    )
    await restarted.start()
    system.scheduler_server = restarted
    await system.append(1, "after")
    await follow.until(b"after\n")
    system.scheduler.update(1, schedule_state=DONE)

    assert await follow.to_end() == b"before\nafter\n"


async def test_drain_ends_follow_streams_with_unavailable(system: System) -> None:
    system.scheduler.add(1)
    system.scheduler.update(1, status=RUNNING, cluster_name="c1")
    system.backend.write("c1", b"live\n")
    task_follow = Follow(system, job_id=1)
    controller_follow = Follow(system, job_id=1, controller=True)
    await task_follow.until(b"live\n")

    await system.servicer.drain()

    for follow in (task_follow, controller_follow):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await follow.to_end()
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"job_id": 99}, grpc.StatusCode.NOT_FOUND, "99"),
        ({"job_id": 99, "follow": True}, grpc.StatusCode.NOT_FOUND, "99"),
        ({"job_id": 0}, grpc.StatusCode.INVALID_ARGUMENT, "job_id"),
        ({"job_id": 1, "tail_lines": -1}, grpc.StatusCode.INVALID_ARGUMENT, "tail_lines"),
        ({"job_id": 1, "task_id": 1}, grpc.StatusCode.INVALID_ARGUMENT, "task_id"),
        ({"job_id": 1, "task_id": -1, "follow": True}, grpc.StatusCode.INVALID_ARGUMENT, "task_id"),
    ],
)
async def test_read_logs_rejects_bad_requests(
    system: System, fields: dict[str, Any], code: grpc.StatusCode, field: str
) -> None:
    system.scheduler.add(1)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await system.read(**fields)
    assert raised.value.code() == code
    assert field in (raised.value.details() or "")


async def test_write_rpcs_reject_bad_requests(system: System) -> None:
    bad_line = log_service_pb2.AppendControllerLogsRequest(
        lines=[log_service_pb2.ControllerLogLine(job_id=0, line="x")]
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await system.stub.AppendControllerLogs(bad_line)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for request in [
        log_service_pb2.FetchTaskLogsRequest(job_id=1, task_id=0),
        log_service_pb2.FetchTaskLogsRequest(job_id=1, task_id=0, handle_json="{"),
        log_service_pb2.FetchTaskLogsRequest(job_id=1, task_id=0, handle_json="[]"),
        log_service_pb2.FetchTaskLogsRequest(
            job_id=1, task_id=0, handle_json=ClusterHandle("c1", backend="sim").to_json()
        ),
        log_service_pb2.FetchTaskLogsRequest(
            job_id=1,
            task_id=0,
            cluster_name="c2",
            handle_json=ClusterHandle("c1", "memory").to_json(),
        ),
        log_service_pb2.FetchTaskLogsRequest(job_id=0, task_id=0, cluster_name="c1"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await system.stub.FetchTaskLogs(request)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_tail_offset_spans_chunks(tmp_path: Path) -> None:
    store = LogStore(tmp_path)
    path = tmp_path / "big.log"
    lines = [f"{i:07d}\n".encode() for i in range(3 * CHUNK_BYTES // 8)]
    path.write_bytes(b"".join(lines))
    for count in (1, 2, CHUNK_BYTES // 8 + 3, len(lines), len(lines) + 1):
        start = store.tail_offset(path, count)
        assert path.read_bytes()[start:] == b"".join(lines[-count:])
    path.write_bytes(b"no newline\nat the end")
    assert path.read_bytes()[store.tail_offset(path, 1) :] == b"at the end"


def test_settings_have_unique_flags_and_env_vars() -> None:
    assert len({s.env for s in SETTINGS}) == len(SETTINGS)
    assert {s.name: s.default for s in SETTINGS}["port"] == 50052
    assert all(s.env.startswith("MJ_") for s in SETTINGS)
