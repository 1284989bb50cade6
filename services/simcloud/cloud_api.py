"""The cloud API the `sim` backend calls (SimCloudService): launches, reads, terminations.

Handlers check every field of a request against bounds.py first (INVALID_ARGUMENT
naming the field), then translate messages to the model and back (convert.py);
every error is an `ApiError` raised by the model or the checks and mapped at this
edge by `rpc_errors`. Every call honours an injected outage (UNAVAILABLE). A
batched call (LaunchClusters, TerminateClusters) answers each of its calls as
that call alone would have been answered.

Streams hold no state of their own beyond a cursor: ReadLogs recomputes the log
of its cluster record, WatchEvents reads the event ring after its last seq.
Both sleep on the event log (woken by any change) or, for logs, until the next
line is due.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as pb_grpc
from services.common.errors import (
    MAX_MESSAGE_BYTES,
    ApiError,
    InvalidArgument,
    bound,
    each_alone,
    rpc_errors,
)
from services.simcloud import bounds, convert
from services.simcloud.cloud import Cloud
from services.simcloud.errors import NoCapacity

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
CLOUD_SERVICE = "managedjobs.simcloud.v1.SimCloudService"
LOG_CHUNK = 64 * 1024
# The log bytes one GetLogs answer carries at most (gRPC's limit on a message is 4 MiB).
GET_LOGS_BYTES = 3 * 1024 * 1024


class SimCloudServicer(pb_grpc.SimCloudServiceServicer):
    """The API the `sim` backend calls."""

    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud

    @rpc_errors
    async def Launch(self, request: pb.LaunchRequest, context: Context) -> pb.LaunchResponse:
        return await self._launch(request)

    @rpc_errors
    async def LaunchClusters(
        self, request: pb.LaunchClustersRequest, context: Context
    ) -> pb.LaunchClustersResponse:
        calls = request.calls
        _batch_size(len(calls))
        self.cloud.check_reachable()
        outcomes = await each_alone(self._launch(call) for call in calls)
        reply = pb.LaunchClustersResponse()
        _answer_each(reply.results, outcomes)
        for result, outcome in zip(reply.results, outcomes, strict=True):
            if isinstance(outcome, NoCapacity):
                result.regions_tried.extend(outcome.regions_tried)
        return reply

    async def _launch(self, request: pb.LaunchRequest) -> pb.LaunchResponse:
        cluster, tried = await self.cloud.launch(convert.launch_spec(request))
        log.debug(
            "launched",
            extra={"cluster": cluster.name, "region": cluster.region, "epoch": cluster.epoch},
        )
        return pb.LaunchResponse(
            cluster=convert.cluster(self.cloud.clock, cluster), regions_tried=tried
        )

    @rpc_errors
    async def GetCluster(
        self, request: pb.GetClusterRequest, context: Context
    ) -> pb.GetClusterResponse:
        bounds.name(request.cluster_name, "cluster_name")
        self.cloud.check_reachable()
        cluster = self.cloud.get(request.cluster_name)
        return pb.GetClusterResponse(cluster=convert.cluster(self.cloud.clock, cluster))

    @rpc_errors
    async def GetClusters(
        self, request: pb.GetClustersRequest, context: Context
    ) -> pb.GetClustersResponse:
        names = _cluster_names(request.cluster_names)
        self.cloud.check_reachable()
        reply = pb.GetClustersResponse()
        for name in dict.fromkeys(names):
            cluster = self.cloud.find(name)
            if cluster is None:
                reply.unknown_cluster_names.append(name)
            else:
                reply.clusters.append(convert.cluster(self.cloud.clock, cluster))
        return reply

    @rpc_errors
    async def Terminate(
        self, request: pb.TerminateRequest, context: Context
    ) -> pb.TerminateResponse:
        grace = _terminate_grace(request)
        self.cloud.check_reachable()
        return await self._terminate(request, grace)

    @rpc_errors
    async def TerminateClusters(
        self, request: pb.TerminateClustersRequest, context: Context
    ) -> pb.TerminateClustersResponse:
        calls = request.calls
        _batch_size(len(calls))
        graces = [_terminate_grace(call, f"calls[{i}].") for i, call in enumerate(calls)]
        self.cloud.check_reachable()
        outcomes = await each_alone(
            self._terminate(call, grace) for call, grace in zip(calls, graces, strict=True)
        )
        reply = pb.TerminateClustersResponse()
        _answer_each(reply.results, outcomes)
        return reply

    async def _terminate(self, request: pb.TerminateRequest, grace: float) -> pb.TerminateResponse:
        if request.keep_cluster:
            stopping = self.cloud.begin_stop(request.cluster_name, request.epoch, grace)
            if stopping is None:
                return pb.TerminateResponse(terminated=False)
            await self.cloud.wait_stopped(stopping)
            return pb.TerminateResponse(terminated=False, signalled=True)
        cluster = self.cloud.begin_terminate(request.cluster_name, request.epoch, grace)
        if cluster is None:
            return pb.TerminateResponse(terminated=False)
        # The grace runs on the cloud's clock: a caller that gives up cancels nothing.
        await self.cloud.wait_terminated(cluster)
        return pb.TerminateResponse(terminated=True, signalled=cluster.sigterm_time is not None)

    @rpc_errors
    async def NotifyPreemption(
        self, request: pb.NotifyPreemptionRequest, context: Context
    ) -> pb.NotifyPreemptionResponse:
        bounds.name(request.cluster_name, "cluster_name")
        bounds.integer(request.epoch, "epoch")
        if not request.HasField("deadline"):
            raise InvalidArgument("deadline: required", field="deadline")
        deadline = bounds.timestamp(request.deadline, "deadline")
        self.cloud.check_reachable()
        delivered = self.cloud.notify(request.cluster_name, request.epoch, deadline)
        log.info(
            "preemption notice",
            extra={"cluster": request.cluster_name, "delivered": delivered is not None},
        )
        return pb.NotifyPreemptionResponse(
            delivered=delivered is not None,
            delivered_time=convert.timestamp(self.cloud.clock, delivered),
        )

    @rpc_errors
    async def ReadLogs(
        self, request: pb.ReadLogsRequest, context: Context
    ) -> AsyncIterator[pb.ReadLogsResponse]:
        bounds.name(request.cluster_name, "cluster_name")
        self.cloud.check_reachable()
        cluster = self.cloud.get(request.cluster_name)
        clock = self.cloud.clock
        sent = 0
        while True:
            # Whether the log is final is decided before reading it, so nothing is missed.
            final = cluster.log_final()
            emitted = cluster.entries_emitted(clock.now())
            if emitted > sent:
                chunks = cluster.render_chunks(sent, emitted, LOG_CHUNK)
                sent = emitted
                for chunk in chunks:
                    yield pb.ReadLogsResponse(data=chunk)
            if not request.follow or final:
                return
            due = cluster.next_line_time(cluster.lines_emitted(clock.now()))
            timeout = None if due is None else max(0.001, clock.real_delay(due - clock.now()))
            await self.cloud.events.wait(timeout)
            self.cloud.check_reachable()

    @rpc_errors
    async def GetLogs(self, request: pb.GetLogsRequest, context: Context) -> pb.GetLogsResponse:
        names = _cluster_names(request.cluster_names)
        self.cloud.check_reachable()
        now = self.cloud.clock.now()
        reply = pb.GetLogsResponse()
        room = GET_LOGS_BYTES
        for name in names:
            log = reply.logs.add(cluster_name=name)
            cluster = self.cloud.find(name)
            if cluster is None:
                continue
            data = b"".join(cluster.render_chunks(0, cluster.entries_emitted(now), LOG_CHUNK))
            if len(data) > room:
                log.omitted = True
                continue
            room -= len(data)
            log.data = data
        return reply

    @rpc_errors
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: Context
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        self.cloud.check_reachable()
        events = self.cloud.events
        cursor = request.after_seq or events.head_seq
        # OUT_OF_RANGE (past the head) or FAILED_PRECONDITION (no longer kept) now,
        # rather than after the hello.
        events.after(cursor, limit=0)
        yield pb.WatchEventsResponse(head_seq=events.head_seq)
        while True:
            # Every event ready now goes in one message: under load, events pile up
            # while the last message is being written, and share the next.
            batch = events.after(cursor)
            if batch:
                cursor = batch[-1].seq
                clock = self.cloud.clock
                yield pb.WatchEventsResponse(
                    events=[convert.event(clock, item) for item in batch],
                    head_seq=events.head_seq,
                )
            else:
                await events.wait()
                self.cloud.check_reachable()

    @rpc_errors
    async def ListRegions(
        self, request: pb.ListRegionsRequest, context: Context
    ) -> pb.ListRegionsResponse:
        self.cloud.check_reachable()
        return pb.ListRegionsResponse(
            cloud=self.cloud.config.cloud,
            regions=[convert.region(r) for r in self.cloud.regions.values()],
            time_scale=self.cloud.clock.time_scale,
        )


def _terminate_grace(request: pb.TerminateRequest, prefix: str = "") -> float:
    """Checks a Terminate call's fields; its grace."""
    bounds.name(request.cluster_name, prefix + "cluster_name")
    bounds.integer(request.epoch, prefix + "epoch")
    return bounds.number(request.grace_seconds, prefix + "grace_seconds")


def _cluster_names(names: Sequence[str]) -> Sequence[str]:
    """The 1 to `MAX_NAMES_PER_CALL` clusters a read names."""
    if not names:
        raise InvalidArgument("cluster_names: name at least one cluster", field="cluster_names")
    bounds.names(names, "cluster_names", bounds.MAX_NAMES_PER_CALL)
    return names


def _batch_size(calls: int) -> None:
    """A batched call carries 1 to `MAX_NAMES_PER_CALL` calls."""
    if not 1 <= calls <= bounds.MAX_NAMES_PER_CALL:
        raise InvalidArgument(
            f"calls: 1 to {bounds.MAX_NAMES_PER_CALL} calls, got {calls}", field="calls"
        )


def _answer_each(results: Any, outcomes: Sequence[Message | ApiError]) -> None:
    """A batch's results, one per call in order: its response, or the error it would
    have failed with alone."""
    for outcome in outcomes:
        result = results.add()
        if isinstance(outcome, ApiError):
            result.error.code = outcome.code.value[0]
            result.error.message = bound(outcome.message, MAX_MESSAGE_BYTES)
            result.error.reason = outcome.reason
        else:
            result.response.CopyFrom(outcome)
