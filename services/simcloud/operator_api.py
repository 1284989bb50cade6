"""The operator API (SimOperatorService): chaos, capacity and the inventory.

For tests and demos, admin only. Like the cloud API, it checks every field first
(bounds.py) and maps the model's errors at this edge; unlike it, it answers during
an injected outage, so a test can end the outage it started (ResetFaults).
"""

from __future__ import annotations

import logging
import re

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as pb_grpc
from services.common.errors import InvalidArgument, rpc_errors
from services.simcloud import bounds, convert
from services.simcloud.cloud import Cloud
from services.simcloud.cloud_api import Context

log = logging.getLogger(__name__)

OPERATOR_SERVICE = "managedjobs.simcloud.v1.SimOperatorService"
DEFAULT_PAGE = 1000
_PAGE_TOKEN_RE = re.compile(r"[0-9]{1,19}")


class SimOperatorServicer(pb_grpc.SimOperatorServiceServicer):
    """Chaos, capacity and the inventory, for tests and demos."""

    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud

    @rpc_errors
    async def PreemptCluster(
        self, request: pb.PreemptClusterRequest, context: Context
    ) -> pb.PreemptClusterResponse:
        bounds.name(request.cluster_name, "cluster_name")
        notice = bounds.number(request.notice_seconds, "notice_seconds")
        preempted, deadline = self.cloud.preempt_cluster(request.cluster_name, notice)
        log.info(
            "preempt cluster",
            extra={"cluster": request.cluster_name, "hit": preempted, "notice": notice},
        )
        return pb.PreemptClusterResponse(
            preempted=preempted, deadline=convert.timestamp(self.cloud.clock, deadline)
        )

    @rpc_errors
    async def PreemptRegion(
        self, request: pb.PreemptRegionRequest, context: Context
    ) -> pb.PreemptRegionResponse:
        bounds.name(request.region, "region")
        notice = bounds.number(request.notice_seconds, "notice_seconds")
        names, deadline = self.cloud.preempt_region(
            request.region, request.include_on_demand, notice
        )
        log.info(
            "preempt region",
            extra={"region": request.region, "clusters": len(names), "notice": notice},
        )
        return pb.PreemptRegionResponse(
            cluster_names=names, deadline=convert.timestamp(self.cloud.clock, deadline)
        )

    @rpc_errors
    async def SetCapacity(
        self, request: pb.SetCapacityRequest, context: Context
    ) -> pb.SetCapacityResponse:
        bounds.name(request.region, "region")
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
        bounds.name(request.region, "region", optional=True)
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
            notice_seconds=(request.notice_seconds if request.HasField("notice_seconds") else None),
        )
        log.info("faults injected", extra={"region": request.region or "*"})
        return pb.InjectFaultsResponse()

    @rpc_errors
    async def ResetFaults(
        self, request: pb.ResetFaultsRequest, context: Context
    ) -> pb.ResetFaultsResponse:
        bounds.name(request.region, "region", optional=True)
        regions = self.cloud.reset_faults(request.region)
        log.info("faults reset", extra={"region": request.region or "*"})
        return pb.ResetFaultsResponse(regions=[convert.region(r) for r in regions])

    @rpc_errors
    async def ListInventory(
        self, request: pb.ListInventoryRequest, context: Context
    ) -> pb.ListInventoryResponse:
        size = bounds.integer(request.page_size, "page_size", 0, bounds.MAX_PAGE) or DEFAULT_PAGE
        token = request.page_token
        start = int(token) if _PAGE_TOKEN_RE.fullmatch(token) else -1
        if token and not 0 <= start <= len(self.cloud.inventory):
            raise InvalidArgument(
                f"page_token: not a token this cloud gave, got {bounds.quote(token)}",
                field="page_token",
            )
        start = max(start, 0)
        job_id = request.job_id if request.HasField("job_id") else None
        if job_id is not None:
            bounds.integer(job_id, "job_id")
        clusters, next_start = self.cloud.list_inventory(start, size, job_id)
        return pb.ListInventoryResponse(
            clusters=[convert.cluster(self.cloud.clock, c) for c in clusters],
            next_page_token="" if next_start is None else str(next_start),
        )

    @rpc_errors
    async def GetCloudState(
        self, request: pb.GetCloudStateRequest, context: Context
    ) -> pb.GetCloudStateResponse:
        return convert.cloud_state(self.cloud)
