"""The subcommands of `mj`: each takes the client and the parsed arguments, returns an exit code.

They raise `ServiceError` (a failed RPC) and `UsageError` (a bad input); `main`
turns both into one line on stderr. Log bytes go to stdout unchanged; what
`mj` says about them (hints, warnings) goes to stderr so a pipe gets only logs.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Iterable

from managedjobs.v1 import job_pb2, job_service_pb2, log_service_pb2
from services.cli import output, tables
from services.cli.client import PAGE_SIZE, Client
from services.cli.exit_codes import ExitCode, UsageError
from services.cli.specs import read_spec
from services.common.statuses import TERMINAL


def _write_logs(chunks: Iterable[bytes]) -> bool:
    """Copies log bytes to stdout as they come; True when the output ended with a newline."""
    stdout = sys.stdout.buffer
    last = b"\n"
    for data in chunks:
        if data:
            stdout.write(data)
            stdout.flush()
            last = data[-1:]
    return last == b"\n"


def job_is_finished(job: job_pb2.Job) -> bool:
    """The job and every task of it are in a terminal status (a chain may be between tasks)."""
    return job.status in TERMINAL and all(task.status in TERMINAL for task in job.tasks)


def _wait_until_finished(client: Client, job_id: int) -> job_pb2.Job:
    """The job once it is finished; if the log stream ended early, waits on its events."""
    job = client.get_job(job_id)
    if job_is_finished(job):
        return job
    print(f"mj: the log stream ended before job {job_id} finished; waiting.", file=sys.stderr)
    for event in client.watch_jobs([job_id], after_event_id=0):
        if event.status in TERMINAL:
            job = client.get_job(job_id)
            if job_is_finished(job):
                return job
    return client.get_job(job_id)


def launch(client: Client, args: argparse.Namespace) -> int:
    """Submits one job per file and, unless detached, follows each one's logs to its end.

    Several files go in one SubmitJobs call (all of them, or none). Each relative
    `workdir` is made absolute against its file's folder first. The exit code is
    the first job's (in the order of the files) that did not succeed: its own exit
    code when it FAILED with one (`job_exit_code`), else 1.
    """
    key = args.idempotency_key or f"mj-launch-{uuid.uuid4()}"
    several = len(args.files) > 1
    requests = [
        job_service_pb2.SubmitJobRequest(
            spec_yaml=read_spec(path),
            name=args.name or "",
            priority=args.priority,
            envs=dict(args.env),
            secrets=dict(args.secret),
            user=args.user,
            # A key of its own makes retrying the submission safe.
            idempotency_key=f"{key}-{index}" if several else key,
        )
        for index, path in enumerate(args.files)
    ]
    job_ids = client.submit_jobs(requests) if several else [client.submit_job(requests[0])]
    for job_id in job_ids:
        print(f"Job {job_id} submitted.", flush=True)
    if args.detach:
        return ExitCode.OK
    code: int = ExitCode.OK
    for job_id in job_ids:
        try:
            outcome = _follow_to_the_end(client, job_id)
        except KeyboardInterrupt:
            print(
                f"\nStopped following job {job_id}; it keeps running. "
                f"Re-attach with: mj logs {job_id}",
                file=sys.stderr,
            )
            return ExitCode.INTERRUPTED
        code = code or outcome
    return code


def _follow_to_the_end(client: Client, job_id: int) -> int:
    """Streams the job's logs, then prints its outcome; its exit code."""
    if not _write_logs(
        client.read_logs(log_service_pb2.ReadLogsRequest(job_id=job_id, follow=True))
    ):
        print(flush=True)
    job = _wait_until_finished(client, job_id)
    print(tables.outcome_line(job))
    return job_exit_code(job)


_WITH_EXIT_CODE = (job_pb2.JOB_STATUS_FAILED, job_pb2.JOB_STATUS_FAILED_SETUP)


