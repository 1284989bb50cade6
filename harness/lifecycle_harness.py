"""Running job lifecycles against the sim cloud in-process, with a real `JobHost`.

- `World`: a sim cloud server on port 0, the `SimBackend` that talks to it, and
  its operator API (preempt, capacity, faults, inventory).
- `Host`: a `JobHost` that keeps what a replica would send to the scheduler:
  every report in order (checked against `TASK_TRANSITIONS`, as the scheduler's
  store does), the lifecycle log, log fetches (read through the backend, to prove
  the logs were readable before teardown), and a launch slot that is granted at
  once or only when the test says so. Its `watch` and `look` use a
  `ClusterWatch` fed by the backend's event stream, as on a replica; with a
  backend that cannot push, the watch polls in batches. One timeline orders the
  reports, log fetches, terminations, the injected sleeps that ran to their end
  and the cancel, and each report counts the backend calls made for news before
  it: tests assert the order of events and what was asked, never how long
  anything took.
- Backend wrappers (`Recorder` and friends): shipped `Backend` classes around the
  real sim backend that record launches and terminations, or bend one behaviour
  (no push, a task that never starts, an unknown task status, a terminate that
  fails or blocks).
- `RunningJob`: one job's `run_job` started in the background, with its cancel
  event.

Moments of the lifecycle can trigger test actions (`Hooks`): inside the first
RUNNING report, at the first wait of the watch (in the background, so the action
lands while the lifecycle waits for news), and inside the grace period.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar, cast

import grpc

from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as spb_grpc
from managedjobs.v1 import job_pb2
from services.backends import (
    Backend,
    BackendError,
    BackendUnreachableError,
    ClusterEvent,
    ClusterHandle,
    ClusterStatus,
    LaunchPlan,
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    TaskStatus,
    cluster_name,
)
from services.backends.sim.backend import SimBackend
from services.backends.wrapper import BackendWrapper
from services.common.security.edge import ServerSecurity
from services.common.statuses import JobStatus, task_transition_allowed
from services.controller.cleanup import CancelRequest, run_job
from services.controller.config import LifecycleConfig
from services.controller.lifecycle import JobLifecycle
from services.controller.messages import TaskReport
from services.controller.watch import ClusterWatch, News, Watcher
from services.scheduler.spec.parse import parse_job_spec, resources_summary
from services.simcloud import CloudConfig, RunningCloud, list_inventory, start
from services.simcloud.config import RegionConfig

S = JobStatus
EAST, WEST, EU = "us-east-1", "us-west-2", "eu-west-1"
REGIONS = (EAST, WEST, EU)
# 1,000 simulated seconds per real second: a default task (1 sim s) runs for 1 ms.
TIME_SCALE = 1000.0
CLOUD = CloudConfig(
    regions=tuple(RegionConfig(r, (f"{r}a",), spot_nodes=2, on_demand_nodes=4) for r in REGIONS),
    time_scale=TIME_SCALE,
    launch_latency_seconds=1.0,
)
DEADLINE = 10.0
_probe_ids = itertools.count(1_000_000)


def fast_config(**changes: Any) -> LifecycleConfig:
    """Every duration in milliseconds; polls hourly, so watching relies on pushed events."""
    base = LifecycleConfig(
        poll_interval=3600.0,
        grace_seconds=0.05,
        backoff_initial=0.01,
        backoff_max=0.04,
        start_checks=20,
        start_check_interval=0.01,
        terminate_attempts=3,
        terminate_retry_delay=0.01,
        grace_period=0.05,
        sleep=asyncio.sleep,
    )
    return dataclasses.replace(base, **changes)


def make_job(
    spec_yaml: str,
    job_id: int,
    prior: Sequence[JobStatus] = (),
    regions: Mapping[int, str] | None = None,
    cancel_requested: bool = False,
) -> job_pb2.Job:
    """A job as the scheduler assigns it: tasks from the spec, in the given statuses."""
    spec = parse_job_spec(spec_yaml)
    tasks = []
    for index, task_spec in enumerate(spec.tasks):
        status = prior[index] if index < len(prior) else S.PENDING
        tasks.append(
            job_pb2.Task(
                task_id=index,
                name=task_spec.name,
                status=int(status),  # type: ignore[arg-type]
                region=(regions or {}).get(index, ""),
                resources=resources_summary(task_spec),
                spec=task_spec,
            )
        )
    job = job_pb2.Job(
        job_id=job_id,
        name=spec.name,
        user="test",
        tasks=tasks,
        cancel_requested=cancel_requested,
        timeouts=spec.timeouts,
    )
    job.submit_time.GetCurrentTime()
    return job


# --- the world: a sim cloud in this process ---------------------------------------------------


class World:
    def __init__(self, cloud: RunningCloud, channel: grpc.aio.Channel) -> None:
        self.cloud = cloud
        self.address = f"127.0.0.1:{cloud.port}"
        self.sim = SimBackend(self.address)
        self.operator = spb_grpc.SimOperatorServiceStub(channel)
        self._channel = channel
        self._job_ids = itertools.count(1)

    @classmethod
    async def open(cls, config: CloudConfig = CLOUD) -> World:
        cloud = await start(config, port=0, security=ServerSecurity.without_auth())
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{cloud.port}")
        return cls(cloud, channel)

    async def close(self) -> None:
        await self.sim.close()
        await self._channel.close()
        await self.cloud.stop()

    def next_job_id(self) -> int:
        return next(self._job_ids)

    async def inventory(self, job_id: int) -> list[spb.Cluster]:
        return await list_inventory(self.operator, job_id=job_id)

    async def live(self, job_id: int) -> list[spb.Cluster]:
        """The job's clusters without a terminate time (live, or preempted and left behind)."""
        return [c for c in await self.inventory(job_id) if not c.HasField("terminate_time")]

    async def preempt(self, name: str) -> None:
        reply = await self.operator.PreemptCluster(spb.PreemptClusterRequest(cluster_name=name))
        assert reply.preempted, f"{name} was not live"

    async def set_spot_capacity(self, region: str, nodes: int) -> None:
        await self.operator.SetCapacity(spb.SetCapacityRequest(region=region, spot_nodes=nodes))

    async def inject(self, **faults: Any) -> None:
        await self.operator.InjectFaults(spb.InjectFaultsRequest(**faults))


