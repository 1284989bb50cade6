"""The whole control plane in this process, for state machines over the job lifecycle.

`World` runs, on one event loop in a thread of its own (so that streams, leases
and heartbeats go on between a test's steps, as between processes):
- the scheduler (`SchedulerApp`) on a SQLite file; it can be stopped and started
  again on the same port and database;
- controller replicas (`Replica` linked to the scheduler, behind its
  ControllerService), started and killed at will, each with its own token;
- the logs service, and the sim cloud on a `JumpClock`;
all with auth on (one tokens file), plaintext on loopback, on free ports.

The test drives it from its own thread, as a client would: JobService as the user,
the operator APIs as the admin, and it reads the database file itself.

Simulated time runs with real time and jumps when the test moves it (`advance`).
A launch (`LAUNCH` sim s) and a run (`RUN` sim s) last far longer than a test,
so nothing happens in the cloud unless the test moves time; and the cloud's
timestamps stay comparable with the scheduler's, as the history checker needs.

`settle()` waits until the system is at rest, when nothing can change until the
test acts again, and returns what it read then (`Snapshot`). At rest means, for
every job not DONE: it waits for a replica (a new job, or one whose replica died)
while none has room, or its holder (a live replica, at the job's epoch,
connected) waits for the cloud's clock: its current task RUNNING on an UP
cluster whose run goes on, or STARTING/RECOVERING with its launch (an INIT
cluster of this epoch) under way, or with its launch preempted before it was up
and held back with the other launches of its call. And no replica runs a job it
does not hold, and the scheduler's counters equal a recount of its jobs table.
What is wrong for good (a cluster left behind, say) is the test's to judge: the
system is at rest with it.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import contextlib
import dataclasses
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc

from harness.history import (
    ClientCancels,
    CloudCounters,
    EventRecord,
    History,
    expected_counters,
)
from harness.identities import Identities, make_identities
from harness.lifecycle_harness import fast_config
from harness.reliability import Database, cluster_record, reported_counters
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as spb_grpc
from managedjobs.v1 import (
    controller_service_pb2,
    controller_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    log_service_pb2_grpc,
    scheduler_service_pb2,
    scheduler_service_pb2_grpc,
)
from services.backends import cluster_name
from services.backends.sim.backend import SimBackend
from services.common.channels import CHANNEL_OPTIONS, open_sync_channel
from services.common.security.auth import Role, add_token
from services.common.server import Server
from services.common.statuses import JobStatus, ScheduleState
from services.controller.joblog import LogsClient
from services.controller.replica import Replica
from services.logs import JobDirectory, LogServicer, LogStore
from services.scheduler.admission import Limits
from services.scheduler.main import SchedulerApp
from services.simcloud import CloudConfig, ManualClock, RunningCloud, start
from services.simcloud.config import RegionConfig

S = JobStatus
St = ScheduleState
T = TypeVar("T")

# Simulated seconds: a launch, then a run. Real seconds: the leases.
LAUNCH = 100.0
RUN = 300.0
LEASE_TTL = 0.5
HEARTBEAT = 0.1
REPLICA_CAPACITY = scheduler_service_pb2.Capacity(max_launches=4, max_jobs=3)
REGIONS = ("us-east-1", "us-west-2")
CLOUD = CloudConfig(
    regions=tuple(RegionConfig(r, (f"{r}a",), spot_nodes=50, on_demand_nodes=50) for r in REGIONS),
    launch_latency_seconds=LAUNCH,
)
# Every lifecycle duration in milliseconds (a stopped task's grace too: the cloud's
# clock runs with real time); watching relies on the cloud's pushed events.
CONFIG = fast_config(grace_period=0.01)
# Seconds between shipments of lifecycle log lines (a job ends once its lines are shipped).
LOG_FLUSH = 0.01
# A bound that only turns a system that never comes to rest into a clear failure.
SETTLE_WITHIN = 20.0
# Lines of a job's lifecycle log in a failure message.
LOG_TAIL = 30
# The test's channels reconnect fast to a restarted scheduler.
TEST_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
]
# Cluster statuses in which a cluster holds capacity: launching or up.
LIVE = frozenset({spb.CLUSTER_STATUS_INIT, spb.CLUSTER_STATUS_UP})
# Task statuses of a run that goes on.
TASK_GOING = frozenset(
    {spb.TASK_STATUS_PENDING, spb.TASK_STATUS_SETTING_UP, spb.TASK_STATUS_RUNNING}
)


async def reconnect_sleep(delay: float) -> None:
    """A replica waits a tenth of its backoff before it tries the scheduler again."""
    await asyncio.sleep(delay / 10)


class JumpClock(ManualClock):
    """Simulated time that runs with real time and jumps forward when a test moves it.

    `wall(s)` is when simulated time passed `s`: an instant inside a jump is the
    moment of the jump. So every cloud timestamp is a real time, in the same order
    as the simulated instants.
    """

    def __init__(self) -> None:
        super().__init__(start_wall=time.time())
        self._origin = time.monotonic()
        # (simulated seconds, real seconds since the origin) at the start of each stretch.
        self._sim: list[float] = [0.0]
        self._real: list[float] = [0.0]

    def _elapsed(self) -> float:
        return time.monotonic() - self._origin

    def now(self) -> float:
        return self._sim[-1] + (self._elapsed() - self._real[-1])

    def set(self, sim_seconds: float) -> None:
        if sim_seconds > self.now():
            self._sim.append(sim_seconds)
            self._real.append(self._elapsed())

    def wall(self, sim_seconds: float) -> float:
        i = max(0, bisect.bisect_right(self._sim, sim_seconds) - 1)
        real = self._real[i] + (sim_seconds - self._sim[i])
        if i + 1 < len(self._real):
            real = min(real, self._real[i + 1])
        return self.start_wall + real

    def real_delay(self, sim_seconds: float) -> float:
        return max(0.0, sim_seconds)


# --- what the test reads --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JobRow:
    job_id: int
    status: JobStatus
    schedule_state: ScheduleState
    current_task: int
    controller_id: str | None
    epoch: int
    cancel_requested: bool


@dataclasses.dataclass(frozen=True)
class TaskRow:
    status: JobStatus
    restart_count: int
    recovery_count: int


@dataclasses.dataclass
class Snapshot:
    """The system as read at one moment: the database, the cloud, the services' views."""

    jobs: dict[int, JobRow]
    tasks: dict[tuple[int, int], TaskRow]
    events: list[EventRecord]
    recount: collections.Counter[tuple[str | None, ScheduleState]]
    clusters: list[spb.Cluster]
    cloud: spb.GetCloudStateResponse
    # None while the scheduler does not answer.
    scheduler: scheduler_service_pb2.GetSchedulerStateResponse | None
    # Live replicas' own state, by controller id (None: it did not answer).
    controllers: dict[str, controller_service_pb2.GetControllerStateResponse | None]
    listed: set[int]
    # The cancels the test sent and those the answers named as cancelled.
    cancels: ClientCancels
    # Counter differences the scheduler's reconcile fixed, over every life of it.
    corrections: int

    def clusters_of(self, job_id: int) -> list[spb.Cluster]:
        return [c for c in self.clusters if c.job_id == job_id]

    def latest(self, job_id: int, task_id: int) -> spb.Cluster | None:
        """The task's most recent cluster (its name's current holder in the cloud)."""
        name = cluster_name(job_id, task_id)
        found = [c for c in self.clusters if c.name == name]
        return max(found, key=lambda c: c.cluster_id) if found else None

    def history(self, tasks: Mapping[int, int]) -> History:
        """The record as the history checker reads it, judging the jobs of `tasks` (job id:
        how many tasks it was submitted with)."""
        return History(
            events=self.events,
            clusters=[cluster_record(c) for c in self.clusters],
            job_ids=sorted(tasks),
            cloud=CloudCounters(
                stale_launches_rejected=self.cloud.stale_launches_rejected,
                stale_terminates_rejected=self.cloud.stale_terminates_rejected,
                stale_notices_rejected=self.cloud.stale_notices_rejected,
                unterminated_clusters=self.cloud.unterminated_clusters,
            ),
            tasks=tasks,
            counter_corrections=self.corrections,
            cancels=self.cancels,
        )

    def fingerprint(self) -> tuple[Any, ...]:
        """What must not change between two readings for the system to be at rest."""
        return (
            tuple(sorted(self.jobs.items())),
            tuple(sorted(self.tasks.items())),
            len(self.events),
            tuple((c.cluster_id, c.status, c.task_status) for c in self.clusters),
        )


