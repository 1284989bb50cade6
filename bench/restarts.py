"""Benchmark: 10,000 submissions while the scheduler is restarted 5 times (contract §16).

Starts the whole system as processes (`system.py`: sim cloud, scheduler on SQLite,
or with `--postgres` on a fresh PostgreSQL database, two replicas, logs; tokens on,
as `make up` runs it). `--clients` callers submit `--jobs` long jobs, each through
`mj`'s own client (`services/cli/client.py`: a key per submission, its retries of
UNAVAILABLE and CANCELLED); a call that still fails with a transient code is made
again with the same key, as a person runs `mj launch --idempotency-key K` again.
Meanwhile the scheduler is restarted `--restarts` times, evenly through the
submissions, by SIGKILL and SIGTERM in turn, and started again with the same
arguments on the same database; each restart waits until the replicas are back
before the next one. The scheduler reconciles its counters every
`--reconcile-interval` seconds, so that each of its lives checks them.

Once every submission is answered and every job RUNNING (at most `--settle`
seconds), it checks, from the API and the database:
- every submission stored exactly once: each key answered with a job of its own,
  which is the key's one row in the jobs table, and ListJobs shows exactly those;
- every job RUNNING (or in a terminal status), each launched once on the cloud;
  nothing in the run ends a job, so one that ended (with its reason) was ended by
  the system, and fails the run;
- 0 counter corrections (GetSchedulerState's count, read before each restart and
  at the end, and the scheduler's log of them, which outlives a SIGKILL), and the
  counters equal to a recount of the database.
It records one JSON line (`results.py`): those findings; each restart's signal and
times from the signal until the old process was gone, the new one served
(grpc.health.v1), every replica was connected again and a submission was answered
again, with p50/p99/max over the restarts; submissions per second; the calls made
again; and the jobs that moved to a new epoch meanwhile (allowed: a replica that
never heard of its assignment, or whose lease ran out), with the releases that
moved them by reason. Exits 1 when anything was lost or duplicated, a job is not
RUNNING or ended, a counter was corrected or differs from the recount, or a service
exited.

    python bench/restarts.py [--jobs 10000] [--restarts 5] [--clients 8] [--postgres URL]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.bench.results import record
from harness.bench.system import LONG_SPEC, postgres_database, running_system, summary
from harness.history import counter_drift, is_release
from harness.reliability import (
    Client,
    Database,
    cloud_figures,
    counter_snapshot,
    service_log_lines,
)
from managedjobs.v1 import job_service_pb2 as jpb
from managedjobs.v1 import scheduler_service_pb2 as spb
from managedjobs.v1 import scheduler_service_pb2_grpc
from services.cli.client import Client as MjClient
from services.cli.client import ServiceError
from services.common.channels import ClientSecurity, open_sync_channel
from services.common.event_messages import RELEASE_PREFIXES
from services.common.statuses import TERMINAL, JobStatus
from services.launcher.stack import Stack

USER = "restarts"
# What `mj` leaves a person to try again once its own retries are spent: the key makes
# another call safe.
RERUN = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
)
# The scheduler's log lines this reads (services/scheduler/counters.py, replicas.py).
CORRECTED = "admission counters differed from a recount; fixed"
LEASE_EXPIRED = "lease expired"
# How often a wait looks again (seconds): the resolution of the restart times.
STEP = 0.05


class Submissions:
    """`jobs` keyed submissions from `clients` threads, each with an `mj` client of its own."""

    def __init__(self, stack: Stack, jobs: int, clients: int, give_up: float) -> None:
        self.stack = stack
        self.jobs = jobs
        self.clients = clients
        self.give_up = give_up
        self.run_id = uuid.uuid4().hex[:8]
        self.answers: dict[int, int] = {}
        # When each answer came (monotonic), in order.
        self.answered_at: list[float] = []
        # Calls made again after `mj`'s own retries were spent, by status code name.
        self.reruns: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.changed = threading.Condition()
        self._next = iter(range(jobs))

    def key(self, index: int) -> str:
        return f"restarts-{self.run_id}-{index}"

    def run(self) -> float:
        """Submits every job; returns the seconds it took."""
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(self.clients) as pool:
            for done in [pool.submit(self._client) for _ in range(self.clients)]:
                done.result()
        return time.monotonic() - start

    def _client(self) -> None:
        stack = self.stack
        with MjClient(
            stack.scheduler_address, stack.logs_address, stack.credentials.client_security, 10
        ) as mj:
            while True:
                with self.changed:
                    index = next(self._next, None)
                if index is None:
                    return
                self._submit(mj, index)

    def _submit(self, mj: MjClient, index: int) -> None:
        request = jpb.SubmitJobRequest(
            spec_yaml=LONG_SPEC,
            name=f"restarts-{index}",
            user=USER,
            idempotency_key=self.key(index),
        )
        deadline = time.monotonic() + self.give_up
        while True:
            try:
                job_id = mj.submit_job(request)
                break
            except ServiceError as error:
                with self.changed:
                    if error.code not in RERUN or time.monotonic() > deadline:
                        self.errors.append(f"submission {index}: {error}")
                        self.changed.notify_all()
                        return
                    self.reruns[error.code.name] += 1
        with self.changed:
            self.answers[index] = job_id
            self.answered_at.append(time.monotonic())
            self.changed.notify_all()

    def wait_answered(self, count: int) -> None:
        """Until `count` submissions were answered (or gave up)."""
        with self.changed:
            self.changed.wait_for(lambda: len(self.answers) + len(self.errors) >= count)

    def first_answer_after(self, moment: float) -> float | None:
        with self.changed:
            return next((t for t in self.answered_at if t > moment), None)


@dataclasses.dataclass
class Restart:
    signal: str
    # Monotonic times: the signal, the old process gone, the new one started, serving,
    # and every replica connected to it.
    signalled: float = 0.0
    exited: float = 0.0
    started: float = 0.0
    serving: float = 0.0
    replicas_back: float | None = None
    # GetSchedulerState's count of corrections in the life that ended (read just before).
    corrections: int = 0

    def figures(self, first_answer: float | None) -> dict[str, Any]:
        def since(moment: float | None) -> float | None:
            return None if moment is None else round(moment - self.signalled, 3)

        return {
            "signal": self.signal,
            "exited_s": since(self.exited),
            "serving_s": since(self.serving),
            "start_to_serving_s": round(self.serving - self.started, 3),
            "replicas_back_s": since(self.replicas_back),
            "answering_s": since(first_answer),
        }


def wait_for(condition: Callable[[], bool], timeout: float) -> float | None:
    """Looks every `STEP` s until `condition()` holds: the monotonic time it did, or None."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return time.monotonic()
        if time.monotonic() > deadline:
            return None
        time.sleep(STEP)


