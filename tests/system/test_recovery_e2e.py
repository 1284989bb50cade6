"""The recovery policy (contract §18) end to end: one row per rule, through the real processes.

The same rules as tests/controller/test_recovery_policy.py, here with mj-simcloud, the
scheduler, a controller replica and the logs service running as processes with
auth on, driven over gRPC the way a client drives them. Each row submits a job,
follows its events (preempting its cluster each time it runs, when the row asks),
and checks the statuses the job went through, its counts and reason, and what the
sim cloud's inventory says about its clusters. The cloud runs 10 simulated seconds
per real second; spec durations are real seconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grpc
import pytest

from harness.e2e import assert_no_tracebacks, mj
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as spb_grpc
from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as pb
from services.common.statuses import JobStatus, ScheduleState
from services.launcher.stack import Stack

pytestmark = pytest.mark.e2e
S = JobStatus
FULL, OPEN = "us-east-1", "us-west-2"  # no spot capacity at all; room for everything
TIME_SCALE = 10
CONTROLLER_ARGS = [
    "--poll-interval", "0.3",
    "--grace-seconds", "0.2",
    "--backoff-initial", "0.2",
    "--backoff-max", "0.5",
    "--start-check-interval", "0.1",
]  # fmt: skip
CLOUD = f"""
seed: 7
time_scale: {TIME_SCALE}
launch_latency_seconds: 1
regions:
  - {{name: {FULL}, zones: [{FULL}a], spot_nodes: 0, on_demand_nodes: 10}}
  - {{name: {OPEN}, zones: [{OPEN}a], spot_nodes: 20, on_demand_nodes: 20}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("recovery-stack")
    config = data / "simcloud.yaml"
    config.write_text(CLOUD)
    with Stack(
        data, replicas=1, controller_args=CONTROLLER_ARGS, simcloud_args=["--config", str(config)]
    ) as running:
        assert running.credentials.client_security.token is not None  # auth is on, as shipped
        yield running
    assert_no_tracebacks(data)


@dataclasses.dataclass
class Run:
    """What a job did, as its events and the cloud told it."""

    job: job_pb2.Job
    statuses: list[int]
    messages: list[str]
    clusters: list[spb.Cluster]


def run_job(
    jobs: job_service_pb2_grpc.JobServiceStub,
    cloud: spb_grpc.SimOperatorServiceStub,
    spec: str,
    *,
    preemptions: int = 0,
    unreachable_seconds: float = 0.0,
    timeout: float = 60,
) -> Run:
    """Submits the job and follows it to DONE.

    Each of its first `preemptions` times RUNNING, its cluster is preempted; the
    first time it runs, the cloud API goes unreachable for `unreachable_seconds`.
    """
    job_id = jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, user="e2e")).job_id
    statuses: list[int] = []
    messages: list[str] = []
    cut_off = False
    for response in jobs.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]), timeout=timeout):
        event = response.event
        messages.append(event.message)
        if event.status and (not statuses or statuses[-1] != event.status):
            statuses.append(event.status)
            if event.status == S.RUNNING and statuses.count(S.RUNNING) <= preemptions:
                name = f"mj-{job_id}-0"
                hit = cloud.PreemptCluster(spb.PreemptClusterRequest(cluster_name=name))
                assert hit.preempted, name
            if event.status == S.RUNNING and unreachable_seconds and not cut_off:
                cut_off = True
                sim_seconds = unreachable_seconds * TIME_SCALE
                cloud.InjectFaults(spb.InjectFaultsRequest(unreachable_seconds=sim_seconds))
        if event.schedule_state == ScheduleState.DONE:
            break
    job = jobs.GetJob(pb.GetJobRequest(job_id=job_id)).job
    request = spb.ListInventoryRequest(job_id=job_id, page_size=100)
    clusters = sorted(cloud.ListInventory(request).clusters, key=lambda c: c.cluster_id)
    return Run(job, statuses, messages, clusters)


