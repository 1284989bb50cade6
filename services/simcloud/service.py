"""The sim cloud's gRPC servicers: the cloud API and the operator API.

Handlers translate messages to the model and back; every error is an `ApiError`
raised by the model and mapped at this edge by `rpc_errors`. The cloud API
honours injected outages (UNAVAILABLE); the operator API always answers, so a
test can end the outage it started.

Streams hold no state of their own beyond a cursor: ReadLogs recomputes the log
of its cluster record, WatchEvents reads the event ring after its last seq.
Both sleep on the event log (woken by any change) or, for logs, until the next
line is due.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as pb_grpc
from services.common.errors import InvalidArgument, rpc_errors
from services.simcloud import convert
from services.simcloud.cloud import Cloud
from services.simcloud.errors import EventsGone

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
CLOUD_SERVICE = "managedjobs.simcloud.v1.SimCloudService"
OPERATOR_SERVICE = "managedjobs.simcloud.v1.SimOperatorService"
LOG_CHUNK = 64 * 1024
DEFAULT_PAGE = 1000
MAX_PAGE = 10_000


class SimCloudServicer(pb_grpc.SimCloudServiceServicer):
    """The API the `sim` backend calls."""

    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud

    @rpc_errors
    async def Launch(self, request: pb.LaunchRequest, context: Context) -> pb.LaunchResponse:
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
        self.cloud.check_reachable()
        cluster = self.cloud.get(request.cluster_name)
        return pb.GetClusterResponse(cluster=convert.cluster(self.cloud.clock, cluster))

    @rpc_errors
    async def Terminate(
        self, request: pb.TerminateRequest, context: Context
    ) -> pb.TerminateResponse:
        self.cloud.check_reachable()
        terminated = self.cloud.terminate(request.cluster_name, epoch=request.epoch)
        return pb.TerminateResponse(terminated=terminated)

    @rpc_errors
    async def ReadLogs(
        self, request: pb.ReadLogsRequest, context: Context
    ) -> AsyncIterator[pb.ReadLogsResponse]:
        self.cloud.check_reachable()
        cluster = self.cloud.get(request.cluster_name)
        clock = self.cloud.clock
        sent = 0
        while True:
            # Whether the log is final is decided before reading it, so nothing is missed.
            final = cluster.log_final()
            emitted = cluster.lines_emitted(clock.now())
            if emitted > sent:
                data = cluster.render(sent, emitted)
                sent = emitted
                for start in range(0, len(data), LOG_CHUNK):
                    yield pb.ReadLogsResponse(data=data[start : start + LOG_CHUNK])
            if not request.follow or final:
                return
            due = cluster.next_line_time(sent)
            timeout = None if due is None else max(0.001, clock.real_delay(due - clock.now()))
            await self.cloud.events.wait(timeout)
            self.cloud.check_reachable()

    @rpc_errors
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: Context
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        self.cloud.check_reachable()
        events = self.cloud.events
        if request.after_seq > events.head_seq:
            raise EventsGone(
                f"after_seq {request.after_seq} is ahead of the latest event "
                f"{events.head_seq} (the cloud restarted); watch again from now",
                head_seq=str(events.head_seq),
            )
        cursor = request.after_seq or events.head_seq
        events.after(cursor, limit=0)  # EventsGone now rather than after the hello
        yield pb.WatchEventsResponse(head_seq=events.head_seq)
        while True:
            batch = events.after(cursor)
            for item in batch:
                cursor = item.seq
                yield pb.WatchEventsResponse(
                    event=convert.event(self.cloud.clock, item), head_seq=events.head_seq
                )
            if not batch:
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


class SimOperatorServicer(pb_grpc.SimOperatorServiceServicer):
    """Chaos, capacity and the inventory, for tests and demos."""

    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud

    @rpc_errors
    async def PreemptCluster(
        self, request: pb.PreemptClusterRequest, context: Context
    ) -> pb.PreemptClusterResponse:
        preempted = self.cloud.preempt_cluster(request.cluster_name)
        log.info("preempt cluster", extra={"cluster": request.cluster_name, "hit": preempted})
        return pb.PreemptClusterResponse(preempted=preempted)

    @rpc_errors
    async def PreemptRegion(
        self, request: pb.PreemptRegionRequest, context: Context
    ) -> pb.PreemptRegionResponse:
        names = self.cloud.preempt_region(request.region, request.include_on_demand)
        log.info("preempt region", extra={"region": request.region, "clusters": len(names)})
        return pb.PreemptRegionResponse(cluster_names=names)

    @rpc_errors
    async def SetCapacity(
        self, request: pb.SetCapacityRequest, context: Context
    ) -> pb.SetCapacityResponse:
        region = self.cloud.set_capacity(
            request.region,
            request.spot_nodes if request.HasField("spot_nodes") else None,
            request.on_demand_nodes if request.HasField("on_demand_nodes") else None,
        )
        log.info(
            "capacity set",
            extra={"region": region.name, "spot": region.spot_capacity},
        )
        return pb.SetCapacityResponse(region=convert.region(region))

    @rpc_errors
    async def InjectFaults(
        self, request: pb.InjectFaultsRequest, context: Context
    ) -> pb.InjectFaultsResponse:
        if request.fail_next_launches < 0:
            raise InvalidArgument("fail_next_launches must not be negative")
        self.cloud.inject_faults(
            region=request.region,
            launch_latency=(
                request.launch_latency_seconds
                if request.HasField("launch_latency_seconds")
                else None
            ),
            fail_next_launches=request.fail_next_launches,
            unreachable_seconds=request.unreachable_seconds,
            preemptions_per_hour=(
                request.preemptions_per_hour if request.HasField("preemptions_per_hour") else None
            ),
        )
        log.info("faults injected", extra={"region": request.region or "*"})
        return pb.InjectFaultsResponse()

    @rpc_errors
    async def ListInventory(
        self, request: pb.ListInventoryRequest, context: Context
    ) -> pb.ListInventoryResponse:
        if request.page_size < 0:
            raise InvalidArgument("page_size must not be negative", field="page_size")
        size = min(request.page_size or DEFAULT_PAGE, MAX_PAGE)
        try:
            start = int(request.page_token or "0")
        except ValueError:
            start = -1
        if start < 0:
            raise InvalidArgument(f"bad page_token {request.page_token!r}", field="page_token")
        job_id = request.job_id if request.HasField("job_id") else None
        clusters, next_start = self.cloud.list_inventory(start, size, job_id)
        return pb.ListInventoryResponse(
            clusters=[convert.cluster(self.cloud.clock, c) for c in clusters],
            next_page_token="" if next_start is None else str(next_start),
        )

    @rpc_errors
    async def GetCloudState(
        self, request: pb.GetCloudStateRequest, context: Context
    ) -> pb.GetCloudStateResponse:
        state = self.cloud.state()
        clock = self.cloud.clock
        return pb.GetCloudStateResponse(
            start_time=convert.timestamp(clock, 0.0),
            sim_seconds=state.sim_seconds,
            time_scale=clock.time_scale,
            seed=self.cloud.config.seed,
            regions=[convert.region(r) for r in self.cloud.regions.values()],
            live_clusters=state.live_clusters,
            unterminated_clusters=state.unterminated_clusters,
            launched_total=state.launched_total,
            terminated_total=state.terminated_total,
            preempted_total=state.preempted_total,
            replaced_total=state.replaced_total,
            stale_launches_rejected=state.stale_launches_rejected,
            stale_terminates_rejected=state.stale_terminates_rejected,
            launches_rejected_precheck=state.launches_rejected_precheck,
            launches_without_capacity=state.launches_without_capacity,
            violations=state.violations,
            head_seq=state.head_seq,
            unreachable_until_time=convert.timestamp(clock, state.unreachable_until),
        )