def job_exit_code(job: job_pb2.Job) -> int:
    """What `mj launch` exits with for a finished job.

    0 when it SUCCEEDED. When it FAILED (or FAILED_SETUP) and the failing task's last
    attempt has an exit code: that code, a death by signal N as 128+N (as a shell
    reports it), clamped to 1..255. Otherwise 1.
    """
    if job.status == job_pb2.JOB_STATUS_SUCCEEDED:
        return ExitCode.OK
    if job.status in _WITH_EXIT_CODE:
        failing = next((t for t in job.tasks if t.status in _WITH_EXIT_CODE), None)
        attempts = sorted(failing.attempts, key=lambda a: a.attempt) if failing else []
        if attempts and attempts[-1].HasField("exit_code"):
            code = attempts[-1].exit_code
            code = 128 - code if code < 0 else code
            return min(max(code, 1), 255)
    return ExitCode.FAILED


def queue(client: Client, args: argparse.Namespace) -> int:
    """Lists jobs as a table: the caller's (or `--user`'s), or everyone's with `--all`."""
    user = "" if args.all else (args.filter_user or args.user)
    page_size = PAGE_SIZE if args.limit is None else min(PAGE_SIZE, args.limit)
    jobs = client.list_jobs(args.status, user, page_size, limit=args.limit)
    # Each page is laid out while the scheduler builds the next one.
    rows = tables.queue_table(jobs, time.time(), args.all)
    if not rows:
        print("No managed jobs.")
        return ExitCode.OK
    output.print_table(tables.queue_headers(args.all), rows)
    return ExitCode.OK


def status(client: Client, args: argparse.Namespace) -> int:
    """Prints one job's details, its deadlines, its tasks and every task's attempts."""
    job = client.get_job(args.job_id)
    now = time.time()
    output.print_fields(tables.job_fields(job, now) + tables.deadline_fields(job, now))
    if job.tasks:
        print()
        output.print_table(tables.TASK_HEADERS, tables.task_table(job))
    notes = tables.task_notes(job, now)
    if notes:
        print()
        print("\n".join(notes))
    attempts = tables.attempt_table(job)
    if attempts:
        print()
        output.print_table(tables.ATTEMPT_HEADERS, attempts)
    return ExitCode.OK


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        raise UsageError("refusing to cancel all jobs without a terminal to confirm: add --yes")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def cancel(client: Client, args: argparse.Namespace) -> int:
    """Cancels jobs by ids, by name, or all of the caller's; asks first for `--all`."""
    if args.all and not args.yes and not _confirm("Cancel all your managed jobs?"):
        print("Nothing cancelled.")
        return ExitCode.OK
    cancelled = client.cancel_jobs(
        job_service_pb2.CancelJobsRequest(
            job_ids=args.job_ids, name=args.name or "", all=args.all, user=args.user
        )
    )
    if cancelled:
        print(f"Cancelling job(s) {', '.join(str(job_id) for job_id in cancelled)}.")
    else:
        print("No jobs to cancel.")
    return ExitCode.OK


def logs(client: Client, args: argparse.Namespace) -> int:
    """Streams a task's (or the controller's) log to stdout."""
    request = log_service_pb2.ReadLogsRequest(
        job_id=args.job_id, follow=args.follow, tail_lines=args.tail, controller=args.controller
    )
    if args.task is not None:
        request.task_id = args.task
    if args.attempt is not None:
        request.attempt = args.attempt
    _write_logs(client.read_logs(request))
    return ExitCode.OK


def watch(client: Client, args: argparse.Namespace) -> int:
    """Prints job events, one line each, until the stream ends or Ctrl-C."""
    for event in client.watch_jobs(args.job_ids, args.after):
        print(tables.event_line(event), flush=True)
    return ExitCode.OK


def ops_state(client: Client, args: argparse.Namespace) -> int:
    """Prints the scheduler's limits, counters, queue depth and replicas."""
    state = client.scheduler_state()
    output.print_fields(tables.state_fields(state))
    if state.replicas:
        print()
        output.print_table(tables.REPLICA_HEADERS, tables.replica_table(state, time.time()))
    return ExitCode.OK