# --- backends: the real one, recorded, and bent in one way each ---------------------------------


class Wrapped(BackendWrapper):
    """Passes every call to `inner`; subclasses change one behaviour.

    `bend` changes what the backend says of a cluster, the same way whether it is
    asked (`observe`, `observe_many`) or pushes it (`events`).
    """

    def bend(self, handle: ClusterHandle, seen: Observation) -> Observation:
        return seen

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        return self.launched(await self.inner.launch(plan))

    def launched(self, handle: ClusterHandle) -> ClusterHandle:
        """The handle a launch returned, with what the launch saw bent like every look."""
        if handle.seen is None:
            return handle
        return dataclasses.replace(handle, seen=self.bend(handle, handle.seen))

    async def observe(self, handle: ClusterHandle) -> Observation:
        return self.bend(handle, await self.inner.observe(handle))

    async def observe_many(
        self, handles: Sequence[ClusterHandle]
    ) -> dict[str, Observation | BackendError]:
        results = await self.inner.observe_many(handles)
        by_name = {h.cluster_name: h for h in handles}
        return {
            name: self.bend(by_name[name], seen) if isinstance(seen, Observation) else seen
            for name, seen in results.items()
        }

    def events(self) -> AsyncIterator[ClusterEvent] | None:
        stream = self.inner.events()
        return None if stream is None else self._bent(stream)

    async def _bent(self, stream: AsyncIterator[ClusterEvent]) -> AsyncIterator[ClusterEvent]:
        async for event in stream:
            if event.observation is not None:
                handle = self.handle_for(event.cluster_name)
                event = dataclasses.replace(event, observation=self.bend(handle, event.observation))
            yield event