class Tables:
    """The scheduler's tables, read from its SQLite file (the database is the only truth):
    the jobs and their tasks at each reading, the events as they come (with epochs)."""

    def __init__(self, path: Path) -> None:
        self.db = Database(f"sqlite:///{path}")
        self._events: list[EventRecord] = []

    def read(self) -> tuple[dict[int, JobRow], dict[tuple[int, int], TaskRow], list[EventRecord]]:
        jobs = {
            int(i): JobRow(
                int(i), JobStatus[s], ScheduleState[st], int(t), c, int(e or 0), bool(cr)
            )
            for i, s, st, t, c, e, cr in self.db.query(
                "SELECT id, status, schedule_state, current_task, controller_id, epoch, "
                "cancel_requested FROM jobs"
            )
        }
        tasks = {
            (int(j), int(t)): TaskRow(JobStatus[s], int(rs), int(rc))
            for j, t, s, rs, rc in self.db.query(
                "SELECT job_id, task_id, status, restart_count, recovery_count FROM tasks"
            )
        }
        self._events += self.db.events(self._events[-1].event_id if self._events else 0)
        return jobs, tasks, list(self._events)


# --- the servers ----------------------------------------------------------------------------


class Loop:
    """An event loop in a thread of its own; the test hands it coroutines to run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="world", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            what = getattr(coro, "__qualname__", "a step")
            where = self.waiting()
            future.cancel()
            raise AssertionError(f"{what} did not finish within {timeout}s:\n{where}") from None

    def waiting(self) -> str:
        """Where the loop's tasks wait (their innermost frames), for a failure message."""

        async def frames() -> str:
            lines = []
            for task in asyncio.all_tasks():
                asked = f" (cancel asked {task.cancelling()}x)" if task.cancelling() else ""
                lines.append(
                    f"  {task.get_name()}{asked}: {' > '.join(_awaiting(task.get_coro()))}"
                )
            return "\n".join(sorted(lines))

        try:
            return asyncio.run_coroutine_threadsafe(frames(), self.loop).result(5)
        except concurrent.futures.TimeoutError:
            return "  (the loop does not answer: something blocks it)"

    def close(self) -> None:
        """Cancels what is left on the loop, then stops it and its thread."""

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(cancel_rest(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def _awaiting(coro: Any) -> list[str]:
    """Where a coroutine waits: its frame, then what it awaits, down the chain."""
    places = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        frame = frame or getattr(coro, "gi_frame", None)
        if frame is not None:
            places.append(
                f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"
            )
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "ag_await", None)
            or getattr(coro, "gi_yieldfrom", None)
        )
    return places