def recovery(policy: str) -> str:
    return f"resources:\n  use_spot: true\n  region: {OPEN}\n  job_recovery: {policy}\n"


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    spec: str
    # The job's statuses from its first RUNNING on.
    statuses: tuple[JobStatus, ...]
    # (recovery_count, restart_count) of its task.
    counts: tuple[int, int] = (0, 0)
    failure: str = ""
    preemptions: int = 0
    # Per cluster launched, in order: spot or not.
    spot: tuple[bool, ...] = ()
    # The exit code of each attempt, when the row says.
    exit_codes: tuple[int, ...] = ()


RECOVERED = (S.RUNNING, S.RECOVERING, S.RUNNING, S.SUCCEEDED)
ROWS = [
    Row(
        "exit-code-to-recover-is-recovered-without-a-restart",
        "name: j\nrun: train\nsim: {runtime_seconds: 5, exit_code: 75, exit_code_runs: 1}\n"
        + recovery("{max_restarts_on_errors: 2, recover_on_exit_codes: [75]}"),
        RECOVERED,
        counts=(1, 0),
        spot=(True, True),
        exit_codes=(75, 0),
    ),
    Row(
        "exit-code-to-fail-fails-at-once-with-restarts-left",
        "name: j\nrun: train\nsim: {runtime_seconds: 5, exit_code: 7}\n"
        + recovery("{max_restarts_on_errors: 3, fail_on_exit_codes: [7]}"),
        (S.RUNNING, S.FAILED),
        failure="exit code 7 is in fail_on_exit_codes",
        spot=(True,),
        exit_codes=(7,),
    ),
    Row(
        "max-recoveries-reached-ends-in-no-resource",
        "name: j\nrun: train\nsim: {runtime_seconds: 100000}\n"
        + recovery("{strategy: FAILOVER, max_recoveries: 1}"),
        (S.RUNNING, S.RECOVERING, S.RUNNING, S.FAILED_NO_RESOURCE),
        counts=(1, 0),
        failure="max_recoveries is 1",
        preemptions=2,
        spot=(True, True),
    ),
    Row(
        "on-demand-after-two-preemptions",
        "name: j\nrun: train\nsim: {runtime_seconds: 20}\n"
        + recovery("{on_demand_after_preemptions: 2}"),
        (S.RUNNING, S.RECOVERING, S.RUNNING, S.RECOVERING, S.RUNNING, S.SUCCEEDED),
        counts=(2, 0),
        preemptions=2,
        spot=(True, True, False),
    ),
    Row(
        "strategy-none-fails-on-preemption",
        "name: j\nrun: train\nsim: {runtime_seconds: 100000}\n" + recovery("NONE"),
        (S.RUNNING, S.FAILED_NO_RESOURCE),
        failure="recovery strategy is NONE",
        preemptions=1,
        spot=(True,),
    ),
    Row(
        "max-duration-stops-the-task-gracefully-and-fails",
        "name: j\nrun: train\nmax_duration: 1\ngrace_period: 5\n"
        f"sim: {{runtime_seconds: 100000}}\n{recovery('FAILOVER')}",
        (S.RUNNING, S.FAILED),
        failure="max_duration of 1s exceeded",
        spot=(True,),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_recovery_policy_end_to_end(
    jobs: job_service_pb2_grpc.JobServiceStub, cloud: spb_grpc.SimOperatorServiceStub, row: Row
) -> None:
    run = run_job(jobs, cloud, row.spec, preemptions=row.preemptions)
    first = run.statuses.index(S.RUNNING)
    assert tuple(run.statuses[first:]) == row.statuses, run.messages
    [task] = run.job.tasks
    assert (task.recovery_count, task.restart_count) == row.counts
    assert run.job.status == row.statuses[-1]
    if row.failure:
        assert row.failure in run.job.failure_reason, run.job.failure_reason
    assert tuple(c.spot for c in run.clusters) == row.spot
    assert all(c.HasField("terminate_time") for c in run.clusters)
    if row.exit_codes:
        assert tuple(a.exit_code for a in task.attempts) == row.exit_codes


def test_max_duration_sends_sigterm_then_sigkill_and_keeps_the_last_words(
    stack: Stack,
    jobs: job_service_pb2_grpc.JobServiceStub,
    cloud: spb_grpc.SimOperatorServiceStub,
) -> None:
    spec = (
        "name: j\nrun: train\nmax_duration: 1\ngrace_period: 5\n"
        "sim: {runtime_seconds: 1000000, log_lines: [working], sigterm_exit_seconds: never}\n"
    )
    run = run_job(jobs, cloud, spec)
    assert run.job.status == S.FAILED
    assert "max_duration of 1s exceeded" in run.job.failure_reason
    [cluster] = run.clusters
    sigterm = cluster.sigterm_time.ToNanoseconds()
    killed = cluster.task_end_time.ToNanoseconds()
    # This sim task traps SIGTERM: it is killed once the grace ran out (5 simulated
    # seconds, 0.5 real ones at this scale), and only then is the cluster terminated.
    grace = 5 / TIME_SCALE * 1e9
    assert sigterm > 0 and killed - sigterm == pytest.approx(grace, rel=0.01)
    assert (cluster.exit_code, cluster.terminate_time.ToNanoseconds() >= killed) == (137, True)
    logs = mj(stack, "logs", str(run.job.job_id), "--no-follow")
    assert logs.stdout == (
        "working\nreceived SIGTERM: stopping, SIGKILL in 5s\nkilled (SIGKILL)\n"
    ), logs.stderr


def test_a_short_outage_is_not_a_preemption(
    jobs: job_service_pb2_grpc.JobServiceStub, cloud: spb_grpc.SimOperatorServiceStub
) -> None:
    spec = "name: j\nrun: train\nsim: {runtime_seconds: 40}\n" + recovery(
        "{unreachable_timeout: 30}"
    )
    run = run_job(jobs, cloud, spec, unreachable_seconds=1.5)
    assert run.job.status == S.SUCCEEDED
    assert run.statuses[-2:] == [S.RUNNING, S.SUCCEEDED] and S.RECOVERING not in run.statuses
    assert run.job.recovery_count == 0 and len(run.clusters) == 1
    seen = [m for m in run.messages if "unreachable since" in m or "answers again" in m]
    assert [("answers again" in m) for m in seen] == [False, True], run.messages
    assert run.job.tasks[0].condition == ""  # cleared


def test_an_outage_past_the_unreachable_timeout_is_recovered_once(
    stack: Stack,
    jobs: job_service_pb2_grpc.JobServiceStub,
    cloud: spb_grpc.SimOperatorServiceStub,
) -> None:
    spec = "name: j\nrun: train\nsim: {runtime_seconds: 40}\n" + recovery(
        "{strategy: FAILOVER, unreachable_timeout: 0.5}"
    )
    run = run_job(jobs, cloud, spec, unreachable_seconds=2.5)
    assert run.job.status == S.SUCCEEDED
    first = run.statuses.index(S.RUNNING)
    assert tuple(run.statuses[first:]) == RECOVERED
    assert run.job.recovery_count == 1 and len(run.clusters) == 2
    # The old attempt was terminated (with its epoch) before the new one launched.
    old, new = run.clusters
    assert old.terminate_time.ToNanoseconds() <= new.launch_time.ToNanoseconds()
    lifecycle = mj(stack, "logs", str(run.job.job_id), "--controller", "--no-follow").stdout
    assert "stayed unreachable for 0.5s: preempted" in lifecycle, lifecycle


@pytest.mark.parametrize(
    ("deadline", "reason"),
    [
        ("max_pending: 1", "max_pending of 1s exceeded"),
        ("launch_timeout: 1", "launch_timeout of 1s exceeded: no capacity"),
    ],
)
def test_no_capacity_anywhere_ends_at_the_deadline(
    jobs: job_service_pb2_grpc.JobServiceStub, deadline: str, reason: str
) -> None:
    spec = f"name: j\nrun: train\n{deadline}\nresources: {{use_spot: true, region: {FULL}}}\n"
    job_id = jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, user="e2e")).job_id
    statuses = []
    for response in jobs.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]), timeout=30):
        statuses.append(response.event.status)
        if response.event.schedule_state == ScheduleState.DONE:
            break
    job = jobs.GetJob(pb.GetJobRequest(job_id=job_id)).job
    assert job.status == S.FAILED_NO_RESOURCE and S.RUNNING not in statuses
    assert reason in job.failure_reason, job.failure_reason
    # Not given up before the deadline, by the job's own record.
    waited = job.end_time.ToNanoseconds() - job.submit_time.ToNanoseconds()
    assert waited >= 1e9, (waited, statuses)


