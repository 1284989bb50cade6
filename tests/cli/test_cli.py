"""The `mj` client: its pure formatting, its command line, and its error mapping.

Commands run against small in-process gRPC servers (real servers on port 0,
fake service logic); the unreachable case runs `mj` as a real process.
"""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import timestamp_pb2

from managedjobs.v1 import (
    job_pb2,
    job_service_pb2,
    job_service_pb2_grpc,
    log_service_pb2,
    log_service_pb2_grpc,
)
from services.cli import commands, output, specs, tables
from services.cli.main import run
from services.launcher.ports import free_port

REPO = Path(__file__).resolve().parents[2]
NOW = 1_700_000_000.0


def ts(value: float) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=int(value))


def single_job() -> job_pb2.Job:
    return job_pb2.Job(
        job_id=7,
        name="train",
        user="alice",
        status=job_pb2.JOB_STATUS_SUCCEEDED,
        submit_time=ts(NOW - 125),
        start_time=ts(NOW - 65),
        end_time=ts(NOW - 5),
        recovery_count=2,
        tasks=[job_pb2.Task(task_id=0, name="train", resources="1x[spot](cpus=2)")],
    )


def chain_job() -> job_pb2.Job:
    return job_pb2.Job(
        job_id=8,
        name="pipeline",
        user="bob",
        status=job_pb2.JOB_STATUS_RUNNING,
        submit_time=ts(NOW - 3700),
        start_time=ts(NOW - 3600),
        recovery_count=1,
        tasks=[
            job_pb2.Task(
                task_id=0,
                name="prep",
                status=job_pb2.JOB_STATUS_SUCCEEDED,
                resources="1x(cpus=1)",
                start_time=ts(NOW - 3600),
                end_time=ts(NOW - 3000),
            ),
            job_pb2.Task(
                task_id=1,
                name="fit",
                status=job_pb2.JOB_STATUS_RUNNING,
                resources="1x[spot](cpus=8)",
                start_time=ts(NOW - 2990),
                recovery_count=1,
            ),
        ],
    )


def pending_job() -> job_pb2.Job:
    return job_pb2.Job(
        job_id=9,
        name="later",
        user="alice",
        status=job_pb2.JOB_STATUS_PENDING,
        submit_time=ts(NOW - 30),
        tasks=[job_pb2.Task(task_id=0, name="later", status=job_pb2.JOB_STATUS_PENDING)],
    )


# --- pure formatting ---------------------------------------------------------------------


