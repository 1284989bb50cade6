"""The whole system as real processes: scheduler, two controller replicas and logs.

Driven the way people drive it, through `mj` and the real `grpcurl` binary, on
the local backend, with the three examples of the README.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from harness.e2e import assert_no_tracebacks, mj
from harness.local_clusters import open_folder
from harness.waiting import wait_until
from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as pb
from services.backends.local.users import DEFAULT_RUN_AS_UIDS, parse_uid_range
from services.common.statuses import JobStatus, ScheduleState
from services.launcher.stack import Stack

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
GRPCURL = str(Path(sys.executable).parent / "grpcurl")
FAST = [
    "--poll-interval", "0.2",
    "--grace-seconds", "0.2",
    "--backoff-initial", "0.2",
    "--backoff-max", "1",
    "--start-check-interval", "0.1",
]  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("stack")
    with Stack(data, replicas=2, controller_args=FAST) as running:
        yield running
    assert_no_tracebacks(data)


def wait_job(
    jobs: job_service_pb2_grpc.JobServiceStub, job_id: int, timeout: float = 60
) -> job_pb2.Job:
    """Follows the job's events until it is DONE."""
    for response in jobs.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]), timeout=timeout):
        if response.event.schedule_state == ScheduleState.DONE:
            break
    return jobs.GetJob(pb.GetJobRequest(job_id=job_id)).job


def job_id_from(output: str) -> int:
    for line in output.splitlines():
        if line.startswith("Job ") and "submitted" in line:
            return int(line.split()[1])
    raise AssertionError(f"no job id in {output!r}")


def test_grpcurl_lists_every_service(stack: Stack) -> None:
    listed: set[str] = set()
    for address in [stack.scheduler_address, stack.logs_address, stack.controllers[0].address]:
        out = subprocess.run(
            [GRPCURL, "-plaintext", address, "list"], capture_output=True, text=True, check=True
        ).stdout
        listed |= set(out.split())
    for service in ("JobService", "SchedulerService", "ControllerService", "LogService"):
        assert f"managedjobs.v1.{service}" in listed
    assert "grpc.health.v1.Health" in listed


def test_grpcurl_submits_a_job_in_json(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub
) -> None:
    body = json.dumps({"spec_yaml": "name: from-grpcurl\nrun: echo via grpcurl\n", "user": "ops"})
    out = subprocess.run(
        [GRPCURL, "-plaintext", "-H", f"authorization: Bearer {stack.credentials.admin_token}",
         "-d", body, stack.scheduler_address, "managedjobs.v1.JobService/SubmitJob"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    reply = json.loads(out)
    job_id = int(reply.get("jobId", reply.get("job_id", 0)))
    job = wait_job(jobs, job_id)
    assert job.status == JobStatus.SUCCEEDED
    assert job.user == "ops"


def test_hello_example_succeeds_and_its_output_is_readable(stack: Stack) -> None:
    launched = mj(stack, "launch", "examples/hello.yaml")
    assert launched.returncode == 0, launched.stderr
    assert "hello from rank 0 of 1" in launched.stdout
    job_id = job_id_from(launched.stdout)
    logs = mj(stack, "logs", str(job_id), "--no-follow")
    assert logs.returncode == 0, logs.stderr
    assert "hello from rank 0 of 1" in logs.stdout


def test_chain_example_runs_every_task_in_order(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub
) -> None:
    launched = mj(stack, "launch", "examples/chain.yaml", "--detach")
    assert launched.returncode == 0, launched.stderr
    job = wait_job(jobs, job_id_from(launched.stdout))
    assert job.status == JobStatus.SUCCEEDED
    assert [t.status for t in job.tasks] == [JobStatus.SUCCEEDED] * 3
    ends = [t.end_time.ToNanoseconds() for t in job.tasks]
    assert ends == sorted(ends)
    expected = {0: "prepare done", 1: "epoch 3", 2: "evaluate done"}
    for task_id, text in expected.items():
        out = mj(stack, "logs", str(job.job_id), "--task", str(task_id), "--no-follow")
        assert out.returncode == 0, out.stderr
        assert text in out.stdout
    controller_log = mj(stack, "logs", str(job.job_id), "--controller", "--no-follow")
    assert "task 2: SUCCEEDED" in controller_log.stdout


def test_failing_example_is_restarted_then_fails(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub
) -> None:
    launched = mj(stack, "launch", "examples/flaky.yaml")
    assert launched.returncode == 3  # the exit code of its last attempt's run
    assert "FAILED" in launched.stdout.splitlines()[-1]
    job = jobs.GetJob(pb.GetJobRequest(job_id=job_id_from(launched.stdout))).job
    assert job.status == JobStatus.FAILED
    assert job.tasks[0].restart_count == 2
    assert job.failure_reason
    logs = mj(stack, "logs", str(job.job_id), "--no-follow")
    assert logs.stdout.count("failing on purpose") == 3
    assert [(a.attempt, a.exit_code) for a in job.tasks[0].attempts] == [(1, 3), (2, 3), (3, 3)]
    for attempt in ("1", "2", "3"):
        one = mj(stack, "logs", str(job.job_id), "--attempt", attempt, "--no-follow")
        assert one.stdout.count("failing on purpose") == 1, one.stderr


def test_killed_supervisor_is_a_preemption_that_is_recovered(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, shared: Path
) -> None:
    marker = shared / "first-attempt"
    spec = (
        "name: preempted\n"
        "run: |\n"
        f"  if [ -f {marker} ]; then echo second attempt; exit 0; fi\n"
        f"  touch {marker}; echo first attempt; sleep 60\n"
    )
    job_id = jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, user="e2e")).job_id
    statuses: list[int] = []
    killed = False
    for response in jobs.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]), timeout=60):
        event = response.event
        if not statuses or statuses[-1] != event.status:
            statuses.append(event.status)
        if event.status == JobStatus.RUNNING and not killed:
            wait_until(marker.exists, what="the first attempt's marker")
            pid_file = stack.data_dir / "clusters" / f"mj-{job_id}-0" / "supervisor.pid"
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
            killed = True
        if event.schedule_state == ScheduleState.DONE:
            break
    job = jobs.GetJob(pb.GetJobRequest(job_id=job_id)).job
    assert job.status == JobStatus.SUCCEEDED
    assert job.recovery_count == 1
    running = statuses.index(JobStatus.RUNNING)
    assert statuses[running:] == [
        JobStatus.RUNNING,
        JobStatus.RECOVERING,
        JobStatus.RUNNING,
        JobStatus.SUCCEEDED,
    ]


