"""The `sim` backend: the client of `mj-simcloud`, the simulated cloud (contract §10).

Clusters live in the sim cloud process, so every controller replica and the
logs service see the same ones; a cluster is found by its name alone. This module
holds the backend's calls; what a launch asks for is `plans`, how the cloud's
errors read `errors`, what its records and events say `observing`, and the calls
sent together `batching`. NOT_FOUND means the cluster never existed (DOWN, no task
status, does not exist).

`observe` is one GetCluster call, `observe_many` one GetClusters call per 1,000
clusters, and `events()` the cloud's WatchEvents stream, so controllers hear of a
preemption, a coming one or a finished task at once.

Durations the cloud is given are simulated seconds: `terminate`'s grace, like the
"sim" options' runtime, passes `time_scale` times faster than real time, and the
Terminate call, which returns once the cluster is gone, may take that long. A
batched launch whose caller gave up is torn down here (`batching` hands it over);
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
    ClusterEvent,
    ClusterHandle,
    ClusterStatus,
    LaunchPlan,
    Observation,
    PrecheckError,
)
from services.backends.sim.batching import GET_CLUSTERS_BATCH, Batches, batchable
from services.backends.sim.errors import backend_error
from services.backends.sim.observing import EventWatch, observation
from services.backends.sim.plans import BACKEND_NAME, launch_request
from services.common.background import Background
from services.common.bounds import CLOUD_NAME_RE
from services.common.channels import ClientSecurity, open_channel

log = logging.getLogger(__name__)


class SimBackend(Backend):
    """Clusters in the sim cloud, reached over one gRPC channel."""

    name = BACKEND_NAME
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
        self._reachable_timeout = reachable_timeout
        self._security = security or ClientSecurity()
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SimCloudServiceAsyncStub | None = None
        # From ListRegions, once heard (`load`).
        self._regions: tuple[str, ...] | None = None
        self._time_scale: float | None = None
        self._loading = Background("sim-regions", self._load_quietly)
        self._events = EventWatch(self._cloud)
        self._teardowns: set[asyncio.Task[None]] = set()
        self.batched = Batches(
            self._cloud,
            timeout=timeout,
            launch_timeout=launch_timeout,
            time_scale=lambda: self._time_scale,
            abandon=self._abandon,
        )

    def _cloud(self) -> pb_grpc.SimCloudServiceAsyncStub:
        if self._stub is None:
            self._channel = open_channel(self.address, self._security)
            self._stub = pb_grpc.SimCloudServiceStub(self._channel)
        return self._stub

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        """Launches in the sim cloud; returns once the cluster is UP and its task started."""
        reply = await self.batched.launch(launch_request(plan))
        cluster = reply.cluster
        return ClusterHandle(
            cluster_name=cluster.name,
            backend=self.name,
            region=cluster.region,
            zone=cluster.zone,
            data={"cluster_id": cluster.cluster_id},
            seen=observation(cluster),
        )

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
            if CLOUD_NAME_RE.fullmatch(name):
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
            cluster_name=batchable(handle),
            epoch=epoch,
            grace_seconds=grace,
            keep_cluster=keep_cluster,
        )
        if grace > 0:
            await self.load()
        await self.batched.terminate(request)

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
        data = await self.batched.read_logs(batchable(handle))
        if data is None:  # too big to share an answer: read alone
            data = b"".join([chunk async for chunk in self._logs(handle, follow=False)])
        return data

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
        return self._events.stream()

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