@dataclasses.dataclass(frozen=True)
class Launch:
    """One `Backend.launch` call: which task, where it asked, what came of it."""

    task_id: int
    # "" (anywhere allowed), "in r1" (candidate regions) or "not r1" (blocked regions).
    where: str
    # The region launched in, "full: r1,r2" (regions tried), "precheck", "unreachable" or
    # "error".
    outcome: str
    under_grant: bool


class Recorder(Wrapped):
    """Records launches, terminations and pushed events, in one timeline with the host's."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.launches: list[Launch] = []
        self.timeline: list[tuple[str, ...]] = []
        self.host: Host | None = None
        # Set on every pushed event: proves the event stream is open.
        self.pushed = asyncio.Event()

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        where = ""
        if plan.candidate_regions:
            where = "in " + ",".join(plan.candidate_regions)
        if plan.blocked_regions:
            where = "not " + ",".join(plan.blocked_regions)
        granted = self.host is not None and self.host.slot.held
        try:
            handle = await self.inner.launch(plan)
        except ResourcesUnavailableError as error:
            outcome = "full: " + ",".join(error.regions_tried)
            self.launches.append(Launch(plan.task_id, where, outcome, granted))
            raise
        except PrecheckError:
            self.launches.append(Launch(plan.task_id, where, "precheck", granted))
            raise
        except BackendUnreachableError:
            self.launches.append(Launch(plan.task_id, where, "unreachable", granted))
            raise
        except BackendError:
            self.launches.append(Launch(plan.task_id, where, "error", granted))
            raise
        self.launches.append(Launch(plan.task_id, where, handle.region, granted))
        return handle

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        self.timeline.append(("terminate", handle.cluster_name))
        return await self.inner.terminate(handle, epoch, grace)

    def events(self) -> AsyncIterator[ClusterEvent] | None:
        stream = self.inner.events()
        return None if stream is None else self._relay(stream)

    async def _relay(self, stream: AsyncIterator[ClusterEvent]) -> AsyncIterator[ClusterEvent]:
        async for event in stream:
            self.pushed.set()
            yield event


def with_sim(plan: LaunchPlan, **options: Any) -> LaunchPlan:
    """The plan with `options` over its sim ones (the spec's `sim` key)."""
    sim = {**plan.extension("sim"), **options}
    return dataclasses.replace(plan, extensions={**plan.extensions, "sim": sim})


class FirstRunBehaves(Wrapped):
    """The first cluster of each task behaves as the `sim` options given say; later ones as
    the spec says."""

    def __init__(self, inner: Backend, **sim: Any) -> None:
        super().__init__(inner)
        self._sim = sim
        self._seen: set[str] = set()

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        if plan.cluster_name not in self._seen:
            self._seen.add(plan.cluster_name)
            plan = with_sim(plan, **self._sim)
        return await self.inner.launch(plan)


class LongFirstRun(FirstRunBehaves):
    """The first cluster of each task runs until something ends it (the spec applies later).

    So that a test can act while the lifecycle watches that cluster, whatever the
    spec's runtime.
    """

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner, runtime_seconds=1e9)


class FirstRunExits(FirstRunBehaves):
    """The first cluster of each task ends its run with `code`; later ones as the spec says."""

    def __init__(self, inner: Backend, code: int) -> None:
        super().__init__(inner, exit_code=code)


class NoPush(Wrapped):
    """A backend that cannot push: the lifecycle must poll."""

    def events(self) -> AsyncIterator[ClusterEvent] | None:
        return None