class ReplicaNode:
    """One controller replica and its ControllerService server (made on the world's loop)."""

    def __init__(self, world: World, controller_id: str, kind: type[Replica] = Replica) -> None:
        self.controller_id = controller_id
        security = world.ids.client(controller_id, False)
        self.replica = kind(
            controller_id=controller_id,
            address="",
            capacity=REPLICA_CAPACITY,
            backend=SimBackend(world.cloud_address, security=security),
            logs=LogsClient(world.logs_address, security, flush_interval=LOG_FLUSH),
            config=CONFIG,
            scheduler_address=world.scheduler_address,
            security=security,
            reconnect_sleep=reconnect_sleep,
        )
        self.server = Server("127.0.0.1", 0, security=world.ids.server(controller_id, False))
        self.server.add(
            controller_service_pb2_grpc.add_ControllerServiceServicer_to_server,
            self.replica,
            "managedjobs.v1.ControllerService",
        )
        self.address = ""

    async def start(self) -> None:
        self.address = f"127.0.0.1:{await self.server.start()}"
        self.replica.address = self.address
        self.replica.start()

    async def stop(self) -> None:
        """Dies: its jobs stop at once, its stream closes, and it never says goodbye."""
        try:
            await self.replica.close()
        finally:
            await self.server.stop(0)


