"""The whole system on the sim cloud, as processes: mj-simcloud, scheduler, controllers, logs.

Every controller polls once an hour (`--poll-interval 3600`), so each recovery
here happens because the sim cloud pushed the change on its watch stream. The
cloud runs 10 simulated seconds per real second; its first region has no spot
capacity, so spot launches fail over to the second.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from harness.e2e import assert_no_tracebacks, mj
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as spb_grpc
from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as pb
from services.common.statuses import JobStatus, ScheduleState
from services.launcher.stack import Stack
from services.logs import RECOVERED_MARKER

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
EAST, WEST, EU = "us-east-1", "us-west-2", "eu-west-1"
CONTROLLER_ARGS = [
    "--poll-interval", "3600",
    "--grace-seconds", "0.2",
    "--backoff-initial", "0.2",
    "--backoff-max", "1",
    "--start-check-interval", "0.1",
]  # fmt: skip
CLOUD = f"""
seed: 1
time_scale: 10
launch_latency_seconds: 1
regions:
  - {{name: {EAST}, zones: [{EAST}a], spot_nodes: 0, on_demand_nodes: 10}}
  - {{name: {WEST}, zones: [{WEST}a, {WEST}b], spot_nodes: 10, on_demand_nodes: 10}}
  - {{name: {EU}, zones: [{EU}a], spot_nodes: 10, on_demand_nodes: 10}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("sim-stack")
    config = data / "simcloud.yaml"
    config.write_text(CLOUD)
    with Stack(
        data,
        replicas=1,
        controller_args=CONTROLLER_ARGS,
        simcloud_args=["--config", str(config)],
    ) as running:
        yield running
    assert_no_tracebacks(data)


def submit(jobs: job_service_pb2_grpc.JobServiceStub, spec: str) -> int:
    return int(jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, user="e2e")).job_id)


def follow(
    jobs: job_service_pb2_grpc.JobServiceStub, job_id: int, timeout: float = 30
) -> Iterator[job_pb2.JobEvent]:
    """The job's events until it is DONE."""
    for response in jobs.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]), timeout=timeout):
        yield response.event
        if response.event.schedule_state == ScheduleState.DONE:
            return


def statuses_of(events: list[job_pb2.JobEvent]) -> list[int]:
    out: list[int] = []
    for event in events:
        if event.status and (not out or out[-1] != event.status):
            out.append(event.status)
    return out


def get(jobs: job_service_pb2_grpc.JobServiceStub, job_id: int) -> job_pb2.Job:
    return jobs.GetJob(pb.GetJobRequest(job_id=job_id)).job


def inventory(cloud: spb_grpc.SimOperatorServiceStub, job_id: int) -> list[spb.Cluster]:
    request = spb.ListInventoryRequest(job_id=job_id, page_size=100)
    return list(cloud.ListInventory(request).clusters)


def test_scripted_spot_preemption_is_recovered_in_the_next_region(
    jobs: job_service_pb2_grpc.JobServiceStub, cloud: spb_grpc.SimOperatorServiceStub
) -> None:
    spec = (
        "name: spot-preempted\nresources:\n  use_spot: true\nrun: train\n"
        "sim: {runtime_seconds: 20, preempt_after_seconds: 10}\n"
    )
    job_id = submit(jobs, spec)
    events = list(follow(jobs, job_id))
    job = get(jobs, job_id)
    assert job.status == JobStatus.SUCCEEDED, job.failure_reason
    assert job.recovery_count == 1
    statuses = statuses_of(events)
    assert statuses[statuses.index(JobStatus.RUNNING) :] == [
        JobStatus.RUNNING,
        JobStatus.RECOVERING,
        JobStatus.RUNNING,
        JobStatus.SUCCEEDED,
    ]
    first, second = inventory(cloud, job_id)
    assert (first.region, first.preempted) == (WEST, True)
    # EAGER_NEXT_REGION blocks the region that preempted us: us-east-1 has no spot, so eu-west-1.
    assert (second.region, second.preempted) == (EU, False)
    assert job.tasks[0].region == EU
    assert first.HasField("terminate_time") and second.HasField("terminate_time")
    # Pushed, not polled: RECOVERING came right after the preemption, with polls an hour apart.
    recovering = next(e for e in events if e.status == JobStatus.RECOVERING)
    lag = recovering.time.ToNanoseconds() / 1e9 - first.preempt_time.ToNanoseconds() / 1e9
    assert lag < 3.0