class NeverStartsFirst(Wrapped):
    """The task never leaves PENDING on the first cluster launched for it."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        # Names whose first cluster is the current one (until it is terminated).
        self._stuck: set[str] = set()
        self._seen: set[str] = set()

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        handle = await self.inner.launch(plan)
        if plan.cluster_name not in self._seen:
            self._seen.add(plan.cluster_name)
            self._stuck.add(plan.cluster_name)
        return self.launched(handle)

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        self._stuck.discard(handle.cluster_name)
        return await self.inner.terminate(handle, epoch, grace)

    def bend(self, handle: ClusterHandle, seen: Observation) -> Observation:
        if seen.task is not None and handle.cluster_name in self._stuck:
            return Observation(seen.cluster, TaskStatus.PENDING)
        return seen


class OddStatus(enum.Enum):
    """A task status this control plane does not know."""

    CANCELLED = "CANCELLED"


class OddTaskStatus(Wrapped):
    """Reports a task status outside `TaskStatus` once the task is running."""

    def bend(self, handle: ClusterHandle, seen: Observation) -> Observation:
        if seen.task in (TaskStatus.RUNNING, TaskStatus.SUCCEEDED) or seen.end is not None:
            return Observation(seen.cluster, cast(TaskStatus, OddStatus.CANCELLED))
        return seen


class FailingTerminate(Wrapped):
    """Terminate always fails: the cluster leaks, and the job must say so."""

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        raise BackendError(f"terminate {handle.cluster_name}: permission denied")


class UnconfirmedTerminate(Wrapped):
    """Terminates, but cannot say the cluster is gone (as the ssh and local backends):
    the lifecycle must ask `cluster_exists` itself."""

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        await self.inner.terminate(handle, epoch, grace)
        return False


class IgnoredTerminate(Wrapped):
    """Accepts every terminate and does nothing: only the lifecycle's own check can tell."""

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        return False


class UnreachableTerminate(Wrapped):
    """The backend never answers a terminate: the cleanup must give up, bounded, and say so."""

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        raise BackendUnreachableError(f"terminate {handle.cluster_name}: no answer")


class Islanded(Wrapped):
    """Once `cut`, the first cluster launched stops answering for good, as a partitioned
    SSH host: looks at it and terminates of it are unreachable, carrying `timeout` as an
    SSH pool's errors do (after `plain_first` plain errors without one). Clusters
    launched later answer."""

    def __init__(self, inner: Backend, timeout: float = 0.05, plain_first: int = 0) -> None:
        super().__init__(inner)
        self.timeout = timeout
        self.plain_first = plain_first
        self.cut = False
        self.first: ClusterHandle | None = None

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        handle = await self.inner.launch(plan)
        self.first = self.first or handle
        return handle

    def _silent(self, handle: ClusterHandle) -> bool:
        return self.cut and self.first is not None and handle.data == self.first.data

    def _error(self, handle: ClusterHandle) -> BackendError:
        if self.plain_first > 0:
            self.plain_first -= 1
            return BackendError(f"observe failed on the host of {handle.cluster_name}")
        return BackendUnreachableError(f"{handle.cluster_name}: no answer", timeout=self.timeout)

    async def observe(self, handle: ClusterHandle) -> Observation:
        if self._silent(handle):
            raise self._error(handle)
        return await super().observe(handle)

    async def observe_many(
        self, handles: Sequence[ClusterHandle]
    ) -> dict[str, Observation | BackendError]:
        silent = {h.cluster_name: self._error(h) for h in handles if self._silent(h)}
        answered = await super().observe_many([h for h in handles if not self._silent(h)])
        return {**answered, **silent}

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        if self._silent(handle):
            raise BackendUnreachableError(f"terminating {handle.cluster_name}: no answer")
        return await self.inner.terminate(handle, epoch, grace)


class VanishesAfterItsTask(Wrapped):
    """A cluster whose task finished is gone (DOWN) at the next look; its task's end is
    still readable, as the backend contract says (spot reclaimed right after success)."""

    def bend(self, handle: ClusterHandle, seen: Observation) -> Observation:
        if seen.end is not None:
            return Observation(ClusterStatus.DOWN, None, seen.end)
        return seen


