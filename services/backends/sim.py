"""The `sim` backend: the client of `mj-simcloud`, the simulated cloud (SPEC §10).

Clusters live in the sim cloud process, so every controller replica and the
logs service see the same ones; a cluster is found by its name alone. The task
a cluster runs behaves as the spec's `sim` key says (runtime_seconds,
setup_seconds, exit_code, setup_exit_code, log_lines, preempt_after_seconds;
defaults in services/simcloud/clusters.py), and `run` and `setup` are never
executed.

Errors from the cloud map onto the backend's: RESOURCE_EXHAUSTED ->
`ResourcesUnavailableError` (regions_tried from the ErrorInfo metadata),
INVALID_ARGUMENT and FAILED_PRECONDITION -> `PrecheckError`, UNAVAILABLE and
DEADLINE_EXCEEDED -> `BackendUnreachableError`; NOT_FOUND means the cluster
never existed (DOWN, no task status, does not exist).

`events()` is the cloud's WatchEvents stream: every cluster and task status
change, so controllers hear of a preemption or a finished task at once. The
backend remembers the last sequence number it saw and resumes after it when the
caller (services/controller/watch.py) reopens the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

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
from services.common.channels import ClientSecurity, open_channel

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


def error_info(exc: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The google.rpc ErrorInfo carried by a failed call (empty if none)."""
    for key, value in exc.trailing_metadata() or ():
        if key != "grpc-status-details-bin" or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return info
    return error_details_pb2.ErrorInfo()


def error_metadata(exc: grpc.aio.AioRpcError) -> dict[str, str]:
    """The metadata of the google.rpc ErrorInfo carried by a failed call, if any."""
    return dict(error_info(exc).metadata)


def backend_error(exc: grpc.aio.AioRpcError) -> BackendError:
    """The backend error for a failed call to the sim cloud."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        tried = error_metadata(exc).get("regions_tried", "")
        return ResourcesUnavailableError(details, [r for r in tried.split(",") if r])
    if code == grpc.StatusCode.FAILED_PRECONDITION and error_info(exc).reason == "STALE_EPOCH":
        return StaleEpochError(details)
    if code in _PRECHECK:
        return PrecheckError(details)
    if code in _UNREACHABLE:
        return BackendUnreachableError(f"sim cloud unreachable: {code.name}: {details}")
    return BackendError(f"sim cloud error: {code.name}: {details}")


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
        if "log_lines" in sim:
            behavior.log_lines.lines.extend(str(line) for line in sim["log_lines"])
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


def observation(cluster: pb.Cluster) -> Observation:
    """What a cluster record of the sim cloud says."""
    status = _CLUSTER_STATUS.get(cluster.status, ClusterStatus.DOWN)
    task = _TASK_STATUS.get(cluster.task_status)
    end = None
    if task is not None and task.finished and cluster.HasField("task_end_time"):
        end = TaskEnd(task, cluster.exit_code, cluster.task_end_time.ToNanoseconds() / 1e9)
    return Observation(status, task if status is ClusterStatus.UP else None, end)


class SimBackend(Backend):
    """Clusters in the sim cloud, reached over one gRPC channel."""

    name = "sim"

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
        try:
            reply = await self._cloud().Launch(call, timeout=self._launch_timeout)
        except grpc.aio.AioRpcError as exc:
            raise backend_error(exc) from exc
        cluster = reply.cluster
        return ClusterHandle(
            cluster_name=cluster.name,
            backend=self.name,
            region=cluster.region,
            zone=cluster.zone,
            data={"cluster_id": cluster.cluster_id},
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

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> None:
        request = pb.TerminateRequest(cluster_name=handle.cluster_name, epoch=epoch)
        try:
            await self._cloud().Terminate(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise backend_error(exc) from exc

    async def cluster_exists(self, cluster_name: str) -> bool:
        cluster = await self._get(cluster_name)
        return cluster is not None and cluster.status != pb.CLUSTER_STATUS_TERMINATED

    async def read_logs(self, handle: ClusterHandle) -> bytes:
        return b"".join([chunk async for chunk in self._logs(handle, follow=False)])

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
            await self._cloud().ListRegions(
                pb.ListRegionsRequest(), timeout=self._reachable_timeout
            )
        except grpc.aio.AioRpcError:
            return False
        return True

    def events(self) -> AsyncIterator[ClusterEvent] | None:
        return self._events()

    async def _events(self) -> AsyncIterator[ClusterEvent]:
        call = self._cloud().WatchEvents(pb.WatchEventsRequest(after_seq=self._after_seq))
        try:
            async for reply in call:
                if not reply.HasField("event"):
                    # The hello: resume from here if the stream breaks before any event.
                    self._after_seq = self._after_seq or reply.head_seq
                    continue
                event = reply.event
                self._after_seq = event.seq
                status = _CLUSTER_STATUS.get(event.cluster_status, ClusterStatus.DOWN)
                task = _TASK_STATUS.get(event.task_status)
                yield ClusterEvent(
                    cluster_name=event.cluster_name,
                    observation=Observation(status, task if status is ClusterStatus.UP else None),
                )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                # The events after our seq are gone (or the cloud restarted): start afresh;
                # the caller wakes every watcher, so nothing missed goes unchecked.
                self._after_seq = 0
            raise backend_error(exc) from exc
        finally:
            call.cancel()

    async def notify_preemption(self, handle: ClusterHandle, epoch: int, deadline: float) -> None:
        raise BackendError("the sim cloud does not take preemption notices yet")

    async def close(self) -> None:
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