def test_cancel_a_running_job(stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub) -> None:
    job_id = jobs.SubmitJob(
        pb.SubmitJobRequest(spec_yaml="name: long\nrun: sleep 60\n", user="e2e")
    ).job_id
    for response in jobs.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]), timeout=30):
        if response.event.status == JobStatus.RUNNING:
            break
    out = mj(stack, "cancel", str(job_id))
    assert out.returncode == 0, out.stderr
    job = wait_job(jobs, job_id, timeout=30)
    assert job.status == JobStatus.CANCELLED


@pytest.mark.parametrize(
    ("trap", "grace", "seen", "sigkill"),
    [
        ("echo got SIGTERM, checkpointing; exit 143", 30, "got SIGTERM, checkpointing", False),
        ("echo ignoring SIGTERM", 1, "ignoring SIGTERM", True),
    ],
    ids=["stops-on-sigterm", "killed-after-the-grace"],
)
def test_max_duration_stops_the_task_with_sigterm_then_sigkill(
    stack: Stack,
    jobs: job_service_pb2_grpc.JobServiceStub,
    trap: str,
    grace: int,
    seen: str,
    sigkill: bool,
) -> None:
    spec = (
        f"name: timed\nmax_duration: 2\ngrace_period: {grace}\n"
        f"run: |\n  trap '{trap}' TERM\n  echo started\n  while :; do sleep 0.2; done\n"
    )
    job_id = jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, user="e2e")).job_id
    job = wait_job(jobs, job_id, timeout=60)
    assert job.status == JobStatus.FAILED
    assert "max_duration of 2s exceeded" in job.failure_reason, job.failure_reason
    # The task's own SIGTERM handler ran, and its output was kept before the teardown.
    logs = mj(stack, "logs", str(job_id), "--no-follow")
    assert logs.stdout.startswith("started\n") and seen in logs.stdout, logs.stdout
    task = job.tasks[0]
    ran = (task.end_time.ToNanoseconds() - task.start_time.ToNanoseconds()) / 1e9
    # Not stopped before its max_duration, as the job's own record of the task says.
    assert ran >= 2, ran
    # SIGKILL came only for the task that ignored SIGTERM, once its grace ran out.
    killed = f"cluster mj-{job_id}-0: ranks outlived the {grace:.1f}s grace; sent SIGKILL"
    logged = "".join(c.log_path.read_text(errors="replace") for c in stack.controllers)
    assert (killed in logged) == sigkill, logged[-3000:]


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every attempt of a task can write: each runs as a uid of its own."""
    with open_folder(0o1777) as path:
        yield path


def test_bad_spec_through_the_cli_is_one_line(stack: Stack, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nrun: echo\nresources:\n  gpus: 1\n")
    out = mj(stack, "launch", str(bad))
    assert out.returncode == 1
    assert "INVALID_ARGUMENT" in out.stderr and "resources.gpus" in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_zz_nothing_is_left_behind(stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub) -> None:
    """Runs last in this module: every job is done, no cluster folder or process remains."""
    listed = jobs.ListJobs(pb.ListJobsRequest(page_size=1000)).jobs
    assert listed
    assert all(j.schedule_state == ScheduleState.DONE for j in listed)
    clusters = stack.data_dir / "clusters"
    # The root keeps only its state (fence and locks): no cluster folder.
    assert not clusters.exists() or [p.name for p in clusters.iterdir()] == [".state"]
    cluster_uids = parse_uid_range(DEFAULT_RUN_AS_UIDS)
    leftovers = [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline", "uids", "status"])
        if p.info["status"] != psutil.STATUS_ZOMBIE
        and (
            any(str(clusters) in part for part in (p.info["cmdline"] or []))
            or (p.info["uids"] is not None and p.info["uids"].real in cluster_uids)
        )
    ]
    assert leftovers == []


def test_controller_state_shows_its_lease_and_capacity(stack: Stack) -> None:
    from managedjobs.v1 import controller_service_pb2 as cpb
    from managedjobs.v1 import controller_service_pb2_grpc

    with stack.channel(stack.controllers[1].address) as channel:
        state = controller_service_pb2_grpc.ControllerServiceStub(channel).GetControllerState(
            cpb.GetControllerStateRequest(), timeout=10
        )
    assert state.controller_id == "controller-2"
    assert state.connected and not state.draining
    assert state.capacity.max_launches >= 4
    assert state.lease_renew_time.seconds > 0
