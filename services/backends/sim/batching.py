"""The sim backend's calls asked for at once, sent to the cloud as one.

Launches asked for at once go as one LaunchClusters call (at most `LAUNCH_BATCH`; a
launch larger than `LAUNCH_ALONE_BYTES`, a long `log_lines` script, goes alone as a
Launch, so a batch stays within gRPC's 4 MiB message), stops and teardowns as one
TerminateClusters call per (keep_cluster, grace): a long grace never holds up a
short one; log reads as one GetLogs call. Each item is answered, and failed, on its
own, as it would have been alone (`errors`). No call waits for an earlier batch: a
launch may take minutes, and the cloud answers a teardown once every task of its
batch ended, up to the grace later (a task that traps SIGTERM).

A batched launch whose caller gives up (a cancel, a drain) is handed to `abandon`
before the caller goes on, and again should its batch still bring it UP, so that
it is torn down as the cloud rolls back a lone Launch cancelled mid-way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as pb_grpc
from services.backends.base import ClusterHandle, PrecheckError
from services.backends.sim.errors import backend_error, call_error, launch_outcome
from services.common.bounds import CLOUD_NAME_RE
from services.common.coalesce import Coalescer

# Clusters per GetClusters, TerminateClusters or GetLogs call (the cloud's limit).
GET_CLUSTERS_BATCH = 1000
# Launches in one LaunchClusters call at most; a request larger than LAUNCH_ALONE_BYTES
# goes alone.
LAUNCH_BATCH = 256
LAUNCH_ALONE_BYTES = 12 * 1024


def batchable(handle: ClusterHandle) -> str:
    """The cluster's name, for a batched call; a name the cloud would refuse is refused
    here, alone, rather than failing the batch it would have gone in."""
    if not CLOUD_NAME_RE.fullmatch(handle.cluster_name):
        raise PrecheckError(f"not a sim cluster name: {handle.cluster_name[:200]!r}")
    return handle.cluster_name


class Batches:
    """The batched calls of one backend: `launches`, `terminations` and `log_reads`."""

    def __init__(
        self,
        cloud: Callable[[], pb_grpc.SimCloudServiceAsyncStub],
        *,
        timeout: float,
        launch_timeout: float,
        time_scale: Callable[[], float | None],
        abandon: Callable[[pb.LaunchRequest], asyncio.Task[None]],
    ) -> None:
        """Creates the batches; nothing is sent until a call is asked for.

        Args:
            cloud: The stub to call (the channel opens on first use).
            timeout: Seconds for a GetLogs call, and a TerminateClusters beyond its grace.
            launch_timeout: Seconds a Launch or LaunchClusters call may take.
            time_scale: How much faster than real time the cloud's seconds pass, if known.
            abandon: Tears down what a launch its caller gave up on may have started.
        """
        self._cloud = cloud
        self._timeout = timeout
        self._launch_timeout = launch_timeout
        self._time_scale = time_scale
        self._abandon = abandon
        self.launches: Coalescer[None, pb.LaunchRequest, pb.LaunchResponse] = Coalescer(
            self._launch_clusters,
            max_batch=LAUNCH_BATCH,
            in_flight=LAUNCH_BATCH,
            abandoned=lambda call, _: abandon(call),
        )
        self.terminations: Coalescer[tuple[bool, float], pb.TerminateRequest, None] = Coalescer(
            self._terminate_clusters, max_batch=GET_CLUSTERS_BATCH, in_flight=None
        )
        self.log_reads: Coalescer[None, str, bytes | None] = Coalescer(
            self._get_logs, max_batch=GET_CLUSTERS_BATCH
        )

    async def launch(self, call: pb.LaunchRequest) -> pb.LaunchResponse:
        """The cloud's answer to the launch, once its cluster is UP (batched unless large).

        Raises:
            BackendError: as the backend's `launch`.
        """
        if call.ByteSize() > LAUNCH_ALONE_BYTES:
            try:
                return await self._cloud().Launch(call, timeout=self._launch_timeout)
            except grpc.aio.AioRpcError as exc:
                raise backend_error(exc) from exc
        try:
            return await self.launches.call(None, call)
        except asyncio.CancelledError:
            # The cloud rolls back a lone Launch whose caller gives up; a batch goes on,
            # and may have started this one: it is torn down before the caller goes on
            # (to its own cleanup, which may not know of this cluster).
            await asyncio.shield(self._abandon(call))
            raise

    async def terminate(self, call: pb.TerminateRequest) -> None:
        """Returns once the cloud stopped (or tore down) the cluster."""
        await self.terminations.call((call.keep_cluster, call.grace_seconds), call)

    async def read_logs(self, cluster_name: str) -> bytes | None:
        """The cluster's log; None when it is too big to share an answer (read it alone)."""
        return await self.log_reads.call(None, cluster_name)

    async def _launch_clusters(
        self, _: None, calls: list[pb.LaunchRequest]
    ) -> list[pb.LaunchResponse | BaseException]:
        """One LaunchClusters call; each failed item as the error it would raise alone."""
        request = pb.LaunchClustersRequest(calls=calls)
        try:
            reply = await self._cloud().LaunchClusters(request, timeout=self._launch_timeout)
        except grpc.aio.AioRpcError as exc:
            raise backend_error(exc) from exc
        return [launch_outcome(result) for result in reply.results]

    async def _terminate_clusters(
        self, key: tuple[bool, float], calls: list[pb.TerminateRequest]
    ) -> list[BaseException | None]:
        """One TerminateClusters call; each failed item as the error it would raise alone."""
        _, grace = key
        timeout = self._timeout + grace / (self._time_scale() or 1.0)
        request = pb.TerminateClustersRequest(calls=calls)
        try:
            reply = await self._cloud().TerminateClusters(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise backend_error(exc) from exc
        return [
            call_error(result.error) if result.HasField("error") else None
            for result in reply.results
        ]

    async def _get_logs(self, _: None, names: list[str]) -> list[bytes | BaseException | None]:
        """One GetLogs call; None for a log left out of the answer."""
        try:
            reply = await self._cloud().GetLogs(
                pb.GetLogsRequest(cluster_names=names), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise backend_error(exc) from exc
        return [None if log.omitted else log.data for log in reply.logs]