def one_look(address: str, security: ClientSecurity, look: Callable[[grpc.Channel], bool]) -> bool:
    """`look` on a channel of its own, so that no reconnect backoff delays the answer."""
    with open_sync_channel(address, security) as chan:
        try:
            return look(chan)
        except grpc.RpcError:
            return False


def serving(stack: Stack) -> bool:
    def look(chan: grpc.Channel) -> bool:
        reply = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    return one_look(stack.scheduler_address, stack.credentials.client_security, look)


def replicas_connected(stack: Stack) -> bool:
    def look(chan: grpc.Channel) -> bool:
        stub = scheduler_service_pb2_grpc.SchedulerServiceStub(chan)
        state = stub.GetSchedulerState(spb.GetSchedulerStateRequest(), timeout=2)
        connected = {r.controller_id for r in state.replicas if r.connected}
        return connected >= {c.name for c in stack.controllers}

    return one_look(stack.scheduler_address, stack.credentials.client_security, look)


def restart_scheduler(stack: Stack, client: Client, kill: bool, timeout: float) -> Restart:
    """SIGKILL (or SIGTERM, then SIGKILL after 15 s) and a new process on the same database."""
    scheduler = stack.scheduler
    restart = Restart("SIGKILL" if kill else "SIGTERM")
    restart.corrections = int(client.scheduler_state().counter_corrections)
    restart.signalled = time.monotonic()
    if kill:
        scheduler.kill()
    else:
        scheduler.stop()
    restart.exited = time.monotonic()
    scheduler.start()
    restart.started = time.monotonic()
    serving_at = wait_for(lambda: serving(stack) or not scheduler.running, timeout)
    if serving_at is None or not scheduler.running:
        raise RuntimeError(f"the scheduler did not serve again: {scheduler.failure()}")
    restart.serving = serving_at
    restart.replicas_back = wait_for(lambda: replicas_connected(stack), timeout)
    return restart