def test_launch_fails_over_from_a_region_without_capacity(
    jobs: job_service_pb2_grpc.JobServiceStub, cloud: spb_grpc.SimOperatorServiceStub
) -> None:
    spec = "name: failover\nresources:\n  use_spot: true\nrun: train\nsim: {runtime_seconds: 15}\n"
    job_id = submit(jobs, spec)
    list(follow(jobs, job_id))
    job = get(jobs, job_id)
    assert job.status == JobStatus.SUCCEEDED, job.failure_reason
    assert job.tasks[0].region == WEST
    assert [(c.region, c.spot) for c in inventory(cloud, job_id)] == [(WEST, True)]
    regions = {r.name: r for r in cloud.GetCloudState(spb.GetCloudStateRequest()).regions}
    assert regions[EAST].spot_capacity == 0


def test_a_region_no_backend_offers_is_refused_at_submit(
    jobs: job_service_pb2_grpc.JobServiceStub,
) -> None:
    spec = "name: nowhere\nresources:\n  region: mars-1\nrun: train\n"
    with pytest.raises(grpc.RpcError) as caught:
        submit(jobs, spec)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "resources.region" in caught.value.details()  # type: ignore[attr-defined]


def test_an_impossible_request_fails_prechecks_without_a_retry(
    stack: Stack,
    jobs: job_service_pb2_grpc.JobServiceStub,
    cloud: spb_grpc.SimOperatorServiceStub,
) -> None:
    before = cloud.GetCloudState(spb.GetCloudStateRequest()).launches_rejected_precheck
    spec = "name: huge\nresources:\n  cpus: 100000\nrun: train\n"
    job_id = submit(jobs, spec)
    list(follow(jobs, job_id))
    job = get(jobs, job_id)
    assert job.status == JobStatus.FAILED_PRECHECKS
    assert "cpus" in job.failure_reason
    assert inventory(cloud, job_id) == []
    after = cloud.GetCloudState(spb.GetCloudStateRequest()).launches_rejected_precheck
    assert after - before == 1
    controller_log = mj(stack, "logs", str(job_id), "--controller", "--no-follow").stdout
    assert controller_log.count("launching mj-") == 1


def test_spec_log_lines_are_readable_with_mj_logs(stack: Stack, tmp_path: Path) -> None:
    spec = tmp_path / "logged.yaml"
    spec.write_text(
        "name: logged\nresources:\n  use_spot: true\nrun: train\n"
        "sim:\n  runtime_seconds: 15\n  log_lines: [step 1 ok, step 2 ok, all done]\n"
    )
    launched = mj(stack, "launch", str(spec))
    assert launched.returncode == 0, launched.stderr
    assert "step 1 ok\nstep 2 ok\nall done" in launched.stdout
    job_id = next(
        int(line.split()[1])
        for line in launched.stdout.splitlines()
        if line.startswith("Job ") and "submitted" in line
    )
    logs = mj(stack, "logs", str(job_id), "--no-follow")
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.count("step 1 ok\nstep 2 ok\nall done\n") == 1


def test_preemption_is_pushed_to_a_controller_that_polls_hourly(
    stack: Stack,
    jobs: job_service_pb2_grpc.JobServiceStub,
    cloud: spb_grpc.SimOperatorServiceStub,
) -> None:
    spec = "name: long\nresources:\n  use_spot: true\nrun: train\nsim: {runtime_seconds: 3000}\n"
    job_id = submit(jobs, spec)
    events = jobs.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]), timeout=30)
    seen: list[job_pb2.JobEvent] = []
    preempted_at = 0.0
    for response in events:
        event = response.event
        seen.append(event)
        running = statuses_of(seen)[-1:] == [JobStatus.RUNNING]
        # Once the launch slot is released after RUNNING, the lifecycle is watching.
        if not preempted_at and running and event.schedule_state == ScheduleState.ALIVE:
            region = get(jobs, job_id).tasks[0].region
            hit = cloud.PreemptRegion(spb.PreemptRegionRequest(region=region)).cluster_names
            assert f"mj-{job_id}-0" in hit
            preempted_at = time.monotonic()
        if preempted_at and event.status == JobStatus.RECOVERING:
            assert time.monotonic() - preempted_at < 3.0
        if preempted_at and running and JobStatus.RECOVERING in statuses_of(seen):
            break
    events.cancel()
    assert get(jobs, job_id).recovery_count == 1
    assert mj(stack, "cancel", str(job_id)).returncode == 0
    list(follow(jobs, job_id))
    assert get(jobs, job_id).status == JobStatus.CANCELLED


def job_id_of(launched: subprocess.CompletedProcess[str]) -> int:
    """The job id in `mj launch`'s "Job N submitted." line."""
    return next(
        int(line.split()[1])
        for line in launched.stdout.splitlines()
        if line.startswith("Job ") and "submitted" in line
    )


