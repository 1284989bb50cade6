"""Hostile input to the sim cloud (contract §19): every RPC of both services, a real server.

Each bad request must be INVALID_ARGUMENT naming the field, quote at most 200
characters of the input, change nothing, and leave every state RPC answering.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.protobuf import timestamp_pb2

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as pb_grpc
from services.common.security.edge import ServerSecurity
from services.simcloud import CloudConfig, RunningCloud, start
from services.simcloud.config import RegionConfig

EAST, WEST = "us-east-1", "us-west-2"
LONG = "x" * 5000
CONFIG = CloudConfig(
    regions=(
        RegionConfig(EAST, (f"{EAST}a",), 4, 4, notice_seconds=120.0),
        RegionConfig(WEST, (f"{WEST}a",), 4, 4),
    ),
    time_scale=1000.0,
    launch_latency_seconds=0.0,
    preemptions_per_hour=0.5,
)


@dataclasses.dataclass
class Clients:
    running: RunningCloud
    cloud: pb_grpc.SimCloudServiceAsyncStub
    operator: pb_grpc.SimOperatorServiceAsyncStub


@pytest.fixture
async def clients() -> AsyncIterator[Clients]:
    running = await start(CONFIG, port=0, security=ServerSecurity.without_auth())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        try:
            yield Clients(
                running,
                pb_grpc.SimCloudServiceStub(channel),
                pb_grpc.SimOperatorServiceStub(channel),
            )
        finally:
            await running.stop()


def launch(**changes: Any) -> pb.LaunchRequest:
    request = pb.LaunchRequest(cluster_name="c", job_id=1, task_id=0, epoch=1)
    for path, value in changes.items():
        target: Any = request
        *parents, leaf = path.split("__")
        for parent in parents:
            target = getattr(target, parent)
        if isinstance(value, list):
            getattr(target, leaf).extend(value)
        else:
            setattr(target, leaf, value)
    return request


def stamp(seconds: int, nanos: int = 0) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)


Call = Callable[[Clients], Awaitable[Any]]


async def drain(stream: Any) -> None:
    async for _ in stream:
        pass


# (case id, the call, the field the error must name)
BAD: list[tuple[str, Call, str]] = [
    ("launch-name-long", lambda c: c.cloud.Launch(launch(cluster_name=LONG)), "cluster_name"),
    ("launch-name-chars", lambda c: c.cloud.Launch(launch(cluster_name="a b")), "cluster_name"),
    ("launch-job", lambda c: c.cloud.Launch(launch(job_id=-1)), "job_id"),
    ("launch-task", lambda c: c.cloud.Launch(launch(task_id=-3)), "task_id"),
    ("launch-epoch", lambda c: c.cloud.Launch(launch(epoch=-1)), "epoch"),
    ("launch-nodes", lambda c: c.cloud.Launch(launch(resources__num_nodes=5000)), "num_nodes"),
    ("launch-region", lambda c: c.cloud.Launch(launch(resources__region=LONG)), "region"),
    ("launch-memory", lambda c: c.cloud.Launch(launch(resources__memory=LONG)), "memory"),
    (
        "launch-accelerators",
        lambda c: c.cloud.Launch(launch(resources__accelerators="A100:1e400")),
        "accelerators",
    ),
    (
        "launch-candidates",
        lambda c: c.cloud.Launch(launch(candidate_regions=[EAST] * 65)),
        "candidate_regions",
    ),
    (
        "launch-blocked",
        lambda c: c.cloud.Launch(launch(blocked_regions=["bad name"])),
        "blocked_regions",
    ),
    (
        "launch-runtime-nan",
        lambda c: c.cloud.Launch(launch(behavior__runtime_seconds=math.nan)),
        "runtime_seconds",
    ),
    (
        "launch-runtime-huge",
        lambda c: c.cloud.Launch(launch(behavior__runtime_seconds=1e308)),
        "runtime_seconds",
    ),
    (
        "launch-setup",
        lambda c: c.cloud.Launch(launch(behavior__setup_seconds=-1)),
        "setup_seconds",
    ),
    (
        "launch-preempt-after",
        lambda c: c.cloud.Launch(launch(behavior__preempt_after_seconds=math.inf)),
        "preempt_after_seconds",
    ),
    (
        "launch-sigterm-exit",
        lambda c: c.cloud.Launch(launch(behavior__sigterm_exit_seconds=-1)),
        "sigterm_exit_seconds",
    ),
    (
        "launch-log-lines",
        lambda c: c.cloud.Launch(launch(behavior__log_lines__lines=["x" * 1024] * 1100)),
        "log_lines",
    ),
    ("get-empty", lambda c: c.cloud.GetCluster(pb.GetClusterRequest()), "cluster_name"),
    (
        "get-long",
        lambda c: c.cloud.GetCluster(pb.GetClusterRequest(cluster_name=LONG)),
        "cluster_name",
    ),
    ("get-many-none", lambda c: c.cloud.GetClusters(pb.GetClustersRequest()), "cluster_names"),
    (
        "get-many-too-many",
        lambda c: c.cloud.GetClusters(pb.GetClustersRequest(cluster_names=["c"] * 1001)),
        "cluster_names",
    ),
    (
        "get-many-bad-name",
        lambda c: c.cloud.GetClusters(pb.GetClustersRequest(cluster_names=["c", "../etc"])),
        "cluster_names[1]",
    ),
    (
        "terminate-grace-nan",
        lambda c: c.cloud.Terminate(pb.TerminateRequest(cluster_name="c", grace_seconds=math.nan)),
        "grace_seconds",
    ),
    (
        "terminate-grace-huge",
        lambda c: c.cloud.Terminate(pb.TerminateRequest(cluster_name="c", grace_seconds=1e308)),
        "grace_seconds",
    ),
    (
        "terminate-epoch",
        lambda c: c.cloud.Terminate(pb.TerminateRequest(cluster_name="c", epoch=-2)),
        "epoch",
    ),
    ("get-logs-none", lambda c: c.cloud.GetLogs(pb.GetLogsRequest()), "cluster_names"),
    (
        "get-logs-too-many",
        lambda c: c.cloud.GetLogs(pb.GetLogsRequest(cluster_names=["c"] * 1001)),
        "cluster_names",
    ),
    (
        "get-logs-bad-name",
        lambda c: c.cloud.GetLogs(pb.GetLogsRequest(cluster_names=["existing", "../etc"])),
        "cluster_names[1]",
    ),
    (
        "terminate-many-none",
        lambda c: c.cloud.TerminateClusters(pb.TerminateClustersRequest()),
        "calls",
    ),
    (
        "terminate-many-too-many",
        lambda c: c.cloud.TerminateClusters(
            pb.TerminateClustersRequest(calls=[pb.TerminateRequest(cluster_name="c")] * 1001)
        ),
        "calls",
    ),
    (
        "terminate-many-bad-item",
        lambda c: c.cloud.TerminateClusters(
            pb.TerminateClustersRequest(
                calls=[
                    pb.TerminateRequest(cluster_name="existing", epoch=1),
                    pb.TerminateRequest(cluster_name="c", grace_seconds=-1),
                ]
            )
        ),
        "calls[1].grace_seconds",
    ),
    (
        "notify-no-deadline",
        lambda c: c.cloud.NotifyPreemption(pb.NotifyPreemptionRequest(cluster_name="c")),
        "deadline",
    ),
    (
        "notify-deadline-range",
        lambda c: c.cloud.NotifyPreemption(
            pb.NotifyPreemptionRequest(cluster_name="c", deadline=stamp(2**62))
        ),
        "deadline",
    ),
    (
        "notify-deadline-nanos",
        lambda c: c.cloud.NotifyPreemption(
            pb.NotifyPreemptionRequest(cluster_name="c", deadline=stamp(10, -1))
        ),
        "deadline",
    ),
    (
        "notify-epoch",
        lambda c: c.cloud.NotifyPreemption(
            pb.NotifyPreemptionRequest(cluster_name="c", epoch=-1, deadline=stamp(10))
        ),
        "epoch",
    ),
    (
        "read-logs",
        lambda c: drain(c.cloud.ReadLogs(pb.ReadLogsRequest(cluster_name=LONG))),
        "cluster_name",
    ),
    (
        "preempt-cluster-notice",
        lambda c: c.operator.PreemptCluster(
            pb.PreemptClusterRequest(cluster_name="c", notice_seconds=math.inf)
        ),
        "notice_seconds",
    ),
    (
        "preempt-cluster-name",
        lambda c: c.operator.PreemptCluster(pb.PreemptClusterRequest(cluster_name=LONG)),
        "cluster_name",
    ),
    (
        "preempt-region-name",
        lambda c: c.operator.PreemptRegion(pb.PreemptRegionRequest(region="")),
        "region",
    ),
    (
        "preempt-region-notice",
        lambda c: c.operator.PreemptRegion(pb.PreemptRegionRequest(region=EAST, notice_seconds=-5)),
        "notice_seconds",
    ),
    (
        "capacity-negative",
        lambda c: c.operator.SetCapacity(pb.SetCapacityRequest(region=EAST, spot_nodes=-1)),
        "spot_nodes",
    ),
    (
        "capacity-huge",
        lambda c: c.operator.SetCapacity(
            pb.SetCapacityRequest(region=EAST, on_demand_nodes=2**31 - 1)
        ),
        "on_demand_nodes",
    ),
    (
        "faults-latency",
        lambda c: c.operator.InjectFaults(pb.InjectFaultsRequest(launch_latency_seconds=1e308)),
        "launch_latency_seconds",
    ),
    (
        "faults-rate",
        lambda c: c.operator.InjectFaults(pb.InjectFaultsRequest(preemptions_per_hour=1e308)),
        "preemptions_per_hour",
    ),
    (
        "faults-outage",
        lambda c: c.operator.InjectFaults(pb.InjectFaultsRequest(unreachable_seconds=1e308)),
        "unreachable_seconds",
    ),
    (
        "faults-notice",
        lambda c: c.operator.InjectFaults(pb.InjectFaultsRequest(notice_seconds=math.nan)),
        "notice_seconds",
    ),
    (
        "faults-failing",
        lambda c: c.operator.InjectFaults(pb.InjectFaultsRequest(fail_next_launches=-1)),
        "fail_next_launches",
    ),
    (
        "faults-failing-pile",
        lambda c: c.operator.InjectFaults(pb.InjectFaultsRequest(fail_next_launches=2**31 - 1)),
        "fail_next_launches",
    ),
    (
        "faults-region",
        lambda c: c.operator.InjectFaults(pb.InjectFaultsRequest(region=LONG)),
        "region",
    ),
    (
        "reset-region",
        lambda c: c.operator.ResetFaults(pb.ResetFaultsRequest(region="no/such")),
        "region",
    ),
    (
        "inventory-page-size",
        lambda c: c.operator.ListInventory(pb.ListInventoryRequest(page_size=10_001)),
        "page_size",
    ),
    (
        "inventory-page-size-negative",
        lambda c: c.operator.ListInventory(pb.ListInventoryRequest(page_size=-1)),
        "page_size",
    ),
    (
        "inventory-token-past-end",
        lambda c: c.operator.ListInventory(pb.ListInventoryRequest(page_token="99999")),
        "page_token",
    ),
    (
        "inventory-token-digits",
        lambda c: c.operator.ListInventory(pb.ListInventoryRequest(page_token="٣")),
        "page_token",
    ),
    (
        "inventory-token-long",
        lambda c: c.operator.ListInventory(pb.ListInventoryRequest(page_token="9" * 400)),
        "page_token",
    ),
    (
        "inventory-job",
        lambda c: c.operator.ListInventory(pb.ListInventoryRequest(job_id=-4)),
        "job_id",
    ),
]


async def snapshot(c: Clients) -> tuple[Any, ...]:
    """Everything a bad request must leave alone, read through the state RPCs."""
    state = await c.operator.GetCloudState(pb.GetCloudStateRequest())
    regions = await c.cloud.ListRegions(pb.ListRegionsRequest())
    inventory = await c.operator.ListInventory(pb.ListInventoryRequest())
    return (
        [r.SerializeToString(deterministic=True) for r in regions.regions],
        [r.SerializeToString(deterministic=True) for r in inventory.clusters],
        state.launched_total,
        state.live_clusters,
        state.HasField("unreachable_until_time"),
    )


@pytest.mark.parametrize(
    ("call", "field"), [(call, f) for _, call, f in BAD], ids=[b[0] for b in BAD]
)
async def test_a_request_out_of_bounds_is_refused_naming_the_field(
    clients: Clients, call: Call, field: str
) -> None:
    await clients.cloud.Launch(launch(cluster_name="existing", job_id=9, epoch=1))
    before = await snapshot(clients)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(clients)
    details = caught.value.details() or ""
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert field in details
    # At most 200 characters of the input are quoted.
    assert "x" * 201 not in details and "9" * 201 not in details
    assert await snapshot(clients) == before


async def test_faults_can_be_reset_after_an_outage(clients: Clients) -> None:
    c = clients
    await c.operator.InjectFaults(
        pb.InjectFaultsRequest(
            launch_latency_seconds=99,
            fail_next_launches=3,
            preemptions_per_hour=5,
            notice_seconds=7,
            unreachable_seconds=1e9,  # about 11 real days at this time scale
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await c.cloud.ListRegions(pb.ListRegionsRequest())
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    state = await c.operator.GetCloudState(pb.GetCloudStateRequest())
    assert state.HasField("unreachable_until_time")
    # One region: its faults only; the outage is the whole cloud's and stays.
    reply = await c.operator.ResetFaults(pb.ResetFaultsRequest(region=WEST))
    assert [(r.name, r.failing_launches, r.launch_latency_seconds) for r in reply.regions] == [
        (WEST, 0, 0.0)
    ]
    with pytest.raises(grpc.aio.AioRpcError):
        await c.cloud.ListRegions(pb.ListRegionsRequest())
    await c.operator.ResetFaults(pb.ResetFaultsRequest())
    regions = (await c.cloud.ListRegions(pb.ListRegionsRequest())).regions
    assert [
        (r.launch_latency_seconds, r.failing_launches, r.preemptions_per_hour, r.notice_seconds)
        for r in regions
    ] == [(0.0, 0, 0.5, 120.0), (0.0, 0, 0.5, 0.0)]
    state = await c.operator.GetCloudState(pb.GetCloudStateRequest())
    assert not state.HasField("unreachable_until_time")
    reply = await c.cloud.Launch(launch(cluster_name="after", job_id=2))
    assert reply.regions_tried == [EAST]