class BlockingTerminate(Wrapped):
    """Terminations after the first `passes` wait for `release`; `entered` is set when one waits.

    So a test can hold the lifecycle inside its cleanup and act meanwhile.
    """

    def __init__(self, inner: Backend, passes: int = 0) -> None:
        super().__init__(inner)
        self.passes = passes
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        if self.passes > 0:
            self.passes -= 1
        else:
            self.entered.set()
            await self.release.wait()
        return await self.inner.terminate(handle, epoch, grace)


W = TypeVar("W", bound="Wrapped")


def layer(backend: Backend, kind: type[W]) -> W:
    """The wrapper of this kind around the real backend (`Recorder` first)."""
    while isinstance(backend, Wrapped):
        if isinstance(backend, kind):
            return backend
        backend = backend.inner
    raise LookupError(f"no {kind.__name__} layer")


# --- the host: what a replica gives a lifecycle -------------------------------------------------


class RecordedSlot:
    """A launch slot like the replica's: acquire waits for a grant, release is recorded."""

    def __init__(self, grant: bool) -> None:
        self.held = False
        self.grant = asyncio.Event()
        if grant:
            self.grant.set()
        self.waiting = asyncio.Event()
        self.acquires: list[str] = []
        self.releases: list[str] = []

    async def acquire(self, reason: str) -> None:
        if self.held:
            return
        self.acquires.append(reason)
        self.waiting.set()
        await self.grant.wait()
        self.waiting.clear()
        self.held = True

    async def release(self, wait_reason: str = "") -> None:
        if not self.held:
            return
        self.held = False
        self.releases.append(wait_reason)


@dataclasses.dataclass(frozen=True)
class Report:
    """A report the lifecycle made."""

    sent: TaskReport
    # Backend calls made for news of clusters before the report (`ClusterWatch.observe_calls`).
    looks: int


Hook = Callable[["World", "Host"], Coroutine[Any, Any, None]]


@dataclasses.dataclass(frozen=True)
class Hooks:
    """Test actions at moments of the lifecycle; each runs once."""

    # Awaited inside the first RUNNING report (before the lifecycle looks at the cluster).
    at_running: Hook | None = None
    # Started in the background when the watch first waits for news of a cluster.
    at_watch: Hook | None = None
    # Awaited inside the grace period after user code failed.
    at_grace: Hook | None = None
    # Awaited inside every RUNNING report (each new cluster), before the lifecycle looks.
    at_each_running: Hook | None = None


class HostWatcher:
    """A replica's watcher that also fires the `at_watch` hook when first waited on."""

    def __init__(self, host: Host, inner: Watcher) -> None:
        self._host = host
        self._inner = inner

    @property
    def notice_deadline(self) -> float | None:
        return self._inner.notice_deadline

    async def next(self, timeout: float | None) -> News | None:
        self._host.waiting_for_news()
        return await self._inner.next(timeout)

    def close(self) -> None:
        self._inner.close()