class World:
    """The servers, and the test's clients of them. Build with `World.open()`."""

    def __init__(
        self, folder: Path, ids: Identities, controllers: list[str], lease_ttl: float
    ) -> None:
        self.folder = folder
        self.lease_ttl = lease_ttl
        self.ids = ids
        self.loop = Loop()
        self.db_path = folder / "scheduler.db"
        self.tables = Tables(self.db_path)
        self._spare = list(controllers)
        self.replicas: dict[str, ReplicaNode] = {}
        self.scheduler: SchedulerApp | None = None
        self.scheduler_port = 0
        self.cloud: RunningCloud | None = None
        self.cloud_address = ""
        self.logs_address = ""
        self.clock = JumpClock()
        self._stack = contextlib.AsyncExitStack()
        self._channels: dict[str, grpc.Channel] = {}
        self._cancels_sent: set[int] = set()
        self._cancels_answered: set[int] = set()
        # Corrections made by the scheduler's earlier lives.
        self._corrections = 0

    @classmethod
    def open(cls, replicas: int, spare: int, lease_ttl: float = LEASE_TTL) -> World:
        """Starts the cloud, the scheduler, the logs service and `replicas` replicas, with
        tokens for `spare` more; leases last `lease_ttl` seconds."""
        folder = Path(tempfile.mkdtemp(prefix="mj-world-"))
        ids = make_identities(folder)
        names = [f"controller-{n}" for n in range(1, replicas + spare + 1)]
        for cid in names:
            ids.tokens[cid] = add_token(ids.tokens_file, cid, Role.CONTROLLER, cid)
        world = cls(folder, ids, names, lease_ttl)
        try:
            world.loop.run(world._open())
            for _ in range(replicas):
                world.start_replica()
        except BaseException:
            world.close()
            raise
        return world

    @property
    def scheduler_address(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    async def _open(self) -> None:
        self.cloud = await start(
            CLOUD, clock=self.clock, security=self.ids.server("simcloud", False)
        )
        self._stack.push_async_callback(self.cloud.stop)
        self.cloud_address = f"127.0.0.1:{self.cloud.port}"
        await self._start_scheduler()
        service = self.ids.client("service", False)
        backend = SimBackend(self.cloud_address, security=service)
        directory = JobDirectory(self.scheduler_address, service)
        store = LogStore(self.folder / "logs")
        logs = Server("127.0.0.1", 0, security=self.ids.server("logs", False))
        logs.add(
            log_service_pb2_grpc.add_LogServiceServicer_to_server,
            LogServicer(store, directory, backend),
            "managedjobs.v1.LogService",
        )
        self.logs_address = f"127.0.0.1:{await logs.start()}"
        self._stack.callback(store.close)
        self._stack.push_async_callback(backend.close)
        self._stack.push_async_callback(directory.close)
        self._stack.push_async_callback(logs.stop, 0)

    async def _start_scheduler(self) -> None:
        app = SchedulerApp(
            f"sqlite:///{self.db_path}",
            Limits(),
            security=self.ids.server("scheduler", False),
            port=self.scheduler_port,
            lease_ttl=self.lease_ttl,
            heartbeat_interval=HEARTBEAT,
        )
        try:
            self.scheduler_port = await app.start()
        except BaseException:
            await app.close()
            raise
        self.scheduler = app

    async def _stop_scheduler(self) -> None:
        app, self.scheduler = self.scheduler, None
        if app is not None:
            self._corrections += app.counters.corrections
            await app.close()

    # --- the test's actions (from the test's thread) ------------------------------------------

    def channel(self, address: str, caller: str = "admin") -> grpc.Channel:
        key = f"{caller}@{address}"
        if key not in self._channels:
            security = self.ids.client(caller, False)
            self._channels[key] = open_sync_channel(address, security, TEST_CHANNEL_OPTIONS)
        return self._channels[key]

    @property
    def jobs(self) -> job_service_pb2_grpc.JobServiceStub:
        return job_service_pb2_grpc.JobServiceStub(self.channel(self.scheduler_address, "user"))

    @property
    def operator(self) -> spb_grpc.SimOperatorServiceStub:
        return spb_grpc.SimOperatorServiceStub(self.channel(self.cloud_address))

    def submit(self, spec_yaml: str) -> int:
        request = job_service_pb2.SubmitJobRequest(spec_yaml=spec_yaml)
        return int(self.jobs.SubmitJob(request, timeout=10).job_id)

    def cancel(self, job_id: int) -> None:
        self._cancels_sent.add(job_id)
        request = job_service_pb2.CancelJobsRequest(job_ids=[job_id])
        self._cancels_answered.update(self.jobs.CancelJobs(request, timeout=10).cancelled_job_ids)

    def preempt(self, name: str) -> bool:
        request = spb.PreemptClusterRequest(cluster_name=name)
        return bool(self.operator.PreemptCluster(request, timeout=10).preempted)

    def advance(self, sim_seconds: float) -> None:
        """Moves the cloud's time forward, firing what comes due on the way."""
        assert self.cloud is not None

        async def advance() -> None:
            assert self.cloud is not None
            self.cloud.cloud.advance(sim_seconds)

        self.loop.run(advance())

    def start_replica(self, kind: type[Replica] = Replica) -> str:
        """Starts a replica (of class `kind`) with a name never used before; returns its
        controller id."""
        cid = self._spare.pop(0)

        async def start() -> ReplicaNode:
            node = ReplicaNode(self, cid, kind)
            await node.start()
            return node

        node = self.loop.run(start())
        self.replicas[node.controller_id] = node
        return node.controller_id

    @property
    def spare(self) -> int:
        return len(self._spare)

    def kill_replica(self, controller_id: str) -> None:
        node = self.replicas.pop(controller_id)
        self.loop.run(node.stop())

    def restart_scheduler(self) -> None:
        """Stops the scheduler and starts it again on the same port and database."""

        async def restart() -> None:
            await self._stop_scheduler()
            await self._start_scheduler()

        self.loop.run(restart())

    # --- reading and waiting ---------------------------------------------------------------

    def read(self) -> Snapshot:
        """One reading of everything (`Snapshot`): the database first, then the services."""
        jobs, tasks, events = self.tables.read()
        recount = collections.Counter((j.controller_id, j.schedule_state) for j in jobs.values())
        scheduler: scheduler_service_pb2.GetSchedulerStateResponse | None = None
        listed: set[int] = set()
        try:
            stub = scheduler_service_pb2_grpc.SchedulerServiceStub(
                self.channel(self.scheduler_address)
            )
            scheduler = stub.GetSchedulerState(
                scheduler_service_pb2.GetSchedulerStateRequest(), timeout=5
            )
            listed = self._listed()
        except grpc.RpcError:
            scheduler = None
        controllers: dict[str, controller_service_pb2.GetControllerStateResponse | None] = {}
        for cid, node in self.replicas.items():
            stub_c = controller_service_pb2_grpc.ControllerServiceStub(self.channel(node.address))
            try:
                controllers[cid] = stub_c.GetControllerState(
                    controller_service_pb2.GetControllerStateRequest(), timeout=5
                )
            except grpc.RpcError:
                controllers[cid] = None
        clusters = self._inventory()
        cloud = self.operator.GetCloudState(spb.GetCloudStateRequest(), timeout=10)
        corrections = self._corrections + (scheduler.counter_corrections if scheduler else 0)
        cancels = ClientCancels(frozenset(self._cancels_sent), frozenset(self._cancels_answered))
        return Snapshot(
            jobs,
            tasks,
            events,
            recount,
            clusters,
            cloud,
            scheduler,
            controllers,
            listed,
            cancels,
            corrections,
        )

    def _inventory(self) -> list[spb.Cluster]:
        """Every inventory record, every page, in launch order."""
        out: list[spb.Cluster] = []
        token = ""
        while True:
            request = spb.ListInventoryRequest(page_size=1000, page_token=token)
            reply = self.operator.ListInventory(request, timeout=10)
            out.extend(reply.clusters)
            token = reply.next_page_token
            if not token:
                return out

    def _listed(self) -> set[int]:
        """Every job the user sees through ListJobs, every page."""
        ids: set[int] = set()
        token = ""
        while True:
            reply = self.jobs.ListJobs(
                job_service_pb2.ListJobsRequest(page_size=500, page_token=token), timeout=10
            )
            ids.update(j.job_id for j in reply.jobs)
            token = reply.next_page_token
            if not token:
                return ids

    def settle(self, within: float = SETTLE_WITHIN) -> Snapshot:
        """Waits until the system is at rest (twice the same reading); returns that reading.

        Raises:
            AssertionError: it did not come to rest within `within` seconds, with why.
        """
        deadline = time.monotonic() + within
        previous: tuple[Any, ...] | None = None
        while True:
            snapshot = self.read()
            why = unsettled(self, snapshot)
            if not why:
                mark = snapshot.fingerprint()
                if mark == previous:
                    return snapshot
                previous = mark
            else:
                previous = None
            if time.monotonic() > deadline:
                named = sorted({int(n) for n in re.findall(r"\b(?:job |mj-)(\d+)", " ".join(why))})
                raise AssertionError(
                    f"the system did not come to rest within {within:g}s:\n  "
                    + "\n  ".join(why)
                    + "".join(f"\n{self.describe(snapshot, j)}" for j in named)
                )
            time.sleep(0.02)

    def describe(self, snap: Snapshot, job_id: int) -> str:
        """`describe_job`, with the job's lifecycle log as the logs service stored it."""
        return describe_job(snap, job_id, self.folder / "logs" / str(job_id) / "controller.log")

    def close(self) -> None:
        """Stops every server, then the loop, and removes the files; idempotent."""

        async def close() -> None:
            # The scheduler first: it ends the replicas' streams itself, so no stream's
            # end is taken for a replica's death while it shuts down.
            with contextlib.suppress(Exception):
                await self._stop_scheduler()
            for cid in list(self.replicas):
                node = self.replicas.pop(cid)
                with contextlib.suppress(Exception):
                    await node.stop()
            await self._stack.aclose()

        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        if not self.loop.loop.is_closed():
            try:
                self.loop.run(close())
            finally:
                self.loop.close()
                shutil.rmtree(self.folder, ignore_errors=True)


# --- at rest ------------------------------------------------------------------------------


def unsettled(world: World, snap: Snapshot) -> list[str]:
    """Why the system is not at rest yet (nothing: it is)."""
    why: list[str] = []
    state = snap.scheduler
    if state is None:
        return ["the scheduler does not answer"]
    leases = {r.controller_id: r for r in state.replicas}
    for cid, seen in snap.controllers.items():
        if seen is None or not seen.connected:
            why.append(f"{cid} is not connected")
        elif cid not in leases or not leases[cid].connected:
            why.append(f"the scheduler does not see {cid} connected")
    room = [
        cid
        for cid, r in leases.items()
        if cid in world.replicas
        and r.connected
        and not r.draining
        and r.alive < REPLICA_CAPACITY.max_jobs
    ]
    held: dict[int, tuple[str, int]] = {}
    for cid, seen in snap.controllers.items():
        for runner in seen.jobs if seen is not None else ():
            held[runner.job_id] = (cid, runner.epoch)
    for job in snap.jobs.values():
        if job.schedule_state == St.DONE:
            continue
        task = snap.tasks[(job.job_id, job.current_task)]
        cluster = snap.latest(job.job_id, job.current_task)
        where = f"job {job.job_id} ({task.status.name}/{job.schedule_state.name})"
        if job.controller_id is None:
            # New, or its replica died: it waits for room (its last holder's cluster is
            # left to whoever resumes it).
            if room:
                why.append(f"{where} waits for a replica while {', '.join(room)} have room")
            continue
        if job.controller_id not in world.replicas:
            why.append(f"{where} is held by {job.controller_id}, which is not running")
            continue
        if held.get(job.job_id) != (job.controller_id, job.epoch):
            why.append(f"{where}: {job.controller_id} does not run it at epoch {job.epoch}")
            continue
        if task.status == S.RUNNING:
            running = (
                cluster is not None
                and cluster.status == spb.CLUSTER_STATUS_UP
                and cluster.task_status in TASK_GOING
                and job.schedule_state == St.ALIVE
            )
            if not running:
                why.append(f"{where}: its cluster is {_describe(cluster)}")
        elif task.status in (S.STARTING, S.RECOVERING):
            ours = (
                cluster is not None
                and cluster.epoch == job.epoch
                and job.schedule_state == St.LAUNCHING
            )
            launching = ours and cluster is not None and cluster.status == spb.CLUSTER_STATUS_INIT
            # A launch preempted before it was up is answered with the other launches of
            # its LaunchClusters call, once they are up: it waits for the clock as well.
            held_back = (
                ours
                and cluster is not None
                and cluster.preempted
                and not cluster.HasField("up_time")
                and any(c.status == spb.CLUSTER_STATUS_INIT for c in snap.clusters)
            )
            if not (launching or held_back):
                why.append(f"{where}: its cluster is {_describe(cluster)}")
        else:
            why.append(f"{where} is on its way")
    for job_id, (cid, epoch) in held.items():
        row = snap.jobs.get(job_id)
        if (
            row is None
            or row.schedule_state == St.DONE
            or (row.controller_id, row.epoch)
            != (
                cid,
                epoch,
            )
        ):
            why.append(f"{cid} still runs job {job_id} at epoch {epoch}")
    reported = reported_counters(state)
    expected = expected_counters(snap.recount, sorted(leases))
    drift = {k: (reported.get(k, 0), v) for k, v in expected.items() if reported.get(k, 0) != v}
    if drift:
        why.append(f"counters (reported, recount) differ: {drift}")
    return why


def _describe(cluster: spb.Cluster | None) -> str:
    if cluster is None:
        return "none"
    status = spb.ClusterStatus.Name(cluster.status).removeprefix("CLUSTER_STATUS_")
    task = spb.TaskStatus.Name(cluster.task_status).removeprefix("TASK_STATUS_")
    return f"{cluster.name}#{cluster.cluster_id} {status}/{task} epoch {cluster.epoch}"


def describe_job(snap: Snapshot, job_id: int, lifecycle: Path | None = None) -> str:
    """A job's row, tasks, events (with epochs), clusters and the end of its lifecycle log
    (when given its file), for failure messages."""
    lines = [f"job {job_id}: {snap.jobs.get(job_id)}"]
    lines += [f"  task {t}: {row}" for (j, t), row in sorted(snap.tasks.items()) if j == job_id]
    lines += [
        f"  event {e.event_id} task {e.task_id} {e.status.name}/{e.schedule_state.name} "
        f"epoch {e.epoch}: {e.message}"
        for e in snap.events
        if e.job_id == job_id
    ]
    lines += [f"  cluster {_describe(c)}" for c in snap.clusters_of(job_id)]
    if lifecycle is not None and lifecycle.exists():
        tail = lifecycle.read_text(errors="replace").splitlines()[-LOG_TAIL:]
        lines += [f"  log: {line}" for line in tail]
    return "\n".join(lines)


__all__ = [
    "LAUNCH",
    "LIVE",
    "RUN",
    "JumpClock",
    "Snapshot",
    "World",
    "describe_job",
]