def test_a_deadline_is_shown_while_it_counts_down(stack: Stack) -> None:
    spec = f"name: j\nrun: train\nmax_pending: 30\nresources: {{use_spot: true, region: {FULL}}}\n"
    with stack.channel(stack.scheduler_address) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, user="e2e")).job_id
        try:
            shown = mj(stack, "status", str(job_id))
            assert shown.returncode == 0, shown.stderr
            assert "Max pending" in shown.stdout and "left)" in shown.stdout, shown.stdout
        finally:
            assert mj(stack, "cancel", str(job_id)).returncode == 0
            for response in stub.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]), timeout=30):
                if response.event.schedule_state == ScheduleState.DONE:
                    break


def test_a_preemption_notice_reaches_the_task_and_both_attempts_keep_their_logs(
    stack: Stack, jobs: job_service_pb2_grpc.JobServiceStub, cloud: spb_grpc.SimOperatorServiceStub
) -> None:
    spec = "name: j\nrun: train\nsim: {runtime_seconds: 60, log_lines: [a, b, c, d]}\n" + recovery(
        "FAILOVER"
    )
    job_id = jobs.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, user="e2e")).job_id
    noticed = False
    for response in jobs.WatchJobs(pb.WatchJobsRequest(job_ids=[job_id]), timeout=60):
        event = response.event
        if event.status == S.RUNNING and not noticed:
            noticed = True
            request = spb.PreemptClusterRequest(cluster_name=f"mj-{job_id}-0", notice_seconds=10)
            assert cloud.PreemptCluster(request).HasField("deadline")
        if event.schedule_state == ScheduleState.DONE:
            break
    job = jobs.GetJob(pb.GetJobRequest(job_id=job_id)).job
    assert (job.status, job.recovery_count) == (S.SUCCEEDED, 1)
    inventory = cloud.ListInventory(spb.ListInventoryRequest(job_id=job_id, page_size=10))
    first = min(inventory.clusters, key=lambda c: c.cluster_id)
    # The controller passed the notice on while the cluster was still there.
    assert first.HasField("notice_delivered_time") and first.HasField("preempt_time")
    assert first.notice_delivered_time.ToNanoseconds() < first.preempt_time.ToNanoseconds()
    one = mj(stack, "logs", str(job_id), "--attempt", "1", "--no-follow")
    two = mj(stack, "logs", str(job_id), "--attempt", "2", "--no-follow")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert "preemption notice" in one.stdout and one.stdout.startswith("a\n")
    assert two.stdout == "a\nb\nc\nd\n"


def test_a_caller_without_a_token_is_refused(stack: Stack) -> None:
    channel = grpc.insecure_channel(stack.scheduler_address)
    with channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListJobs(pb.ListJobsRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_zz_no_cluster_is_left_and_no_stale_call_was_accepted(
    jobs: job_service_pb2_grpc.JobServiceStub, cloud: spb_grpc.SimOperatorServiceStub
) -> None:
    listed = jobs.ListJobs(pb.ListJobsRequest(page_size=1000)).jobs
    assert listed and all(j.schedule_state == ScheduleState.DONE for j in listed)
    state = cloud.GetCloudState(spb.GetCloudStateRequest())
    assert (state.unterminated_clusters, state.violations, state.replaced_total) == (0, 0, 0)
