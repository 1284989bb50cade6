"""SIGTERM drains a replica: it takes no new jobs, hands its jobs back unfailed, and exits.

The jobs it held resume on the other replica, which watches the clusters they
already run on: nothing is relaunched and nothing fails.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as spb_grpc
from managedjobs.v1 import job_service_pb2 as pb
from managedjobs.v1 import job_service_pb2_grpc, log_service_pb2, log_service_pb2_grpc
from services.common.statuses import JobStatus, ScheduleState
from services.launcher.stack import Stack

pytestmark = pytest.mark.e2e
CLOUD = """
seed: 5
time_scale: 10
launch_latency_seconds: 1
regions:
  - {name: us-east-1, zones: [us-east-1a], spot_nodes: 50, on_demand_nodes: 50}
"""


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    config = tmp_path / "simcloud.yaml"
    config.write_text(CLOUD)
    args = ["--poll-interval", "3600", "--start-check-interval", "0.05", "--max-jobs", "3"]
    with Stack(
        tmp_path, replicas=2, controller_args=args, simcloud_args=["--config", str(config)]
    ) as running:
        yield running


def test_sigterm_hands_jobs_back_and_they_finish_elsewhere(stack: Stack) -> None:
    spec = "run: train\nsim: {runtime_seconds: 40}\n"
    with stack.channel(stack.scheduler_address) as channel:
        jobs = job_service_pb2_grpc.JobServiceStub(channel)
        ids = [jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec)).job_id for _ in range(4)]
        running: set[int] = set()
        for response in jobs.WatchJobs(pb.WatchJobsRequest(job_ids=ids), timeout=60):
            if response.event.status == JobStatus.RUNNING:
                running.add(response.event.job_id)
                if running == set(ids):
                    break
        held = {
            i
            for i in ids
            if jobs.GetJob(pb.GetJobRequest(job_id=i)).job.controller_id == "controller-1"
        }
        assert held, "controller-1 should hold some of the jobs"

        draining = stack.controllers[0]
        draining.signal(signal.SIGTERM)
        assert draining.process is not None
        assert draining.process.wait(30) == 0

        done: set[int] = set()
        for response in jobs.WatchJobs(pb.WatchJobsRequest(job_ids=ids), timeout=90):
            if response.event.schedule_state == ScheduleState.DONE:
                done.add(response.event.job_id)
                if done == set(ids):
                    break
        final = [jobs.GetJob(pb.GetJobRequest(job_id=i)).job for i in ids]
    assert {j.status for j in final} == {JobStatus.SUCCEEDED}
    assert {j.controller_id for j in final if j.job_id in held} == {"controller-2"}
    assert all(j.recovery_count == 0 for j in final)
    # Each handed-back job's lifecycle log says so: the lines were stored before the
    # handback (after it, the logs service takes none from the old holder).
    with stack.channel(stack.logs_address) as channel:
        logs = log_service_pb2_grpc.LogServiceStub(channel)
        for job_id in held:
            request = log_service_pb2.ReadLogsRequest(job_id=job_id, controller=True)
            text = b"".join(r.data for r in logs.ReadLogs(request)).decode()
            assert "handed back: controller-1 is draining" in text, text
    with stack.channel(stack.simcloud_address) as channel:
        cloud = spb_grpc.SimOperatorServiceStub(channel)
        state = cloud.GetCloudState(spb.GetCloudStateRequest())
        assert state.live_clusters == 0
        assert state.launched_total == len(ids)