def test_queue_table_shows_a_chain_as_a_job_row_and_one_row_per_task() -> None:
    rows = tables.queue_table([single_job(), chain_job(), pending_job()], NOW, show_user=False)
    assert tables.queue_headers(False) == [
        "ID", "TASK", "NAME", "RESOURCES", "SUBMITTED", "TOT. DURATION", "JOB DURATION",
        "#RECOVERIES", "STATUS",
    ]  # fmt: skip
    assert rows == [
        ["7", "-", "train", "1x[spot](cpus=2)", "2 mins ago", "2m", "1m", "2", "SUCCEEDED"],
        ["8", "", "pipeline", "-", "1 hr ago", "1h 1m 40s", "1h", "1", "RUNNING"],
        [" ↳", "0", "prep", "1x(cpus=1)", "1 hr ago", "11m 40s", "10m", "0", "SUCCEEDED"],
        [" ↳", "1", "fit", "1x[spot](cpus=8)", "1 hr ago", "1h 1m 40s", "49m 50s", "1", "RUNNING"],
        ["9", "-", "later", "-", "30 secs ago", "30s", "-", "0", "PENDING"],
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


TABLE_HEADERS = ["ID", "NAME", "STATUS"]
TABLE_ROWS = [["7", "{name}", "FAILED_SETUP"], ["12", "x", "RUNNING"], ["3", "long-name", ""]]


def test_a_plain_table_aligns_columns_with_no_trailing_blanks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    output.print_table(TABLE_HEADERS, TABLE_ROWS)
    assert out.getvalue() == (
        "ID  NAME       STATUS\n"
        "7   {name}     FAILED_SETUP\n"
        "12  x          RUNNING\n"
        "3   long-name\n"
    )


def test_a_terminal_table_colours_statuses_and_aligns_as_the_plain_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = _Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    output.print_table(TABLE_HEADERS, TABLE_ROWS)
    text = out.getvalue()
    assert text.splitlines()[0] == "\x1b[1mID\x1b[0m  \x1b[1mNAME     \x1b[0m  \x1b[1mSTATUS\x1b[0m"
    assert "\x1b[31mFAILED_SETUP\x1b[0m" in text
    assert "\x1b[32mRUNNING\x1b[0m" in text
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stdout", plain)
    output.print_table(TABLE_HEADERS, TABLE_ROWS)
    assert re.sub("\x1b\\[[0-9]+m", "", text) == plain.getvalue()


def test_queue_table_puts_user_after_name_with_all() -> None:
    rows = tables.queue_table([chain_job()], NOW, show_user=True)
    assert tables.queue_headers(True)[:5] == ["ID", "TASK", "NAME", "USER", "RESOURCES"]
    assert [row[:4] for row in rows] == [
        ["8", "", "pipeline", "bob"],
        [" ↳", "0", "prep", ""],
        [" ↳", "1", "fit", ""],
    ]
    assert all(len(row) == len(tables.queue_headers(True)) for row in rows)


@pytest.mark.parametrize(
    ("elapsed", "text"),
    [
        (0.2, "just now"),
        (5, "a few secs ago"),
        (42, "42 secs ago"),
        (60, "1 min ago"),
        (150, "2 mins ago"),
        (3600, "1 hr ago"),
        (3 * 3600 + 59, "3 hrs ago"),
        (86_400, "1 day ago"),
        (15 * 86_400, "2 weeks ago"),
        (400 * 86_400, "1 year ago"),
    ],
)
def test_relative_time_reads_like_sky_jobs_queue(elapsed: float, text: str) -> None:
    assert tables.format_ago(NOW - elapsed, NOW) == text


def test_durations_leave_out_zero_units() -> None:
    assert tables.format_duration(0.4) == "< 1s"
    assert tables.format_duration(59) == "59s"
    assert tables.format_duration(3725) == "1h 2m 5s"
    assert tables.format_duration(86_400 + 60) == "1d 1m"
    assert tables.format_ago(None, NOW) == "-"


def test_outcome_line_carries_the_failure_reason() -> None:
    job = single_job()
    assert tables.outcome_line(job) == "Job 7 SUCCEEDED"
    job.status = job_pb2.JOB_STATUS_FAILED
    job.tasks[0].status = job_pb2.JOB_STATUS_FAILED
    job.tasks[0].failure_reason = "exit code 3"
    assert tables.outcome_line(job) == "Job 7 FAILED: exit code 3"


def test_a_chain_between_tasks_is_not_finished() -> None:
    job = chain_job()
    job.status = job_pb2.JOB_STATUS_SUCCEEDED
    job.tasks[1].status = job_pb2.JOB_STATUS_PENDING
    assert not commands.job_is_finished(job)
    job.tasks[1].status = job_pb2.JOB_STATUS_SUCCEEDED
    assert commands.job_is_finished(job)


def test_event_line() -> None:
    event = job_pb2.JobEvent(
        event_id=12,
        job_id=3,
        task_id=1,
        status=job_pb2.JOB_STATUS_RECOVERING,
        schedule_state=job_pb2.SCHEDULE_STATE_ALIVE,
        time=timestamp_pb2.Timestamp(seconds=1_700_000_000, nanos=125_000_000),
        message="cluster lost\nin us-east-1",
    )
    assert tables.event_line(event) == (
        "12 2023-11-14T22:13:20.125Z job 3 task 1 RECOVERING ALIVE cluster lost in us-east-1"
    )


def troubled_job(now: float = NOW) -> job_pb2.Job:
    """Job 10: preempted once, running again on a cluster that does not answer, under
    a job and a task deadline (times relative to `now`)."""
    first = job_pb2.Attempt(
        attempt=1,
        cluster_name="mj-10-0",
        region="us-west-2",
        start_time=ts(now - 500),
        end_time=ts(now - 300),
        outcome="mj-10-0 was\npreempted",
    )
    second = job_pb2.Attempt(
        attempt=2, cluster_name="mj-10-0", region="eu-west-1", start_time=ts(now - 280)
    )
    return job_pb2.Job(
        job_id=10,
        name="train",
        user="alice",
        status=job_pb2.JOB_STATUS_RUNNING,
        submit_time=ts(now - 600),
        start_time=ts(now - 500),
        timeouts=job_pb2.JobTimeouts(max_pending_seconds=3600, max_duration_seconds=7200),
        tasks=[
            job_pb2.Task(
                task_id=0,
                name="train",
                status=job_pb2.JOB_STATUS_RUNNING,
                cluster_name="mj-10-0",
                region="eu-west-1",
                start_time=ts(now - 500),
                recovery_count=1,
                max_duration_seconds=1800,
                condition="mj-10-0 unreachable since 22:11:20 UTC (host does not answer)",
                condition_time=ts(now - 120),
                attempts=[second, first],
            )
        ],
    )


def test_status_tables_show_attempts_condition_and_deadlines() -> None:
    job = troubled_job()
    assert tables.deadline_fields(job, NOW) == [
        ("Max pending", "1h from submission (met: started after 1m 40s)"),
        ("Max duration", "2h from the job's start (1h 51m 40s left)"),
    ]
    assert tables.task_notes(job, NOW) == [
        "Task 0: mj-10-0 unreachable since 22:11:20 UTC (host does not answer) (for 2m)",
        "Task 0: max duration 30m from its first start (21m 40s left)",
    ]
    time_ = tables.format_time
    assert tables.attempt_table(job) == [
        ["0", "1", "mj-10-0", "us-west-2", time_(NOW - 500), time_(NOW - 300), "-",
         "mj-10-0 was preempted"],
        ["0", "2", "mj-10-0", "eu-west-1", time_(NOW - 280), "-", "-", "-"],
    ]  # fmt: skip
    job.tasks[0].attempts[0].exit_code = 3
    assert tables.attempt_table(job)[1][6] == "3"


PENDING_FOR = "from submission"
RUNNING_FOR = "from the job's start"


@pytest.mark.parametrize(
    ("timeouts", "start", "end", "field"),
    [
        ({"max_pending_seconds": 60}, None, None, f"1m {PENDING_FOR} (30s left)"),
        ({"max_pending_seconds": 20}, None, None, f"20s {PENDING_FOR} (over by 10s)"),
        ({"max_pending_seconds": 20}, None, NOW, f"20s {PENDING_FOR} (never started)"),
        ({"max_duration_seconds": 90}, None, None, f"1m 30s {RUNNING_FOR} (not started)"),
        ({"max_duration_seconds": 90}, NOW - 20, NOW - 5, f"1m 30s {RUNNING_FOR} (ran 15s)"),
        ({}, NOW - 20, None, None),
    ],
)
def test_deadlines_count_down_from_their_start(
    timeouts: dict[str, float], start: float | None, end: float | None, field: str | None
) -> None:
    job = pending_job()  # submitted 30 s ago
    job.timeouts.CopyFrom(job_pb2.JobTimeouts(**timeouts))
    if start is not None:
        job.start_time.CopyFrom(ts(start))
    if end is not None:
        job.end_time.CopyFrom(ts(end))
    assert [value for _, value in tables.deadline_fields(job, NOW)] == ([field] if field else [])


@pytest.mark.parametrize(
    ("status", "codes", "expected"),
    [
        (job_pb2.JOB_STATUS_SUCCEEDED, [0], 0),
        (job_pb2.JOB_STATUS_FAILED, [], 1),
        (job_pb2.JOB_STATUS_FAILED, [None], 1),
        (job_pb2.JOB_STATUS_FAILED, [7, 3], 3),
        (job_pb2.JOB_STATUS_FAILED_SETUP, [42], 42),
        (job_pb2.JOB_STATUS_FAILED, [-9], 137),
        (job_pb2.JOB_STATUS_FAILED, [0], 1),
        (job_pb2.JOB_STATUS_FAILED, [1000], 255),
        (job_pb2.JOB_STATUS_FAILED, [-200], 255),
        (job_pb2.JOB_STATUS_CANCELLED, [5], 1),
        (job_pb2.JOB_STATUS_FAILED_NO_RESOURCE, [5], 1),
    ],
)
def test_launch_exit_code_is_the_failing_attempts_clamped(
    status: job_pb2.JobStatus.ValueType, codes: list[int | None], expected: int
) -> None:
    attempts = [
        job_pb2.Attempt(attempt=number, exit_code=code)
        if code is not None
        else job_pb2.Attempt(attempt=number)
        for number, code in enumerate(codes, start=1)
    ]
    done = job_pb2.Task(task_id=0, status=job_pb2.JOB_STATUS_SUCCEEDED)
    failing = job_pb2.Task(task_id=1, status=status, attempts=reversed(attempts))
    job = job_pb2.Job(job_id=1, status=status, tasks=[done, failing])
    assert commands.job_exit_code(job) == expected


def test_relative_workdirs_become_absolute_and_nothing_else_changes(tmp_path: Path) -> None:
    text = (
        "name: chain  # the job\n"
        "---\n"
        "name: prep\nworkdir: src\nrun: make\n"
        "---\n"
        "workdir: '../data dir'\nenvs: {A: '1'}\n"
        "---\n"
        "workdir: /abs/path\n"
        "---\n"
        "workdir: 12\n"
        "---\n"
        "x: &w here\nworkdir: *w\n"
    )
    folder = tmp_path / "jobs"
    out = specs.absolute_workdirs(text, folder)
    assert out == text.replace("workdir: src", f'workdir: "{folder}/src"').replace(
        "workdir: '../data dir'", f'workdir: "{tmp_path}/data dir"'
    )
    assert specs.absolute_workdirs("name: [unclosed", folder) == "name: [unclosed"


# --- command line ------------------------------------------------------------------------


def test_cancel_with_ids_and_all_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["cancel", "3", "--all"], environ={}) == 2
    assert run(["cancel"], environ={}) == 2
    assert "exactly one of" in capsys.readouterr().err