def test_each_attempt_of_a_preempted_job_keeps_its_logs(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, tmp_path: Path
) -> None:
    spec = tmp_path / "attempts.yaml"
    spec.write_text(
        "name: attempts\nresources:\n  use_spot: true\nrun: train\n"
        "sim:\n  runtime_seconds: 20\n  preempt_after_seconds: 10\n"
        "  log_lines: [step 1, step 2, step 3, step 4]\n"
    )
    launched = mj(stack, "launch", str(spec))
    assert launched.returncode == 0, launched.stderr
    job_id = job_id_of(launched)
    job = get(jobs, job_id)
    assert (job.status, job.recovery_count) == (JobStatus.SUCCEEDED, 1)
    attempts = job.tasks[0].attempts
    assert [(a.attempt, a.cluster_name) for a in attempts] == [
        (1, f"mj-{job_id}-0"),
        (2, f"mj-{job_id}-0"),
    ]

    first = mj(stack, "logs", str(job_id), "--attempt", "1", "--no-follow")
    second = mj(stack, "logs", str(job_id), "--attempt", "2")  # follows: ends, the job is done
    whole = mj(stack, "logs", str(job_id), "--no-follow")
    for result in (first, second, whole):
        assert result.returncode == 0, result.stderr
    # Preempted halfway: the first attempt got as far as its first lines, never the last.
    assert first.stdout.startswith("step 1\n") and "step 4" not in first.stdout
    assert second.stdout == "step 1\nstep 2\nstep 3\nstep 4\n"
    assert whole.stdout == first.stdout + RECOVERED_MARKER.decode() + second.stdout
    missing = mj(stack, "logs", str(job_id), "--attempt", "3", "--no-follow")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_a_cancelled_jobs_attempt_logs_are_kept_and_its_secrets_never_shown(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub
) -> None:
    secret = "hunter2-do-not-print"
    spec = (
        "name: cancelled\nresources:\n  use_spot: true\nrun: train\n"
        f"secrets: {{API_KEY: {secret}}}\n"
        "sim:\n  runtime_seconds: 3000\n  log_lines: [warming up, halfway]\n"
    )
    job_id = submit(jobs, spec)
    for response in jobs.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]), timeout=30):
        event = response.event
        if event.status == JobStatus.RUNNING and event.schedule_state == ScheduleState.ALIVE:
            break
    assert mj(stack, "cancel", str(job_id)).returncode == 0
    list(follow(jobs, job_id))
    job = get(jobs, job_id)
    assert job.status == JobStatus.CANCELLED
    assert [a.attempt for a in job.tasks[0].attempts] == [1]

    logs = mj(stack, "logs", str(job_id), "--attempt", "1")
    assert logs.returncode == 0, logs.stderr
    # Stopped gracefully: SIGTERM with the default grace (30 s), at which the task, with
    # no handler of its own, exited at once; all it wrote is kept.
    assert logs.stdout == (
        "warming up\nreceived SIGTERM: stopping, SIGKILL in 30s\nexited (SIGTERM)\n"
    )
    status = mj(stack, "status", str(job_id))
    assert status.returncode == 0, status.stderr
    assert "ATTEMPT" in status.stdout and f"mj-{job_id}-0" in status.stdout
    controller = mj(stack, "logs", str(job_id), "--controller", "--no-follow")
    for shown in (status, logs, controller):
        assert secret not in shown.stdout + shown.stderr


def test_mj_launch_exits_with_the_exit_code_of_a_failed_job(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, tmp_path: Path
) -> None:
    spec = tmp_path / "fails.yaml"
    spec.write_text("name: fails\nrun: train\nsim: {runtime_seconds: 2, exit_code: 42}\n")
    launched = mj(stack, "launch", str(spec))
    job_id = job_id_of(launched)
    list(follow(jobs, job_id))  # to DONE: the cleanup may still be going on
    assert launched.returncode == 42, launched.stderr
    assert f"Job {job_id} FAILED" in launched.stdout


def test_zz_no_cluster_is_left_and_no_task_was_launched_twice(
    jobs: job_service_pb2_grpc.JobServiceStub, cloud: spb_grpc.SimOperatorServiceStub
) -> None:
    """Runs last: every job is done, every cluster terminated, no duplicate launch."""
    listed = jobs.ListJobs(pb.ListJobsRequest(page_size=1000)).jobs
    assert listed and all(j.schedule_state == ScheduleState.DONE for j in listed)
    # A replica terminates and verifies every cluster before it marks the job DONE.
    state = cloud.GetCloudState(spb.GetCloudStateRequest())
    assert (state.unterminated_clusters, state.violations, state.replaced_total) == (0, 0, 0)
    assert state.stale_launches_rejected == 0
    records = cloud.ListInventory(spb.ListInventoryRequest(page_size=1000)).clusters
    assert records and all(c.HasField("terminate_time") for c in records)