class Host:
    """A `JobHost` that records everything a replica would send on."""

    def __init__(
        self,
        world: World,
        job: job_pb2.Job,
        epoch: int,
        recorder: Recorder,
        watch: ClusterWatch,
        grant: bool = True,
        hooks: Hooks = Hooks(),
    ) -> None:
        self.world = world
        self.job_id = job.job_id
        self.epoch = epoch
        self._slot = RecordedSlot(grant)
        self.recorder = recorder
        self.timeline = recorder.timeline
        self.hub = watch
        self.hooks = hooks
        self.attempts: list[tuple[int, int]] = []
        self.reports: list[Report] = []
        # Statuses whose report the scheduler refuses, and how (an exception to raise).
        self.refuse: dict[JobStatus, Exception] = {}
        self.conditions: list[tuple[int, str]] = []
        self.notes: list[str] = []
        self.fetched: list[tuple[int, str, bytes, bool]] = []
        self.current = {t.task_id: S(t.status) for t in job.tasks}
        self.watching = asyncio.Event()
        # Backend calls made for news of clusters when a hook acted (see `Report.looks`).
        self.marks: dict[str, int] = {}
        self.background: list[asyncio.Task[None]] = []
        self._fired: set[str] = set()

    @property
    def slot(self) -> RecordedSlot:
        return self._slot

    def _once(self, name: str, hook: Hook | None) -> Hook | None:
        if hook is None or name in self._fired:
            return None
        self._fired.add(name)
        return hook

    async def report(self, report: TaskReport) -> None:
        task_id, status = report.task_id, report.status
        old = self.current[task_id]
        if status == old and report.condition is not None:
            # A condition of the task, not a transition.
            self.conditions.append((task_id, report.condition))
            return
        if status in self.refuse:
            raise self.refuse.pop(status)
        # The scheduler's store refuses what the table forbids; so do we.
        if not task_transition_allowed(old, status):
            raise ValueError(f"task {task_id}: {old.name} -> {status.name} is not allowed")
        self.current[task_id] = status
        self.reports.append(Report(report, self.hub.observe_calls))
        self.timeline.append(("report", str(task_id), status.name))
        if status == S.RUNNING and (hook := self._once("running", self.hooks.at_running)):
            await hook(self.world, self)
        if status == S.RUNNING and self.hooks.at_each_running is not None:
            await self.hooks.at_each_running(self.world, self)

    def note(self, message: str) -> None:
        self.notes.append(message)

    async def fetch_logs(self, task_id: int, handle: ClusterHandle, attempt: int) -> None:
        # As through the logs service: a backend that cannot answer leaves nothing saved.
        try:
            data = await self.recorder.read_logs(handle)
            # The test's own look, not a call of the lifecycle's backend.
            exists = await self.world.sim.cluster_exists(handle.cluster_name)
        except BackendError:
            data, exists = b"", False
        self.fetched.append((task_id, handle.cluster_name, data, exists))
        self.attempts.append((task_id, attempt))
        self.timeline.append(("fetch", str(task_id)))

    def watch(self, handle: ClusterHandle) -> HostWatcher:
        return HostWatcher(self, self.hub.watch(handle))

    async def look(self, handle: ClusterHandle) -> News:
        return await self.hub.look(handle)

    def waiting_for_news(self) -> None:
        self.watching.set()
        if hook := self._once("watch", self.hooks.at_watch):
            self.background.append(asyncio.create_task(hook(self.world, self)))

    async def grace_sleep(self, delay: float, grace: float) -> None:
        """The injected sleep: runs the grace hook inside the grace period; a sleep that
        ran to its end joins the timeline."""
        if delay == grace and (hook := self._once("grace", self.hooks.at_grace)):
            await hook(self.world, self)
        await asyncio.sleep(delay)
        self.timeline.append(("slept", f"{delay:g}"))

    # --- what the test reads ---

    def statuses(self, task_id: int) -> list[JobStatus]:
        return [r.sent.status for r in self.reports if r.sent.task_id == task_id]

    def last(self, task_id: int) -> TaskReport:
        return [r.sent for r in self.reports if r.sent.task_id == task_id][-1]

    def final(self, task_id: int) -> JobStatus:
        return self.current[task_id]


