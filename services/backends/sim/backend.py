"""The `sim` backend: the client of `mj-simcloud`, the simulated cloud (contract §10).

Clusters live in the sim cloud process, so every controller replica and the
logs service see the same ones; a cluster is found by its name alone. The task
a cluster runs behaves as the spec's `sim` key says (runtime_seconds,
setup_seconds, exit_code, exit_code_runs, setup_exit_code, log_lines,
preempt_after_seconds, sigterm_exit_seconds; defaults in
services/simcloud/clusters.py), and `run` and `setup` are never executed.

Errors from the cloud map onto the backend's: RESOURCE_EXHAUSTED ->
`ResourcesUnavailableError` (regions_tried from the ErrorInfo metadata),
FAILED_PRECONDITION with reason STALE_EPOCH -> `StaleEpochError`, other
INVALID_ARGUMENT and FAILED_PRECONDITION -> `PrecheckError`, UNAVAILABLE and
DEADLINE_EXCEEDED -> `BackendUnreachableError`; NOT_FOUND means the cluster
never existed (DOWN, no task status, does not exist).

What the backend reads (`observe`, `observe_many` with one GetClusters call per
1,000 clusters, and every pushed event) is a whole `Observation`: a task that
finished keeps its status (`task`) and its `TaskEnd` (exit code, end time) after
its cluster was preempted, until the cluster is terminated; an unfinished task
on a DOWN cluster is unreadable (`task=None`).

`events()` is the cloud's WatchEvents stream: every cluster and task status
change, each with its whole observation, and every preemption notice
(`ClusterEvent.notice_deadline`, Unix seconds), so controllers hear of a
preemption, a coming one or a finished task at once. The backend remembers the
last sequence number it saw and resumes after it when the caller
(services/controller/watch.py) reopens the stream; a cloud that restarted (the
resume is OUT_OF_RANGE) or dropped the events (FAILED_PRECONDITION) is watched
afresh from its head.

Durations the cloud is given are simulated seconds: `terminate`'s grace, like
the `sim` key's runtime, passes `time_scale` times faster than real time, and
the Terminate call, which returns once the cluster is gone, may take that long.
Launches asked for at once go as one LaunchClusters call (`launches`), stops and
teardowns as one TerminateClusters call per grace (`terminations`), each item
answered, and failed, on its own; a stop or teardown never waits for an earlier
batch, whose answer may wait for its tasks' grace to run out. Log reads asked for
at once go as one GetLogs call (`log_reads`). A batched launch whose caller gives
up (a cancel, a drain) is torn down before the caller goes on, and again should its
batch still bring it UP, as the cloud rolls back a lone Launch cancelled mid-way;
closing the backend cancels its batches in flight, which the cloud rolls back.
`notify_preemption` passes a notice on to the task (SIGTERM and the notice file,
recorded by the cloud); a cluster never launched, already down or whose task
ended has nothing to tell and the call returns quietly.

`regions()` is None until the backend first heard from the cloud: `load()` (or
any `reachable()` probe) fetches ListRegions once and caches the region names
and the time scale; `regions()` itself starts that fetch in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf import timestamp_pb2

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as pb_grpc
from services.backends.base import (
    Backend,
    BackendError,
    BackendUnreachableError,
    ClusterEvent,
    ClusterHandle,
    ClusterStatus,
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    StaleEpochError,
    TaskEnd,
    TaskRequest,
    TaskStatus,
)
from services.common.background import Background
from services.common.channels import ClientSecurity, open_channel
from services.common.coalesce import Coalescer
from services.common.errors import error_info
from services.scheduler.spec.fields import NEVER
from services.simcloud.bounds import NAME_RE

log = logging.getLogger(__name__)

_CLUSTER_STATUS = {
    pb.CLUSTER_STATUS_INIT: ClusterStatus.INIT,
    pb.CLUSTER_STATUS_UP: ClusterStatus.UP,
    pb.CLUSTER_STATUS_DOWN: ClusterStatus.DOWN,
    pb.CLUSTER_STATUS_TERMINATED: ClusterStatus.DOWN,
}
_TASK_STATUS = {
    pb.TASK_STATUS_PENDING: TaskStatus.PENDING,
    pb.TASK_STATUS_SETTING_UP: TaskStatus.SETTING_UP,
    pb.TASK_STATUS_RUNNING: TaskStatus.RUNNING,
    pb.TASK_STATUS_SUCCEEDED: TaskStatus.SUCCEEDED,
    pb.TASK_STATUS_FAILED: TaskStatus.FAILED,
    pb.TASK_STATUS_FAILED_SETUP: TaskStatus.FAILED_SETUP,
}
_PRECHECK = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Clusters per GetClusters call (the cloud's limit).
GET_CLUSTERS_BATCH = 1000
# Launches in one LaunchClusters call at most; a request larger than LAUNCH_ALONE_BYTES
# (a long `log_lines` script) goes alone, so a batch stays within gRPC's 4 MiB message.
LAUNCH_BATCH = 256
LAUNCH_ALONE_BYTES = 12 * 1024
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def error_metadata(exc: grpc.aio.AioRpcError) -> dict[str, str]:
    """The metadata of the google.rpc ErrorInfo carried by a failed call, if any."""
    return dict(error_info(exc).metadata)


def backend_error(exc: grpc.aio.AioRpcError) -> BackendError:
    """The backend error for a failed call to the sim cloud."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        tried = error_metadata(exc).get("regions_tried", "")
        return ResourcesUnavailableError(details, [r for r in tried.split(",") if r])
    return _error(code, details, error_info(exc).reason)


