"""Between the model and simcloud.v1 messages; simulated times become wall-clock Timestamps.

Timestamps are clamped to the range google.protobuf.Timestamp allows, so no value
the model holds can make a reply fail to serialize.
"""

from __future__ import annotations

import dataclasses
import math

from google.protobuf import timestamp_pb2

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from services.simcloud import bounds
from services.simcloud.clock import Clock
from services.simcloud.cloud import Cloud
from services.simcloud.clusters import DEFAULT_RUNTIME_SECONDS, Cluster, TaskPlan
from services.simcloud.events import Event
from services.simcloud.regions import LaunchSpec, Region


def timestamp(clock: Clock, sim_seconds: float | None) -> timestamp_pb2.Timestamp | None:
    """The wall-clock Timestamp of a simulated instant (None stays None)."""
    if sim_seconds is None:
        return None
    return wall_timestamp(clock.wall(sim_seconds))


def wall_timestamp(unix_seconds: float | None) -> timestamp_pb2.Timestamp | None:
    if unix_seconds is None:
        return None
    low, high = bounds.MIN_TIMESTAMP_SECONDS, bounds.MAX_TIMESTAMP_SECONDS
    clamped = min(max(unix_seconds, low), high) if not math.isnan(unix_seconds) else low
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(clamped * 1e9))
    return stamp


def launch_spec(request: pb.LaunchRequest) -> LaunchSpec:
    res = request.resources
    behavior = request.behavior
    plan = TaskPlan(
        runtime=(
            behavior.runtime_seconds
            if behavior.HasField("runtime_seconds")
            else DEFAULT_RUNTIME_SECONDS
        ),
        setup_seconds=behavior.setup_seconds,
        has_setup=behavior.has_setup,
        exit_code=behavior.exit_code,
        exit_code_runs=behavior.exit_code_runs,
        setup_exit_code=behavior.setup_exit_code,
        log_lines=tuple(behavior.log_lines.lines) if behavior.HasField("log_lines") else None,
        preempt_after=(
            behavior.preempt_after_seconds if behavior.HasField("preempt_after_seconds") else None
        ),
        sigterm_exit=None if behavior.sigterm_ignored else behavior.sigterm_exit_seconds,
    )
    return LaunchSpec(
        cluster_name=request.cluster_name,
        job_id=request.job_id,
        task_id=request.task_id,
        epoch=request.epoch,
        cloud=res.cloud,
        region=res.region,
        zone=res.zone,
        cpus=res.cpus,
        memory=res.memory,
        accelerators=res.accelerators,
        use_spot=res.use_spot,
        num_nodes=res.num_nodes or 1,
        candidate_regions=tuple(request.candidate_regions),
        blocked_regions=tuple(request.blocked_regions),
        plan=plan,
    )


def cluster(clock: Clock, c: Cluster) -> pb.Cluster:
    return pb.Cluster(
        cluster_id=c.cluster_id,
        name=c.name,
        job_id=c.job_id,
        task_id=c.task_id,
        epoch=c.epoch,
        region=c.region,
        zone=c.zone,
        spot=c.spot,
        num_nodes=c.num_nodes,
        status=int(c.status),  # type: ignore[arg-type]
        task_status=int(c.readable_task_status() or 0),  # type: ignore[arg-type]
        exit_code=c.exit_code,
        launch_time=timestamp(clock, c.launch_time),
        up_time=timestamp(clock, c.up_time),
        task_end_time=timestamp(clock, c.task_end_time),
        preempt_time=timestamp(clock, c.preempt_time),
        terminate_time=timestamp(clock, c.terminate_time),
        preempted=c.preempted,
        replaced=c.replaced,
        notice_deadline=timestamp(clock, c.notice_deadline),
        notice_delivered_time=timestamp(clock, c.notice_delivered_time),
        notice_delivered_deadline=wall_timestamp(c.notice_delivered_deadline),
        sigterm_time=timestamp(clock, c.sigterm_time),
        event_seq=c.event_seq,
        calls=[
            pb.ClusterCall(
                kind=int(kind),  # type: ignore[arg-type]
                epoch=epoch,
                call_time=timestamp(clock, when),
            )
            for kind, epoch, when in c.calls or ()
        ],
        calls_dropped=c.calls_dropped,
    )


def event(clock: Clock, e: Event) -> pb.ClusterEvent:
    return pb.ClusterEvent(
        seq=e.seq,
        event_time=timestamp(clock, e.sim_time),
        sim_seconds=e.sim_time,
        kind=int(e.kind),  # type: ignore[arg-type]
        cluster_name=e.cluster_name,
        cluster_id=e.cluster_id,
        job_id=e.job_id,
        task_id=e.task_id,
        region=e.region,
        cluster_status=int(e.cluster_status),  # type: ignore[arg-type]
        task_status=int(e.task_status or 0),  # type: ignore[arg-type]
        message=e.message,
        exit_code=e.exit_code if e.task_end_time is not None else 0,
        task_end_time=timestamp(clock, e.task_end_time),
        notice_deadline=timestamp(clock, e.notice_deadline),
    )


def region(r: Region) -> pb.Region:
    return pb.Region(
        name=r.name,
        zones=list(r.zones),
        accelerators=list(r.accelerator_names),
        spot_capacity=r.spot_capacity,
        spot_used=r.spot_used,
        on_demand_capacity=r.on_demand_capacity,
        on_demand_used=r.on_demand_used,
        launch_latency_seconds=r.launch_latency,
        preemptions_per_hour=r.preemptions_per_hour,
        failing_launches=r.failing_launches,
        notice_seconds=r.notice_seconds,
    )


def cloud_state(cloud: Cloud) -> pb.GetCloudStateResponse:
    """The cloud's counters and regions, as GetCloudState answers."""
    counters = dataclasses.asdict(cloud.state())
    # The fields of `CloudState` are the response's, but for one time.
    until = counters.pop("unreachable_until")
    return pb.GetCloudStateResponse(
        start_time=timestamp(cloud.clock, 0.0),
        time_scale=cloud.clock.time_scale,
        seed=cloud.config.seed,
        regions=[region(r) for r in cloud.regions.values()],
        unreachable_until_time=timestamp(cloud.clock, until),
        **counters,
    )