class RunningJob:
    """One job's lifecycle run by `run_job` in the background, as a replica runs it."""

    def __init__(
        self, world: World, host: Host, lifecycle: JobLifecycle, watch: ClusterWatch
    ) -> None:
        self.world = world
        self.host = host
        self.lifecycle = lifecycle
        self.watch = watch
        self.cancel = CancelRequest()
        self.task = asyncio.create_task(run_job(lifecycle, self.cancel))
        self.reason: str | None = None

    @property
    def job_id(self) -> int:
        return self.host.job_id

    def request_cancel(self) -> None:
        """Requests the cancel, marked in the timeline."""
        self.host.timeline.append(("cancel",))
        self.cancel.set()

    async def finished(self, timeout: float = DEADLINE) -> None:
        """Waits for the job (cleanup included) to end.

        Re-raises what the job or a background hook raised; a job still running after
        `timeout` fails the test with the end of its lifecycle log.
        """
        done, _ = await asyncio.wait({self.task}, timeout=timeout)
        try:
            if not done:
                log = "\n".join(self.host.notes[-40:])
                raise AssertionError(f"job {self.job_id} still running after {timeout}s:\n{log}")
            self.reason = self.task.result()
            for task in self.host.background:
                await asyncio.wait_for(task, DEADLINE)
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Ends whatever is left of the job (idempotent)."""
        self.task.cancel()
        for task in self.host.background:
            task.cancel()
        await asyncio.gather(self.task, *self.host.background, return_exceptions=True)
        await self.watch.close()


async def start_job(
    world: World,
    job: job_pb2.Job,
    *,
    epoch: int = 1,
    config: LifecycleConfig | None = None,
    wrap: Callable[[Backend], Backend] | None = None,
    grant: bool = True,
    hooks: Hooks = Hooks(),
    before: Callable[[World], Awaitable[None]] | None = None,
) -> RunningJob:
    """Starts `run_job` for the job, with the backend wrapped as asked and recorded.

    `before` shapes the cloud (capacity, faults) once the harness is ready and
    before the job starts.
    """
    host, lifecycle = await build(
        world, job, epoch=epoch, config=config, wrap=wrap, grant=grant, hooks=hooks
    )
    if before is not None:
        await before(world)
    return RunningJob(world, host, lifecycle, host.hub)


async def build(
    world: World,
    job: job_pb2.Job,
    *,
    epoch: int = 1,
    config: LifecycleConfig | None = None,
    wrap: Callable[[Backend], Backend] | None = None,
    grant: bool = True,
    hooks: Hooks = Hooks(),
) -> tuple[Host, JobLifecycle]:
    """A host and a lifecycle for the job, its cluster watch fed by the backend's events."""
    recorder = Recorder(wrap(world.sim) if wrap else world.sim)
    config = config or fast_config()
    watch = ClusterWatch(recorder, config.poll_interval)
    host = Host(world, job, epoch, recorder, watch, grant=grant, hooks=hooks)
    recorder.host = host
    grace = config.grace_seconds
    config = dataclasses.replace(config, sleep=lambda delay: host.grace_sleep(delay, grace))
    watch.start()
    if recorder.events() is not None:
        await _stream_open(world, recorder)
    return host, JobLifecycle(job, host, recorder, config)


async def _stream_open(world: World, recorder: Recorder) -> None:
    """Waits until pushed events flow: the stream starts "from now", so probe until one shows."""
    for _ in range(100):
        probe = next(_probe_ids)
        plan = LaunchPlan(job_id=probe, task_id=0, epoch=1, cluster_name=f"probe-{probe}")
        await world.sim.terminate(await world.sim.launch(plan))
        try:
            await asyncio.wait_for(recorder.pushed.wait(), 0.1)
            return
        except TimeoutError:
            continue
    raise AssertionError("the sim cloud's event stream never opened")


async def prelaunch(world: World, job_id: int, task_id: int, sim: Mapping[str, Any]) -> str:
    """Launches a task's cluster as a previous holder of the job (epoch 1) would have."""
    name = cluster_name(job_id, task_id)
    plan = LaunchPlan(
        job_id=job_id,
        task_id=task_id,
        epoch=1,
        cluster_name=name,
        use_spot=True,
        extensions={"sim": sim},
    )
    handle = await world.sim.launch(plan)
    return handle.region


__all__ = [
    "CLOUD",
    "DEADLINE",
    "EAST",
    "EU",
    "REGIONS",
    "WEST",
    "BlockingTerminate",
    "FailingTerminate",
    "FirstRunExits",
    "Hooks",
    "Host",
    "Launch",
    "LongFirstRun",
    "NeverStartsFirst",
    "NoPush",
    "OddTaskStatus",
    "Recorder",
    "RunningJob",
    "UnreachableTerminate",
    "VanishesAfterItsTask",
    "World",
    "Wrapped",
    "build",
    "fast_config",
    "layer",
    "make_job",
    "prelaunch",
    "start_job",
]
