"""The inventory: what reliability tests judge the control plane by.

Every cluster ever launched, who launched it (job, task, epoch) and when it
ended. No leak means every record has a terminate time (`unterminated_clusters`
is 0); no duplicate launch means `violations` and `replaced_total` are 0. This
module computes the cloud's counters and reads every page of ListInventory
from outside (tests, benches).
"""

from __future__ import annotations

import dataclasses
import math

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as pb_grpc
from services.simcloud.clusters import Cluster


@dataclasses.dataclass(frozen=True)
class CloudState:
    sim_seconds: float
    live_clusters: int
    unterminated_clusters: int
    launched_total: int
    terminated_total: int
    preempted_total: int
    replaced_total: int
    stale_launches_rejected: int
    stale_terminates_rejected: int
    stale_notices_rejected: int
    preemption_notices_total: int
    notices_delivered_total: int
    launches_rejected_precheck: int
    launches_without_capacity: int
    violations: int
    head_seq: int
    unreachable_until: float | None


def count_violations(clusters: list[Cluster]) -> int:
    """Launches that found another cluster of the same (job_id, task_id) still live.

    Computed from the inventory alone: a cluster is live from its launch until it
    was preempted or terminated, and a launch that starts while an earlier one of
    its task is live is one violation (a duplicate launch of a task attempt).
    """
    by_task: dict[tuple[int, int], list[Cluster]] = {}
    for cluster in clusters:
        by_task.setdefault((cluster.job_id, cluster.task_id), []).append(cluster)
    violations = 0
    for group in by_task.values():
        latest_end = -math.inf
        for cluster in sorted(group, key=lambda c: (c.launch_time, c.cluster_id)):
            if latest_end > cluster.launch_time:
                violations += 1
            latest_end = max(latest_end, cluster.end_time)
    return violations


async def list_inventory(
    stub: pb_grpc.SimOperatorServiceAsyncStub, job_id: int | None = None, page_size: int = 5000
) -> list[pb.Cluster]:
    """Every inventory record (of one job when `job_id` is given), in launch order."""
    out: list[pb.Cluster] = []
    token = ""
    while True:
        request = pb.ListInventoryRequest(page_size=page_size, page_token=token)
        if job_id is not None:
            request.job_id = job_id
        reply = await stub.ListInventory(request, timeout=30)
        out.extend(reply.clusters)
        token = reply.next_page_token
        if not token:
            return out