def logged_corrections(stack: Stack) -> int:
    """Counter differences the scheduler's log says were fixed, over all its lives."""
    return sum(
        sum(abs(int(n)) for n in line.get("differences", {}).values())
        for line in service_log_lines(stack, "scheduler")
        if line.get("msg") == CORRECTED
    )


def logged(stack: Stack, message: str) -> int:
    return sum(1 for line in service_log_lines(stack, "scheduler") if line.get("msg") == message)


def measure(stack: Stack, db: Database, args: argparse.Namespace) -> dict[str, Any]:
    client = Client(stack)
    submissions = Submissions(stack, args.jobs, args.clients, args.settle)
    thresholds = [args.jobs * k // (args.restarts + 1) for k in range(1, args.restarts + 1)]
    restarts: list[Restart] = []

    def restart_all() -> None:
        # Odd restarts crash (SIGKILL), even ones stop cleanly (SIGTERM).
        for k, threshold in enumerate(thresholds, start=1):
            submissions.wait_answered(threshold)
            restarts.append(restart_scheduler(stack, client, k % 2 == 1, args.settle))

    problems: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        restarter = pool.submit(restart_all)
        submit_seconds = submissions.run()
        try:
            restarter.result()
        except (RuntimeError, grpc.RpcError) as error:
            problems.append(f"restart {len(restarts) + 1} failed: {error}")
    last_answer = max(submissions.answered_at, default=time.monotonic())

    def running_now() -> bool:
        statuses = db.statuses()
        settled = sum(n for s, n in statuses.items() if s == JobStatus.RUNNING or s in TERMINAL)
        return settled >= len(submissions.answers)

    all_running = wait_for(running_now, args.settle)
    statuses = db.statuses()

    # Stored exactly once: each key's one row is the job its answer named.
    rows = db.query('SELECT idempotency_key, id FROM jobs WHERE "user" = $1', USER)
    stored = {str(key): int(job_id) for key, job_id in rows}
    answers = submissions.answers
    kept = sum(stored.get(submissions.key(i)) == job_id for i, job_id in answers.items())
    duplicated = (len(rows) - kept) + (len(answers) - len(set(answers.values())))
    listed = {j.job_id for j in client.list_jobs(USER)}
    listed_differ = len(listed ^ set(answers.values()))

    # The counters, once nothing is in flight, against a recount; and their corrections.
    snapshot = counter_snapshot(client, db, "after the restarts")
    drift = [v.evidence for v in counter_drift(snapshot)]
    corrections = sum(r.corrections for r in restarts)
    corrections += int(client.scheduler_state().counter_corrections)
    corrections_logged = logged_corrections(stack)
    cloud = cloud_figures(client)
    moved = int(db.query("SELECT count(*) FROM jobs WHERE epoch > 1")[0][0])
    # Nothing in this run ends a job: one that ended, the system ended.
    ended = [
        (status, why, int(n))
        for status, why, n in db.query(
            "SELECT status, failure_reason, count(*) FROM jobs WHERE status <> $1 GROUP BY 1, 2",
            JobStatus.RUNNING.name,
        )
        if JobStatus[status] in TERMINAL
    ]
    releases = collections.Counter(
        next(p for p in RELEASE_PREFIXES if e.message.startswith(p)).strip()
        for e in db.events()
        if is_release(e)
    )
    exited = [s.name for s in stack.exited()]
    client.close()

    figures: dict[str, Any] = {
        "lost": args.jobs - kept,
        "duplicated": duplicated,
        "listed_differ": listed_differ,
        "not_running": sum(
            n for s, n in statuses.items() if s != JobStatus.RUNNING and s not in TERMINAL
        ),
        "statuses": {s.name: n for s, n in sorted(statuses.items())},
        "ended": sum(n for _, _, n in ended),
        "ended_why": [f"{n} {status}: {why}" for status, why, n in ended][:10],
        "counter_corrections": corrections,
        "counter_corrections_logged": corrections_logged,
        "counter_drift": drift,
        "launches": cloud["launches"],
        "duplicate_launches": cloud["duplicate_launches"],
        "jobs_moved": moved,
        # Why replicas lost jobs (by the release event's message): each such job moved.
        "releases": dict(releases),
        "leases_expired": logged(stack, LEASE_EXPIRED),
        "services_exited": exited,
    }
    if figures["lost"] or duplicated or listed_differ:
        problems.append(
            f"{figures['lost']} lost, {duplicated} duplicated, {listed_differ} listed otherwise"
        )
    if figures["not_running"] or all_running is None:
        problems.append(f"jobs not RUNNING after {args.settle:.0f}s: {figures['statuses']}")
    if figures["ended"]:
        problems.append(f"{figures['ended']} jobs ended: {figures['ended_why']}")
    if corrections or corrections_logged or drift:
        problems.append(f"counters: {corrections} corrected ({corrections_logged} logged), {drift}")
    if cloud["duplicate_launches"]:
        problems.append(f"{cloud['duplicate_launches']} duplicate launches")
    if exited:
        problems.append(f"services exited: {', '.join(exited)}")
    problems += submissions.errors[:20]

    each = [r.figures(submissions.first_answer_after(r.started)) for r in restarts]
    return {
        "restarts": len(restarts),
        "signals": [r.signal for r in restarts],
        "restarted_at_answers": thresholds[: len(restarts)],
        **{
            f"restart_{name}": summary([e[f"{name}_s"] for e in each if e[f"{name}_s"]], "s")
            for name in ("exited", "serving", "replicas_back", "answering")
        },
        "restart_times": each,
        "submit_seconds": round(submit_seconds, 1),
        "submissions_per_s": round(len(answers) / submit_seconds, 1),
        "all_running_after_last_answer_s": (
            None if all_running is None else round(max(0.0, all_running - last_answer), 2)
        ),
        "reruns": dict(submissions.reruns),
        **figures,
        "problems": problems,
    }


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10000)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8, help="concurrent submitters")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--postgres", default="", help="admin URL: run on a fresh PostgreSQL db")
    parser.add_argument("--reconcile-interval", type=float, default=2.0, help="seconds")
    parser.add_argument(
        "--settle", type=float, default=300.0, help="the longest wait for any one step (s)"
    )
    parser.add_argument("--data-dir", default="", help="keep the services' data and logs here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    database_url = postgres_database(args.postgres) if args.postgres else ""
    scheduler_args = ["--reconcile-interval", str(args.reconcile_interval)]
    with tempfile.TemporaryDirectory(prefix="mj-restarts-") as scratch:
        data_dir = Path(args.data_dir or scratch).resolve()
        with running_system(
            data_dir, args.replicas, database_url, scheduler_args=scheduler_args
        ) as stack:
            db = Database(database_url or f"sqlite:///{stack.data_dir / 'scheduler.db'}")
            figures = measure(stack, db, args)
    record(
        "restarts",
        {
            "database": "postgres" if database_url else "sqlite",
            "jobs": args.jobs,
            "clients": args.clients,
            "replicas": args.replicas,
            **figures,
        },
    )
    return 1 if figures["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