def test_launch_of_a_missing_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.yaml"
    assert run(["launch", str(missing)], environ={}) == 2
    err = capsys.readouterr().err
    assert err == f"mj: launch: cannot read {missing}: No such file or directory\n"


def test_env_without_equals_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("run: echo hi\n")
    assert run(["launch", str(spec), "--env", "FOO"], environ={}) == 2
    assert "expected KEY=VALUE, got 'FOO'" in capsys.readouterr().err


def test_a_bad_environment_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["queue"], environ={"MJ_TIMEOUT": "soon"}) == 2
    assert capsys.readouterr().err == (
        "mj: error: MJ_TIMEOUT='soon': not a positive number of seconds: 'soon'\n"
    )


def test_unreachable_scheduler_exits_3_with_one_line_naming_it() -> None:
    address = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "queue", "--scheduler", address],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(
        f"mj: queue: UNAVAILABLE: cannot reach the scheduler at {address}"
    )


def test_python_dash_m_services_cli_runs_mj() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert "launch" in done.stdout


# --- commands against in-process servers ---------------------------------------------------


class FakeJobs(job_service_pb2_grpc.JobServiceServicer):
    """Just enough of the scheduler's JobService: a dict of jobs and a list of events."""

    def __init__(self) -> None:
        self.jobs: dict[int, job_pb2.Job] = {}
        self.submitted: list[job_service_pb2.SubmitJobRequest] = []
        self.list_requests: list[job_service_pb2.ListJobsRequest] = []
        self.metadata: list[tuple[tuple[str, str], ...]] = []
        self.events: list[job_pb2.JobEvent] = []
        self.outcome = job_pb2.JOB_STATUS_SUCCEEDED
        self.reject: str | None = None
        self.cancels: list[job_service_pb2.CancelJobsRequest] = []
        # The attempts each submitted job's task shows (with their exit codes).
        self.attempts: list[job_pb2.Attempt] = []
        self.batches: list[job_service_pb2.SubmitJobsRequest] = []

    def SubmitJob(
        self, request: job_service_pb2.SubmitJobRequest, context: grpc.ServicerContext
    ) -> job_service_pb2.SubmitJobResponse:
        self.metadata.append(tuple((str(k), str(v)) for k, v in context.invocation_metadata()))
        if self.reject:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.reject)
        return job_service_pb2.SubmitJobResponse(job_id=self._store(request))

    def SubmitJobs(
        self, request: job_service_pb2.SubmitJobsRequest, context: grpc.ServicerContext
    ) -> job_service_pb2.SubmitJobsResponse:
        self.batches.append(request)
        return job_service_pb2.SubmitJobsResponse(job_ids=[self._store(r) for r in request.jobs])

    def _store(self, request: job_service_pb2.SubmitJobRequest) -> int:
        self.submitted.append(request)
        job_id = len(self.jobs) + 1
        reason = "" if self.outcome == job_pb2.JOB_STATUS_SUCCEEDED else "exit code 3"
        self.jobs[job_id] = job_pb2.Job(
            job_id=job_id,
            name=request.name,
            user=request.user,
            status=self.outcome,
            failure_reason=reason,
            submit_time=ts(NOW),
            tasks=[job_pb2.Task(task_id=0, status=self.outcome, attempts=self.attempts)],
        )
        return job_id

    def GetJob(
        self, request: job_service_pb2.GetJobRequest, context: grpc.ServicerContext
    ) -> job_service_pb2.GetJobResponse:
        if request.job_id not in self.jobs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"job {request.job_id} does not exist")
        return job_service_pb2.GetJobResponse(job=self.jobs[request.job_id])

    def ListJobs(
        self, request: job_service_pb2.ListJobsRequest, context: grpc.ServicerContext
    ) -> job_service_pb2.ListJobsResponse:
        """One job per page, whatever the page size, to make the client page."""
        self.list_requests.append(request)
        ids = sorted(self.jobs)
        start = int(request.page_token or 0)
        more = start + 1 < len(ids)
        return job_service_pb2.ListJobsResponse(
            jobs=[self.jobs[job_id] for job_id in ids[start : start + 1]],
            next_page_token=str(start + 1) if more else "",
        )

    def CancelJobs(
        self, request: job_service_pb2.CancelJobsRequest, context: grpc.ServicerContext
    ) -> job_service_pb2.CancelJobsResponse:
        self.cancels.append(request)
        ids = [job_id for job_id in request.job_ids if job_id in self.jobs]
        return job_service_pb2.CancelJobsResponse(cancelled_job_ids=ids)

    def WatchJobs(
        self, request: job_service_pb2.WatchJobsRequest, context: grpc.ServicerContext
    ) -> Iterator[job_service_pb2.WatchJobsResponse]:
        for event in self.events:
            if event.event_id > request.after_event_id:
                if event.job_id in self.jobs:  # an event is a change of the job
                    job = self.jobs[event.job_id]
                    job.status = job.tasks[event.task_id].status = event.status
                if request.batched:
                    yield job_service_pb2.WatchJobsResponse(events=[event])
                else:
                    yield job_service_pb2.WatchJobsResponse(event=event)