def call_error(error: pb.CallError) -> BackendError:
    """The backend error for one failed call of a batch."""
    code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    return _error(code, error.message, error.reason)


def _error(code: grpc.StatusCode, details: str, reason: str) -> BackendError:
    if code == grpc.StatusCode.FAILED_PRECONDITION and reason == "STALE_EPOCH":
        return StaleEpochError(details)
    if code in _PRECHECK:
        return PrecheckError(details)
    if code in _UNREACHABLE:
        return BackendUnreachableError(f"sim cloud unreachable: {code.name}: {details}")
    return BackendError(f"sim cloud error: {code.name}: {details}")


def _launch_outcome(result: pb.LaunchResult) -> pb.LaunchResponse | BaseException:
    if not result.HasField("error"):
        return result.response
    error = result.error
    if _STATUS_CODES.get(error.code) == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourcesUnavailableError(error.message, list(result.regions_tried))
    return call_error(error)


def _batchable(handle: ClusterHandle) -> str:
    """The cluster's name, for a batched call; a name the cloud would refuse is refused
    here, alone, rather than failing the batch it would have gone in."""
    if not NAME_RE.fullmatch(handle.cluster_name):
        raise PrecheckError(f"not a sim cluster name: {handle.cluster_name[:200]!r}")
    return handle.cluster_name


def launch_request(
    request: TaskRequest, candidate_regions: Sequence[str], blocked_regions: Sequence[str]
) -> pb.LaunchRequest:
    """The Launch call for a task attempt.

    Raises:
        PrecheckError: the `sim` settings cannot be read.
    """
    sim = request.sim
    behavior = pb.TaskBehavior(has_setup=bool(request.setup.strip()))
    try:
        if "runtime_seconds" in sim:
            behavior.runtime_seconds = float(sim["runtime_seconds"])
        if "preempt_after_seconds" in sim:
            behavior.preempt_after_seconds = float(sim["preempt_after_seconds"])
        behavior.setup_seconds = float(sim.get("setup_seconds", 0.0))
        behavior.exit_code = int(sim.get("exit_code", 0))
        behavior.setup_exit_code = int(sim.get("setup_exit_code", 0))
        behavior.exit_code_runs = int(sim.get("exit_code_runs", 0))
        if "log_lines" in sim:
            behavior.log_lines.lines.extend(str(line) for line in sim["log_lines"])
        sigterm_exit = sim.get("sigterm_exit_seconds")
        if sigterm_exit == NEVER:
            behavior.sigterm_ignored = True
        elif sigterm_exit is not None:
            behavior.sigterm_exit_seconds = float(sigterm_exit)
    except (TypeError, ValueError) as exc:
        raise PrecheckError(f"sim: {exc}") from exc
    return pb.LaunchRequest(
        cluster_name=request.cluster_name,
        job_id=request.job_id,
        task_id=request.task_id,
        epoch=request.epoch,
        resources=pb.Resources(
            cloud=request.cloud,
            region=request.region,
            zone=request.zone,
            cpus=request.cpus,
            memory=request.memory,
            accelerators=request.accelerators,
            use_spot=request.use_spot,
            num_nodes=request.num_nodes,
        ),
        candidate_regions=list(candidate_regions),
        blocked_regions=list(blocked_regions),
        behavior=behavior,
    )


