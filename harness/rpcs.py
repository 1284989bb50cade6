"""A minimal valid request for every RPC of every service, and the RPCs' descriptors.

The auth matrix calls each method with its request here; the fuzzer starts from
them when it mutates a valid request field by field. Job 1 is alice's (the
"user" caller of `identities`) in both.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pool, message, timestamp_pb2

from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.v1 import (
    controller_service_pb2,
    job_service_pb2,
    log_service_pb2,
    scheduler_service_pb2,
)

JOB_SPEC = "name: matrix\nrun: echo hi\n"

# A minimal valid request per method; job 1 is alice's.
REQUESTS: dict[str, message.Message] = {
    "/managedjobs.v1.JobService/SubmitJob": job_service_pb2.SubmitJobRequest(spec_yaml=JOB_SPEC),
    "/managedjobs.v1.JobService/SubmitJobs": job_service_pb2.SubmitJobsRequest(
        jobs=[job_service_pb2.SubmitJobRequest(spec_yaml=JOB_SPEC)]
    ),
    "/managedjobs.v1.JobService/GetJob": job_service_pb2.GetJobRequest(job_id=1),
    "/managedjobs.v1.JobService/ListJobs": job_service_pb2.ListJobsRequest(),
    "/managedjobs.v1.JobService/CancelJobs": job_service_pb2.CancelJobsRequest(job_ids=[1]),
    "/managedjobs.v1.JobService/WatchJobs": job_service_pb2.WatchJobsRequest(job_ids=[1]),
    "/managedjobs.v1.SchedulerService/ConnectController": (
        scheduler_service_pb2.ConnectControllerRequest(
            seq=1,
            hello=scheduler_service_pb2.ControllerHello(
                controller_id="controller-1",
                capacity=scheduler_service_pb2.Capacity(max_launches=1, max_jobs=1),
            ),
        )
    ),
    "/managedjobs.v1.SchedulerService/GetSchedulerState": (
        scheduler_service_pb2.GetSchedulerStateRequest()
    ),
    "/managedjobs.v1.ControllerService/GetControllerState": (
        controller_service_pb2.GetControllerStateRequest()
    ),
    "/managedjobs.v1.LogService/ReadLogs": log_service_pb2.ReadLogsRequest(
        job_id=1, controller=True
    ),
    "/managedjobs.v1.LogService/FetchTaskLogs": log_service_pb2.FetchTaskLogsRequest(
        job_id=1, task_id=0, cluster_name="mj-1-0", attempt=1, epoch=1
    ),
    "/managedjobs.v1.LogService/BatchFetchTaskLogs": log_service_pb2.BatchFetchTaskLogsRequest(
        fetches=[
            log_service_pb2.FetchTaskLogsRequest(
                job_id=1, task_id=0, cluster_name="mj-1-0", attempt=1, epoch=1
            )
        ]
    ),
    "/managedjobs.v1.LogService/AppendControllerLogs": log_service_pb2.AppendControllerLogsRequest(
        lines=[log_service_pb2.ControllerLogLine(job_id=1, line="matrix\n", epoch=1)]
    ),
    "/managedjobs.simcloud.v1.SimCloudService/Launch": spb.LaunchRequest(
        cluster_name="matrix", job_id=1, epoch=1
    ),
    "/managedjobs.simcloud.v1.SimCloudService/LaunchClusters": spb.LaunchClustersRequest(
        calls=[spb.LaunchRequest(cluster_name="matrix-many", job_id=2, epoch=1)]
    ),
    "/managedjobs.simcloud.v1.SimCloudService/GetCluster": spb.GetClusterRequest(
        cluster_name="matrix"
    ),
    "/managedjobs.simcloud.v1.SimCloudService/Terminate": spb.TerminateRequest(
        cluster_name="nothing", epoch=1
    ),
    "/managedjobs.simcloud.v1.SimCloudService/TerminateClusters": spb.TerminateClustersRequest(
        calls=[spb.TerminateRequest(cluster_name="nothing", epoch=1)]
    ),
    "/managedjobs.simcloud.v1.SimCloudService/NotifyPreemption": spb.NotifyPreemptionRequest(
        cluster_name="nothing", epoch=1, deadline=timestamp_pb2.Timestamp(seconds=2_000_000_000)
    ),
    "/managedjobs.simcloud.v1.SimCloudService/GetClusters": spb.GetClustersRequest(
        cluster_names=["matrix"]
    ),
    "/managedjobs.simcloud.v1.SimCloudService/ReadLogs": spb.ReadLogsRequest(cluster_name="matrix"),
    "/managedjobs.simcloud.v1.SimCloudService/GetLogs": spb.GetLogsRequest(
        cluster_names=["matrix"]
    ),
    "/managedjobs.simcloud.v1.SimCloudService/WatchEvents": spb.WatchEventsRequest(),
    "/managedjobs.simcloud.v1.SimCloudService/ListRegions": spb.ListRegionsRequest(),
    "/managedjobs.simcloud.v1.SimOperatorService/PreemptCluster": spb.PreemptClusterRequest(
        cluster_name="nothing"
    ),
    "/managedjobs.simcloud.v1.SimOperatorService/PreemptRegion": spb.PreemptRegionRequest(
        region="nowhere"
    ),
    "/managedjobs.simcloud.v1.SimOperatorService/SetCapacity": spb.SetCapacityRequest(
        region="nowhere"
    ),
    "/managedjobs.simcloud.v1.SimOperatorService/InjectFaults": spb.InjectFaultsRequest(),
    "/managedjobs.simcloud.v1.SimOperatorService/ResetFaults": spb.ResetFaultsRequest(),
    "/managedjobs.simcloud.v1.SimOperatorService/ListInventory": spb.ListInventoryRequest(),
    "/managedjobs.simcloud.v1.SimOperatorService/GetCloudState": spb.GetCloudStateRequest(),
}


def method_descriptor(method: str) -> Any:
    """The MethodDescriptor of "/package.Service/Method"."""
    service, name = method.strip("/").split("/")
    return descriptor_pool.Default().FindServiceByName(service).methods_by_name[name]
