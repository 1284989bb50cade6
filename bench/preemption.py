"""Preemptions on a pushing backend: how soon a job notices and runs again.

Starts the whole system (harness/bench/system.py: sim cloud with launch latency 0, one
replica), runs N long spot jobs until they are all RUNNING, then preempts their
clusters through the sim cloud's operator API without notice (the cluster goes
DOWN at once and the cloud pushes the change):
- one at a time, each after the previous job runs again;
- all N at once: the region reclaims every spot cluster in one instant (one
  `PreemptRegion` call).
For each preemption: the call -> the job's RECOVERING event (`noticed`: the
replica saw the cluster DOWN and reported it) and -> RUNNING again on a new
cluster (`running_again`: teardown and logs of the lost attempt, relaunch),
p50/p99, and the CPU each process spent per preemption in the all-at-once round.
Target: the "preemption noticed" row of contract §15 (its grace is the notice's,
when one is given; none here). Records one JSON line (`results.py`).

    .venv/bin/python bench/preemption.py [--jobs 200]
"""

from __future__ import annotations

import asyncio
import time

from harness.bench.system import LONG_SPEC, CpuMeter, JobEvents, channel, run_jobs_bench, summary
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as spb_grpc
from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as jpb
from services.backends.base import cluster_name
from services.launcher.stack import Stack

SPEC = LONG_SPEC + "resources: {use_spot: true}\n"
REGION = "us-east-1"  # the one region of harness/bench/system.py's cloud
RUNNING, RECOVERING = job_pb2.JOB_STATUS_RUNNING, job_pb2.JOB_STATUS_RECOVERING


class Events(JobEvents):
    """For every job: when it last became RUNNING, and when it was first RECOVERING after
    that (a recovery's later events, its relaunch's progress, carry the job's status
    RECOVERING too)."""

    def __init__(self) -> None:
        super().__init__()
        self.running: dict[int, float] = {}
        self.recovering: dict[int, float] = {}

    def record(self, event: job_pb2.JobEvent, at: float) -> None:
        job_id = event.job_id
        if event.status == RUNNING:
            self.running[job_id] = at
            return
        first_since_running = self.recovering.get(job_id, 0.0) < self.running.get(job_id, 0.0)
        if event.status == RECOVERING and first_since_running:
            self.recovering[job_id] = at

    def recovered(self, job_id: int, since: float) -> bool:
        noticed = self.recovering.get(job_id, 0.0)
        return noticed >= since and self.running.get(job_id, 0.0) >= noticed


async def measure(stack: Stack, jobs: int) -> dict[str, object]:
    async with (
        channel(stack, stack.scheduler_address) as chan,
        channel(stack, stack.simcloud_address) as cloud_chan,
    ):
        stub = job_service_pb2_grpc.JobServiceStub(chan)
        cloud = spb_grpc.SimOperatorServiceStub(cloud_chan)
        events = Events()
        watcher = asyncio.create_task(events.follow(stub))
        request = jpb.SubmitJobsRequest(jobs=[jpb.SubmitJobRequest(spec_yaml=SPEC)] * jobs)
        ids = list((await stub.SubmitJobs(request)).job_ids)
        await events.until(lambda: set(ids) <= events.running.keys(), 300)

        async def preempt(job_id: int) -> float:
            sent = time.time()
            reply = await cloud.PreemptCluster(
                spb.PreemptClusterRequest(cluster_name=cluster_name(job_id, 0))
            )
            assert reply.preempted, f"job {job_id}'s cluster was not live"
            return sent

        def figures(sent: dict[int, float]) -> dict[str, object]:
            def after(times: dict[int, float]) -> dict[str, float]:
                return summary([(times[j] - t) * 1000 for j, t in sent.items()], "ms")

            return {"noticed": after(events.recovering), "running_again": after(events.running)}

        sent: dict[int, float] = {}
        for job_id in ids:
            sent[job_id] = await preempt(job_id)
            await events.until(lambda j=job_id: events.recovered(j, sent[j]), 60)
        results: dict[str, object] = {"one_at_a_time": figures(sent)}

        meter = CpuMeter(stack, bench=True)
        at = time.time()
        reply = await cloud.PreemptRegion(spb.PreemptRegionRequest(region=REGION))
        hit = set(reply.cluster_names)
        assert hit == {cluster_name(j, 0) for j in ids}, f"{len(hit)} of {jobs} clusters preempted"
        sent = dict.fromkeys(ids, at)
        await events.until(lambda: all(events.recovered(j, t) for j, t in sent.items()), 300)
        results["all_at_once"] = {
            **figures(sent),
            "cpu_ms_per_preemption": meter.ms_per(jobs),
        }
        watcher.cancel()
    return results


def main() -> None:
    run_jobs_bench("preemption", __doc__, measure, jobs=200)


if __name__ == "__main__":
    main()