def observation(message: pb.Cluster | pb.ClusterEvent) -> Observation:
    """What a cluster record, or an event about one, of the sim cloud says.

    The cloud reports the task's status while the cluster is UP and a finished
    task's while DOWN (UNSPECIFIED otherwise, and always once terminated).
    """
    status_code = message.status if isinstance(message, pb.Cluster) else message.cluster_status
    status = _CLUSTER_STATUS.get(status_code, ClusterStatus.DOWN)
    task = _TASK_STATUS.get(message.task_status)
    if status is ClusterStatus.INIT or (
        status is ClusterStatus.DOWN and not (task and task.finished)
    ):
        task = None
    end = None
    if task is not None and task.finished and message.HasField("task_end_time"):
        end = TaskEnd(task, message.exit_code, message.task_end_time.ToNanoseconds() / 1e9)
    notice = None
    if status is ClusterStatus.UP and message.HasField("notice_deadline"):
        notice = message.notice_deadline.ToNanoseconds() / 1e9
    seq = message.event_seq if isinstance(message, pb.Cluster) else message.seq
    return Observation(status, task, end, notice, seq)


class SimBackend(Backend):
    """Clusters in the sim cloud, reached over one gRPC channel."""

    name = "sim"
    # A launch is one RPC and the cloud holds no process per cluster.
    launch_concurrency = 256

    def __init__(
        self,
        address: str,
        *,
        timeout: float = 10.0,
        launch_timeout: float = 3600.0,
        reachable_timeout: float = 2.0,
        security: ClientSecurity | None = None,
    ) -> None:
        """Creates the backend; the channel opens on first use.

        Args:
            address: host:port of mj-simcloud.
            security: The token (a controller's, or the logs service's) and TLS to call with.
            timeout: Seconds for each call but Launch and log streams.
            launch_timeout: Seconds a Launch may take (it returns once the cluster is UP).
            reachable_timeout: Seconds `reachable` waits for an answer.
        """
        self.address = address
        self._timeout = timeout
        self._launch_timeout = launch_timeout
        self._reachable_timeout = reachable_timeout
        self._security = security or ClientSecurity()
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SimCloudServiceAsyncStub | None = None
        self._after_seq = 0
        # From ListRegions, once heard (`load`).
        self._regions: tuple[str, ...] | None = None
        self._time_scale: float | None = None
        self._loading = Background("sim-regions", self._load_quietly)
        # Launches asked for at once go as one LaunchClusters call, never waiting for an
        # earlier batch (a launch may take minutes); one done for a caller that gave up
        # meanwhile is torn down.
        self.launches: Coalescer[None, pb.LaunchRequest, pb.LaunchResponse] = Coalescer(
            self._launch_clusters,
            max_batch=LAUNCH_BATCH,
            in_flight=LAUNCH_BATCH,
            abandoned=lambda call, _: self._abandon(call),
        )
        self._teardowns: set[asyncio.Task[None]] = set()
        # Stops and teardowns asked for at once go as one TerminateClusters call, by
        # (keep_cluster, grace): a long grace never holds up a short one. The cloud answers
        # once every task of the batch ended, up to the grace later (a task that traps
        # SIGTERM), so a call never waits for an earlier batch: its SIGTERM goes at once.
        self.terminations: Coalescer[tuple[bool, float], pb.TerminateRequest, None] = Coalescer(
            self._terminate_clusters, max_batch=GET_CLUSTERS_BATCH, in_flight=None
        )
        # Log reads asked for at once (the logs service fetching many clusters' logs
        # before their teardown) go as one GetLogs call.
        self.log_reads: Coalescer[None, str, bytes | None] = Coalescer(
            self._get_logs, max_batch=GET_CLUSTERS_BATCH
        )

    def _cloud(self) -> pb_grpc.SimCloudServiceAsyncStub:
        if self._stub is None:
            self._channel = open_channel(self.address, self._security)
            self._stub = pb_grpc.SimCloudServiceStub(self._channel)
        return self._stub

    async def launch(
        self,
        request: TaskRequest,
        candidate_regions: Sequence[str] = (),
        blocked_regions: Sequence[str] = (),
    ) -> ClusterHandle:
        """Launches in the sim cloud; returns once the cluster is UP and its task started."""
        call = launch_request(request, candidate_regions, blocked_regions)
        if call.ByteSize() > LAUNCH_ALONE_BYTES:
            try:
                reply = await self._cloud().Launch(call, timeout=self._launch_timeout)
            except grpc.aio.AioRpcError as exc:
                raise backend_error(exc) from exc
        else:
            try:
                reply = await self.launches.call(None, call)
            except asyncio.CancelledError:
                # The cloud rolls back a lone Launch whose caller gives up; a batch goes on,
                # and may have started this one: it is torn down before the caller goes on
                # (to its own cleanup, which may not know of this cluster).
                await asyncio.shield(self._abandon(call))
                raise
        cluster = reply.cluster
        return ClusterHandle(
            cluster_name=cluster.name,
            backend=self.name,
            region=cluster.region,
            zone=cluster.zone,
            data={"cluster_id": cluster.cluster_id},
            seen=observation(cluster),
        )

    async def _launch_clusters(
        self, _: None, calls: list[pb.LaunchRequest]
    ) -> list[pb.LaunchResponse | BaseException]:
        """One LaunchClusters call; each failed item as the error it would raise alone."""
        request = pb.LaunchClustersRequest(calls=calls)
        try:
            reply = await self._cloud().LaunchClusters(request, timeout=self._launch_timeout)
        except grpc.aio.AioRpcError as exc:
            raise backend_error(exc) from exc
        return [_launch_outcome(result) for result in reply.results]

    def _abandon(self, call: pb.LaunchRequest) -> asyncio.Task[None]:
        """Tears down what a launch its caller gave up on may have started: nobody else
        would ever end it. (Terminated while provisioning, it fails in its batch.)"""
        handle = ClusterHandle(call.cluster_name, self.name)
        task = asyncio.create_task(self._tear_down(handle, call.epoch), name="abandoned-launch")
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)
        return task

    async def _tear_down(self, handle: ClusterHandle, epoch: int) -> None:
        if self.own_call_fence is not None:
            try:
                await self.own_call_fence(f"teardown of {handle.cluster_name}, a launch given up")
            except Exception as refusal:  # the fence's reason: the caller lost the job
                log.info(
                    "abandoned launch left to the job's next holder",
                    extra={"cluster": handle.cluster_name, "reason": str(refusal)},
                )
                return
        try:
            await self.terminate(handle, epoch)
        except BackendError as error:
            # A newer epoch holds it (its holder decides), or the cloud is away: the
            # cluster is then the job's next holder's to find by its name.
            log.info(
                "abandoned launch not torn down",
                extra={"cluster": handle.cluster_name, "error": str(error)},
            )

    def handle_for(self, cluster_name: str) -> ClusterHandle:
        return ClusterHandle(cluster_name, self.name)

    async def _get(self, cluster_name: str) -> pb.Cluster | None:
        """The latest cluster of the name, or None if it never existed."""
        request = pb.GetClusterRequest(cluster_name=cluster_name)
        try:
            reply = await self._cloud().GetCluster(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise backend_error(exc) from exc
        return reply.cluster

    async def observe(self, handle: ClusterHandle) -> Observation:
        cluster = await self._get(handle.cluster_name)
        return Observation(ClusterStatus.DOWN) if cluster is None else observation(cluster)

    async def observe_many(
        self, handles: Sequence[ClusterHandle]
    ) -> dict[str, Observation | BackendError]:
        """One GetClusters call per 1,000 clusters; a failed call fails only its own."""
        out: dict[str, Observation | BackendError] = {}
        names: list[str] = []
        for name in dict.fromkeys(handle.cluster_name for handle in handles):
            if NAME_RE.fullmatch(name):
                names.append(name)
            else:
                # Refused alone, rather than failing the call for every other cluster.
                out[name] = PrecheckError(f"invalid cluster name {name[:200]!r}")
        batches = [
            names[i : i + GET_CLUSTERS_BATCH] for i in range(0, len(names), GET_CLUSTERS_BATCH)
        ]
        for batch, seen in zip(
            batches, await asyncio.gather(*(self._get_many(b) for b in batches)), strict=True
        ):
            for name in batch:
                if isinstance(seen, BackendError):
                    out[name] = seen
                else:
                    out[name] = seen.get(name) or BackendError(f"the sim cloud omitted {name}")
        return out

    async def _get_many(self, names: Sequence[str]) -> dict[str, Observation] | BackendError:
        request = pb.GetClustersRequest(cluster_names=names)
        try:
            reply = await self._cloud().GetClusters(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            return backend_error(exc)
        seen = dict.fromkeys(reply.unknown_cluster_names, Observation(ClusterStatus.DOWN))
        seen.update((cluster.name, observation(cluster)) for cluster in reply.clusters)
        return seen

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        """Terminates the cluster; a live task gets SIGTERM and `grace` simulated seconds.

        Returns (True) once the cloud has the cluster gone: it answers a teardown only then.
        """
        await self._terminate(handle, epoch, grace, keep_cluster=False)
        return True

    async def stop(self, handle: ClusterHandle, epoch: int, grace: float) -> None:
        """SIGTERM, SIGKILL after `grace` simulated seconds; the cluster and its log stay
        until `terminate`. Returns once the task is no longer live."""
        await self._terminate(handle, epoch, grace, keep_cluster=True)

    async def _terminate(
        self, handle: ClusterHandle, epoch: int, grace: float, *, keep_cluster: bool
    ) -> None:
        if not (math.isfinite(grace) and grace >= 0):
            raise PrecheckError(f"grace must be a finite number >= 0, got {grace}")
        request = pb.TerminateRequest(
            cluster_name=_batchable(handle),
            epoch=epoch,
            grace_seconds=grace,
            keep_cluster=keep_cluster,
        )
        if grace > 0:
            await self.load()
        await self.terminations.call((keep_cluster, grace), request)

    async def _terminate_clusters(
        self, key: tuple[bool, float], calls: list[pb.TerminateRequest]
    ) -> list[BaseException | None]:
        """One TerminateClusters call; each failed item as the error it would raise alone."""
        _, grace = key
        timeout = self._timeout + grace / (self._time_scale or 1.0)
        request = pb.TerminateClustersRequest(calls=calls)
        try:
            reply = await self._cloud().TerminateClusters(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise backend_error(exc) from exc
        return [
            call_error(result.error) if result.HasField("error") else None
            for result in reply.results
        ]

    async def notify_preemption(self, handle: ClusterHandle, epoch: int, deadline: float) -> None:
        """Has the cloud deliver SIGTERM and the notice file (the deadline) to the task.

        Raises:
            StaleEpochError: a newer epoch of the job holds the cluster.
            BackendUnreachableError: the cloud cannot be asked now.
        """
        if not math.isfinite(deadline):
            raise PrecheckError(f"a preemption deadline is a Unix time, got {deadline}")
        stamp = timestamp_pb2.Timestamp()
        stamp.FromNanoseconds(int(deadline * 1e9))
        request = pb.NotifyPreemptionRequest(
            cluster_name=handle.cluster_name, epoch=epoch, deadline=stamp
        )
        try:
            await self._cloud().NotifyPreemption(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return
            raise backend_error(exc) from exc

    async def cluster_exists(self, cluster_name: str) -> bool:
        cluster = await self._get(cluster_name)
        return cluster is not None and cluster.status != pb.CLUSTER_STATUS_TERMINATED

    async def read_logs(self, handle: ClusterHandle) -> bytes:
        """The log as it is now; reads asked for at once share one GetLogs call."""
        data = await self.log_reads.call(None, _batchable(handle))
        if data is None:  # too big to share an answer: read alone
            data = b"".join([chunk async for chunk in self._logs(handle, follow=False)])
        return data

    async def _get_logs(self, _: None, names: list[str]) -> list[bytes | BaseException | None]:
        """One GetLogs call; None for a log left out of the answer."""
        try:
            reply = await self._cloud().GetLogs(
                pb.GetLogsRequest(cluster_names=names), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise backend_error(exc) from exc
        return [None if log.omitted else log.data for log in reply.logs]

    def tail_logs(self, handle: ClusterHandle) -> AsyncIterator[bytes]:
        return self._logs(handle, follow=True)

    async def _logs(self, handle: ClusterHandle, follow: bool) -> AsyncIterator[bytes]:
        request = pb.ReadLogsRequest(cluster_name=handle.cluster_name, follow=follow)
        call = self._cloud().ReadLogs(request, timeout=None if follow else self._timeout)
        try:
            async for reply in call:
                yield reply.data
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return
            raise backend_error(exc) from exc
        finally:
            call.cancel()

    async def reachable(self) -> bool:
        try:
            reply = await self._cloud().ListRegions(
                pb.ListRegionsRequest(), timeout=self._reachable_timeout
            )
        except grpc.aio.AioRpcError:
            return False
        self._remember(reply)
        return True

    async def load(self) -> None:
        """Fetches the cloud's regions and time scale, unless already known.

        Raises:
            BackendUnreachableError: the cloud cannot be asked now.
        """
        if self._regions is not None:
            return
        try:
            reply = await self._cloud().ListRegions(pb.ListRegionsRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise backend_error(exc) from exc
        self._remember(reply)

    async def prepare(self) -> None:
        """Learns the cloud's regions and time scale, if it answers now."""
        with contextlib.suppress(BackendError):
            await self.load()

    def _remember(self, reply: pb.ListRegionsResponse) -> None:
        self._regions = tuple(region.name for region in reply.regions)
        self._time_scale = reply.time_scale or None

    def regions(self) -> Sequence[str] | None:
        """The cloud's regions once heard (`load`); None before, while a fetch starts."""
        if self._regions is None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return None
            self._loading.start()
        return self._regions

    async def _load_quietly(self) -> None:
        try:
            await self.load()
        except BackendError:
            # Asked again at the next regions() or reachable().
            return

    def events(self) -> AsyncIterator[ClusterEvent] | None:
        return self._events()

    async def _events(self) -> AsyncIterator[ClusterEvent]:
        call = self._cloud().WatchEvents(pb.WatchEventsRequest(after_seq=self._after_seq))
        try:
            async for reply in call:
                if not reply.events:
                    # The hello: resume from here if the stream breaks before any event.
                    self._after_seq = self._after_seq or reply.head_seq
                    continue
                for event in reply.events:
                    self._after_seq = event.seq
                    deadline = None
                    if event.kind == pb.EVENT_KIND_PREEMPTION_NOTICE and event.HasField(
                        "notice_deadline"
                    ):
                        deadline = event.notice_deadline.ToNanoseconds() / 1e9
                    yield ClusterEvent(
                        cluster_name=event.cluster_name,
                        observation=observation(event),
                        notice_deadline=deadline,
                    )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE):
                # The events after our seq are gone, or the cloud restarted: start afresh;
                # the caller wakes every watcher, so nothing missed goes unchecked.
                self._after_seq = 0
            raise backend_error(exc) from exc
        finally:
            call.cancel()

    async def close(self) -> None:
        for task in list(self._teardowns):
            task.cancel()
        await asyncio.gather(*self._teardowns, return_exceptions=True)
        await self._loading.stop()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None


def from_settings(settings: Mapping[str, Any]) -> SimBackend:
    """The sim backend of a service: the client of the sim cloud at `simcloud_address`,
    calling with the service's own token and TLS settings (`settings.CLIENT_SECURITY`)."""
    address = settings.get("simcloud_address")
    if not address:
        raise ValueError("the sim backend needs simcloud_address (host:port of mj-simcloud)")
    return SimBackend(str(address), security=ClientSecurity.from_settings(settings))