class FakeLogs(log_service_pb2_grpc.LogServiceServicer):
    def __init__(self) -> None:
        self.chunks = [b"hello\n", b"world"]
        self.requests: list[log_service_pb2.ReadLogsRequest] = []
        # While set, a follow stays open after the chunks, as for a job that keeps running.
        self.running = threading.Event()

    def ReadLogs(
        self, request: log_service_pb2.ReadLogsRequest, context: grpc.ServicerContext
    ) -> Iterator[log_service_pb2.ReadLogsResponse]:
        self.requests.append(request)
        for chunk in self.chunks:
            yield log_service_pb2.ReadLogsResponse(job_id=request.job_id, data=chunk)
        while request.follow and self.running.is_set() and context.is_active():
            time.sleep(0.05)

    def FetchTaskLogs(
        self, request: log_service_pb2.FetchTaskLogsRequest, context: grpc.ServicerContext
    ) -> log_service_pb2.FetchTaskLogsResponse:
        raise NotImplementedError

    def AppendControllerLogs(
        self, request: log_service_pb2.AppendControllerLogsRequest, context: grpc.ServicerContext
    ) -> log_service_pb2.AppendControllerLogsResponse:
        raise NotImplementedError


@pytest.fixture
def services() -> Iterator[tuple[str, FakeJobs, FakeLogs]]:
    jobs, logs = FakeJobs(), FakeLogs()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    job_service_pb2_grpc.add_JobServiceServicer_to_server(jobs, server)
    log_service_pb2_grpc.add_LogServiceServicer_to_server(logs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", jobs, logs
    logs.running.clear()
    server.stop(grace=None)


def mj(address: str, *args: str) -> int:
    flags = ["--scheduler", address, "--logs", address, "--user", "alice"]
    return run([*flags, *args], environ={"MJ_TOKEN": "s3cret"})


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text("name: hello\nrun: echo hello\n")
    return path


def test_launch_follows_the_logs_then_reports_success(
    services: tuple[str, FakeJobs, FakeLogs],
    spec: Path,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    address, jobs, logs = services
    assert (
        mj(address, "launch", str(spec), "--env", "A=1", "--env", "B=x=y", "--priority", "5") == 0
    )
    assert capsysbinary.readouterr().out == (b"Job 1 submitted.\nhello\nworld\nJob 1 SUCCEEDED\n")
    request = jobs.submitted[0]
    assert request.spec_yaml == spec.read_text()
    assert dict(request.envs) == {"A": "1", "B": "x=y"}
    assert (request.user, request.priority) == ("alice", 5)
    assert dict(request.secrets) == {}
    assert ("authorization", "Bearer s3cret") in jobs.metadata[0]
    assert logs.requests[0].follow and logs.requests[0].job_id == 1


def test_launch_sends_secrets_from_the_command_line_or_the_environment(
    services: tuple[str, FakeJobs, FakeLogs],
    spec: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    address, jobs, _ = services
    monkeypatch.setenv("HF_TOKEN", "hf-from-env")
    assert mj(address, "launch", str(spec), "--secret", "API_KEY=k=1", "--secret", "HF_TOKEN") == 0
    assert dict(jobs.submitted[0].secrets) == {"API_KEY": "k=1", "HF_TOKEN": "hf-from-env"}
    assert b"hf-from-env" not in capsysbinary.readouterr().out
    monkeypatch.delenv("HF_TOKEN")
    assert mj(address, "launch", str(spec), "--secret", "HF_TOKEN") == 2


def test_launch_of_a_failing_job_exits_1_with_the_reason(
    services: tuple[str, FakeJobs, FakeLogs],
    spec: Path,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    address, jobs, _ = services
    jobs.outcome = job_pb2.JOB_STATUS_FAILED
    assert mj(address, "launch", str(spec)) == 1
    assert capsysbinary.readouterr().out.endswith(b"world\nJob 1 FAILED: exit code 3\n")


def test_launch_waits_for_the_end_when_the_log_stream_ends_early(
    services: tuple[str, FakeJobs, FakeLogs],
    spec: Path,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    address, jobs, _ = services
    jobs.outcome = job_pb2.JOB_STATUS_RUNNING
    jobs.events = [job_pb2.JobEvent(event_id=1, job_id=1, status=job_pb2.JOB_STATUS_SUCCEEDED)]
    assert mj(address, "launch", str(spec)) == 0
    captured = capsysbinary.readouterr()
    assert captured.out.endswith(b"world\nJob 1 SUCCEEDED\n")
    assert b"waiting" in captured.err


def test_ctrl_c_while_following_leaves_the_job_running_and_says_how_to_reattach(
    services: tuple[str, FakeJobs, FakeLogs], spec: Path
) -> None:
    address, jobs, logs = services
    jobs.outcome = job_pb2.JOB_STATUS_RUNNING
    logs.chunks = [b"hello\n"]
    logs.running.set()
    command = [sys.executable, "-m", "services.cli", "--scheduler", address, "--logs", address]
    process = subprocess.Popen(
        [*command, "launch", str(spec)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == b"Job 1 submitted.\n"
    assert process.stdout.readline() == b"hello\n"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130
    assert out == b""
    assert b"Traceback" not in err
    assert b"Re-attach with: mj logs 1" in err
    assert jobs.cancels == []


def test_launch_detached_does_not_read_logs(
    services: tuple[str, FakeJobs, FakeLogs], spec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address, _, logs = services
    assert mj(address, "launch", str(spec), "--detach") == 0
    assert capsys.readouterr().out == "Job 1 submitted.\n"
    assert logs.requests == []


def test_a_rejected_spec_is_one_line_with_the_status_code(
    services: tuple[str, FakeJobs, FakeLogs], spec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address, jobs, _ = services
    jobs.reject = "resources.gpus: unknown field"
    assert mj(address, "launch", str(spec)) == 1
    captured = capsys.readouterr()
    assert captured.err == "mj: launch: INVALID_ARGUMENT: resources.gpus: unknown field\n"
    assert captured.out == ""


def test_queue_pages_through_every_job(
    services: tuple[str, FakeJobs, FakeLogs], capsys: pytest.CaptureFixture[str]
) -> None:
    address, jobs, _ = services
    jobs.jobs = {7: single_job(), 8: chain_job(), 9: pending_job()}
    assert mj(address, "queue", "--all", "--status", "running", "SUCCEEDED") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["ID", "TASK", "NAME", "USER"]
    assert [line.split()[0] for line in lines[1:]] == ["7", "8", "↳", "↳", "9"]
    assert len(jobs.list_requests) == 3
    assert jobs.list_requests[0].user == ""
    assert list(jobs.list_requests[0].statuses) == [
        job_pb2.JOB_STATUS_RUNNING,
        job_pb2.JOB_STATUS_SUCCEEDED,
    ]


def test_queue_limit_stops_paging(
    services: tuple[str, FakeJobs, FakeLogs], capsys: pytest.CaptureFixture[str]
) -> None:
    address, jobs, _ = services
    jobs.jobs = {7: single_job(), 8: chain_job(), 9: pending_job()}
    assert mj(address, "queue", "--limit", "1") == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert len(jobs.list_requests) == 1
    assert jobs.list_requests[0].user == "alice"
    # Pages are asked for ahead, but never past the limit.
    jobs.list_requests.clear()
    assert mj(address, "queue", "--limit", "2") == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == [
        "7",
        "8",
        "↳",
        "↳",
    ]
    assert [r.page_token for r in jobs.list_requests] == ["", "1"]


def test_cancel_names_the_jobs_it_cancels(
    services: tuple[str, FakeJobs, FakeLogs], capsys: pytest.CaptureFixture[str]
) -> None:
    address, jobs, _ = services
    jobs.jobs = {3: single_job(), 4: single_job()}
    assert mj(address, "cancel", "3", "4", "5") == 0
    assert mj(address, "cancel", "5") == 0
    assert capsys.readouterr().out == "Cancelling job(s) 3, 4.\nNo jobs to cancel.\n"


def test_cancel_all_needs_yes_without_a_terminal(
    services: tuple[str, FakeJobs, FakeLogs], capsys: pytest.CaptureFixture[str]
) -> None:
    address, jobs, _ = services
    assert mj(address, "cancel", "--all") == 2
    assert "add --yes" in capsys.readouterr().err
    assert jobs.cancels == []
    assert mj(address, "cancel", "--all", "--yes") == 0
    assert (jobs.cancels[0].all, jobs.cancels[0].user) == (True, "alice")


def test_status_of_an_unknown_job_is_not_found(
    services: tuple[str, FakeJobs, FakeLogs], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _, _ = services
    assert mj(address, "status", "42") == 1
    assert capsys.readouterr().err == "mj: status: NOT_FOUND: job 42 does not exist\n"


def test_status_prints_the_job_and_its_tasks(
    services: tuple[str, FakeJobs, FakeLogs], capsys: pytest.CaptureFixture[str]
) -> None:
    address, jobs, _ = services
    jobs.jobs = {8: chain_job()}
    assert mj(address, "status", "8") == 0
    out = capsys.readouterr().out
    assert "Schedule state:" in out
    assert "1x[spot](cpus=8)" in out


def test_status_shows_the_current_tasks_condition(
    services: tuple[str, FakeJobs, FakeLogs], capsys: pytest.CaptureFixture[str]
) -> None:
    address, jobs, _ = services
    job = chain_job()
    job.current_task_id = 1
    job.tasks[1].condition = "mj-8-1 unreachable since 12:00:01 UTC (no answer)"
    jobs.jobs = {8: job}
    assert mj(address, "status", "8") == 0
    assert "Condition:" in (out := capsys.readouterr().out)
    assert "task 1: mj-8-1 unreachable since 12:00:01 UTC (no answer)" in out
    job.tasks[1].condition = ""
    assert mj(address, "status", "8") == 0
    (line,) = [row for row in capsys.readouterr().out.splitlines() if "Condition:" in row]
    assert line.split() == ["Condition:", "-"]


def test_watch_prints_one_line_per_event_after_the_given_id(
    services: tuple[str, FakeJobs, FakeLogs], capsys: pytest.CaptureFixture[str]
) -> None:
    address, jobs, _ = services
    jobs.events = [
        job_pb2.JobEvent(event_id=i, job_id=1, status=job_pb2.JOB_STATUS_RUNNING, time=ts(NOW))
        for i in (1, 2, 3)
    ]
    assert mj(address, "watch", "--after", "1") == 0
    assert capsys.readouterr().out.splitlines() == [
        "2 2023-11-14T22:13:20.000Z job 1 task 0 RUNNING UNSPECIFIED",
        "3 2023-11-14T22:13:20.000Z job 1 task 0 RUNNING UNSPECIFIED",
    ]


def test_logs_passes_task_tail_and_follow(
    services: tuple[str, FakeJobs, FakeLogs], capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    address, _, logs = services
    assert mj(address, "logs", "3", "--task", "1", "--tail", "20", "--no-follow") == 0
    assert capsysbinary.readouterr().out == b"hello\nworld"
    request = logs.requests[0]
    assert request.HasField("task_id") and request.task_id == 1
    assert (request.tail_lines, request.follow, request.controller) == (20, False, False)
    assert not request.HasField("attempt")
    assert mj(address, "logs", "3", "--attempt", "2") == 0
    assert logs.requests[1].HasField("attempt") and logs.requests[1].attempt == 2
    assert logs.requests[1].follow
    assert mj(address, "logs", "3", "--attempt", "0") == 2


def test_launch_rides_out_a_scheduler_that_is_not_up_yet(tmp_path: Path) -> None:
    """mj launch keys its submission, so it retries safely until the scheduler answers."""
    from services.common.security.auth import Secrets
    from services.common.security.tokens import bootstrap, tokens_path
    from services.launcher.service import wait_serving

    port = free_port()
    spec = tmp_path / "job.yaml"
    spec.write_text("name: late\nrun: echo hi\n")
    data = tmp_path / "data"
    bootstrap(tokens_path(data), Secrets.in_data_dir(data), admin="e2e")
    # mj finds the admin token in the data dir by itself.
    env = {
        **os.environ,
        "MJ_SCHEDULER_ADDRESS": f"127.0.0.1:{port}",
        "MJ_DATA_DIR": str(data),
        "MJ_TOKEN": "",
    }
    # Until mj's first attempt, the port has a listener that hangs up on it, as on a
    # scheduler not up yet; only then does the scheduler start.
    with socket.create_server(("127.0.0.1", port)) as early:
        launch = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "launch", str(spec), "--detach"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        early.settimeout(30)
        try:
            first_attempt, _ = early.accept()
        except TimeoutError:
            launch.kill()
            raise AssertionError(f"mj launch never called: {launch.communicate()}") from None
        first_attempt.close()
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "services.scheduler.main", "--port", str(port),
         "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_serving(f"127.0.0.1:{port}")
        out, err = launch.communicate(timeout=30)
        assert launch.returncode == 0, err
        assert "Job 1 submitted." in out
    finally:
        scheduler.terminate()
        scheduler.wait(15)


def test_mj_takes_its_token_from_the_flag_then_a_file_then_the_data_dir(tmp_path: Path) -> None:
    from services.cli.main import build_parser, client_security
    from services.common.security.auth import Secrets

    data = tmp_path / "data"
    admin = Secrets.in_data_dir(data).admin()
    admin.parent.mkdir(parents=True)
    admin.write_text("from-data-dir\n")
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    environ = {"MJ_DATA_DIR": str(data)}

    def token(*flags: str, **env: str) -> str | None:
        args = build_parser({**environ, **env}).parse_args([*flags, "queue"])
        security = client_security(args)
        return security.token() if security.token is not None else None

    assert token() == "from-data-dir"
    assert token(MJ_TOKEN_FILE=str(token_file)) == "from-file"
    assert token("--token", "from-flag", MJ_TOKEN_FILE=str(token_file)) == "from-flag"
    assert token(MJ_TOKEN="from-env") == "from-env"
    assert token(MJ_DATA_DIR=str(tmp_path / "elsewhere")) is None


def test_status_prints_attempts_exit_codes_the_condition_and_deadlines(
    services: tuple[str, FakeJobs, FakeLogs], capsys: pytest.CaptureFixture[str]
) -> None:
    address, jobs, _ = services
    job = troubled_job(time.time())
    job.tasks[0].attempts[1].exit_code = 143  # the first attempt, stopped by SIGTERM
    jobs.jobs = {10: job}
    assert mj(address, "status", "10") == 0
    out = capsys.readouterr().out
    assert re.search(r"^Max pending: +1h from submission \(met: started after 1m 40s\)$", out, re.M)
    assert re.search(
        r"^Max duration: +2h from the job's start \(1h 5\dm( \d+s)? left\)$", out, re.M
    )
    assert "Task 0: mj-10-0 unreachable since 22:11:20 UTC (host does not answer) (for 2m" in out
    assert re.search(
        r"^Task 0: max duration 30m from its first start \(2\dm( \d+s)? left\)$", out, re.M
    )
    header, first, second = out.split("\n\n")[-1].splitlines()
    assert header.split() == ["TASK", "ATTEMPT", "CLUSTER", "REGION", "STARTED", "ENDED",
                              "EXIT", "CODE", "OUTCOME"]  # fmt: skip
    assert first.split()[:4] == ["0", "1", "mj-10-0", "us-west-2"]
    assert re.search(r" 143 +mj-10-0 was preempted$", first)
    assert second.split()[:4] == ["0", "2", "mj-10-0", "eu-west-1"]
    assert second.split()[-2:] == ["-", "-"]


def test_launch_of_a_job_that_failed_with_an_exit_code_exits_with_it(
    services: tuple[str, FakeJobs, FakeLogs],
    spec: Path,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    address, jobs, _ = services
    jobs.outcome = job_pb2.JOB_STATUS_FAILED
    jobs.attempts = [
        job_pb2.Attempt(attempt=1, outcome="preempted"),
        job_pb2.Attempt(attempt=2, exit_code=42, outcome="user run exited non-zero"),
    ]
    assert mj(address, "launch", str(spec)) == 42
    assert capsysbinary.readouterr().out.endswith(b"Job 1 FAILED: exit code 3\n")


def test_launch_of_several_files_submits_them_in_one_call_and_follows_each(
    services: tuple[str, FakeJobs, FakeLogs],
    tmp_path: Path,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    address, jobs, logs = services
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("name: a\nrun: echo a\n")
    second.write_text("name: b\nrun: echo b\n")
    jobs.outcome = job_pb2.JOB_STATUS_FAILED
    jobs.attempts = [job_pb2.Attempt(attempt=1, exit_code=7)]

    assert mj(address, "launch", str(first), str(second), "--idempotency-key", "k") == 7
    assert [len(batch.jobs) for batch in jobs.batches] == [2]
    assert [r.spec_yaml for r in jobs.submitted] == [first.read_text(), second.read_text()]
    assert [r.idempotency_key for r in jobs.submitted] == ["k-0", "k-1"]
    assert [(r.job_id, r.follow) for r in logs.requests] == [(1, True), (2, True)]
    assert capsysbinary.readouterr().out == (
        b"Job 1 submitted.\nJob 2 submitted.\n"
        b"hello\nworld\nJob 1 FAILED: exit code 3\n"
        b"hello\nworld\nJob 2 FAILED: exit code 3\n"
    )


def test_launch_makes_a_relative_workdir_absolute_against_the_spec_folder(
    services: tuple[str, FakeJobs, FakeLogs], tmp_path: Path
) -> None:
    address, jobs, _ = services
    folder = tmp_path / "project" / "jobs"
    folder.mkdir(parents=True)
    path = folder / "train.yaml"
    path.write_text("name: train\nworkdir: ../src  # the code\nrun: python train.py\n")
    # mj runs elsewhere: the folder of the file decides, not the current directory.
    assert mj(address, "launch", os.path.relpath(path), "--detach") == 0
    assert jobs.submitted[0].spec_yaml == (
        f'name: train\nworkdir: "{tmp_path}/project/src"  # the code\nrun: python train.py\n'
    )
    assert jobs.batches == []
